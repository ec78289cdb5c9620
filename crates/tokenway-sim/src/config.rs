//! Configuration of the simulator: timing model, capacity, prefix cache and injected faults.
//!
//! Every field has a default, so an empty TOML document is a valid configuration. Units are in
//! the field names (`_ms`, `_tokens`, `_per_second`) and spelled out in each doc comment.

use serde::{Deserialize, Serialize};

use crate::SimError;

/// The whole simulator configuration (TOML keys are the field names; faults live in `[faults]`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Model ids served and listed by `GET /v1/models`; requests for any other model get 404.
    /// Default `["sim-model"]`.
    pub model_names: Vec<String>,
    /// Seed of the generated text and of fault decisions: the same seed and prompt give the same
    /// tokens. Default 0.
    pub seed: u64,
    /// Fixed part of the time to first token, milliseconds. Default 5.
    pub base_latency_ms: f64,
    /// Prefill speed for prompt tokens not found in the prefix cache, tokens per second.
    /// Default 20000.
    pub prefill_tokens_per_second: f64,
    /// Whether `prefill_tokens_per_second` is the engine's whole prefill throughput, shared by
    /// the requests in prefill (one after another, as chunked prefill shares a step's token
    /// budget), rather than each request's own. Default true.
    pub prefill_shared: bool,
    /// Time between output tokens when one request runs alone, milliseconds. Default 20.
    pub time_per_output_token_ms: f64,
    /// Slow-down of decoding per additional running request (dimensionless): the token interval
    /// is `time_per_output_token_ms * (1 + batch_penalty * (running - 1))`. Default 0.05.
    pub batch_penalty: f64,
    /// Requests that run at once (slots); further requests wait in FIFO order. Default 16.
    pub max_concurrency: usize,
    /// Requests that may wait for a slot; beyond this the server answers 429. Default 1024.
    pub max_queue: usize,
    /// Output tokens when the request gives no `max_tokens` / `max_completion_tokens` (at
    /// most what the context leaves). Default 64.
    pub default_max_tokens: u32,
    /// Mean output length before the "model" ends a choice with its end-of-sequence token
    /// (`finish_reason` `stop`): lengths are geometric with this mean, a pure function of
    /// (seed, prompt, choice). 0 (the default) draws none: the limit ends every choice, so
    /// output lengths are known in advance.
    pub eos_mean_tokens: f64,
    /// Context length in tokens, as vLLM's `max_model_len`: a prompt this long, or a prompt
    /// plus its `max_tokens` longer, is a 400; `/v1/models` reports it. Default 2 097 152
    /// (2^21), far past real models so that floods may ask for long outputs; set a model's
    /// (e.g. 32768) to test context-length errors.
    pub max_model_len: u32,
    /// Capacity of the prefix cache, tokens (rounded down to whole blocks; 0 disables it).
    /// Default 100000.
    pub prefix_cache_tokens: usize,
    /// Tokens per prefix-cache block (vLLM's block size). Default 16.
    pub block_tokens: usize,
    /// Size of the vectors `POST /v1/embeddings` answers (a request's `dimensions` may ask for
    /// fewer). Default 384.
    pub embedding_dimensions: usize,
    /// Prompt bytes per token: prompt tokens = ceil(prompt bytes / bytes_per_token). 4 is the
    /// usual ~4 characters per token of English text under BPE tokenizers. Default 4.
    pub bytes_per_token: usize,
    /// Artificial network round trip, milliseconds: every request (probes included) waits this
    /// long before it is handled, as if the backend were far away. Default 0.
    pub network_rtt_ms: f64,
    /// Injected faults (also replaceable at run time with `POST /admin/faults`).
    pub faults: Faults,
}

/// Faults to inject, for testing routers, retries and health checks.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Fraction (0.0 to 1.0) of completion requests answered 500 with an OpenAI error body.
    /// Default 0.0.
    pub error_rate: f64,
    /// After this many output tokens a stream stops sending but stays open (until the client
    /// leaves). Default none.
    pub stall_after_tokens: Option<u32>,
    /// After this many output tokens the engine "fails" as vLLM reports it: a stream gets a
    /// final `data: {"error": ...}` event and `data: [DONE]`, a whole answer a 500. Default none.
    pub error_after_tokens: Option<u32>,
    /// `GET /health` answers 503 (a dead engine core), while requests are still served.
    /// Default false.
    pub unhealthy: bool,
    /// Read completion requests but never answer them, while `GET /health` stays 200.
    /// Default false.
    pub hang: bool,
    /// Extra delay before the first token, milliseconds. Default 0.
    pub slow_start_ms: f64,
    /// Accept every TCP connection and reset it at once (SO_LINGER 0, then close).
    /// Default false.
    pub refuse_connections: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model_names: vec!["sim-model".to_owned()],
            seed: 0,
            base_latency_ms: 5.0,
            prefill_tokens_per_second: 20_000.0,
            prefill_shared: true,
            time_per_output_token_ms: 20.0,
            batch_penalty: 0.05,
            max_concurrency: 16,
            max_queue: 1024,
            default_max_tokens: 64,
            eos_mean_tokens: 0.0,
            max_model_len: MAX_MODEL_LEN,
            prefix_cache_tokens: 100_000,
            block_tokens: 16,
            bytes_per_token: 4,
            embedding_dimensions: 384,
            network_rtt_ms: 0.0,
            faults: Faults::default(),
        }
    }
}

/// Upper bound of `max_concurrency` (tokio's semaphore holds at most `usize::MAX >> 3` permits;
/// a million slots is far beyond any real server).
const MAX_CONCURRENCY: usize = 1_000_000;

/// Largest embedding vector (real models stop at a few thousand; a request of 2048 inputs then
/// answers at most ~200 MB of JSON).
const MAX_EMBEDDING_DIMENSIONS: usize = 8192;

/// Largest `max_model_len` (the output of all choices of a request together is bounded apart,
/// by the sim's `MAX_TOTAL_OUTPUT`).
pub const MAX_MODEL_LEN: u32 = 1 << 21;

/// Largest `batch_penalty`: a thousand times slower per extra running request (a token interval
/// must stay a representable duration).
const MAX_BATCH_PENALTY: f64 = 1000.0;

/// Slowest prefill: a token per thousand seconds.
const MIN_PREFILL_RATE: f64 = 0.001;

/// Longest time any setting may ask for: a day.
const MAX_MS: f64 = 86_400_000.0;

fn non_negative_ms(key: &'static str, v: f64) -> Result<(), SimError> {
    if v.is_finite() && (0.0..=MAX_MS).contains(&v) {
        Ok(())
    } else {
        Err(SimError::invalid(
            key,
            "a number of milliseconds in [0, 86400000]",
            v,
        ))
    }
}

impl SimConfig {
    /// Parses TOML (keys as in [`SimConfig`]) and validates the result.
    pub fn from_toml_str(s: &str) -> Result<Self, SimError> {
        let config: Self = toml::from_str(s).map_err(SimError::Toml)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value against its allowed range; the error names the key.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.model_names.is_empty() {
            return Err(SimError::invalid(
                "sim.model_names",
                "a non-empty list",
                "[]",
            ));
        }
        if let Some(bad) = self.model_names.iter().find(|m| m.trim().is_empty()) {
            return Err(SimError::invalid(
                "sim.model_names",
                "a list of non-empty names",
                format!("{bad:?}"),
            ));
        }
        if let Some(bad) = self
            .model_names
            .iter()
            .find(|m| tokenway_telemetry::label_value_problem(m).is_some())
        {
            return Err(SimError::invalid(
                "sim.model_names",
                "names without a double quote, a backslash or a control character (they label \
                 metrics)",
                format!("{bad:?}"),
            ));
        }
        non_negative_ms("sim.base_latency_ms", self.base_latency_ms)?;
        non_negative_ms("sim.network_rtt_ms", self.network_rtt_ms)?;
        non_negative_ms(
            "sim.time_per_output_token_ms",
            self.time_per_output_token_ms,
        )?;
        let pps = self.prefill_tokens_per_second;
        if !(pps.is_finite() && pps >= MIN_PREFILL_RATE) {
            return Err(SimError::invalid(
                "sim.prefill_tokens_per_second",
                "a finite number >= 0.001",
                pps,
            ));
        }
        let bp = self.batch_penalty;
        if !(bp.is_finite() && (0.0..=MAX_BATCH_PENALTY).contains(&bp)) {
            return Err(SimError::invalid("sim.batch_penalty", "in [0, 1000]", bp));
        }
        let eos = self.eos_mean_tokens;
        if !(eos.is_finite() && (eos == 0.0 || (1.0..=f64::from(MAX_MODEL_LEN)).contains(&eos))) {
            return Err(SimError::invalid(
                "sim.eos_mean_tokens",
                "0 (off) or in [1, 2097152]",
                eos,
            ));
        }
        if !(2..=MAX_MODEL_LEN).contains(&self.max_model_len) {
            return Err(SimError::invalid(
                "sim.max_model_len",
                "in 2..=2097152",
                self.max_model_len,
            ));
        }
        if !(1..=MAX_CONCURRENCY).contains(&self.max_concurrency) {
            return Err(SimError::invalid(
                "sim.max_concurrency",
                "in 1..=1000000",
                self.max_concurrency,
            ));
        }
        if !(1..self.max_model_len).contains(&self.default_max_tokens) {
            return Err(SimError::invalid(
                "sim.default_max_tokens",
                "in 1..max_model_len",
                self.default_max_tokens,
            ));
        }
        // Bounded so that their product (a block's bytes) cannot overflow, and a token-id
        // prompt (each id stands for `bytes_per_token` bytes) cannot ask for terabytes.
        if !(1..=4096).contains(&self.block_tokens) {
            return Err(SimError::invalid(
                "sim.block_tokens",
                "in 1..=4096",
                self.block_tokens,
            ));
        }
        if !(1..=64).contains(&self.bytes_per_token) {
            return Err(SimError::invalid(
                "sim.bytes_per_token",
                "in 1..=64",
                self.bytes_per_token,
            ));
        }
        if !(1..=MAX_EMBEDDING_DIMENSIONS).contains(&self.embedding_dimensions) {
            return Err(SimError::invalid(
                "sim.embedding_dimensions",
                "in 1..=8192",
                self.embedding_dimensions,
            ));
        }
        self.faults.validate()
    }
}

impl Faults {
    /// Checks every value against its allowed range; the error names the key.
    pub fn validate(&self) -> Result<(), SimError> {
        let r = self.error_rate;
        if !(0.0..=1.0).contains(&r) {
            return Err(SimError::invalid("sim.faults.error_rate", "in [0, 1]", r));
        }
        non_negative_ms("sim.faults.slow_start_ms", self.slow_start_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_toml_gives_the_defaults() {
        assert_eq!(SimConfig::from_toml_str("").unwrap(), SimConfig::default());
    }

    #[test]
    fn zero_prefill_rate_is_rejected_naming_the_key_and_range() {
        let err = SimConfig::from_toml_str("prefill_tokens_per_second = 0").unwrap_err();
        assert_eq!(
            err.to_string(),
            "sim.prefill_tokens_per_second must be a finite number >= 0.001 (got 0)"
        );
    }

    #[test]
    fn block_and_token_sizes_are_bounded() {
        let err = SimConfig::from_toml_str("bytes_per_token = 1000000").unwrap_err();
        assert!(err.to_string().contains("sim.bytes_per_token"), "{err}");
        let err = SimConfig::from_toml_str("block_tokens = 4294967296").unwrap_err();
        assert!(err.to_string().contains("sim.block_tokens"), "{err}");
    }

    #[test]
    fn a_model_name_that_would_break_the_metrics_page_is_rejected() {
        let err = SimConfig::from_toml_str("model_names = ['org/m \"v2\"']").unwrap_err();
        assert!(err.to_string().contains("sim.model_names"), "{err}");
    }

    #[test]
    fn unknown_key_is_rejected_naming_it() {
        let err = SimConfig::from_toml_str("prefil_tokens_per_second = 5").unwrap_err();
        assert!(
            err.to_string().contains("prefil_tokens_per_second"),
            "{err}"
        );
        let err = SimConfig::from_toml_str("[faults]\nerror = 1").unwrap_err();
        assert!(err.to_string().contains("error"), "{err}");
    }

    #[test]
    fn values_that_would_overflow_a_duration_or_the_output_bound_are_rejected() {
        for (toml, key) in [
            ("batch_penalty = 1e300", "sim.batch_penalty"),
            (
                "prefill_tokens_per_second = 1e-20",
                "sim.prefill_tokens_per_second",
            ),
            ("default_max_tokens = 4000000", "sim.default_max_tokens"),
            ("max_model_len = 1", "sim.max_model_len"),
            ("max_model_len = 3000000", "sim.max_model_len"),
        ] {
            let err = SimConfig::from_toml_str(toml).unwrap_err().to_string();
            assert!(err.starts_with(key), "{toml}: {err}");
        }
    }

    #[test]
    fn error_rate_above_one_is_rejected() {
        let err = SimConfig::from_toml_str("[faults]\nerror_rate = 1.5").unwrap_err();
        assert_eq!(
            err.to_string(),
            "sim.faults.error_rate must be in [0, 1] (got 1.5)"
        );
    }

    #[test]
    fn shipped_example_config_is_valid_and_shows_the_defaults() {
        let text = include_str!("../../../examples/sim.toml");
        assert_eq!(
            SimConfig::from_toml_str(text).unwrap(),
            SimConfig::default()
        );
    }

    #[test]
    fn integer_milliseconds_are_accepted_for_float_fields() {
        let c =
            SimConfig::from_toml_str("base_latency_ms = 7\n[faults]\nslow_start_ms = 3").unwrap();
        assert_eq!(c.base_latency_ms, 7.0);
        assert_eq!(c.faults.slow_start_ms, 3.0);
    }
}
