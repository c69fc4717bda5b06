//! Finding markers in streamed text.

/// Where the first of some markers is in a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scan {
    /// Marker `marker` starts at byte `at`.
    Found {
        /// Its offset.
        at: usize,
        /// Its index in the list.
        marker: usize,
    },
    /// No marker; the first `safe` bytes cannot be part of one, the rest may begin one.
    Partial {
        /// Bytes that are certainly not a marker's.
        safe: usize,
    },
}

/// The earliest of `markers` in `buf` (the longest at that offset), or how much of `buf` no
/// marker can start in: a suffix that is a prefix of a marker, even one byte of it, is held back.
/// Offsets are on character boundaries.
pub(super) fn scan(buf: &str, markers: &[&str]) -> Scan {
    let mut best: Option<(usize, usize)> = None;
    for (i, m) in markers.iter().enumerate() {
        if let Some(at) = buf.find(m) {
            let better = match best {
                None => true,
                Some((b_at, b_i)) => at < b_at || (at == b_at && m.len() > markers[b_i].len()),
            };
            if better {
                best = Some((at, i));
            }
        }
    }
    if let Some((at, marker)) = best {
        return Scan::Found { at, marker };
    }
    Scan::Partial { safe: buf.len() - held_suffix(buf, markers) }
}

/// Bytes at the end of `buf` that begin one of `markers` (0 when none does).
pub(super) fn held_suffix(buf: &str, markers: &[&str]) -> usize {
    let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    let mut start = buf.len().saturating_sub(longest.saturating_sub(1));
    while !buf.is_char_boundary(start) {
        start += 1;
    }
    for (at, _) in buf[start..].char_indices() {
        let tail = &buf[start + at..];
        if markers.iter().any(|m| m.len() > tail.len() && m.starts_with(tail)) {
            return tail.len();
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_first_and_longest_and_partial_ones_held_back() {
        assert_eq!(scan("ab</think>cd", &["</think>"]), Scan::Found { at: 2, marker: 0 });
        assert_eq!(scan("ab</thi", &["</think>"]), Scan::Partial { safe: 2 });
        assert_eq!(scan("ab<", &["</think>"]), Scan::Partial { safe: 2 }, "one byte is held back");
        assert_eq!(scan("a < b", &["</think>"]), Scan::Partial { safe: 5 });
        assert_eq!(scan("x Here is", &[" Here is my response:", "Here is my response:"]), Scan::Partial { safe: 1 });
        assert_eq!(
            scan("x Here is my response: y", &["Here is my response:", " Here is my response:"]),
            Scan::Found { at: 1, marker: 1 }
        );
        // Multi-byte markers: hold back on character boundaries only.
        assert_eq!(scan("plan◁/thi", &["◁/think▷"]), Scan::Partial { safe: 4 });
        assert_eq!(scan("é", &["◁/think▷"]), Scan::Partial { safe: 2 });
        assert_eq!(
            scan("a<|tool", &["<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"]),
            Scan::Partial { safe: 1 }
        );
    }
}
