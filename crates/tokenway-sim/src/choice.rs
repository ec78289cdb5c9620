//! One choice's output as it is generated: token after token until the "model" ends it (an
//! end-of-sequence token after a drawn length, when `eos_mean_tokens` is set), the request's
//! limit ends it, or a `stop` string appears.
//!
//! The drawn length is a pure function of (seed, prompt, choice), geometric with mean
//! `eos_mean_tokens`, at least the request's `min_tokens`; `ignore_eos` turns it off, as on vLLM.

use std::borrow::Cow;
use std::hash::{DefaultHasher, Hash, Hasher};

use crate::text::TokenSource;

/// How a choice ended: `finish_reason`, and vLLM's `stop_reason` (the stop string matched).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Finish {
    pub(crate) reason: &'static str,
    pub(crate) stop: Option<String>,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Choice {
    source: TokenSource,
    /// Tokens it produces unless a stop string ends it sooner.
    length: u32,
    /// Tokens before which no stop string counts.
    min_tokens: u32,
    /// `finish_reason` once `length` tokens are out.
    at_length: &'static str,
    generated: u32,
    /// Text generated but not handed out yet, while the request has stop strings: the last
    /// bytes, which a stop string could begin with (see [`Choice::next`]).
    held: String,
    finish: Option<Finish>,
}

/// The rules every choice of a request follows (its `stop` strings are passed to
/// [`Choice::next`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ending {
    pub(crate) seed: u64,
    /// Output limit: the request's, else the default.
    pub(crate) max_tokens: u32,
    /// Whether the request set the limit (it then ends with `length`; the default one ends
    /// with `stop`, as if the model had chosen to).
    pub(crate) limit_requested: bool,
    /// Mean length before the end-of-sequence token; 0 draws none (the limit ends every choice).
    pub(crate) eos_mean_tokens: f64,
    pub(crate) ignore_eos: bool,
    pub(crate) min_tokens: u32,
}

impl Choice {
    /// Choice `index` of `prompt`.
    pub(crate) fn new(ending: &Ending, prompt: &[u8], index: u32) -> Self {
        let eos = (ending.eos_mean_tokens > 0.0 && !ending.ignore_eos)
            .then(|| drawn_length(ending.seed, prompt, index, ending.eos_mean_tokens))
            .map(|n| n.max(ending.min_tokens));
        let (length, at_length) = match eos {
            Some(n) if n < ending.max_tokens => (n, "stop"),
            _ if ending.limit_requested => (ending.max_tokens, "length"),
            _ => (ending.max_tokens, "stop"),
        };
        Self {
            source: TokenSource::choice(ending.seed, prompt, index),
            length,
            min_tokens: ending.min_tokens,
            at_length,
            generated: 0,
            held: String::new(),
            finish: None,
        }
    }

    /// The next token's text to hand out, or `None` once the choice has ended. With stop
    /// strings, as vLLM does, the text a stop string could begin with (the longest one's length
    /// less one byte) is held back until the next token shows it is not one, and the text of
    /// a matched stop string is never handed out: a stream and a whole answer read the same,
    /// ending exactly before it. So a token may hand out less than its text, or nothing, and
    /// the last one what was held.
    pub(crate) fn next(&mut self, stop: &[String]) -> Option<Cow<'static, str>> {
        if self.finish.is_some() || self.generated >= self.length {
            return None;
        }
        let token = self.source.token(self.generated);
        self.generated += 1;
        let ends = |c: &mut Self| {
            if c.generated >= c.length {
                c.finish = Some(Finish {
                    reason: c.at_length,
                    stop: None,
                });
            }
        };
        let longest = stop.iter().map(String::len).max().unwrap_or(0);
        if longest == 0 {
            ends(self);
            return Some(Cow::Borrowed(token));
        }
        self.held.push_str(token);
        // As vLLM: no stop string ends a choice before `min_tokens`, and of several that
        // appear the first listed wins.
        if self.generated > self.min_tokens {
            let found = stop
                .iter()
                .filter(|s| !s.is_empty())
                .find_map(|s| self.held.find(s.as_str()).map(|at| (at, s)));
            if let Some((at, s)) = found {
                self.finish = Some(Finish {
                    reason: "stop",
                    stop: Some(s.clone()),
                });
                self.held.truncate(at);
                return Some(Cow::Owned(std::mem::take(&mut self.held)));
            }
        }
        ends(self);
        if self.finish.is_some() {
            return Some(Cow::Owned(std::mem::take(&mut self.held)));
        }
        // Tokens are ASCII, so any byte is a boundary.
        let release = self.held.len().saturating_sub(longest - 1);
        Some(Cow::Owned(self.held.drain(..release).collect()))
    }

    /// How it ended, once it has.
    pub(crate) fn finish(&self) -> Option<&Finish> {
        self.finish.as_ref()
    }

    /// Tokens generated so far (the one that completed a stop string included, as vLLM
    /// counts it).
    pub(crate) fn generated(&self) -> u32 {
        self.generated
    }
}

/// A geometric length with mean `mean` (at least 1), from a hash of (seed, prompt, choice).
fn drawn_length(seed: u64, prompt: &[u8], choice: u32, mean: f64) -> u32 {
    let mut h = DefaultHasher::new();
    (seed, "eos").hash(&mut h);
    prompt.hash(&mut h);
    choice.hash(&mut h);
    // Uniform in (0, 1].
    let u = ((h.finish() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let p = 1.0 / mean.max(1.0);
    if p >= 1.0 {
        return 1;
    }
    let n = (u.ln() / (1.0 - p).ln()).ceil();
    if n.is_finite() && n >= 1.0 {
        n.min(f64::from(u32::MAX)) as u32
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ending() -> Ending {
        Ending {
            seed: 1,
            max_tokens: 50,
            limit_requested: true,
            eos_mean_tokens: 0.0,
            ignore_eos: false,
            min_tokens: 0,
        }
    }

    fn run(c: &mut Choice, stop: &[String]) -> String {
        let mut out = String::new();
        while let Some(t) = c.next(stop) {
            out.push_str(&t);
        }
        out
    }

    #[test]
    fn without_eos_the_limit_ends_a_choice() {
        let mut c = Choice::new(&ending(), b"p", 0);
        assert_eq!(run(&mut c, &[]).split_whitespace().count(), 50);
        assert_eq!(c.finish().unwrap().reason, "length");
        let mut d = Choice::new(
            &Ending {
                limit_requested: false,
                ..ending()
            },
            b"p",
            0,
        );
        run(&mut d, &[]);
        assert_eq!(d.finish().unwrap().reason, "stop");
    }

    #[test]
    fn eos_lengths_average_their_mean_and_respect_min_tokens_and_ignore_eos() {
        let e = Ending {
            eos_mean_tokens: 10.0,
            max_tokens: 10_000,
            ..ending()
        };
        let lengths: Vec<u32> = (0..2000)
            .map(|i| {
                let mut c = Choice::new(&e, format!("prompt {i}").as_bytes(), 0);
                run(&mut c, &[]);
                assert_eq!(c.finish().unwrap().reason, "stop");
                c.generated()
            })
            .collect();
        let mean = lengths.iter().map(|&n| f64::from(n)).sum::<f64>() / 2000.0;
        assert!((8.5..11.5).contains(&mean), "{mean}");
        assert!(lengths.contains(&1) && lengths.iter().any(|&n| n > 30));
        let min = Ending {
            min_tokens: 25,
            ..e
        };
        assert!((0..200).all(|i| {
            let mut c = Choice::new(&min, format!("p{i}").as_bytes(), 0);
            run(&mut c, &[]);
            c.generated() >= 25
        }));
        let ignore = Ending {
            ignore_eos: true,
            max_tokens: 40,
            ..e
        };
        let mut c = Choice::new(&ignore, b"p", 0);
        run(&mut c, &[]);
        assert_eq!((c.generated(), c.finish().unwrap().reason), (40, "length"));
    }

    #[test]
    fn no_stop_string_counts_before_min_tokens_and_the_first_listed_wins() {
        let mut plain = Choice::new(&ending(), b"p", 0);
        let words: Vec<String> = std::iter::from_fn(|| plain.next(&[]).map(String::from)).collect();
        let stop = vec![words[0].to_owned()];
        let late = Ending {
            min_tokens: 5,
            ..ending()
        };
        let mut c = Choice::new(&late, b"p", 0);
        run(&mut c, &stop);
        assert!(c.generated() > 5, "{}", c.generated());
        // Both occur at the third token: the one listed first names the stop.
        let both = vec![words[2][1..].to_owned(), words[2].to_owned()];
        let mut c = Choice::new(&ending(), b"p", 0);
        run(&mut c, &both);
        assert_eq!(c.finish().unwrap().stop.as_deref(), Some(&both[0][..]));
    }

    #[test]
    fn with_stop_strings_that_never_match_all_the_text_goes_out_by_the_end() {
        let mut plain = Choice::new(&ending(), b"p", 0);
        let whole = run(&mut plain, &[]);
        let stop = vec!["no such text in the output".to_owned()];
        let mut c = Choice::new(&ending(), b"p", 0);
        assert_eq!(run(&mut c, &stop), whole);
        assert_eq!(c.finish().unwrap().reason, "length");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_even_across_tokens() {
        let mut plain = Choice::new(&ending(), b"p", 0);
        let words: Vec<String> = std::iter::from_fn(|| plain.next(&[]).map(String::from)).collect();
        let whole: String = words.concat();
        // Across a token boundary, inside a token, and a whole word.
        let stops = [
            format!("{}{}", words[2], &words[3][..2]),
            words[1][1..].to_owned(),
            words[5].to_owned(),
        ];
        for stop in stops {
            let stop = vec![stop];
            let mut c = Choice::new(&ending(), b"p", 0);
            let text = run(&mut c, &stop);
            let at = whole.find(&stop[0]).expect("the stop is in the text");
            assert_eq!(text, whole[..at], "{stop:?}");
            // Handed out token by token, no part of the stop string ever goes out.
            let mut c = Choice::new(&ending(), b"p", 0);
            let mut sent = String::new();
            while let Some(t) = c.next(&stop) {
                sent.push_str(&t);
                assert!(
                    whole[..at].starts_with(&sent),
                    "{sent:?} went past {stop:?}"
                );
            }
            assert_eq!(sent, whole[..at]);
            assert_eq!(
                c.finish().unwrap(),
                &Finish {
                    reason: "stop",
                    stop: Some(stop[0].clone())
                }
            );
        }
    }
}
