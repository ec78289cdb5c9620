//! The multi-turn chat workload of `tokenway bench routing`, generated from a seed so every
//! policy sees exactly the same requests at the same offsets.
//!
//! A conversation starts at a Poisson arrival time, uses one of a few shared system prompts, and
//! runs its turns one after another: each turn's messages are the whole conversation so far (the
//! system prompt, every earlier user message and assistant reply) plus a new user message, so
//! consecutive turns share a growing prefix, as chat clients send them. The assistant replies in
//! the history are synthetic (fixed by the seed), not the sim's actual output, so the prompt of a
//! turn does not depend on which backend served the previous one. Between turns the user
//! "thinks" for an exponentially distributed time.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// Shape of the workload.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadShape {
    /// Conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts shared by the conversations.
    pub system_prompts: usize,
    /// Bytes of each system prompt.
    pub system_prompt_bytes: usize,
    /// Bytes of each user message.
    pub user_message_bytes: usize,
    /// Bytes of each (synthetic) assistant reply in the history.
    pub reply_bytes: usize,
    /// Output tokens asked per request (`max_tokens`).
    pub max_tokens: u32,
    /// Mean think time between a reply and the next turn, seconds.
    pub think_mean_secs: f64,
    /// Seed of everything random.
    pub seed: u64,
}

/// One conversation: when it starts and the bodies of its turns.
#[derive(Clone, Debug)]
pub struct Conversation {
    /// Offset of the first turn from the start of the run.
    pub start: Duration,
    /// Think time before each turn after the first (index 0 unused, zero).
    pub think: Vec<Duration>,
    /// The request body of each turn.
    pub bodies: Vec<String>,
}

/// A whole run's requests.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The conversations, by start time.
    pub conversations: Vec<Conversation>,
    /// Mean prompt bytes over all requests (the JSON text of the messages).
    pub mean_prompt_bytes: f64,
    /// Mean prompt bytes that are not a system prompt (what a backend without this conversation
    /// in its cache must prefill, assuming it holds the shared system prompts).
    pub mean_history_bytes: f64,
}

const WORDS: [&str; 48] = [
    "latency",
    "token",
    "prefix",
    "cache",
    "gateway",
    "backend",
    "route",
    "stream",
    "model",
    "request",
    "queue",
    "prefill",
    "decode",
    "batch",
    "network",
    "region",
    "packet",
    "window",
    "replica",
    "session",
    "affinity",
    "health",
    "probe",
    "weight",
    "shard",
    "kernel",
    "socket",
    "buffer",
    "budget",
    "signal",
    "tensor",
    "layer",
    "attention",
    "context",
    "prompt",
    "reply",
    "answer",
    "question",
    "summary",
    "detail",
    "number",
    "table",
    "graph",
    "value",
    "error",
    "retry",
    "hedge",
    "policy",
];

/// Pseudo-text of exactly `bytes` bytes (ASCII letters and spaces, JSON-safe).
fn text(rng: &mut SmallRng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s.truncate(bytes);
    s
}

/// Exponentially distributed duration with the given mean.
fn exponential(rng: &mut SmallRng, mean_secs: f64) -> Duration {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    Duration::from_secs_f64(-u.ln() * mean_secs)
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    stream: bool,
    max_tokens: u32,
    stream_options: StreamOptions,
    messages: &'a [Message<'a>],
}

/// Generates the workload with conversations arriving as a Poisson process of
/// `conversation_rate` per second.
pub fn generate(shape: &WorkloadShape, conversation_rate: f64) -> Workload {
    let mut rng = SmallRng::seed_from_u64(shape.seed);
    let systems: Vec<String> = (0..shape.system_prompts.max(1))
        .map(|_| text(&mut rng, shape.system_prompt_bytes))
        .collect();
    let mut at = Duration::ZERO;
    let mut conversations = Vec::with_capacity(shape.conversations);
    let mut prompt_bytes = 0usize;
    let mut history_bytes = 0usize;
    let mut requests = 0usize;
    for c in 0..shape.conversations {
        at += exponential(&mut rng, 1.0 / conversation_rate.max(1e-9));
        let system = &systems[c % systems.len()];
        let mut turns_text: Vec<(String, String)> = Vec::with_capacity(shape.turns);
        let mut think = Vec::with_capacity(shape.turns);
        for t in 0..shape.turns {
            turns_text.push((
                text(&mut rng, shape.user_message_bytes),
                text(&mut rng, shape.reply_bytes),
            ));
            think.push(if t == 0 {
                Duration::ZERO
            } else {
                exponential(&mut rng, shape.think_mean_secs)
            });
        }
        let mut bodies = Vec::with_capacity(shape.turns);
        for t in 0..shape.turns {
            let mut messages = vec![Message {
                role: "system",
                content: system,
            }];
            for (i, (user, reply)) in turns_text.iter().enumerate().take(t + 1) {
                messages.push(Message {
                    role: "user",
                    content: user,
                });
                if i < t {
                    messages.push(Message {
                        role: "assistant",
                        content: reply,
                    });
                }
            }
            let json_messages = serde_json::to_string(&messages).expect("strings always serialize");
            prompt_bytes += json_messages.len();
            history_bytes += json_messages.len().saturating_sub(system.len());
            requests += 1;
            bodies.push(
                serde_json::to_string(&Body {
                    model: "sim-model",
                    stream: true,
                    max_tokens: shape.max_tokens,
                    stream_options: StreamOptions {
                        include_usage: true,
                    },
                    messages: &messages,
                })
                .expect("strings always serialize"),
            );
        }
        conversations.push(Conversation {
            start: at,
            think,
            bodies,
        });
    }
    let n = requests.max(1) as f64;
    Workload {
        conversations,
        mean_prompt_bytes: prompt_bytes as f64 / n,
        mean_history_bytes: history_bytes as f64 / n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> WorkloadShape {
        WorkloadShape {
            conversations: 5,
            turns: 3,
            system_prompts: 2,
            system_prompt_bytes: 300,
            user_message_bytes: 50,
            reply_bytes: 40,
            max_tokens: 8,
            think_mean_secs: 0.5,
            seed: 7,
        }
    }

    #[test]
    fn each_turn_extends_the_previous_turns_messages() {
        let w = generate(&shape(), 10.0);
        assert_eq!(w.conversations.len(), 5);
        for c in &w.conversations {
            let messages: Vec<serde_json::Value> = c
                .bodies
                .iter()
                .map(|b| {
                    serde_json::from_str::<serde_json::Value>(b).expect("json")["messages"].clone()
                })
                .collect();
            for t in 1..messages.len() {
                let prev = messages[t - 1].as_array().expect("array");
                let next = messages[t].as_array().expect("array");
                assert_eq!(next.len(), prev.len() + 2);
                assert_eq!(&next[..prev.len()], &prev[..]);
            }
        }
        let starts: Vec<Duration> = w.conversations.iter().map(|c| c.start).collect();
        assert!(starts.windows(2).all(|p| p[0] <= p[1]));
    }

    #[test]
    fn the_same_seed_gives_the_same_workload() {
        let a = generate(&shape(), 10.0);
        let b = generate(&shape(), 10.0);
        assert_eq!(a.conversations[3].bodies, b.conversations[3].bodies);
        assert_eq!(a.conversations[3].start, b.conversations[3].start);
        assert!(a.mean_history_bytes < a.mean_prompt_bytes);
    }
}
