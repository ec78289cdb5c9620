//! `POST /v1/embeddings` as vLLM serves it for an embedding model: the request's inputs, and
//! deterministic unit vectors in OpenAI's response shape.
//!
//! A vector is a pure function of (seed, input): the same text always embeds to the same vector,
//! different texts to nearly orthogonal ones. `encoding_format: "base64"` (what the official
//! `openai` package asks for unless told otherwise) is the vector's little-endian `f32` bytes in
//! standard base64; `dimensions` truncates the vector and normalises it again, as Matryoshka
//! models do.

use std::hash::{DefaultHasher, Hash, Hasher};

use base64::Engine as _;
use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::openai::{ApiError, Prompt};

/// Most inputs one request may carry (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

#[derive(Deserialize)]
struct Request {
    #[serde(default)]
    model: Option<String>,
    input: Prompt,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<u32>,
}

/// How the vectors are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    Float,
    Base64,
}

/// What the simulator needs from an embeddings request.
#[derive(Debug)]
pub(crate) struct EmbedJob {
    /// The model asked for; `None` is the first served model.
    pub(crate) model: Option<String>,
    /// The inputs, as the cost model's bytes (token-id inputs as in completions).
    pub(crate) inputs: Vec<Vec<u8>>,
    encoding: Encoding,
    dimensions: usize,
}

impl EmbedJob {
    /// Parses a request body; `max_dimensions` is the model's vector size.
    pub(crate) fn parse(
        body: &[u8],
        bytes_per_token: usize,
        max_dimensions: usize,
    ) -> Result<Self, ApiError> {
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::invalid_request(
                "invalid JSON body: expected a JSON object".to_owned(),
            ));
        }
        let r: Request = serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid_request(format!("invalid JSON body: {e}")))?;
        let encoding = match r.encoding_format.as_deref() {
            None | Some("float") => Encoding::Float,
            Some("base64") => Encoding::Base64,
            Some(other) => {
                return Err(ApiError::invalid_request(format!(
                    "encoding_format must be \"float\" or \"base64\", got {other:?}."
                ))
                .with_param("encoding_format"))
            }
        };
        let dimensions = match r.dimensions {
            None => max_dimensions,
            Some(d) if (1..=max_dimensions as u64).contains(&u64::from(d)) => d as usize,
            Some(d) => {
                return Err(ApiError::invalid_request(format!(
                    "dimensions must be in 1..={max_dimensions} for this model, got {d}."
                ))
                .with_param("dimensions"))
            }
        };
        let inputs = r.input.into_batch("input", bytes_per_token)?;
        if inputs.len() > MAX_INPUTS {
            return Err(ApiError::invalid_request(format!(
                "input must have at most {MAX_INPUTS} items, got {}.",
                inputs.len()
            ))
            .with_param("input"));
        }
        Ok(Self {
            model: r.model,
            inputs,
            encoding,
            dimensions,
        })
    }

    /// vLLM's context-length check for each input.
    pub(crate) fn check_context(
        &self,
        max_model_len: u32,
        bytes_per_token: usize,
    ) -> Result<(), ApiError> {
        let longest = self
            .inputs
            .iter()
            .map(|i| crate::cost::prompt_tokens(i.len(), bytes_per_token))
            .max()
            .unwrap_or(0);
        if longest > max_model_len as usize {
            return Err(ApiError::invalid_request(format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {longest} tokens in the input for embedding generation. Please reduce \
                 the length of the input."
            ))
            .with_param("input"));
        }
        Ok(())
    }

    /// The response body: one vector per input, in order.
    pub(crate) fn answer(
        &self,
        seed: u64,
        full_dimensions: usize,
        prompt_tokens: usize,
        created: u64,
    ) -> Bytes {
        let data: Vec<Embedding> = (0..)
            .zip(&self.inputs)
            .map(|(index, input)| {
                let v = vector(seed, input, full_dimensions, self.dimensions);
                Embedding {
                    index,
                    object: "embedding",
                    embedding: match self.encoding {
                        Encoding::Float => Vector::Float(v),
                        Encoding::Base64 => Vector::Base64(base64_f32(&v)),
                    },
                }
            })
            .collect();
        let answer = Answer {
            id: format!("embd-{:032x}", rand::random::<u128>()),
            object: "list",
            created,
            model: self.model.as_deref().unwrap_or_default(),
            data,
            usage: Usage {
                prompt_tokens,
                total_tokens: prompt_tokens,
                completion_tokens: 0,
                prompt_tokens_details: None,
            },
        };
        Bytes::from(serde_json::to_vec(&answer).expect("serializing plain structs cannot fail"))
    }
}

#[derive(Serialize)]
struct Answer<'a> {
    id: String,
    object: &'static str,
    created: u64,
    model: &'a str,
    data: Vec<Embedding>,
    usage: Usage,
}

#[derive(Serialize)]
struct Embedding {
    index: u32,
    object: &'static str,
    embedding: Vector,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
    completion_tokens: usize,
    prompt_tokens_details: Option<()>,
}

/// The unit vector of `input`: `full` components drawn from a generator seeded by (seed, input),
/// cut to `dimensions` and normalised (a prefix of a Matryoshka embedding).
fn vector(seed: u64, input: &[u8], full: usize, dimensions: usize) -> Vec<f32> {
    let mut h = DefaultHasher::new();
    seed.hash(&mut h);
    input.hash(&mut h);
    let mut rng = SmallRng::seed_from_u64(h.finish());
    let mut v: Vec<f32> = (0..full.min(dimensions))
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

/// A vector as OpenAI's `base64` encoding: its little-endian `f32` bytes, standard alphabet.
fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<EmbedJob, ApiError> {
        EmbedJob::parse(body.as_bytes(), 4, 8)
    }

    fn data(job: &EmbedJob) -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_slice(&job.answer(3, 8, 5, 7)).unwrap();
        assert_eq!(v["object"], "list");
        assert_eq!(v["usage"]["prompt_tokens"], 5);
        v["data"].as_array().unwrap().clone()
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    }

    #[test]
    fn vectors_are_unit_length_deterministic_and_differ_by_input() {
        let job = parse(r#"{"model":"m","input":["a","b","a"]}"#).unwrap();
        let d = data(&job);
        let (a, b, a2) = (floats(&d[0]), floats(&d[1]), floats(&d[2]));
        assert_eq!(a.len(), 8);
        assert_eq!(a, a2);
        assert_ne!(a, b);
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        assert_eq!(
            (d[2]["index"].as_u64(), d[2]["object"].as_str()),
            (Some(2), Some("embedding"))
        );
    }

    #[test]
    fn base64_is_the_little_endian_floats_and_dimensions_cut_and_renormalise() {
        let float = data(&parse(r#"{"model":"m","input":"x","dimensions":3}"#).unwrap());
        let b64 = data(
            &parse(r#"{"model":"m","input":"x","dimensions":3,"encoding_format":"base64"}"#)
                .unwrap(),
        );
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64[0]["embedding"].as_str().unwrap())
            .unwrap();
        let decoded: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(decoded, floats(&float[0]));
        assert_eq!(decoded.len(), 3);
        let norm: f32 = decoded.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        // A prefix of the full vector, scaled.
        let full = floats(&data(&parse(r#"{"model":"m","input":"x"}"#).unwrap())[0]);
        let ratio = decoded[0] / full[0];
        assert!(decoded
            .iter()
            .zip(&full)
            .all(|(d, f)| (d / f - ratio).abs() < 1e-4));
    }

    #[test]
    fn bad_fields_are_400s_naming_them() {
        for (body, param) in [
            (
                r#"{"model":"m","input":"x","encoding_format":"int8"}"#,
                "encoding_format",
            ),
            (r#"{"model":"m","input":"x","dimensions":9}"#, "dimensions"),
            (r#"{"model":"m","input":"x","dimensions":0}"#, "dimensions"),
            (r#"{"model":"m","input":[]}"#, "input"),
        ] {
            let e = parse(body).unwrap_err();
            assert_eq!(e.param, Some(param), "{body}");
        }
        let many = serde_json::json!({"model": "m", "input": vec!["x"; MAX_INPUTS + 1]});
        assert_eq!(parse(&many.to_string()).unwrap_err().param, Some("input"));
        assert!(parse(r#"{"model":"m"}"#).is_err());
        assert!(parse(r#"["m", "x"]"#).is_err());
        let long = parse(r#"{"input":["abcdefghi"]}"#).unwrap();
        assert!(long.check_context(3, 4).is_ok());
        assert_eq!(long.check_context(2, 4).unwrap_err().param, Some("input"));
    }
}
