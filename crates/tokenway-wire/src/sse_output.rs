//! Whether one server-sent event of an inference stream carries output (a token), for the
//! clocks that time the first token and the gaps between tokens.
//!
//! Not every event of an OpenAI-compatible stream is a token. vLLM opens a chat stream with a
//! role chunk (`"delta":{"role":"assistant","content":""}`), may close each choice with a
//! chunk holding only its `finish_reason`, and ends with a usage chunk (`"choices":[]`);
//! Anthropic's Messages stream has `message_start`, `content_block_start`, `ping` and
//! `message_delta` events around its `content_block_delta`s; the Responses API wraps its
//! `response.output_text.delta` events in `response.created`, `response.completed` and the
//! like. Counted as tokens, they time the first token at the role chunk (sent before the
//! prefill by some servers) and add near-zero gaps that pull the gap percentiles down.
//!
//! This is a byte-level check of one whole event, not a JSON parse: a stream's events are
//! compact JSON from serializers (pydantic, serde, nlohmann, Go's encoding/json), and inside a
//! JSON string a quote is always escaped, so a key pattern such as `"content":` cannot be
//! matched inside token text. What it does not recognise (plain-text data, JSON of another
//! shape) counts as output, as every event did before.

use std::sync::LazyLock;

use memchr::memmem::{self, Finder};

/// Keys whose non-empty string value is generated text in an OpenAI-style chunk: chat
/// `content`, reasoning models' `reasoning_content` / `reasoning`, legacy completions' `text`,
/// and a tool call's `arguments`. Searchers are built once: this runs on every chunk a
/// gateway relays.
static OUTPUT_KEYS: LazyLock<[Finder<'static>; 5]> = LazyLock::new(|| {
    [
        Finder::new(b"\"content\":"),
        Finder::new(b"\"text\":"),
        Finder::new(b"\"reasoning_content\":"),
        Finder::new(b"\"reasoning\":"),
        Finder::new(b"\"arguments\":"),
    ]
});
static CHOICES: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"choices\":"));
static TOOL_CALLS: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"tool_calls\":"));

/// Whether `event` (the bytes of one whole event, its fields and terminating blank line)
/// carries generated output. See the [module docs](self).
pub fn event_carries_output(event: &[u8]) -> bool {
    let at = if event.starts_with(b"data:") {
        Some(0)
    } else {
        memmem::find(event, b"data:")
    };
    let Some(at) = at else {
        // `data` without a colon (an empty value), or no data field at all (which the scanner
        // does not count as an event anyway).
        return true;
    };
    let value = skip_space(&event[at + b"data:".len()..]);
    if value.first() != Some(&b'{') {
        // Plain-text data (a backend of its own shape): every event is output.
        return true;
    }
    if skip_space(&value[1..]).starts_with(b"\"error\"") {
        return false;
    }
    if CHOICES.find(value).is_some() {
        return OUTPUT_KEYS
            .iter()
            .any(|key| non_empty_string_after(value, key))
            || opens_non_empty_array(value, &TOOL_CALLS);
    }
    if let Some(kind) = event_type(value) {
        // Anthropic's `content_block_delta`, the Responses API's `response.*.delta`; not
        // Anthropic's `message_delta`, which carries the stop reason and usage.
        return kind.ends_with(b"delta") && kind != b"message_delta";
    }
    true
}

fn skip_space(bytes: &[u8]) -> &[u8] {
    let n = bytes
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t'))
        .count();
    &bytes[n..]
}

/// Whether some occurrence of `key` is followed by a string with at least one character.
fn non_empty_string_after(value: &[u8], key: &Finder<'_>) -> bool {
    key.find_iter(value).any(|at| {
        let rest = skip_space(&value[at + key.needle().len()..]);
        rest.first() == Some(&b'"') && rest.get(1).is_some_and(|&b| b != b'"')
    })
}

/// Whether some occurrence of `key` is followed by an array holding an object.
fn opens_non_empty_array(value: &[u8], key: &Finder<'_>) -> bool {
    key.find_iter(value).any(|at| {
        let rest = skip_space(&value[at + key.needle().len()..]);
        rest.first() == Some(&b'[') && skip_space(&rest[1..]).first() == Some(&b'{')
    })
}

/// The value of the first `"type"` key, when it is a string.
fn event_type(value: &[u8]) -> Option<&[u8]> {
    let at = memmem::find(value, b"\"type\":")?;
    let rest = skip_space(&value[at + b"\"type\":".len()..]);
    let rest = rest.strip_prefix(b"\"")?;
    let end = memchr::memchr(b'"', rest)?;
    Some(&rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(event: &str) -> bool {
        event_carries_output(event.as_bytes())
    }

    #[test]
    fn openai_chat_chunks_carry_output_only_with_text() {
        let chunk = |delta: &str| {
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\
                 \"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\
                 \"finish_reason\":null}}]}}\n\n"
            )
        };
        assert!(!output(&chunk(r#"{"role":"assistant","content":""}"#)));
        assert!(!output(&chunk(r#"{"role":"assistant"}"#)));
        assert!(!output(&chunk("{}")));
        assert!(!output(&chunk(r#"{"content":null}"#)));
        assert!(output(&chunk(r#"{"content":"Hel"}"#)));
        assert!(output(&chunk(r#"{"content":" "}"#)));
        // An escaped quote is text too.
        assert!(output(&chunk(r#"{"content":"\""}"#)));
        // Text that looks like a key is not one: the quotes in it are escaped.
        assert!(!output(&chunk(
            r#"{"role":"assistant","content":""},"x":"\"content\":\"a"#
        )));
        assert!(output(&chunk(r#"{"reasoning_content":"Let"}"#)));
        assert!(output(&chunk(r#"{"reasoning":"Let"}"#)));
        assert!(output(&chunk(
            r#"{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":""}}]}"#
        )));
        assert!(output(&chunk(
            r#"{"tool_calls":[{"index":0,"function":{"arguments":"{\"a"}}]}"#
        )));
        assert!(!output(&chunk(r#"{"tool_calls":[]}"#)));
        // Spaces after the colons (Python's json.dumps defaults).
        assert!(output(
            "data: {\"choices\": [{\"delta\": {\"content\": \"Hi\"}}]}\n\n"
        ));
        assert!(!output(
            "data: {\"choices\": [{\"delta\": {\"content\": \"\"}}]}\n\n"
        ));
    }

    #[test]
    fn usage_finish_and_error_events_are_not_output() {
        assert!(!output(
            "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\
             \"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n"
        ));
        assert!(!output(
            "data: {\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"\",\
             \"finish_reason\":\"length\"}]}\n\n"
        ));
        assert!(output(
            "data: {\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"a\",\
             \"finish_reason\":null}]}\n\n"
        ));
        assert!(!output(
            "data: {\"error\":{\"message\":\"engine died\",\"code\":500}}\n\n"
        ));
        assert!(!output("data: { \"error\": {\"message\": \"x\"}}\n\n"));
    }

    #[test]
    fn anthropic_and_responses_events_are_output_only_as_deltas() {
        let anthropic = |kind: &str, rest: &str| {
            format!("event: {kind}\ndata: {{\"type\":\"{kind}\"{rest}}}\n\n")
        };
        assert!(!output(&anthropic(
            "message_start",
            r#","message":{"id":"m","content":[]}"#
        )));
        assert!(!output(&anthropic(
            "content_block_start",
            r#","index":0,"content_block":{"type":"text","text":""}"#
        )));
        assert!(!output(&anthropic("ping", "")));
        assert!(output(&anthropic(
            "content_block_delta",
            r#","index":0,"delta":{"type":"text_delta","text":"Hi"}"#
        )));
        assert!(!output(&anthropic(
            "message_delta",
            r#","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}"#
        )));
        assert!(!output(&anthropic("message_stop", "")));
        assert!(output(
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\
             \"delta\":\"Hi\"}\n\n"
        ));
        assert!(!output(
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":\
             {\"output\":[{\"content\":[{\"type\":\"output_text\",\"text\":\"Hi\"}]}]}}\n\n"
        ));
    }

    #[test]
    fn what_is_not_recognised_counts_as_output() {
        assert!(output("data: hello\n\n"));
        assert!(output("data\n\n"));
        assert!(output("data: {\"n\":1}\n\n"));
        assert!(output("data: {\"token\":{\"text\":\"a\"}}\n\n"));
    }
}
