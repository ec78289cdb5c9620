//! `tokenway publish`: upload a model directory to an origin as one revision (see
//! `docs/weights.md`).

use std::path::PathBuf;

use anyhow::Context as _;
use tokenway_mirror::{open_origin, publish, PublishOptions};

/// Flags of `tokenway publish`.
#[derive(clap::Args)]
pub struct PublishArgs {
    /// Directory holding the model files (every regular file under it is published).
    pub dir: PathBuf,
    /// Origin object store, e.g. `file:///srv/models`, `s3://bucket/prefix` or
    /// `az://container/prefix` (credentials from the AWS_* or AZURE_* environment,
    /// docs/weights.md).
    #[arg(long, value_name = "URL")]
    pub origin: String,
    /// Model name: `[A-Za-z0-9._-]`, optionally `org/name`.
    #[arg(long, value_name = "NAME")]
    pub model: String,
    /// Revision name (immutable once published).
    #[arg(long, value_name = "REV")]
    pub revision: String,
    /// Tag to point at this revision, e.g. `latest`.
    #[arg(long, value_name = "TAG")]
    pub tag: Option<String>,
    /// Piece size in KiB: the unit of verification and of parallel download (64..=65536).
    #[arg(long, value_name = "KIB", default_value_t = 4096)]
    pub piece_size_kib: u64,
    /// Chunk group of the outboards in KiB: the finest unit any byte range is verified in
    /// (64..=1024, a power of two, at most the piece size).
    #[arg(long, value_name = "KIB", default_value_t = 64)]
    pub group_size_kib: u64,
    /// Files hashed and uploaded at once.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub parallel: usize,
    /// Upload every blob and outboard even when the origin has an object of that name and
    /// size (repairs an object that went bad in the origin; pulls name it when it does).
    #[arg(long)]
    pub reupload: bool,
}

/// Runs `tokenway publish`.
pub async fn run(args: PublishArgs) -> anyhow::Result<()> {
    let origin = open_origin(&args.origin)?;
    let opts = PublishOptions {
        piece_size: args.piece_size_kib.saturating_mul(1024),
        group_size: args.group_size_kib.saturating_mul(1024),
        parallel: args.parallel.max(1),
        reupload: args.reupload,
    };
    let report = publish(
        origin,
        &args.dir,
        &args.model,
        &args.revision,
        args.tag.as_deref(),
        &opts,
    )
    .await
    .with_context(|| format!("publishing {}", args.dir.display()))?;
    eprintln!(
        "published {}@{}: {} files, {} bytes, {} blobs uploaded, {} already in the origin, {} outboards uploaded{}",
        args.model,
        args.revision,
        report.files,
        report.bytes_hashed,
        report.blobs_uploaded,
        report.blobs_skipped,
        report.outboards_uploaded,
        args.tag
            .map(|t| format!(", tag {t} -> {}", args.revision))
            .unwrap_or_default()
    );
    Ok(())
}
