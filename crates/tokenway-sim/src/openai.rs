//! The OpenAI wire format: the parts of requests the simulator reads, and byte-exact response
//! objects (`chat.completion`, `chat.completion.chunk`, `text_completion`, errors) as OpenAI and
//! vLLM send them, so that the official SDKs parse the simulator's output.

use bytes::Bytes;
use http::StatusCode;
use serde::{de, Deserialize, Serialize};
use tokenway_wire::openai_fields::{lax_bool, lax_count};

use crate::choice::Finish;

/// Which completion API a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

impl Api {
    pub(crate) fn route(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default, deserialize_with = "lax_bool")]
    include_usage: Option<bool>,
}

/// Most output tokens of all choices of one request together (a whole answer of this many is
/// ~25 MB of text).
pub const MAX_TOTAL_OUTPUT: u64 = 1 << 22;

/// Most choices one request may ask for (`n` × prompts), like an engine's bound on sequences in
/// a batch: each costs a token event per step.
pub const MAX_CHOICES: u32 = 128;

#[derive(Deserialize)]
struct ChatRequest {
    /// Tool definitions: the chat template puts them into the prompt, ahead of the messages.
    #[serde(default)]
    tools: Option<Box<serde_json::value::RawValue>>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default, deserialize_with = "lax_bool")]
    ignore_eos: Option<bool>,
    #[serde(default, deserialize_with = "lax_count")]
    min_tokens: Option<u64>,
    #[serde(default)]
    model: Option<String>,
    messages: Vec<Message>,
    #[serde(default, deserialize_with = "lax_count")]
    n: Option<u64>,
    #[serde(default, deserialize_with = "lax_bool")]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "lax_count")]
    max_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lax_count")]
    max_completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

/// A message's content: text, or a list of parts.
type Content = OneOrMany<Part>;

#[derive(Deserialize)]
struct Part {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default, deserialize_with = "lax_bool")]
    ignore_eos: Option<bool>,
    #[serde(default, deserialize_with = "lax_count")]
    min_tokens: Option<u64>,
    #[serde(default)]
    model: Option<String>,
    prompt: Prompt,
    #[serde(default, deserialize_with = "lax_count")]
    n: Option<u64>,
    #[serde(default, deserialize_with = "lax_bool")]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "lax_count")]
    max_tokens: Option<u64>,
}

/// `stop`: one string or several.
type Stop = OneOrMany<String>;

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// A value the OpenAI API takes as one string or as a list. Read as it comes: serde's
/// `untagged` first copies the whole value into a tree of its own, some 16 times the size of a
/// list of small items in the body (a 32 MiB body of `[0,0,…]` took over half a gigabyte
/// before any bound was checked).
pub(crate) enum OneOrMany<T> {
    One(String),
    Many(Vec<T>),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> de::Visitor<'de> for Visit<T> {
            type Value = OneOrMany<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a list")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(OneOrMany::One(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(OneOrMany::One(v))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                Vec::<T>::deserialize(de::value::SeqAccessDeserializer::new(seq))
                    .map(OneOrMany::Many)
            }
        }
        d.deserialize_any(Visit(std::marker::PhantomData))
    }
}

/// A completion prompt or embedding input as the OpenAI API takes it: text, a batch of texts,
/// token ids, or a batch of token-id lists. Read as it comes (see [`OneOrMany`]): a list's
/// first item says which kind of list it is.
pub(crate) enum Prompt {
    One(String),
    Many(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> de::Visitor<'de> for Visit {
            type Value = Prompt;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(
                    "a string, a list of strings, a list of token ids or a list of lists of \
                     token ids",
                )
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::One(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::One(v))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
                fn rest<'de, A: de::SeqAccess<'de>, T: Deserialize<'de>>(
                    first: T,
                    seq: &mut A,
                ) -> Result<Vec<T>, A::Error> {
                    let mut all = vec![first];
                    while let Some(next) = seq.next_element()? {
                        all.push(next);
                    }
                    Ok(all)
                }
                Ok(match seq.next_element::<PromptItem>()? {
                    None => Prompt::Many(Vec::new()),
                    Some(PromptItem::Text(t)) => Prompt::Many(rest(t, &mut seq)?),
                    Some(PromptItem::Id(id)) => Prompt::Ids(rest(id, &mut seq)?),
                    Some(PromptItem::Ids(ids)) => Prompt::IdLists(rest(ids, &mut seq)?),
                })
            }
        }
        d.deserialize_any(Visit)
    }
}

/// The first item of a prompt list.
enum PromptItem {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> de::Visitor<'de> for Visit {
            type Value = PromptItem;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Id)
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &"a token id"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &"a token id"))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<PromptItem, A::Error> {
                Vec::<u32>::deserialize(de::value::SeqAccessDeserializer::new(seq))
                    .map(PromptItem::Ids)
            }
        }
        d.deserialize_any(Visit)
    }
}

impl Prompt {
    /// Each prompt of the batch as the cost model's bytes: text as it is; token ids as
    /// `bytes_per_token` bytes each (derived from the id), so a list of k ids is exactly k
    /// tokens and lists sharing a prefix of ids share a prefix of bytes (and of cache blocks).
    pub(crate) fn into_batch(
        self,
        param: &'static str,
        bytes_per_token: usize,
    ) -> Result<Vec<Vec<u8>>, ApiError> {
        let ids = |ids: Vec<u32>| -> Vec<u8> {
            ids.iter()
                .flat_map(|id| id.to_le_bytes().into_iter().cycle().take(bytes_per_token))
                .collect()
        };
        let batch: Vec<Vec<u8>> = match self {
            Self::One(p) => vec![p.into_bytes()],
            Self::Many(ps) => ps.into_iter().map(String::into_bytes).collect(),
            Self::Ids(list) => vec![ids(list)],
            Self::IdLists(lists) => lists.into_iter().map(ids).collect(),
        };
        if batch.is_empty() {
            return Err(
                ApiError::invalid_request(format!("{param} must not be an empty list."))
                    .with_param(param),
            );
        }
        Ok(batch)
    }
}

/// What the simulator needs from a completion request.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) api: Api,
    /// The model asked for; `None` (vLLM allows leaving it out) is the first served model.
    pub(crate) model: Option<String>,
    /// The prompts of the batch, as the cost model's bytes (a chat request has one: every
    /// message's role followed by its text; a completion request one per prompt of a batch).
    pub(crate) prompts: Vec<Vec<u8>>,
    /// Choices per prompt (`n`).
    pub(crate) n: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// Output tokens asked for, if the request set a limit.
    pub(crate) max_tokens: Option<u64>,
    /// The field that set it (`max_tokens` or `max_completion_tokens`).
    limit_param: &'static str,
    /// Stop strings: a choice ends before the first one it generates.
    pub(crate) stop: Vec<String>,
    /// Whether the end-of-sequence token is ignored (the limit ends every choice).
    pub(crate) ignore_eos: bool,
    /// Tokens each choice generates before an end-of-sequence token may end it.
    pub(crate) min_tokens: u32,
}

impl Job {
    /// The choices of the answer: `n` for each prompt, prompt-major (vLLM's order).
    pub(crate) fn choices(&self) -> u32 {
        self.n * self.prompts.len() as u32
    }

    /// The output limit as a count of tokens ([`Job::check_context`] bounded it by the
    /// context length).
    pub(crate) fn output_limit(&self) -> Option<u32> {
        self.max_tokens
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// vLLM's context-length check: every prompt shorter than `max_model_len` tokens, and with
    /// the requested output no longer than it. Without this bound a non-streaming request for
    /// 2^32 tokens at no time per token would build gigabytes of text in a loop nobody can
    /// cancel.
    pub(crate) fn check_context(
        &self,
        max_model_len: u32,
        default_max_tokens: u32,
        bytes_per_token: usize,
    ) -> Result<(), ApiError> {
        let longest = self.longest_prompt(bytes_per_token);
        let limit = u64::from(max_model_len);
        let input = match self.api {
            Api::Chat => "messages",
            Api::Completions => "prompt",
        };
        if longest >= limit {
            return Err(ApiError::invalid_request(format!(
                "This model's maximum context length is {limit} tokens. However, your request has \
                 {longest} input tokens. Please reduce the length of the input {input}."
            ))
            .with_param(input));
        }
        if let Some(k) = self
            .max_tokens
            .filter(|k| longest.saturating_add(*k) > limit)
        {
            return Err(ApiError::invalid_request(format!(
                "This model's maximum context length is {limit} tokens. However, you requested \
                 {} tokens ({longest} in the {input}, {k} in the completion). Please reduce the \
                 length of the {input} or completion.",
                longest.saturating_add(k)
            ))
            .with_param(self.limit_param));
        }
        if let Some(k) = self.max_tokens.filter(|k| u64::from(self.min_tokens) > *k) {
            return Err(ApiError::invalid_request(format!(
                "min_tokens must be less than or equal to max_tokens={k}, got {}.",
                self.min_tokens
            ))
            .with_param("min_tokens"));
        }
        // All choices together: a whole answer holds every choice's text at once.
        let each = self.max_tokens.unwrap_or(u64::from(default_max_tokens));
        let total = each.saturating_mul(u64::from(self.choices()));
        if total > MAX_TOTAL_OUTPUT {
            return Err(ApiError::invalid_request(format!(
                "the output of all choices (n × prompts × the output limit) must be at most \
                 {MAX_TOTAL_OUTPUT} tokens, got {} × {each}.",
                self.choices()
            ))
            .with_param("n"));
        }
        Ok(())
    }

    /// Tokens of the batch's longest prompt.
    pub(crate) fn longest_prompt(&self, bytes_per_token: usize) -> u64 {
        self.prompts
            .iter()
            .map(|p| crate::cost::prompt_tokens(p.len(), bytes_per_token) as u64)
            .max()
            .unwrap_or(0)
    }

    /// Parses a request body of `api`; token-id prompts become `bytes_per_token` bytes per id.
    pub(crate) fn parse(api: Api, body: &[u8], bytes_per_token: usize) -> Result<Self, ApiError> {
        let bad =
            |e: serde_json::Error| ApiError::invalid_request(format!("invalid JSON body: {e}"));
        // serde would also read the struct from a JSON array, field by field.
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::invalid_request(
                "invalid JSON body: expected a JSON object".to_owned(),
            ));
        }
        let mut limit_param = "max_tokens";
        let job = match api {
            Api::Chat => {
                let r: ChatRequest = last_wins(body).map_err(bad)?;
                if r.max_completion_tokens.is_some() {
                    limit_param = "max_completion_tokens";
                }
                let mut prompt = String::new();
                // As a chat template renders them: the tools first (often thousands of tokens,
                // the same for every request of an agent: a shared prefix), then the messages.
                if let Some(tools) = &r.tools {
                    prompt.push_str(tools.get());
                }
                for m in &r.messages {
                    prompt.push_str(&m.role);
                    match &m.content {
                        Some(OneOrMany::One(t)) => prompt.push_str(t),
                        Some(OneOrMany::Many(parts)) => {
                            for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                                prompt.push_str(t);
                            }
                        }
                        None => {}
                    }
                }
                let stream = stream_flags(r.stream, r.stream_options)?;
                Job {
                    api,
                    model: r.model,
                    prompts: vec![prompt.into_bytes()],
                    n: choices_per_prompt(r.n)?,
                    stream: stream.0,
                    include_usage: stream.1,
                    max_tokens: r.max_completion_tokens.or(r.max_tokens),
                    limit_param,
                    stop: r.stop.map(Stop::into_vec).unwrap_or_default(),
                    ignore_eos: r.ignore_eos.unwrap_or(false),
                    min_tokens: count_u32(r.min_tokens),
                }
            }
            Api::Completions => {
                let r: CompletionRequest = last_wins(body).map_err(bad)?;
                let stream = stream_flags(r.stream, r.stream_options)?;
                Job {
                    api,
                    model: r.model,
                    prompts: r.prompt.into_batch("prompt", bytes_per_token)?,
                    n: choices_per_prompt(r.n)?,
                    stream: stream.0,
                    include_usage: stream.1,
                    max_tokens: r.max_tokens,
                    limit_param,
                    stop: r.stop.map(Stop::into_vec).unwrap_or_default(),
                    ignore_eos: r.ignore_eos.unwrap_or(false),
                    min_tokens: count_u32(r.min_tokens),
                }
            }
        };
        if job.n == 0 {
            return Err(
                ApiError::invalid_request("n must be at least 1, got 0.".to_owned())
                    .with_param("n"),
            );
        }
        if u64::from(job.n) * job.prompts.len() as u64 > u64::from(MAX_CHOICES) {
            return Err(ApiError::invalid_request(format!(
                "n × prompts must be at most {MAX_CHOICES}, got {} × {}.",
                job.n,
                job.prompts.len()
            ))
            .with_param("n"));
        }
        if job.max_tokens == Some(0) {
            return Err(ApiError::invalid_request(
                "max_tokens must be at least 1, got 0.".to_owned(),
            )
            .with_param(limit_param));
        }
        // Every token of every choice is checked against every stop string: a list of
        // millions pinned a worker for minutes.
        if job.stop.len() > MAX_STOP_STRINGS
            || job.stop.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES)
        {
            return Err(ApiError::invalid_request(format!(
                "stop takes at most {MAX_STOP_STRINGS} strings of at most \
                 {MAX_STOP_STRING_BYTES} bytes, got {} strings.",
                job.stop.len()
            ))
            .with_param("stop"));
        }
        Ok(job)
    }
}

/// Most stop strings a request may give (OpenAI takes 4; vLLM does not bound them).
pub const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// Largest body read again for a key given twice ([`last_wins`]): the tree it is read into
/// takes up to some 16 times the body's size.
const MAX_REREAD_BYTES: usize = 4 << 20;

/// Parses `body`; a key given twice counts with its last value, as Python's `json` (vLLM's
/// parser) reads it, where serde's derive refuses it: such a body (up to [`MAX_REREAD_BYTES`];
/// a larger one keeps serde's error) is read again through a map that keeps the last value.
fn last_wins<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    match serde_json::from_slice(body) {
        Err(e)
            if e.to_string().starts_with("duplicate field") && body.len() <= MAX_REREAD_BYTES =>
        {
            serde_json::from_value(serde_json::from_slice::<serde_json::Value>(body)?)
        }
        other => other,
    }
}

/// `stream` and `include_usage` as vLLM settles them: `stream_options` only with a stream
/// (else 400), and there `include_usage` defaults to true.
fn stream_flags(
    stream: Option<bool>,
    options: Option<StreamOptions>,
) -> Result<(bool, bool), ApiError> {
    let stream = stream.unwrap_or(false);
    match options {
        None => Ok((stream, false)),
        // vLLM tests the dict's truth: an empty `{}` passes without a stream.
        Some(o) if !stream && o.include_usage.is_none() => Ok((false, false)),
        Some(_) if !stream => Err(ApiError::invalid_request(
            "Stream options can only be defined when `stream=True`.".to_owned(),
        )
        .with_param("stream_options")),
        Some(o) => Ok((true, o.include_usage.unwrap_or(true))),
    }
}

fn count_u32(n: Option<u64>) -> u32 {
    n.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// `n`, at least 1 (absent is 1).
fn choices_per_prompt(n: Option<u64>) -> Result<u32, ApiError> {
    match n {
        None => Ok(1),
        Some(0) => Err(
            ApiError::invalid_request("n must be at least 1, got 0.".to_owned()).with_param("n"),
        ),
        Some(n) => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
    }
}

/// An error answered in OpenAI's shape:
/// `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    message: String,
    kind: &'static str,
    pub(crate) param: Option<&'static str>,
    code: Option<&'static str>,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: String) -> Self {
        Self {
            status,
            message,
            kind,
            param: None,
            code: None,
        }
    }

    pub(crate) fn invalid_request(message: String) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub(crate) fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub(crate) fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub(crate) fn body(&self) -> Bytes {
        let env = ErrorEnvelope {
            error: ErrorBody {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        };
        Bytes::from(serde_json::to_vec(&env).expect("serializing plain structs cannot fail"))
    }
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) total_tokens: u64,
    pub(crate) prompt_tokens_details: PromptTokensDetails,
}

/// Which prompt tokens came from the prefix cache (OpenAI's `usage.prompt_tokens_details`).
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct PromptTokensDetails {
    pub(crate) cached_tokens: u64,
}

impl Usage {
    pub(crate) fn new(prompt: usize, cached: usize, completion: u32) -> Self {
        let prompt = prompt as u64;
        let completion = u64::from(completion);
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached as u64,
            },
        }
    }
}

#[derive(Serialize)]
struct Chunk<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: Option<&'a str>,
    choices: &'a [C],
    /// Omitted without `include_usage`; `null` on ordinary chunks with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<&'a Usage>>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    stop_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'a str>,
    stop_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'a str,
    stop_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct Full<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: Option<&'a str>,
    choices: &'a [C],
    usage: &'a Usage,
}

/// The terminating SSE event.
pub(crate) const DONE: &[u8] = b"data: [DONE]\n\n";

/// An error as vLLM reports one inside a stream that already answered 200:
/// `data: {"error": {...}}`.
pub(crate) fn error_event(err: &ApiError) -> Bytes {
    let mut event = b"data: ".to_vec();
    event.extend_from_slice(&err.body());
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

/// Writes the response objects of one request.
pub(crate) struct Encoder {
    api: Api,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    buf: Vec<u8>,
}

impl Encoder {
    pub(crate) fn new(job: &Job, created: u64) -> Self {
        let prefix = match job.api {
            Api::Chat => "chatcmpl-",
            Api::Completions => "cmpl-",
        };
        Self {
            api: job.api,
            id: format!("{prefix}{:032x}", rand::random::<u128>()),
            created,
            model: job.model.clone().unwrap_or_default(),
            include_usage: job.include_usage,
            buf: Vec::with_capacity(512),
        }
    }

    fn event<C: Serialize>(&mut self, choices: &[C], usage: Option<&Usage>) -> Bytes {
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        };
        let chunk = Chunk {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            system_fingerprint: None,
            choices,
            usage: self.include_usage.then_some(usage),
        };
        self.buf.clear();
        self.buf.extend_from_slice(b"data: ");
        serde_json::to_writer(&mut self.buf, &chunk)
            .expect("serializing plain structs cannot fail");
        self.buf.extend_from_slice(b"\n\n");
        Bytes::copy_from_slice(&self.buf)
    }

    fn delta(
        &mut self,
        index: u32,
        role: Option<&str>,
        content: Option<&str>,
        finish: Option<&Finish>,
    ) -> Bytes {
        let finish_reason = finish.map(|f| f.reason);
        let stop_reason = finish.and_then(|f| f.stop.as_deref());
        match self.api {
            Api::Chat => self.event(
                &[ChatChunkChoice {
                    index,
                    delta: Delta { role, content },
                    logprobs: None,
                    finish_reason,
                    stop_reason,
                }],
                None,
            ),
            Api::Completions => self.event(
                &[TextChoice {
                    index,
                    text: content.unwrap_or(""),
                    logprobs: None,
                    finish_reason,
                    stop_reason,
                }],
                None,
            ),
        }
    }

    /// A chat choice's first event, `delta: {"role":"assistant","content":""}`; none for
    /// completions.
    pub(crate) fn role(&mut self, index: u32) -> Option<Bytes> {
        (self.api == Api::Chat).then(|| self.delta(index, Some("assistant"), Some(""), None))
    }

    /// One token event of choice `index`.
    pub(crate) fn token(&mut self, index: u32, text: &str) -> Bytes {
        self.delta(index, None, Some(text), None)
    }

    /// The event carrying choice `index`'s `finish_reason` and `stop_reason` (empty delta for
    /// chat, empty text for completions).
    pub(crate) fn finish(&mut self, index: u32, finish: &Finish) -> Bytes {
        match self.api {
            Api::Chat => self.delta(index, None, None, Some(finish)),
            Api::Completions => self.delta(index, None, Some(""), Some(finish)),
        }
    }

    /// The `include_usage` event: `choices: []` and the usage object.
    pub(crate) fn usage(&mut self, usage: &Usage) -> Bytes {
        self.event::<TextChoice<'_>>(&[], Some(usage))
    }

    /// The non-streaming response object, one choice per text and its finish.
    pub(crate) fn full(&self, texts: &[(String, Finish)], usage: &Usage) -> Bytes {
        let out = match self.api {
            Api::Chat => serde_json::to_vec(&Full {
                id: &self.id,
                object: "chat.completion",
                created: self.created,
                model: &self.model,
                system_fingerprint: None,
                choices: &(0..)
                    .zip(texts)
                    .map(|(index, (text, finish))| ChatChoice {
                        index,
                        message: ChatMessage {
                            role: "assistant",
                            content: text,
                        },
                        logprobs: None,
                        finish_reason: finish.reason,
                        stop_reason: finish.stop.as_deref(),
                    })
                    .collect::<Vec<_>>(),
                usage,
            }),
            Api::Completions => serde_json::to_vec(&Full {
                id: &self.id,
                object: "text_completion",
                created: self.created,
                model: &self.model,
                system_fingerprint: None,
                choices: &(0..)
                    .zip(texts)
                    .map(|(index, (text, finish))| TextChoice {
                        index,
                        text,
                        logprobs: None,
                        finish_reason: Some(finish.reason),
                        stop_reason: finish.stop.as_deref(),
                    })
                    .collect::<Vec<_>>(),
                usage,
            }),
        };
        Bytes::from(out.expect("serializing plain structs cannot fail"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(api: Api, body: &str) -> Job {
        Job::parse(api, body.as_bytes(), 4).unwrap()
    }

    #[test]
    fn prompts_stops_and_contents_read_every_form_the_api_takes_and_refuse_mixtures() {
        let prompt = |json: &str| serde_json::from_str::<Prompt>(json);
        assert!(matches!(prompt(r#""hi""#), Ok(Prompt::One(p)) if p == "hi"));
        assert!(matches!(prompt(r#"["a","b"]"#), Ok(Prompt::Many(p)) if p == ["a", "b"]));
        assert!(matches!(prompt("[1,2,3]"), Ok(Prompt::Ids(p)) if p == [1, 2, 3]));
        assert!(
            matches!(prompt("[[1],[2,3]]"), Ok(Prompt::IdLists(p)) if p == [vec![1], vec![2, 3]])
        );
        assert!(matches!(prompt("[]"), Ok(Prompt::Many(p)) if p.is_empty()));
        for bad in [
            r#"["a",1]"#,
            r#"[1,"a"]"#,
            "[[1],2]",
            "[-1]",
            "[4294967296]",
            "[1.5]",
            "{}",
            "7",
            "null",
        ] {
            assert!(prompt(bad).is_err(), "{bad} was taken");
        }
        let stop = |json: &str| serde_json::from_str::<Stop>(json).map(Stop::into_vec);
        assert_eq!(stop(r#""x""#).unwrap(), ["x"]);
        assert_eq!(stop(r#"["x","y"]"#).unwrap(), ["x", "y"]);
        assert!(stop("[1]").is_err() && stop("1").is_err());
        let content = |json: &str| serde_json::from_str::<Content>(json);
        assert!(matches!(content(r#""t""#), Ok(OneOrMany::One(t)) if t == "t"));
        assert!(
            matches!(content(r#"[{"type":"text","text":"t"},{}]"#), Ok(OneOrMany::Many(p)) if p.len() == 2)
        );
        assert!(content("[1]").is_err());
        // Whole requests: a prompt of ids is read as ids.
        let j = job(Api::Completions, r#"{"model":"m","prompt":[1,2,3,4]}"#);
        assert_eq!(j.prompts.len(), 1);
    }

    #[test]
    fn chat_prompt_is_roles_and_contents_including_text_parts() {
        let j = job(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
               {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],
               "max_completion_tokens":3,"max_tokens":9}"#,
        );
        assert_eq!(j.prompts, [b"systembe briefuserhi there".to_vec()]);
        assert_eq!(j.max_tokens, Some(3));
        assert!(!j.stream);
    }

    #[test]
    fn tools_are_part_of_a_chat_prompt_ahead_of_the_messages() {
        let j = job(
            Api::Chat,
            r#"{"tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"hi"}]}"#,
        );
        let prompt = String::from_utf8(j.prompts[0].clone()).unwrap();
        assert!(
            prompt.starts_with(r#"[{"type":"function""#) && prompt.ends_with("userhi"),
            "{prompt}"
        );
    }

    #[test]
    fn completion_prompt_arrays_are_a_batch_with_n_choices_each() {
        let j = job(
            Api::Completions,
            r#"{"model":"m","prompt":["ab","cd"],"n":3,"stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert_eq!(j.prompts, [b"ab".to_vec(), b"cd".to_vec()]);
        assert_eq!(j.choices(), 6);
        assert!(j.stream && j.include_usage);
    }

    #[test]
    fn token_id_prompts_are_one_token_per_id_and_keep_their_prefixes() {
        let one = job(Api::Completions, r#"{"model":"m","prompt":[1,2,300]}"#);
        assert_eq!(one.prompts.len(), 1);
        assert_eq!(one.prompts[0].len(), 3 * 4);
        let batch = job(
            Api::Completions,
            r#"{"model":"m","prompt":[[1,2,300,4],[7]]}"#,
        );
        assert_eq!(batch.prompts.len(), 2);
        assert!(batch.prompts[0].starts_with(&one.prompts[0]));
        let narrow = Job::parse(Api::Completions, br#"{"model":"m","prompt":[1,2]}"#, 1).unwrap();
        assert_eq!(narrow.prompts[0].len(), 2);
    }

    #[test]
    fn prompts_and_limits_past_the_context_length_are_400s_naming_the_field() {
        let ok = job(
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"abcdefgh"}],"max_tokens":6}"#,
        );
        // "user" + 8 bytes = 3 tokens; 3 + 6 = 9.
        assert!(ok.check_context(10, 64, 4).is_ok());
        let e = ok.check_context(8, 64, 4).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        assert!(
            e.message.contains("maximum context length is 8 tokens"),
            "{}",
            e.message
        );
        let e = ok.check_context(3, 64, 4).unwrap_err();
        assert_eq!(e.param, Some("messages"));
        let batch = job(
            Api::Completions,
            r#"{"prompt":["a","abcdefghijkl"],"max_completion_tokens":1}"#,
        );
        assert_eq!(batch.longest_prompt(4), 3);
        assert_eq!(
            batch.check_context(3, 64, 4).unwrap_err().param,
            Some("prompt")
        );
        // A limit near u64::MAX does not wrap past the check.
        let huge = job(
            Api::Completions,
            r#"{"prompt":"x","max_tokens":18446744073709551615}"#,
        );
        assert_eq!(
            huge.check_context(1 << 21, 64, 4).unwrap_err().param,
            Some("max_tokens")
        );
        // Every choice's output counts.
        let many = job(
            Api::Completions,
            r#"{"prompt":"x","n":128,"max_tokens":2000000}"#,
        );
        assert_eq!(
            many.check_context(1 << 21, 64, 4).unwrap_err().param,
            Some("n")
        );
    }

    #[test]
    fn a_repeated_key_counts_with_its_last_value() {
        let j = job(
            Api::Completions,
            r#"{"prompt":"a","max_tokens":1,"prompt":"b","max_tokens":3}"#,
        );
        assert_eq!(
            (j.prompts[0].as_slice(), j.output_limit()),
            (&b"b"[..], Some(3))
        );
        let e = Job::parse(
            Api::Completions,
            br#"{"prompt":"a","max_tokens":2,"min_tokens":3}"#,
            4,
        )
        .unwrap()
        .check_context(1 << 21, 64, 4)
        .unwrap_err();
        assert_eq!(e.param, Some("min_tokens"));
    }

    #[test]
    fn lax_scalars_and_stream_options_follow_vllm() {
        let j = job(
            Api::Completions,
            r#"{"prompt":"x","stream":"true","max_tokens":8.0,"n":"2","stream_options":{}}"#,
        );
        assert!(j.model.is_none());
        assert_eq!(
            (j.stream, j.include_usage, j.output_limit(), j.n),
            (true, true, Some(8), 2)
        );
        let e = Job::parse(
            Api::Completions,
            br#"{"prompt":"x","stream_options":{"include_usage":true}}"#,
            4,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("stream_options"));
        let e = Job::parse(Api::Chat, br#"["m", []]"#, 4).unwrap_err();
        assert!(e.message.contains("JSON object"), "{}", e.message);
    }

    #[test]
    fn more_stop_strings_than_a_request_may_give_are_a_400_naming_stop() {
        let stops: Vec<String> = (0..=MAX_STOP_STRINGS).map(|i| format!("s{i}")).collect();
        let body = serde_json::json!({"prompt": "x", "stop": stops}).to_string();
        let e = Job::parse(Api::Completions, body.as_bytes(), 4).unwrap_err();
        assert_eq!(e.param, Some("stop"));
        let long = "x".repeat(MAX_STOP_STRING_BYTES + 1);
        let body = serde_json::json!({"prompt": "x", "stop": long}).to_string();
        assert!(Job::parse(Api::Completions, body.as_bytes(), 4).is_err());
        let body = serde_json::json!({"prompt": "x", "stop": ["a", "b"]}).to_string();
        assert!(Job::parse(Api::Completions, body.as_bytes(), 4).is_ok());
    }

    #[test]
    fn empty_batches_zero_n_and_too_many_choices_are_400s_naming_the_field() {
        for (body, param) in [
            (r#"{"model":"m","prompt":[]}"#, "prompt"),
            (r#"{"model":"m","prompt":"x","n":0}"#, "n"),
            (r#"{"model":"m","prompt":["a","b"],"n":100}"#, "n"),
            (r#"{"model":"m","messages":[],"n":129}"#, "n"),
        ] {
            let api = if body.contains("messages") {
                Api::Chat
            } else {
                Api::Completions
            };
            let e = Job::parse(api, body.as_bytes(), 4).unwrap_err();
            assert_eq!(
                (e.status, e.param),
                (StatusCode::BAD_REQUEST, Some(param)),
                "{body}"
            );
        }
    }

    #[test]
    fn chat_chunks_have_openai_shape_and_null_usage_with_include_usage() {
        let mut j = job(Api::Chat, r#"{"model":"m","messages":[]}"#);
        j.include_usage = true;
        let mut e = Encoder::new(&j, 7);
        let role = e.role(0).unwrap();
        let text = std::str::from_utf8(&role).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(text.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v["choices"][0]["delta"]["content"], "");
        assert!(v["usage"].is_null() && v.as_object().unwrap().contains_key("usage"));
        let fin = e.finish(
            1,
            &Finish {
                reason: "length",
                stop: None,
            },
        );
        let v: serde_json::Value = serde_json::from_slice(&fin[6..fin.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["choices"][0]["index"], 1);
    }

    #[test]
    fn usage_field_is_omitted_without_include_usage() {
        let j = job(Api::Completions, r#"{"model":"m","prompt":"x"}"#);
        let mut e = Encoder::new(&j, 7);
        let t = e.token(0, " a");
        let v: serde_json::Value = serde_json::from_slice(&t[6..t.len() - 2]).unwrap();
        assert!(!v.as_object().unwrap().contains_key("usage"));
        assert_eq!(v["choices"][0]["text"], " a");
        assert!(e.role(0).is_none());
    }
}
