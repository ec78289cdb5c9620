//! The few fields of an OpenAI request body that routing needs, read without copying the rest.
//!
//! The body is forwarded to the backend byte for byte; this module only looks. Unknown fields are
//! skipped by serde (validated as JSON, never materialised), and the prompt is kept as a borrowed
//! raw JSON slice for affinity work later. A key given twice counts with its last value, as in
//! Python's `json` (what vLLM and SGLang parse with), where serde's derive would refuse it.

use std::borrow::Cow;

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokenway_wire::openai_fields::{count_hint, lax_bool};

use crate::error::ApiError;

/// What routing reads from a request body.
#[derive(Debug, Default)]
pub struct RequestMeta<'a> {
    /// Requested model.
    pub model: Option<Cow<'a, str>>,
    /// Whether the client asked for a stream. Read as the Python servers read it (pydantic's
    /// lax booleans: `true`, `1`, `"yes"`, ...); anything else is a 400.
    pub stream: Option<bool>,
    /// OpenAI `user` field, a session key for affinity.
    pub user: Option<Cow<'a, str>>,
    /// Chat messages, unparsed.
    pub messages: Option<&'a RawValue>,
    /// Completion prompt, unparsed.
    pub prompt: Option<&'a RawValue>,
    /// The Responses API's (and embeddings') input, unparsed.
    pub input: Option<&'a RawValue>,
    /// Output limit (`max_tokens`), a routing hint only: a value the gateway cannot read as a
    /// count (`-1`, `"many"`) is left for the backend to accept or refuse.
    pub max_tokens: Option<u64>,
    /// Output limit of newer chat clients (`max_completion_tokens`), a hint like `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    /// The Responses API's output limit (`max_output_tokens`), a hint like `max_tokens`.
    pub max_output_tokens: Option<u64>,
}

/// A string field (or `null`), borrowed from the body unless it holds escapes (serde's derive
/// copies an `Option<Cow<str>>` always).
struct Text<'a>(Option<Cow<'a, str>>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Str;
        impl<'de> Visitor<'de> for Str {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Text(None))
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_str(self)
            }
        }
        d.deserialize_option(Str)
    }
}

#[derive(Deserialize)]
#[serde(transparent)]
struct LaxBool(#[serde(deserialize_with = "lax_bool")] Option<bool>);

#[derive(Deserialize)]
#[serde(transparent)]
struct CountHint(#[serde(deserialize_with = "count_hint")] Option<u64>);

/// The body's keys that routing reads.
enum Field {
    Model,
    Stream,
    User,
    Messages,
    Prompt,
    Input,
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    Other,
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl Visitor<'_> for Name {
            type Value = Field;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, v: &str) -> Result<Field, E> {
                Ok(match v {
                    "model" => Field::Model,
                    "stream" => Field::Stream,
                    "user" => Field::User,
                    "messages" => Field::Messages,
                    "prompt" => Field::Prompt,
                    "input" => Field::Input,
                    "max_tokens" => Field::MaxTokens,
                    "max_completion_tokens" => Field::MaxCompletionTokens,
                    "max_output_tokens" => Field::MaxOutputTokens,
                    _ => Field::Other,
                })
            }
        }
        d.deserialize_identifier(Name)
    }
}

impl<'de> Deserialize<'de> for RequestMeta<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = RequestMeta<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut m = RequestMeta::default();
                // A repeated key overwrites: the last one counts, as in Python's `json`.
                while let Some(field) = map.next_key::<Field>()? {
                    match field {
                        Field::Model => m.model = map.next_value::<Text<'de>>()?.0,
                        Field::Stream => m.stream = map.next_value::<LaxBool>()?.0,
                        Field::User => m.user = map.next_value::<Text<'de>>()?.0,
                        Field::Messages => m.messages = map.next_value()?,
                        Field::Prompt => m.prompt = map.next_value()?,
                        Field::Input => m.input = map.next_value()?,
                        Field::MaxTokens => m.max_tokens = map.next_value::<CountHint>()?.0,
                        Field::MaxCompletionTokens => {
                            m.max_completion_tokens = map.next_value::<CountHint>()?.0;
                        }
                        Field::MaxOutputTokens => {
                            m.max_output_tokens = map.next_value::<CountHint>()?.0;
                        }
                        Field::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(m)
            }
        }
        d.deserialize_map(Fields)
    }
}

impl<'a> RequestMeta<'a> {
    /// Parses `body`; the error is the 400 the client receives.
    pub fn parse(body: &'a [u8]) -> Result<Self, ApiError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::bad_request(
                "the request body is empty; expected a JSON object",
            ));
        }
        // serde also reads a struct from a JSON array (`["m"]` would name model `m`).
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ));
        }
        let meta: RequestMeta<'a> = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!(
                "the request body is not valid JSON for this route: {e}"
            ))
        })?;
        Ok(meta)
    }

    /// The prompt as routing sees it: the raw JSON text of the chat messages or of the prompt.
    /// Two requests of one conversation share a prefix of this text, which is what the prefix
    /// index needs; it is never parsed further.
    pub fn prompt_text(&self) -> &'a [u8] {
        self.messages
            .or(self.prompt)
            .or(self.input)
            .map_or(&[][..], |raw| raw.get().as_bytes())
    }

    /// The requested output limit, if any.
    pub fn output_limit(&self) -> Option<u32> {
        self.max_completion_tokens
            .or(self.max_output_tokens)
            .or(self.max_tokens)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// The model name, or the 400 for a missing one.
    pub fn require_model(&self) -> Result<&str, ApiError> {
        match self.model.as_deref() {
            Some(m) if !m.is_empty() => Ok(m),
            _ => Err(ApiError::new(
                http::StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "missing_model",
                "you must provide a model parameter",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_routing_fields_and_skips_the_rest() {
        let body = br#"{"model":"m","stream":true,"user":"u1","temperature":0.2,
            "messages":[{"role":"user","content":"hi"}],"tools":[{"x":[1,2,{"y":null}]}]}"#;
        let m = RequestMeta::parse(body).expect("valid");
        assert_eq!(m.model.as_deref(), Some("m"));
        assert_eq!(m.stream, Some(true));
        assert_eq!(m.user.as_deref(), Some("u1"));
        assert!(m.messages.expect("messages").get().contains("hi"));
    }

    #[test]
    fn malformed_or_non_object_bodies_are_rejected() {
        for body in [&b"{"[..], b"", b"[1,2]", b"{\"model\": 3}", b"nul"] {
            let e = RequestMeta::parse(body).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST, "{body:?}");
        }
        // An array would otherwise fill the struct's fields in order.
        for body in [&br#"["sim-model"]"#[..], br#" ["m", true]"#, br#""str""#] {
            let e = RequestMeta::parse(body).unwrap_err();
            assert!(
                e.message.contains("must be a JSON object"),
                "{body:?}: {}",
                e.message
            );
        }
    }

    #[test]
    fn stream_and_limits_are_read_as_the_python_servers_read_them() {
        let read = |body: &str| {
            let m = RequestMeta::parse(body.as_bytes()).expect(body);
            (m.stream, m.output_limit())
        };
        assert_eq!(
            read(r#"{"stream":true,"max_tokens":256.0}"#),
            (Some(true), Some(256))
        );
        assert_eq!(
            read(r#"{"stream":"True","max_tokens":"64"}"#),
            (Some(true), Some(64))
        );
        assert_eq!(read(r#"{"stream":0,"max_tokens":-1}"#), (Some(false), None));
        assert_eq!(read(r#"{"stream":null,"max_tokens":null}"#), (None, None));
        assert_eq!(
            read(r#"{"stream":"no","max_tokens":2.5}"#),
            (Some(false), None)
        );
        assert_eq!(
            read(r#"{"max_tokens":{"a":[1]},"max_completion_tokens":9}"#),
            (None, Some(9))
        );
        for body in [
            r#"{"stream":"maybe"}"#,
            r#"{"stream":2}"#,
            r#"{"stream":[true]}"#,
        ] {
            let e = RequestMeta::parse(body.as_bytes()).unwrap_err();
            assert!(
                e.message.contains("expected a boolean"),
                "{body}: {}",
                e.message
            );
        }
    }

    #[test]
    fn model_and_user_are_borrowed_from_the_body_unless_escaped() {
        let m = RequestMeta::parse(br#"{"model":"m","user":"u\u0041"}"#).expect("valid");
        assert!(matches!(m.model, Some(Cow::Borrowed("m"))));
        assert!(matches!(m.user.as_deref(), Some("uA")));
        assert!(RequestMeta::parse(br#"{"model":null}"#)
            .expect("valid")
            .model
            .is_none());
    }

    #[test]
    fn a_repeated_key_counts_with_its_last_value_as_in_python() {
        let m = RequestMeta::parse(br#"{"model":"a","stream":false,"model":"b","stream":true}"#)
            .expect("valid");
        assert_eq!((m.model.as_deref(), m.stream), (Some("b"), Some(true)));
    }

    #[test]
    fn escaped_model_names_are_decoded() {
        let m = RequestMeta::parse(br#"{"model":"a\/b"}"#).expect("valid");
        assert_eq!(m.require_model().expect("model"), "a/b");
        assert!(RequestMeta::parse(b"{}")
            .expect("valid")
            .require_model()
            .is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = RequestMeta::parse(&body).map(|m| m.require_model().map(str::len));
        }

        #[test]
        fn any_model_string_round_trips(model in "\\PC{1,40}") {
            let body = serde_json::json!({"model": model, "messages": []}).to_string();
            let meta = RequestMeta::parse(body.as_bytes()).expect("valid JSON");
            proptest::prop_assert_eq!(meta.require_model().expect("model"), model.as_str());
        }
    }
}
