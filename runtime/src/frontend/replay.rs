//! Token-identical replay of generated turns.
//!
//! A chat template re-renders an assistant turn from what the client echoes: parsed text, tool
//! arguments re-serialized, reasoning trimmed or dropped. The tokens it gives need not be the ones
//! the model generated (a different tokenization of the same text, `{"a":1}` for `{"a": 1}`,
//! `<think>\n` for `<think>`), and then the next request's prompt leaves the cached prefix at
//! that turn. So every generated turn is kept here: its generation prompt, the token ids the model
//! generated (its end-of-turn token included) and its reasoning. When a later request of the
//! same session carries that turn, [`lower`](super::lower) splices the kept ids in place of the
//! template's tokens, provided the template renders the same content there (it may drop history
//! reasoning, and then the miss it documents is kept).
//!
//! Turns are found by content, not by a handle: the key is a digest of the turn's text and tool
//! calls (name and arguments compared as JSON values), so a turn is recognised through every API,
//! including text-only turns of Chat Completions, which carry no handle at all. The handles the
//! node gives out ([`handle`]: a thinking block's Anthropic `signature`, a reasoning item's
//! Responses `encrypted_content`) say which reasoning a turn had when the client sends back none
//! of its text (`display: "omitted"`, Codex's stateless turns): the kept reasoning is restored.
//! An echoed reasoning text must match the kept one, and a handle that is not one of the turn's
//! own means the turn is someone else's: neither is spliced.
//!
//! The store is bounded by the token ids it holds (`frontend.replay_tokens`) and by age
//! (`frontend.replay_ttl`); the oldest turns go first.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

/// Prefix of the handles this node gives out.
pub const HANDLE_PREFIX: &str = "dn1.";

/// The replay handle of a reasoning text: its digest, so a client echoing it can be matched to
/// the kept reasoning without sending the text back.
pub fn handle(thinking: &str) -> String {
    format!("{HANDLE_PREFIX}{:032x}", xxhash_rust::xxh3::xxh3_128(thinking.as_bytes()))
}

/// One generated turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Kept {
    /// The generation prompt the turn was generated after (the template's assistant header).
    pub generation_prompt: String,
    /// The generated ids, in order; the last is the end-of-turn token when the turn ended on one.
    pub tokens: Vec<u32>,
    /// The turn's reasoning, block by block.
    pub thinking: Vec<String>,
}

impl Kept {
    /// Whether `echoed` (the reasoning blocks a client sent back for this turn: text and
    /// handle) can be this turn's: every echoed text is the kept text of its block (or empty, or
    /// absent) and every handle is one of this turn's.
    pub fn accepts(&self, echoed: &[(String, Option<String>)]) -> bool {
        let texts: String = echoed.iter().map(|(t, _)| t.trim()).collect();
        let kept: String = self.thinking.iter().map(|t| t.trim()).collect();
        let handles: Vec<String> = self.thinking.iter().map(|t| handle(t)).collect();
        (texts.is_empty() || texts == kept)
            && echoed.iter().all(|(_, h)| h.as_ref().is_none_or(|h| handles.contains(h)))
    }
}

/// The key of a turn within its session: a digest of its text (trimmed) and its tool calls
/// (name, and the arguments as a canonical JSON value).
pub fn turn_key<'a>(text: &str, calls: impl IntoIterator<Item = (&'a str, &'a Value)>) -> u128 {
    let mut canonical = String::with_capacity(text.len() + 64);
    canonical.push_str(text.trim());
    for (name, arguments) in calls {
        canonical.push('\u{0}');
        canonical.push_str(name);
        canonical.push('\u{0}');
        match arguments {
            // OpenAI sends arguments as JSON text; compare the value it holds.
            Value::String(raw) => match serde_json::from_str::<Value>(raw) {
                Ok(value) => write_canonical(&value, &mut canonical),
                Err(_) => canonical.push_str(raw.trim()),
            },
            value => write_canonical(value, &mut canonical),
        }
    }
    xxhash_rust::xxh3::xxh3_128(canonical.as_bytes())
}

/// `value` as compact JSON with object keys sorted: equal values, equal text.
fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(&map[key], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The kept turns of every session.
#[derive(Debug)]
pub struct ReplayStore {
    inner: Mutex<Turns>,
    max_tokens: usize,
    ttl: Duration,
}

#[derive(Debug, Default)]
struct Turns {
    /// Each turn with the number of its insertion.
    by_key: HashMap<(String, u128), (Kept, u64)>,
    /// Insertions, oldest first, with their time (a key kept again appears again: only its
    /// latest insertion removes it).
    order: VecDeque<((String, u128), u64, Instant)>,
    inserted: u64,
    tokens: usize,
}

impl ReplayStore {
    /// A store of at most `max_tokens` generated ids, each turn kept for `ttl`.
    pub fn new(max_tokens: usize, ttl: Duration) -> ReplayStore {
        ReplayStore { inner: Mutex::new(Turns::default()), max_tokens, ttl }
    }

    /// Whether replay is on (`frontend.replay_tokens` > 0).
    pub fn enabled(&self) -> bool {
        self.max_tokens > 0
    }

    /// Keeps `turn` of `session` (`""` for requests without one) under `key`.
    pub fn keep(&self, session: &str, key: u128, turn: Kept) {
        if turn.tokens.len() > self.max_tokens || turn.tokens.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut turns = self.inner.lock();
        let id = (session.to_owned(), key);
        turns.inserted += 1;
        let n = turns.inserted;
        turns.tokens += turn.tokens.len();
        if let Some((old, _)) = turns.by_key.insert(id.clone(), (turn, n)) {
            turns.tokens -= old.tokens.len();
        }
        turns.order.push_back((id, n, now));
        turns.evict(self.max_tokens, self.ttl, now);
    }

    /// The kept turn of `session` under `key`, if it is younger than the TTL.
    pub fn find(&self, session: &str, key: u128) -> Option<Kept> {
        let now = Instant::now();
        let mut turns = self.inner.lock();
        turns.evict(self.max_tokens, self.ttl, now);
        turns.by_key.get(&(session.to_owned(), key)).map(|(kept, _)| kept.clone())
    }

    /// Turns and token ids kept.
    pub fn len(&self) -> (usize, usize) {
        let turns = self.inner.lock();
        (turns.by_key.len(), turns.tokens)
    }
}

impl Turns {
    fn evict(&mut self, max_tokens: usize, ttl: Duration, now: Instant) {
        while let Some((_, _, at)) = self.order.front() {
            if now.duration_since(*at) < ttl && self.tokens <= max_tokens {
                break;
            }
            let (id, n, _) = self.order.pop_front().expect("a front entry");
            if self.by_key.get(&id).is_some_and(|(_, latest)| *latest == n)
                && let Some((old, _)) = self.by_key.remove(&id)
            {
                self.tokens -= old.tokens.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn kept(tokens: usize, thinking: &str) -> Kept {
        Kept {
            generation_prompt: "<a>".into(),
            tokens: (0..tokens as u32).collect(),
            thinking: if thinking.is_empty() { Vec::new() } else { vec![thinking.to_owned()] },
        }
    }

    #[test]
    fn keys_compare_arguments_as_values() {
        let a = json!({"b": 1, "a": [1, 2]});
        let text = Value::String(r#"{"a":[1,2],"b":1}"#.into());
        let spaced = Value::String(r#"{ "b": 1, "a": [1, 2] }"#.into());
        assert_eq!(turn_key("hi", [("f", &a)]), turn_key(" hi\n", [("f", &text)]));
        assert_eq!(turn_key("hi", [("f", &a)]), turn_key("hi", [("f", &spaced)]));
        assert_ne!(turn_key("hi", [("f", &a)]), turn_key("hi", [("g", &a)]));
        assert_ne!(turn_key("hi", [("f", &a)]), turn_key("hi", [("f", &json!({"b": 2, "a": [1, 2]}))]));
        assert_ne!(turn_key("hi", []), turn_key("ho", []));
        // Two calls are not one call with both arguments.
        let one = json!(1);
        assert_ne!(turn_key("", [("f", &one), ("f", &one)]), turn_key("", [("f", &one)]));
    }

    #[test]
    fn echoed_reasoning_must_be_the_kept_one() {
        let turn = kept(3, "plan the edit");
        assert!(turn.accepts(&[]));
        assert!(turn.accepts(&[("plan the edit\n".into(), None)]));
        assert!(turn.accepts(&[(String::new(), Some(handle("plan the edit")))]));
        assert!(!turn.accepts(&[("another plan".into(), None)]));
        assert!(!turn.accepts(&[(String::new(), Some(handle("another plan")))]));
        assert!(!turn.accepts(&[(String::new(), Some("EuYBCkQYAiJA".into()))]));
    }

    #[test]
    fn the_store_is_bounded_by_tokens_and_age() {
        let store = ReplayStore::new(10, Duration::from_secs(3600));
        store.keep("s", 1, kept(4, ""));
        store.keep("s", 2, kept(4, ""));
        assert_eq!(store.len(), (2, 8));
        assert!(store.find("t", 1).is_none(), "sessions do not share turns");
        store.keep("s", 3, kept(4, ""));
        assert!(store.find("s", 1).is_none(), "the oldest turn went first");
        assert!(store.find("s", 2).is_some() && store.find("s", 3).is_some());
        assert_eq!(store.len(), (2, 8));
        // Keeping a key again replaces it, and its earlier insertion does not evict it later.
        store.keep("s", 2, kept(2, ""));
        store.keep("s", 4, kept(5, ""));
        assert_eq!(store.len(), (2, 7));
        assert_eq!(store.find("s", 2).map(|k| k.tokens.len()), Some(2));
        assert!(store.find("s", 3).is_none());
        store.keep("s", 5, kept(11, ""));
        assert!(store.find("s", 5).is_none(), "a turn larger than the store is not kept");

        let short = ReplayStore::new(100, Duration::from_millis(20));
        short.keep("s", 1, kept(4, ""));
        assert!(short.find("s", 1).is_some());
        std::thread::sleep(Duration::from_millis(30));
        assert!(short.find("s", 1).is_none());
        assert_eq!(short.len(), (0, 0));
    }
}
