//! Traces: the two formats read into sessions of turns, and a hash id's tokens.

use super::*;

#[derive(Debug, Deserialize)]
pub(super) struct Line {
    #[serde(default)]
    pub(super) session_id: Option<String>,
    #[serde(default)]
    pub(super) timestamp: Option<f64>,
    #[serde(default)]
    pub(super) delay: Option<f64>,
    pub(super) input_length: usize,
    pub(super) output_length: usize,
    pub(super) hash_ids: Vec<u64>,
}

/// One turn (or one Mooncake request).
#[derive(Debug, Clone)]
pub(super) struct Turn {
    /// Leading tokens shared by many sessions (system prompt, tools, group context): the
    /// `system` retention region.
    pub(super) system_tokens: usize,
    /// Mooncake: arrival; aiperf first turn: session start.
    pub(super) at_ms: f64,
    /// aiperf later turns: wait after the previous turn completed.
    pub(super) delay_ms: f64,
    pub(super) new_tokens: Vec<u32>,
    pub(super) output_length: usize,
}

/// A trace as sessions of turns (a Mooncake request is a session of one full-prompt turn).
#[derive(Debug)]
pub(super) struct Trace {
    pub(super) name: String,
    pub(super) sessions: Vec<Vec<Turn>>,
    pub(super) requests: usize,
}

pub(super) fn tokens_of(ids: &[u64], len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(ids.len() * TRACE_BLOCK_TOKENS);
    for &id in ids {
        let mut state = id.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed;
        for _ in 0..TRACE_BLOCK_TOKENS {
            state = splitmix(state);
            out.push((state % 120_000) as u32 + 256);
        }
    }
    out.truncate(len.max(1).min(out.len()));
    out
}

pub(super) fn load_trace(path: &Path, format: Option<TraceFormat>, limit: Option<usize>) -> anyhow::Result<Trace> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = Vec::new();
    for (n, raw) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line: Line =
            serde_json::from_str(raw).with_context(|| format!("{}:{}: not a trace request", path.display(), n + 1))?;
        lines.push(line);
    }
    let format = format.unwrap_or(if lines.first().is_some_and(|l| l.session_id.is_some()) {
        TraceFormat::AiperfAgentic
    } else {
        TraceFormat::Mooncake
    });
    // A hash id that starts the prompts of many sessions is shared instruction (system prompt,
    // tool definitions, a group's repository context): it is tagged `system`, as the frontend
    // tags those messages. "Many": at least 3 and 2% of the first prompts.
    let firsts: Vec<&Line> = match format {
        TraceFormat::Mooncake => lines.iter().collect(),
        TraceFormat::AiperfAgentic => lines.iter().filter(|l| l.delay.is_none()).collect(),
    };
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for l in &firsts {
        for id in &l.hash_ids {
            *counts.entry(*id).or_default() += 1;
        }
    }
    let shared = (firsts.len() / 50).max(3);
    let system_tokens = |l: &Line| {
        let ids = l.hash_ids.iter().take_while(|id| counts.get(id).is_some_and(|&c| c >= shared)).count();
        (ids * TRACE_BLOCK_TOKENS).min(l.input_length)
    };
    let mut sessions: Vec<Vec<Turn>> = Vec::new();
    match format {
        TraceFormat::Mooncake => {
            for l in lines.iter().take(limit.unwrap_or(usize::MAX)) {
                let turn = Turn {
                    system_tokens: system_tokens(l),
                    at_ms: l.timestamp.unwrap_or(0.0),
                    delay_ms: 0.0,
                    new_tokens: tokens_of(&l.hash_ids, l.input_length),
                    output_length: l.output_length.max(1),
                };
                sessions.push(vec![turn]);
            }
        }
        TraceFormat::AiperfAgentic => {
            let mut by_id: HashMap<String, usize> = HashMap::new();
            for (n, l) in lines.iter().enumerate() {
                let Some(id) = &l.session_id else { bail!("{}:{}: no session_id", path.display(), n + 1) };
                let at = *by_id.entry(id.clone()).or_insert_with(|| {
                    sessions.push(Vec::new());
                    sessions.len() - 1
                });
                let first = sessions[at].is_empty();
                sessions[at].push(Turn {
                    system_tokens: if first { system_tokens(l) } else { 0 },
                    at_ms: if first { l.timestamp.unwrap_or(0.0) } else { 0.0 },
                    delay_ms: l.delay.unwrap_or(0.0),
                    new_tokens: tokens_of(&l.hash_ids, l.input_length),
                    output_length: l.output_length.max(1),
                });
            }
            sessions.truncate(limit.unwrap_or(usize::MAX));
        }
    }
    let requests = sessions.iter().map(Vec::len).sum();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(Trace { name, sessions, requests })
}
