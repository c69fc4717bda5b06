//! Parsing with spans: turns TOML and serde errors, and validation problems that name a key path,
//! into [`Problem`]s located at `origin:line:column`.
//!
//! The source is parsed once into toml's spanned document tree ([`DeTable`]); the typed value is
//! deserialized from that tree, so every error carries a byte span. A span is mapped back to the
//! dotted key path by walking the tree, and a key path back to a span the same way.

use std::ops::Range;

use serde::de::DeserializeOwned;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use crate::error::{ConfigError, Location, Problem};

/// A parsed source: its text, its label and its spanned tree.
#[derive(Debug)]
pub(crate) struct Source<'a> {
    src: &'a str,
    origin: &'a str,
    tree: Spanned<DeTable<'a>>,
}

/// Parses `src` into `T`, locating any error.
pub(crate) fn parse<'a, T: DeserializeOwned>(src: &'a str, origin: &'a str) -> Result<(T, Source<'a>), ConfigError> {
    let (tree, errors) = DeTable::parse_recoverable(src);
    let source = Source { src, origin, tree };
    if let Some(err) = errors.first() {
        let span = err.span();
        let key = span.as_ref().and_then(|s| source.key_at(s).map(|hit| hit.path).or_else(|| source.bare_key_at(s)));
        return Err(ConfigError::Syntax(Problem {
            key,
            message: err.message().trim().to_owned(),
            location: Some(source.location_of(span.map_or(0, |s| s.start), false)),
        }));
    }
    let value = T::deserialize(toml::de::Deserializer::from(source.tree.clone()))
        .map_err(|err| source.deserialize_error(&err))?;
    Ok((value, source))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum HitKind {
    Key,
    Leaf,
    Container,
}

#[derive(Debug)]
struct Hit {
    path: String,
    kind: HitKind,
    span_len: usize,
}

fn contains(span: &Range<usize>, pos: usize) -> bool {
    span.start <= pos && pos < span.end.max(span.start + 1)
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() { key.to_owned() } else { format!("{prefix}.{key}") }
}

fn collect_table(table: &DeTable<'_>, prefix: &str, pos: usize, hits: &mut Vec<Hit>) {
    for (key, value) in table.iter() {
        let path = join(prefix, key.get_ref());
        let span = key.span();
        if contains(&span, pos) {
            hits.push(Hit { path: path.clone(), kind: HitKind::Key, span_len: span.len() });
        }
        collect_value(value, path, pos, hits);
    }
}

fn collect_value(value: &Spanned<DeValue<'_>>, path: String, pos: usize, hits: &mut Vec<Hit>) {
    let kind = match value.get_ref() {
        DeValue::Table(table) => {
            collect_table(table, &path, pos, hits);
            HitKind::Container
        }
        DeValue::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                collect_value(item, format!("{path}[{i}]"), pos, hits);
            }
            HitKind::Container
        }
        _ => HitKind::Leaf,
    };
    let span = value.span();
    if contains(&span, pos) {
        hits.push(Hit { path, kind, span_len: span.len() });
    }
}

/// Splits `a.b[2].c` into `[("a", None), ("b", Some(2)), ("c", None)]`.
fn segments(path: &str) -> Vec<(&str, Option<usize>)> {
    path.split('.')
        .map(|seg| match seg.split_once('[') {
            Some((name, idx)) => (name, idx.trim_end_matches(']').parse().ok()),
            None => (seg, None),
        })
        .collect()
}

/// Rewrites serde's `` `a`, `b` `` lists as `a, b`.
fn unquote_list(s: &str) -> String {
    s.replace('`', "")
}

impl Source<'_> {
    /// 1-based line and column (in characters) of byte offset `pos`.
    fn location_of(&self, pos: usize, defaulted: bool) -> Location {
        let pos = pos.min(self.src.len());
        let before = self.src.get(..pos).unwrap_or(self.src);
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Location {
            origin: self.origin.to_owned(),
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
            defaulted,
        }
    }

    /// The most specific key path at `span`: a key, else a scalar value, else the smallest
    /// table or array containing it.
    fn key_at(&self, span: &Range<usize>) -> Option<Hit> {
        let mut hits = Vec::new();
        collect_table(self.tree.get_ref(), "", span.start, &mut hits);
        hits.into_iter().min_by_key(|h| (h.kind, h.span_len))
    }

    /// For a syntax error outside the recovered tree (a duplicate key, say): the bare key the
    /// span covers, under the last `[table]` header above it.
    fn bare_key_at(&self, span: &Range<usize>) -> Option<String> {
        let text = self.src.get(span.clone())?;
        let is_bare =
            |k: &str| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !is_bare(text) {
            return None;
        }
        let header = self.src[..span.start]
            .lines()
            .rev()
            .map(str::trim)
            .find(|line| line.starts_with('['))
            .map(|line| {
                let line = line.split('#').next().unwrap_or(line).trim();
                line.trim_matches(|c| c == '[' || c == ']').trim().to_owned()
            })
            .filter(|h| is_bare(h));
        Some(match header {
            Some(h) => join(&h, text),
            None => text.to_owned(),
        })
    }

    /// Byte offset of the key at `path`, if the file sets it.
    fn find_key(&self, path: &str) -> Option<usize> {
        let mut table = self.tree.get_ref();
        let segs = segments(path);
        for (i, &(name, index)) in segs.iter().enumerate() {
            let (key, value) = table.iter().find(|(k, _)| k.get_ref() == name)?;
            let value = match index {
                Some(idx) => value.get_ref().as_array()?.get(idx)?,
                None => value,
            };
            if i + 1 == segs.len() {
                return Some(if index.is_some() { value.span().start } else { key.span().start });
            }
            table = value.get_ref().as_table()?;
        }
        None
    }

    /// Locates validation problems at their keys, or at `1:1` marked as defaults.
    pub(crate) fn locate(&self, problems: Vec<Problem>) -> Vec<Problem> {
        problems
            .into_iter()
            .map(|mut p| {
                let found = p.key.as_deref().and_then(|k| self.find_key(k));
                p.location = Some(match found {
                    Some(pos) => self.location_of(pos, false),
                    None => Location { origin: self.origin.to_owned(), line: 1, column: 1, defaulted: true },
                });
                p
            })
            .collect()
    }

    fn deserialize_error(&self, err: &toml::de::Error) -> ConfigError {
        let span = err.span();
        let hit = span.as_ref().and_then(|s| self.key_at(s));
        let location = Some(self.location_of(span.map_or(0, |s| s.start), false));
        let raw = err.message().trim();

        if let Some(rest) = raw.strip_prefix("unknown field `") {
            let expected = rest.split_once(", ").map_or("", |(_, e)| e);
            let message = if expected == "there are no fields" {
                "unknown key; this table takes no keys".to_owned()
            } else {
                format!("unknown key; {}", unquote_list(expected))
            };
            return ConfigError::UnknownKey(Problem { key: hit.map(|h| h.path), message, location });
        }

        let mut key = hit.as_ref().map(|h| h.path.clone());
        let message = if let Some(rest) = raw.strip_prefix("unknown variant `") {
            let (name, expected) = rest.split_once("`, ").unwrap_or((rest, ""));
            format!("unknown value `{name}`; {}", unquote_list(expected))
        } else if let Some(rest) = raw.strip_prefix("missing field `") {
            let field = rest.trim_end_matches('`');
            key = Some(match &hit {
                Some(h) if h.kind == HitKind::Container => join(&h.path, field),
                _ => field.to_owned(),
            });
            "missing key; it has no default and must be set".to_owned()
        } else {
            match raw.split_once(", expected struct ") {
                Some((head, _)) => format!("{head}, expected a table"),
                None => raw.to_owned(),
            }
        };
        ConfigError::InvalidValue(Problem { key, message, location })
    }
}
