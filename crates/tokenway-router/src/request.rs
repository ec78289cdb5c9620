//! What the router needs to know about one request: [`RouteRequest`].
//!
//! The gateway fills it from the parts of the request it already parsed (model, the prompt's
//! block hashes, a session key, the client's region, token estimates); the router never sees the
//! body. Everything beyond the model is optional: a request with only a model is ranked by load
//! and latency alone.

use std::fmt;

use serde::Serialize;

use crate::backend::BackendId;
use crate::prefix::BlockHash;

/// Where a session key came from. Placement treats all kinds alike; the kind is reported in
/// the route reason and metrics so operators can tell explicit sessions from guesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionKind {
    /// The `x-session-id` request header.
    Header,
    /// The OpenAI `user` field of the request body.
    User,
    /// The client's source address, used only when enabled and nothing else identifies the
    /// client. The gateway decides how long an address counts as one client (its TTL).
    SourceAddr,
}

impl SessionKind {
    /// A short label for logs, metrics and the `server-timing` header.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Header => "header",
            Self::User => "user",
            Self::SourceAddr => "source_addr",
        }
    }
}

impl fmt::Display for SessionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An opaque session key: requests with equal keys are placed on the same backend by
/// rendezvous hashing, on every gateway replica, as long as that backend is eligible and within
/// the load bound.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    /// Where it came from.
    pub kind: SessionKind,
    /// The key itself (header value, user id or address), compared byte for byte.
    pub key: String,
}

impl SessionKey {
    /// A key of `kind`.
    pub fn new(kind: SessionKind, key: impl Into<String>) -> Self {
        Self {
            kind,
            key: key.into(),
        }
    }
}

/// One request as the router sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouteRequest {
    /// The requested model.
    pub model: String,
    /// Chained hashes of the prompt's fixed-size blocks, from
    /// [`prompt_blocks`](crate::prompt_blocks); empty when unknown.
    pub blocks: Vec<BlockHash>,
    /// The session key, if the client gave or implied one.
    pub session: Option<SessionKey>,
    /// The client's region, if known (for the cross-region penalty and to keep sessions in
    /// region).
    pub client_region: Option<String>,
    /// Estimated prompt tokens (for example prompt bytes / 4); 0 when unknown.
    pub prompt_tokens: u32,
    /// Of those, the tokens past the last block in `blocks` (a prompt longer than
    /// [`MAX_PROMPT_BLOCKS`](crate::MAX_PROMPT_BLOCKS) blocks): never found in a cache.
    pub untracked_tokens: u32,
    /// The request's output limit (`max_tokens` / `max_completion_tokens`), if given.
    pub max_output_tokens: Option<u32>,
    /// Set when routing it again after a hold ([`Route::hold`](crate::Route::hold)).
    pub held: Option<Held>,
    /// The answer comes whole, not streamed (`stream` false or absent, embeddings): its first
    /// byte arrives when the generation has ended, so it says nothing about the time to first
    /// token and feeds neither that estimate nor outlier detection.
    pub whole_answer: bool,
}

/// A request that the router told the gateway to hold, routed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The first backend of the route that said "hold": the one prefilling its prefix.
    pub backend: BackendId,
    /// How long the request has been held so far, in all.
    pub waited: std::time::Duration,
}

impl RouteRequest {
    /// A request for `model` with nothing else known.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            ..Self::default()
        }
    }

    /// With the prompt's block hashes.
    pub fn with_blocks(mut self, blocks: Vec<BlockHash>) -> Self {
        self.blocks = blocks;
        self
    }

    /// With a session key.
    pub fn with_session(mut self, kind: SessionKind, key: impl Into<String>) -> Self {
        self.session = Some(SessionKey::new(kind, key));
        self
    }

    /// With the client's region.
    pub fn with_client_region(mut self, region: impl Into<String>) -> Self {
        self.client_region = Some(region.into());
        self
    }

    /// With the estimated prompt tokens.
    pub fn with_prompt_tokens(mut self, tokens: u32) -> Self {
        self.prompt_tokens = tokens;
        self
    }

    /// With `tokens` of the prompt past its tracked blocks.
    pub fn with_untracked_tokens(mut self, tokens: u32) -> Self {
        self.untracked_tokens = tokens;
        self
    }

    /// With the output limit.
    pub fn with_max_output_tokens(mut self, tokens: u32) -> Self {
        self.max_output_tokens = Some(tokens);
        self
    }

    /// With an answer that comes whole rather than streamed.
    pub fn with_whole_answer(mut self, whole: bool) -> Self {
        self.whole_answer = whole;
        self
    }

    /// Routed again after being held for `backend`'s prefill, `waited` in all so far.
    pub fn with_held(mut self, backend: BackendId, waited: std::time::Duration) -> Self {
        self.held = Some(Held { backend, waited });
        self
    }
}
