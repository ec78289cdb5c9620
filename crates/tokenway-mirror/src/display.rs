//! How a pull shows its advance: an indicatif bar (bytes, rate, ETA) on a terminal, plain
//! lines at most once a second otherwise (logs, CI), plus one line per finished file.

use std::io::IsTerminal as _;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::pull::{ProgressFn, PullProgress};

struct Plain {
    started: Instant,
    last: Option<Instant>,
    base: Option<u64>,
}

/// Whether fetching has begun: what was on disk before (checked first, which can take
/// minutes on a large model) is no part of the rate or the ETA.
#[derive(Default)]
struct Phase {
    fetching: bool,
    /// When the first check was reported: a check shorter than a second says nothing.
    checking_since: Option<Instant>,
}

/// The progress display of one pull.
pub struct PullDisplay {
    bar: Option<ProgressBar>,
    plain: Mutex<Plain>,
    phase: Mutex<Phase>,
}

impl PullDisplay {
    /// A bar if stderr is a terminal, plain lines otherwise.
    pub fn for_stderr() -> Arc<Self> {
        Self::new(std::io::stderr().is_terminal())
    }

    /// A bar (`tty`) or plain lines.
    pub fn new(tty: bool) -> Arc<Self> {
        let bar = tty.then(|| {
            let style = ProgressStyle::with_template(
                "{bar:40.cyan/blue} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta} {msg}",
            )
            .expect("invariant: the progress template is valid")
            .progress_chars("=> ");
            let b = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            b.set_style(style);
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        Arc::new(Self {
            bar,
            plain: Mutex::new(Plain {
                started: Instant::now(),
                last: None,
                base: None,
            }),
            phase: Mutex::new(Phase::default()),
        })
    }

    /// The callback to put in `PullOptions::progress`.
    pub fn callback(self: &Arc<Self>) -> ProgressFn {
        let me = Arc::clone(self);
        Arc::new(move |p: &PullProgress| me.update(p))
    }

    /// Shows `p`.
    pub fn update(&self, p: &PullProgress) {
        let (starts, long_check) = {
            let mut ph = self.phase.lock().unwrap_or_else(PoisonError::into_inner);
            let starts = !p.checking && !ph.fetching;
            ph.fetching |= starts;
            let since = *ph.checking_since.get_or_insert_with(Instant::now);
            (starts, since.elapsed() >= Duration::from_secs(1))
        };
        if let Some(bar) = &self.bar {
            bar.set_length(p.bytes_total);
            bar.set_position(p.bytes_done);
            if starts {
                // The bytes found on disk came at once: not a rate.
                bar.reset_eta();
            }
            bar.set_message(if p.checking {
                format!("checking files on disk {}/{}", p.files_done, p.files_total)
            } else {
                format!("files {}/{}", p.files_done, p.files_total)
            });
            if let Some(f) = &p.file_finished {
                bar.println(format!("done {f}"));
            }
            return;
        }
        if let Some(f) = &p.file_finished {
            eprintln!("done {f}");
            return;
        }
        let mut st = self.plain.lock().unwrap_or_else(PoisonError::into_inner);
        if p.checking {
            if long_check
                && st
                    .last
                    .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
            {
                st.last = Some(Instant::now());
                eprintln!(
                    "checking what is already on disk: {:.1} / {:.1} MiB in place, files {}/{}",
                    p.bytes_done as f64 / 1048576.0,
                    p.bytes_total as f64 / 1048576.0,
                    p.files_done,
                    p.files_total
                );
            }
            return;
        }
        if starts {
            // Rate and ETA from here: what was on disk is not fetched.
            st.started = Instant::now();
            st.base = Some(p.bytes_done);
            st.last = None;
        }
        let base = *st.base.get_or_insert(p.bytes_done);
        if st
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        st.last = Some(Instant::now());
        let secs = st.started.elapsed().as_secs_f64().max(0.001);
        let rate = p.bytes_done.saturating_sub(base) as f64 / secs;
        let left = p.bytes_total.saturating_sub(p.bytes_done) as f64;
        let eta = if rate > 0.0 {
            format!("{:.0}s", left / rate)
        } else {
            "?".into()
        };
        eprintln!(
            "{:.1} / {:.1} MiB ({:.0}%), {:.1} MiB/s, eta {eta}, files {}/{}",
            p.bytes_done as f64 / 1048576.0,
            p.bytes_total as f64 / 1048576.0,
            100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64,
            rate / 1048576.0,
            p.files_done,
            p.files_total
        );
    }

    /// Removes the bar (plain lines need nothing).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
