//! Generated ids → text, a token at a time, and stop strings.
//!
//! [`IncrementalDecoder`] emits text only once it decodes to complete UTF-8: a character split
//! over several byte tokens is held back until its last byte arrives. It decodes a short window of
//! recent ids (from the last emitted boundary) rather than the whole answer, so each token costs
//! about the same, and it decodes that window together so tokenizers whose decoders depend on
//! neighbouring tokens (SentencePiece's leading spaces) produce the same text as a full decode.
//!
//! [`StopMatcher`] cuts the text at the first stop string and holds back a tail that could still
//! become one, so a streamed answer never shows part of a stop string.

use std::collections::HashSet;

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Incremental detokenization; see the module doc.
#[derive(Debug)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip: HashSet<u32>,
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// End of what has been emitted.
    read: usize,
}

impl IncrementalDecoder {
    /// A decoder that drops the ids in `skip` (stop tokens) from the text.
    pub fn new(tokenizer: Tokenizer, skip: impl IntoIterator<Item = u32>) -> IncrementalDecoder {
        IncrementalDecoder { tokenizer, skip: skip.into_iter().collect(), ids: Vec::new(), prefix: 0, read: 0 }
    }

    /// Adds one id; returns the text that became complete (often empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        if self.skip.contains(&id) {
            return Ok(String::new());
        }
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        if now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let text = match now.strip_prefix(before.as_str()) {
            Some(new) => new.to_owned(),
            None => now[common_prefix(&before, &now)..].to_owned(),
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(text)
    }

    /// The text still held back (an incomplete character at the end of the answer, decoded
    /// lossily).
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(now[common_prefix(&before, &now)..].to_owned())
    }
}

fn common_prefix(a: &str, b: &str) -> usize {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !b.is_char_boundary(n) {
        n -= 1;
    }
    n
}

/// Stop strings over streamed text; see the module doc.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for the non-empty `stops`.
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), matched: None }
    }

    /// Adds `text`; returns what can be shown and whether a stop string matched (the answer
    /// ends before it).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some((at, stop)) = self.stops.iter().filter_map(|s| Some((self.held.find(s.as_str())?, s))).min() {
            self.matched = Some(stop.clone());
            self.held.truncate(at);
            return (std::mem::take(&mut self.held), true);
        }
        let len = self.held.len();
        let longest = self.stops.iter().map(|s| s.len() - 1).max().unwrap_or(0).min(len);
        let keep = (1..=longest)
            .rev()
            .find(|&k| {
                self.held.is_char_boundary(len - k) && self.stops.iter().any(|s| s.starts_with(&self.held[len - k..]))
            })
            .unwrap_or(0);
        let tail = self.held.split_off(len - keep);
        (std::mem::replace(&mut self.held, tail), false)
    }

    /// The stop string that ended the answer, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// What is held back, at the end of the answer.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_characters_are_held_until_complete() {
        let t = Tokenizer::builtin();
        let text = "ok 𓀀𓁐 done é";
        let ids = t.encode(text).unwrap();
        let mut d = IncrementalDecoder::new(t.clone(), []);
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            out.push_str(&piece);
        }
        out.push_str(&d.flush().unwrap());
        assert_eq!(out, text);
    }

    #[test]
    fn skipped_ids_and_a_cut_character_at_the_end() {
        let t = Tokenizer::builtin();
        let ids = t.encode("a𓀀").unwrap();
        let mut d = IncrementalDecoder::new(t.clone(), [199_999]);
        let mut out = String::new();
        for &id in &ids[..ids.len() - 1] {
            out.push_str(&d.push(id).unwrap());
        }
        out.push_str(&d.push(199_999).unwrap());
        assert_eq!(out, "a");
        assert_eq!(d.flush().unwrap(), "\u{FFFD}");
    }

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut m = StopMatcher::new(vec!["STOP".into(), "".into()]);
        assert_eq!(m.push("hello S"), ("hello ".into(), false));
        assert_eq!(m.push("T"), (String::new(), false));
        assert_eq!(m.push("x"), ("STx".into(), false));
        assert_eq!(m.push(" and STO"), (" and ".into(), false));
        assert_eq!(m.push("P more"), (String::new(), true));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caf\u{e9}"), ("caf".into(), false));
        assert_eq!(m.finish(), "é");
        let mut none = StopMatcher::new(Vec::new());
        assert_eq!(none.push("abc"), ("abc".into(), false));
    }
}
