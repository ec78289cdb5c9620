//! Where backends beyond the main config come from: a watched file ([`file`], `backends_file`)
//! and DNS names ([`dns`], `[[discovery.dns]]`: A/AAAA and SRV records, which covers Kubernetes
//! headless services). Both add and remove backends through the same path
//! (`Shared::add_backend` with a probe task, `Shared::remove_backend`), and neither ever touches
//! the backends of the main config.

pub mod dns;
pub mod file;

pub use file::{reload, watch_file};
