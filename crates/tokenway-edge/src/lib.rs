//! Placeholder: the edge agent.
