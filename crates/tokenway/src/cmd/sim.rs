//! `tokenway sim`: a simulated OpenAI-compatible inference server (see `docs/sim.md`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use tokenway_sim::SimConfig;

/// Flags of `tokenway sim`.
#[derive(clap::Args)]
pub struct SimArgs {
    /// Address to listen on (port 0 picks a free port; the real one is printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// TOML file with the simulator settings (keys as in docs/sim.md); flags below override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model id to serve (repeatable; replaces `model_names`).
    #[arg(long = "model", value_name = "NAME")]
    pub models: Vec<String>,
    /// Seed of the generated text and of fault decisions.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Fixed part of the time to first token, in milliseconds (`base_latency_ms`).
    #[arg(long, value_name = "MS")]
    pub ttft_base_ms: Option<f64>,
    /// Time per output token with one request running, in milliseconds
    /// (`time_per_output_token_ms`).
    #[arg(long, value_name = "MS")]
    pub tpot_ms: Option<f64>,
    /// Prefill speed of uncached prompt tokens, tokens per second
    /// (`prefill_tokens_per_second`).
    #[arg(long, value_name = "TOKENS_PER_S")]
    pub prefill_tps: Option<f64>,
    /// Requests that run at once; more wait in a FIFO queue (`max_concurrency`).
    #[arg(long, value_name = "N")]
    pub max_concurrency: Option<usize>,
    /// Fraction of requests answered 500, 0.0 to 1.0 (`faults.error_rate`).
    #[arg(long, value_name = "FRACTION")]
    pub error_rate: Option<f64>,
}

impl SimArgs {
    fn config(&self) -> anyhow::Result<SimConfig> {
        let mut config = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read sim config {}", path.display()))?;
                SimConfig::from_toml_str(&text)
                    .with_context(|| format!("in sim config {}", path.display()))?
            }
            None => SimConfig::default(),
        };
        if !self.models.is_empty() {
            config.model_names.clone_from(&self.models);
        }
        if let Some(v) = self.seed {
            config.seed = v;
        }
        if let Some(v) = self.ttft_base_ms {
            config.base_latency_ms = v;
        }
        if let Some(v) = self.tpot_ms {
            config.time_per_output_token_ms = v;
        }
        if let Some(v) = self.prefill_tps {
            config.prefill_tokens_per_second = v;
        }
        if let Some(v) = self.max_concurrency {
            config.max_concurrency = v;
        }
        if let Some(v) = self.error_rate {
            config.faults.error_rate = v;
        }
        config.validate()?;
        Ok(config)
    }
}

/// Runs `tokenway sim`.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    let config = args.config()?;
    let listener = tokenway_transport::socket::listen_tcp(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!("tokenway sim listening on http://{addr}");
    tokenway_sim::serve(config, listener, crate::cmd::signal::shutdown()).await?;
    Ok(())
}
