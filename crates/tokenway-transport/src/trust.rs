//! Placeholder: filled by the edge/client stage.
