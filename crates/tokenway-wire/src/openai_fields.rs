//! Scalar fields of OpenAI requests read the way the Python inference servers read them.
//!
//! vLLM and SGLang declare their request bodies as pydantic models in lax mode, so a client that
//! sends `"stream": "true"` or `"max_tokens": 256.0` is served. A gateway in front of them must
//! not refuse what they accept, and a simulator standing in for them should accept the same.
//! These are `serde(deserialize_with = ...)` readers for such fields.

use std::borrow::Cow;

use serde::de::{Deserializer, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// A JSON scalar as the readers see it; any other value (an array, an object) is skipped
/// without being built: a client's 32 MiB array in `max_tokens` costs no allocation.
enum Scalar<'a> {
    Bool(bool),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Text(Cow<'a, str>),
    Other,
}

impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Scalar::Bool(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Scalar::Unsigned(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Scalar::Signed(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Scalar::Float(v))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Scalar::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Scalar::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Scalar::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }
}

impl Scalar<'_> {
    /// pydantic's lax boolean: JSON booleans, the numbers 0 and 1, and the strings it names.
    fn as_bool(&self) -> Option<bool> {
        match self {
            Self::Bool(b) => Some(*b),
            Self::Unsigned(0) | Self::Signed(0) => Some(false),
            Self::Unsigned(1) | Self::Signed(1) => Some(true),
            Self::Float(f) if *f == 0.0 => Some(false),
            Self::Float(f) if *f == 1.0 => Some(true),
            Self::Text(s) => match s.to_ascii_lowercase().as_str() {
                "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
                "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
                _ => None,
            },
            _ => None,
        }
    }

    /// pydantic's lax integer, non-negative: integers, whole floats, digit strings.
    fn as_count(&self) -> Option<u64> {
        match self {
            Self::Unsigned(n) => Some(*n),
            Self::Float(f) if *f >= 0.0 && f.fract() == 0.0 && *f < u64::MAX as f64 => {
                Some(*f as u64)
            }
            Self::Text(s) => s.trim().parse().ok(),
            _ => None,
        }
    }
}

/// A boolean field (`stream`): `null` or absent is `None`, anything pydantic would not read as
/// a boolean is an error naming the value's type.
pub fn lax_bool<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    match Option::<Scalar<'de>>::deserialize(d)? {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| D::Error::custom("expected a boolean")),
    }
}

/// A token count (`max_tokens`, `n`): `null` or absent is `None`, anything else that is not a
/// non-negative integer as pydantic reads one is an error.
pub fn lax_count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Scalar<'de>>::deserialize(d)? {
        None => Ok(None),
        Some(v) => v
            .as_count()
            .map(Some)
            .ok_or_else(|| D::Error::custom("expected a non-negative integer")),
    }
}

/// A token count read only as a hint: a value [`lax_count`] refuses is `None`, never an error
/// (the server behind judges it).
pub fn count_hint<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Ok(Option::<Scalar<'de>>::deserialize(d)?.and_then(|v| v.as_count()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Fields {
        #[serde(default, deserialize_with = "lax_bool")]
        stream: Option<bool>,
        #[serde(default, deserialize_with = "lax_count")]
        n: Option<u64>,
        #[serde(default, deserialize_with = "count_hint")]
        max_tokens: Option<u64>,
    }

    type Read = (Option<bool>, Option<u64>, Option<u64>);

    fn read(json: &str) -> Result<Read, String> {
        serde_json::from_str::<Fields>(json)
            .map(|f| (f.stream, f.n, f.max_tokens))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn lax_values_are_read_as_pydantic_reads_them() {
        assert_eq!(
            read(r#"{"stream":true,"n":2,"max_tokens":256.0}"#),
            Ok((Some(true), Some(2), Some(256)))
        );
        assert_eq!(
            read(r#"{"stream":"True","n":"3","max_tokens":"64"}"#),
            Ok((Some(true), Some(3), Some(64)))
        );
        assert_eq!(
            read(r#"{"stream":0,"n":null,"max_tokens":-1}"#),
            Ok((Some(false), None, None))
        );
        assert_eq!(
            read(r#"{"stream":"no","max_tokens":2.5}"#),
            Ok((Some(false), None, None))
        );
        assert_eq!(read(r#"{"max_tokens":{"a":[1]}}"#), Ok((None, None, None)));
        assert_eq!(read("{}"), Ok((None, None, None)));
        // A large array is skipped element by element, never built.
        let big = format!("{{\"max_tokens\":[{}0],\"n\":1}}", "0,".repeat(100_000));
        assert_eq!(read(&big), Ok((None, Some(1), None)));
    }

    #[test]
    fn what_pydantic_refuses_is_an_error_except_for_hints() {
        for json in [
            r#"{"stream":"maybe"}"#,
            r#"{"stream":2}"#,
            r#"{"stream":[true]}"#,
        ] {
            assert!(
                read(json).unwrap_err().contains("expected a boolean"),
                "{json}"
            );
        }
        for json in [
            r#"{"n":-1}"#,
            r#"{"n":1.5}"#,
            r#"{"n":"x"}"#,
            r#"{"n":[1]}"#,
        ] {
            assert!(
                read(json).unwrap_err().contains("non-negative integer"),
                "{json}"
            );
        }
    }
}
