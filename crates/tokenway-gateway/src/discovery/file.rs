//! Backend discovery from a file: `backends_file` holds `[[backends]]` entries like the main
//! config. It is re-read when its modification time changes (checked every second) and on
//! SIGHUP; backends that appeared are added (and probed), backends that disappeared are removed
//! (requests in flight finish), and a backend whose entry changed in any key (URL, models,
//! `max_inflight`, region, key, probe path...) is replaced: removed, then added as new. A file that does not parse or validate is
//! reported and ignored: the previous set stays, so a bad edit never empties the pool.
//! Backends of the main config are never touched.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::config::BackendsFile;
use crate::probe;
use crate::state::{Shared, Source};

/// How often the file's modification time is checked.
const POLL: Duration = Duration::from_secs(1);

/// Watches `path` until `stop` fires.
pub async fn watch_file(shared: Arc<Shared>, path: PathBuf, mut stop: watch::Receiver<bool>) {
    let mut last_seen: Option<SystemTime> = None;
    let mut first = true;
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        let forced = if first {
            first = false;
            true
        } else {
            #[cfg(unix)]
            let hup_signal = async {
                match hup.as_mut() {
                    Some(h) => {
                        h.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            #[cfg(not(unix))]
            let hup_signal = std::future::pending::<()>();
            tokio::select! {
                _ = tokio::time::sleep(POLL) => false,
                _ = hup_signal => true,
                _ = stop.changed() => return,
            }
        };
        let modified = tokio::fs::metadata(&path)
            .await
            .and_then(|m| m.modified())
            .ok();
        if !forced && modified == last_seen {
            continue;
        }
        last_seen = modified;
        reload(&shared, &path, &stop).await;
    }
}

/// Reads the file once and applies the differences.
pub async fn reload(shared: &Arc<Shared>, path: &Path, stop: &watch::Receiver<bool>) {
    let text = match tokio::fs::read_to_string(path).await {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "cannot read backends_file; keeping the current backends");
            return;
        }
    };
    let file = match BackendsFile::parse(&text) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "invalid backends_file; keeping the current backends");
            return;
        }
    };
    let current: HashMap<String, _> = shared
        .live_upstreams()
        .into_iter()
        .filter(|(_, u)| u.source == Source::File)
        .map(|(id, u)| (u.name.clone(), (id, u.config.clone())))
        .collect();
    let statics: Vec<String> = shared
        .live_upstreams()
        .into_iter()
        .filter(|(_, u)| u.source == Source::Static)
        .map(|(_, u)| u.name.clone())
        .collect();
    let wanted: HashMap<String, _> = file
        .backends
        .iter()
        .map(|b| (b.display_name(), b))
        .collect();
    for (name, (id, config)) in &current {
        let keep = wanted.get(name).is_some_and(|b| *b == config);
        if !keep {
            tracing::info!(backend = %name, "backend removed by backends_file");
            shared.remove_backend(*id);
        }
    }
    for (name, b) in &wanted {
        if statics.contains(name) {
            tracing::warn!(backend = %name, "backends_file names a backend of the main config; ignored");
            continue;
        }
        if current.get(name).is_some_and(|(_, config)| config == *b) {
            continue;
        }
        match shared.add_backend(b, Source::File) {
            Ok(id) => {
                tracing::info!(backend = %name, url = %b.url, "backend added by backends_file");
                tokio::spawn(probe::run(shared.clone(), id, stop.clone()));
            }
            Err(e) => tracing::warn!(backend = %name, error = %e, "cannot add backend"),
        }
    }
}
