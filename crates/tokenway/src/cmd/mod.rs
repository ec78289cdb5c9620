//! One module per subcommand: flags, config loading, wiring.

pub mod bench;
pub mod demo;
pub mod edge;
pub mod gateway;
pub mod mirror;
pub mod netlab;
pub mod preheat;
pub mod publish;
pub mod pull;
pub mod signal;
pub mod sim;
pub mod smoke;
pub mod weights_access;
