//! QUIC connection metrics (placeholder until the edge stage fills it).
