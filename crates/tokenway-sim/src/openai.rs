//! The OpenAI wire format: the parts of requests the simulator reads, and byte-exact response
//! objects (`chat.completion`, `chat.completion.chunk`, `text_completion`, errors) as OpenAI and
//! vLLM send them, so that the official SDKs parse the simulator's output.

use bytes::Bytes;
use http::StatusCode;
use serde::{Deserialize, Serialize};

/// Most output tokens one request may ask for, like an engine's context length: 1 Mi (the
/// e2e tests' floods ask for 400 000).
pub const MAX_OUTPUT_TOKENS: u32 = 1 << 20;

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
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: Prompt,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    One(String),
    Many(Vec<String>),
}

/// What the simulator needs from a completion request.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) api: Api,
    pub(crate) model: String,
    /// Chat: every message's role followed by its text; completions: the prompt(s) joined.
    pub(crate) prompt: String,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// Output tokens asked for, if the request set a limit.
    pub(crate) max_tokens: Option<u32>,
}

impl Job {
    /// Parses a request body of `api`.
    pub(crate) fn parse(api: Api, body: &[u8]) -> Result<Self, ApiError> {
        let bad =
            |e: serde_json::Error| ApiError::invalid_request(format!("invalid JSON body: {e}"));
        let mut limit_param = "max_tokens";
        let job = match api {
            Api::Chat => {
                let r: ChatRequest = serde_json::from_slice(body).map_err(bad)?;
                if r.max_completion_tokens.is_some() {
                    limit_param = "max_completion_tokens";
                }
                let mut prompt = String::new();
                for m in &r.messages {
                    prompt.push_str(&m.role);
                    match &m.content {
                        Some(Content::Text(t)) => prompt.push_str(t),
                        Some(Content::Parts(parts)) => {
                            for t in parts.iter().filter_map(|p| p.text.as_deref()) {
                                prompt.push_str(t);
                            }
                        }
                        None => {}
                    }
                }
                Job {
                    api,
                    model: r.model,
                    prompt,
                    stream: r.stream.unwrap_or(false),
                    include_usage: include_usage(r.stream_options),
                    max_tokens: r.max_completion_tokens.or(r.max_tokens),
                }
            }
            Api::Completions => {
                let r: CompletionRequest = serde_json::from_slice(body).map_err(bad)?;
                let prompt = match r.prompt {
                    Prompt::One(p) => p,
                    Prompt::Many(ps) => ps.concat(),
                };
                Job {
                    api,
                    model: r.model,
                    prompt,
                    stream: r.stream.unwrap_or(false),
                    include_usage: include_usage(r.stream_options),
                    max_tokens: r.max_tokens,
                }
            }
        };
        if job.max_tokens == Some(0) {
            return Err(ApiError::invalid_request(
                "max_tokens must be at least 1, got 0.".to_owned(),
            )
            .with_param(limit_param));
        }
        // Like an engine's context length (vLLM answers 400 past `max_model_len`): without a
        // bound, a non-streaming request for 2^32 tokens at no time per token would build
        // gigabytes of text in a loop nobody can cancel.
        if let Some(n) = job.max_tokens.filter(|n| *n > MAX_OUTPUT_TOKENS) {
            return Err(ApiError::invalid_request(format!(
                "max_tokens must be at most {MAX_OUTPUT_TOKENS} (the sim's context length), got {n}."
            ))
            .with_param(limit_param));
        }
        Ok(job)
    }
}

fn include_usage(o: Option<StreamOptions>) -> bool {
    o.and_then(|o| o.include_usage).unwrap_or(false)
}

/// An error answered in OpenAI's shape:
/// `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
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
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'a str,
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
            model: job.model.clone(),
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

    fn delta(&mut self, role: Option<&str>, content: Option<&str>, finish: Option<&str>) -> Bytes {
        match self.api {
            Api::Chat => self.event(
                &[ChatChunkChoice {
                    index: 0,
                    delta: Delta { role, content },
                    logprobs: None,
                    finish_reason: finish,
                }],
                None,
            ),
            Api::Completions => self.event(
                &[TextChoice {
                    index: 0,
                    text: content.unwrap_or(""),
                    logprobs: None,
                    finish_reason: finish,
                }],
                None,
            ),
        }
    }

    /// The first chat event, `delta: {"role":"assistant","content":""}`; none for completions.
    pub(crate) fn role(&mut self) -> Option<Bytes> {
        (self.api == Api::Chat).then(|| self.delta(Some("assistant"), Some(""), None))
    }

    /// One token event.
    pub(crate) fn token(&mut self, text: &str) -> Bytes {
        self.delta(None, Some(text), None)
    }

    /// The event carrying `finish_reason` (empty delta for chat, empty text for completions).
    pub(crate) fn finish(&mut self, reason: &str) -> Bytes {
        match self.api {
            Api::Chat => self.delta(None, None, Some(reason)),
            Api::Completions => self.delta(None, Some(""), Some(reason)),
        }
    }

    /// The `include_usage` event: `choices: []` and the usage object.
    pub(crate) fn usage(&mut self, usage: &Usage) -> Bytes {
        self.event::<TextChoice<'_>>(&[], Some(usage))
    }

    /// The non-streaming response object.
    pub(crate) fn full(&self, text: &str, finish: &str, usage: &Usage) -> Bytes {
        let out = match self.api {
            Api::Chat => serde_json::to_vec(&Full {
                id: &self.id,
                object: "chat.completion",
                created: self.created,
                model: &self.model,
                system_fingerprint: None,
                choices: &[ChatChoice {
                    index: 0,
                    message: ChatMessage {
                        role: "assistant",
                        content: text,
                    },
                    logprobs: None,
                    finish_reason: finish,
                }],
                usage,
            }),
            Api::Completions => serde_json::to_vec(&Full {
                id: &self.id,
                object: "text_completion",
                created: self.created,
                model: &self.model,
                system_fingerprint: None,
                choices: &[TextChoice {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason: Some(finish),
                }],
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
        Job::parse(api, body.as_bytes()).unwrap()
    }

    #[test]
    fn chat_prompt_is_roles_and_contents_including_text_parts() {
        let j = job(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
               {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],
               "max_completion_tokens":3,"max_tokens":9}"#,
        );
        assert_eq!(j.prompt, "systembe briefuserhi there");
        assert_eq!(j.max_tokens, Some(3));
        assert!(!j.stream);
    }

    #[test]
    fn completion_prompt_arrays_are_joined() {
        let j = job(
            Api::Completions,
            r#"{"model":"m","prompt":["ab","cd"],"stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert_eq!(j.prompt, "abcd");
        assert!(j.stream && j.include_usage);
    }

    #[test]
    fn chat_chunks_have_openai_shape_and_null_usage_with_include_usage() {
        let mut j = job(Api::Chat, r#"{"model":"m","messages":[]}"#);
        j.include_usage = true;
        let mut e = Encoder::new(&j, 7);
        let role = e.role().unwrap();
        let text = std::str::from_utf8(&role).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(text.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(v["choices"][0]["delta"]["content"], "");
        assert!(v["usage"].is_null() && v.as_object().unwrap().contains_key("usage"));
        let fin = e.finish("length");
        let v: serde_json::Value = serde_json::from_slice(&fin[6..fin.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["delta"], serde_json::json!({}));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn usage_field_is_omitted_without_include_usage() {
        let j = job(Api::Completions, r#"{"model":"m","prompt":"x"}"#);
        let mut e = Encoder::new(&j, 7);
        let t = e.token(" a");
        let v: serde_json::Value = serde_json::from_slice(&t[6..t.len() - 2]).unwrap();
        assert!(!v.as_object().unwrap().contains_key("usage"));
        assert_eq!(v["choices"][0]["text"], " a");
        assert!(e.role().is_none());
    }
}
