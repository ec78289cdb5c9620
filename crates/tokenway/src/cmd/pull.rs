//! `tokenway pull`: download a model revision from an origin, verified and resumable (see
//! `docs/weights.md`).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokenway_mirror::{open_origin, pull, ModelRef, PullOptions, PullProgress};

/// Flags of `tokenway pull`.
#[derive(clap::Args)]
pub struct PullArgs {
    /// What to pull: `NAME` (tag latest), `NAME:TAG` or `NAME@REVISION`.
    #[arg(value_name = "MODEL")]
    pub model: String,
    /// Origin object store, e.g. `file:///srv/models` (only file:// in this build).
    #[arg(long, value_name = "URL")]
    pub origin: String,
    /// Output directory; unfinished files live in `<out>/.partial` until verified.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Pieces downloaded at once.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub parallel: usize,
}

/// Runs `tokenway pull`.
pub async fn run(args: PullArgs) -> anyhow::Result<()> {
    let mref = ModelRef::parse(&args.model)?;
    let origin = open_origin(&args.origin)?;
    let started = Instant::now();
    let last_line = Arc::new(Mutex::new(Instant::now()));
    let progress = move |p: &PullProgress| {
        if let Some(f) = &p.file_finished {
            eprintln!("done {f}");
            return;
        }
        // Plain lines at most once a second (a progress bar is future work).
        let Ok(mut last) = last_line.lock() else {
            return;
        };
        if last.elapsed() >= Duration::from_secs(1) {
            *last = Instant::now();
            let secs = started.elapsed().as_secs_f64().max(0.001);
            eprintln!(
                "{} / {} bytes ({:.0}%), {:.1} MB/s, files {}/{}",
                p.bytes_done,
                p.bytes_total,
                100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64,
                p.bytes_done as f64 / secs / 1e6,
                p.files_done,
                p.files_total
            );
        }
    };
    let opts = PullOptions {
        parallel: args.parallel.max(1),
        progress: Some(Arc::new(progress)),
        ..PullOptions::default()
    };
    // Ctrl-C stops starting pieces; what is recorded is kept for the next run.
    let cancel = Arc::clone(&opts.cancel);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: finishing pieces in flight; rerun to resume");
            cancel.store(true, Ordering::Relaxed);
        }
    });
    let report = pull(origin, &mref, &args.out, &opts)
        .await
        .with_context(|| format!("pulling {mref} into {}", args.out.display()))?;
    if !report.complete {
        anyhow::bail!("pull of {mref} interrupted; rerun the same command to resume");
    }
    eprintln!(
        "pulled {}@{} into {}: {} files ({} already present), {} bytes fetched in {:.1}s, {} pieces resumed",
        report.manifest.model,
        report.manifest.revision,
        args.out.display(),
        report.manifest.files.len(),
        report.files_already_present,
        report.bytes_fetched,
        started.elapsed().as_secs_f64(),
        report.pieces_resumed
    );
    Ok(())
}
