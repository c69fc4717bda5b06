//! Just enough JSON and Python-literal scanning for tool calls: where a value ends in streamed
//! text, the fields of an object with their raw text, and Python call lists as JSON.

use serde_json::Value;

/// The end (exclusive) of the JSON value starting at `s[start..]` after whitespace, or `None`
/// while it is incomplete (or not JSON: the caller treats that as text).
pub(super) fn value_end(s: &str, start: usize) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = skip_ws(s, start);
    match *b.get(i)? {
        b'{' | b'[' => {
            let mut depth = 0usize;
            while i < b.len() {
                match b[i] {
                    b'"' => i = string_end(b, i)? - 1,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        b'"' => string_end(b, i),
        _ => {
            // A number, true, false, null: up to a delimiter (incomplete at the end of the text).
            let end = (i..b.len()).find(|&j| matches!(b[j], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t'))?;
            (end > i).then_some(end)
        }
    }
}

/// The end of the JSON string starting at `b[i]` (a `"`), after its closing quote.
fn string_end(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

pub(super) fn skip_ws(s: &str, mut i: usize) -> usize {
    let b = s.as_bytes();
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// Whether `s` is valid JSON (checked without building it).
pub(super) fn is_json(s: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok()
}

/// Whether `s` is a JSON object.
pub(super) fn is_json_object(s: &str) -> bool {
    s.trim_start().starts_with('{') && is_json(s)
}

/// The fields of the JSON object `s` (whitespace around it allowed), each key decoded and its
/// value as the raw text the model wrote, in order.
pub(super) fn object_fields(s: &str) -> Option<Vec<(std::borrow::Cow<'_, str>, &str)>> {
    // Valid as a whole, so the scan below only finds where each value ends.
    if !is_json(s) {
        return None;
    }
    let b = s.as_bytes();
    let mut i = skip_ws(s, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(s, i + 1);
    let mut fields = Vec::new();
    if b.get(i) == Some(&b'}') {
        return (skip_ws(s, i + 1) == s.len()).then_some(fields);
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(b, i)?;
        let key = json_str(&s[i..key_end])?;
        i = skip_ws(s, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(s, i + 1);
        let value_stop = value_end(s, value_start)?;
        fields.push((key, &s[value_start..value_stop]));
        i = skip_ws(s, value_stop);
        match b.get(i) {
            Some(b',') => i = skip_ws(s, i + 1),
            Some(b'}') => return (skip_ws(s, i + 1) == s.len()).then_some(fields),
            _ => return None,
        }
    }
}

/// The JSON string literal `raw` (quotes included) decoded; borrowed when it has no escapes.
pub(super) fn json_str(raw: &str) -> Option<std::borrow::Cow<'_, str>> {
    let inner = raw.strip_prefix('"')?.strip_suffix('"')?;
    if inner.contains('\\') {
        serde_json::from_str::<String>(raw).ok().map(std::borrow::Cow::Owned)
    } else {
        Some(std::borrow::Cow::Borrowed(inner))
    }
}

/// A JSON object, as text, of `fields` in their order, spaced as Python's `json.dumps` spaces
/// it (`", "`, `": "`), which is how chat templates write tool arguments back.
pub(super) fn object_text(fields: &[(String, Value)]) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&Value::String(k.clone()).to_string());
        out.push_str(": ");
        dumps(v, None, 0, &mut out);
    }
    out.push('}');
    out
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False, indent=indent)` writes it (what
/// `transformers` renders a chat template's `tojson` with).
pub(crate) fn python_json(v: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    dumps(v, indent, 0, &mut out);
    out
}

/// Appends `v` as Python's `json.dumps` writes it: `", "` and `": "` without an indent; with one,
/// a line per item and `","`.
fn dumps(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let open_item = |out: &mut String, i: usize, depth: usize| match indent {
        Some(n) => {
            if i > 0 {
                out.push(',');
            }
            out.push('\n');
            out.push_str(&" ".repeat(n * (depth + 1)));
        }
        None if i > 0 => out.push_str(", "),
        None => {}
    };
    let close = |out: &mut String, empty: bool, depth: usize, c: char| {
        if let (Some(n), false) = (indent, empty) {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
        out.push(c);
    };
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                open_item(out, i, depth);
                dumps(item, indent, depth + 1, out);
            }
            close(out, items.is_empty(), depth, ']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                open_item(out, i, depth);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                dumps(item, indent, depth + 1, out);
            }
            close(out, map.is_empty(), depth, '}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

/// A tagged value as the model wrote it: JSON when it is a JSON object, array, number, boolean or
/// null, else the text itself.
pub(super) fn loose_value(text: &str) -> Value {
    match serde_json::from_str::<Value>(text.trim()) {
        Ok(v) if !v.is_string() => v,
        _ => Value::String(text.to_owned()),
    }
}

/// The end (exclusive) of the Python list starting at `s[start]` (a `[`), or `None` while it is
/// incomplete.
pub(super) fn python_list_end(s: &str, start: usize) -> Option<usize> {
    let b = s.as_bytes();
    let mut depth = 0usize;
    let mut i = start;
    while i < b.len() {
        match b[i] {
            q @ (b'"' | b'\'') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'[' | b'(' | b'{' => depth += 1,
            b']' | b')' | b'}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// `[f(a=1, b="x"), g()]` as calls with JSON arguments; `None` if it is not such a list.
pub(super) fn python_calls(s: &str) -> Option<Vec<(String, String)>> {
    let mut p = Py { s: s.trim().as_bytes(), i: 0 };
    p.expect(b'[')?;
    let mut calls = Vec::new();
    loop {
        p.ws();
        if p.eat(b']') {
            break;
        }
        let name = p.ident()?;
        p.ws();
        p.expect(b'(')?;
        let mut args = Vec::new();
        loop {
            p.ws();
            if p.eat(b')') {
                break;
            }
            let key = p.ident()?;
            p.ws();
            p.expect(b'=')?;
            let value = p.literal()?;
            args.push((key, value));
            p.ws();
            if !p.eat(b',') {
                p.ws();
                p.expect(b')')?;
                break;
            }
        }
        calls.push((name, object_text(&args)));
        p.ws();
        if !p.eat(b',') {
            p.ws();
            p.expect(b']')?;
            break;
        }
    }
    p.ws();
    (p.i == p.s.len()).then_some(calls)
}

struct Py<'a> {
    s: &'a [u8],
    i: usize,
}

impl Py<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.s.get(self.i) == Some(&c);
        self.i += usize::from(hit);
        hit
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        self.eat(c).then_some(())
    }

    fn ident(&mut self) -> Option<String> {
        let start = self.i;
        while self.i < self.s.len()
            && (self.s[self.i].is_ascii_alphanumeric() || matches!(self.s[self.i], b'_' | b'.' | b'-'))
        {
            self.i += 1;
        }
        let first = *self.s.get(start)?;
        (self.i > start && !first.is_ascii_digit())
            .then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    fn literal(&mut self) -> Option<Value> {
        self.ws();
        match *self.s.get(self.i)? {
            q @ (b'"' | b'\'') => {
                self.i += 1;
                let mut out = Vec::new();
                while *self.s.get(self.i)? != q {
                    let c = self.s[self.i];
                    if c == b'\\' {
                        self.i += 1;
                        out.push(match *self.s.get(self.i)? {
                            b'n' => b'\n',
                            b't' => b'\t',
                            b'r' => b'\r',
                            other => other,
                        });
                    } else {
                        out.push(c);
                    }
                    self.i += 1;
                }
                self.i += 1;
                Some(Value::String(String::from_utf8(out).ok()?))
            }
            b'[' | b'(' => {
                let close = if self.s[self.i] == b'[' { b']' } else { b')' };
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.ws();
                    if self.eat(close) {
                        return Some(Value::Array(items));
                    }
                    items.push(self.literal()?);
                    self.ws();
                    if !self.eat(b',') {
                        self.ws();
                        self.expect(close)?;
                        return Some(Value::Array(items));
                    }
                }
            }
            b'{' => {
                self.i += 1;
                let mut map = serde_json::Map::new();
                loop {
                    self.ws();
                    if self.eat(b'}') {
                        return Some(Value::Object(map));
                    }
                    let key = match self.literal()? {
                        Value::String(k) => k,
                        other => other.to_string(),
                    };
                    self.ws();
                    self.expect(b':')?;
                    map.insert(key, self.literal()?);
                    self.ws();
                    if !self.eat(b',') {
                        self.ws();
                        self.expect(b'}')?;
                        return Some(Value::Object(map));
                    }
                }
            }
            _ => {
                let start = self.i;
                while self.i < self.s.len()
                    && !matches!(self.s[self.i], b',' | b')' | b']' | b'}' | b':')
                    && !self.s[self.i].is_ascii_whitespace()
                {
                    self.i += 1;
                }
                let word = std::str::from_utf8(&self.s[start..self.i]).ok()?;
                match word {
                    "True" | "true" => Some(Value::Bool(true)),
                    "False" | "false" => Some(Value::Bool(false)),
                    "None" | "null" => Some(Value::Null),
                    _ => serde_json::from_str::<serde_json::Number>(word).ok().map(Value::Number),
                }
            }
        }
    }
}
