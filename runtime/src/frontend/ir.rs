//! The one representation every API lowers to, and the one stream of output events every API
//! renders from.
//!
//! A protocol contributes two conversions: its wire request → [`Conversation`] (its own folder:
//! `openai/`, `anthropic/`), and [`Output`] events (and [`ApiError`](super::ApiError)s) → its
//! wire format. Everything in between is shared: lowering to the chat template and tokens
//! ([`lower`](super::lower)), replay of generated turns ([`replay`](super::replay)), generation,
//! detokenization and parsing ([`answer`](super::answer)).

use serde_json::Value;

use super::generate::{AgentHints, FinishReason};

/// Who speaks a [`Turn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A system message inside the conversation (Anthropic's inline `role: "system"`, an
    /// OpenAI `system` message after the first).
    System,
    /// OpenAI's `developer` role (rendered as the template's `developer`, else as system).
    Developer,
    /// The user; its [`Block::ToolResult`]s answer the previous assistant turn's calls.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role as chat templates spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// A cache breakpoint a client set on a block (Anthropic `cache_control`) or on the whole
/// request (Anthropic's top-level `cache_control`, OpenAI's `prompt_cache_retention`): the
/// prompt up to it is leased for the mark's TTL after each use. Rendering ignores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CacheMark {
    /// `{"type": "ephemeral"}` or `"ttl": "5m"`.
    FiveMinutes,
    /// `"ttl": "1h"`.
    OneHour,
    /// OpenAI's `prompt_cache_retention: "24h"`.
    OneDay,
}

impl CacheMark {
    /// How long the lease lives after each use.
    pub fn ttl(self) -> std::time::Duration {
        std::time::Duration::from_secs(match self {
            CacheMark::FiveMinutes => 300,
            CacheMark::OneHour => 3600,
            CacheMark::OneDay => 86_400,
        })
    }
}

/// One typed content block.
#[derive(Clone, Debug, PartialEq)]
pub enum Block {
    /// Text.
    Text {
        /// The text.
        text: String,
        /// Its cache breakpoint.
        cache: Option<CacheMark>,
    },
    /// An image (refused when lowering: the served models read text).
    Image,
    /// The model's reasoning, as a client echoes it.
    Thinking {
        /// The text (empty when the client was sent none, e.g. `display: "omitted"`).
        text: String,
        /// The replay handle the node gave it (Anthropic `signature`, Responses
        /// `encrypted_content`), when the client sent one back.
        handle: Option<String>,
    },
    /// A tool call of an assistant turn.
    ToolUse {
        /// The call's id.
        id: String,
        /// The tool.
        name: String,
        /// The arguments as the client sent them: a JSON string (OpenAI) rendered verbatim, or
        /// a JSON value (Anthropic `input`).
        arguments: Value,
    },
    /// A tool's result, in a user turn.
    ToolResult {
        /// The call it answers.
        call_id: String,
        /// Its text.
        content: String,
        /// Whether the tool failed.
        is_error: bool,
        /// Its cache breakpoint.
        cache: Option<CacheMark>,
    },
}

impl Block {
    /// A text block without a cache mark.
    pub fn text(text: impl Into<String>) -> Block {
        Block::Text { text: text.into(), cache: None }
    }

    /// Its cache breakpoint, if it can carry one.
    pub fn cache_mark(&self) -> Option<CacheMark> {
        match self {
            Block::Text { cache, .. } | Block::ToolResult { cache, .. } => *cache,
            _ => None,
        }
    }

    /// Bytes of text it holds (for the pre-tokenizing length check).
    pub fn text_bytes(&self) -> usize {
        match self {
            Block::Text { text, .. } | Block::Thinking { text, .. } => text.len(),
            Block::ToolUse { name, arguments, .. } => name.len() + arguments.as_str().map_or(0, str::len),
            Block::ToolResult { content, .. } => content.len(),
            Block::Image => 0,
        }
    }
}

/// One message of the conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    /// Who speaks.
    pub role: Role,
    /// What it says, in order.
    pub blocks: Vec<Block>,
    /// The participant's name (OpenAI `name`).
    pub name: Option<String>,
}

impl Turn {
    /// A turn of `blocks`.
    pub fn new(role: Role, blocks: Vec<Block>) -> Turn {
        Turn { role, blocks, name: None }
    }
}

/// A tool the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDef {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Its parameters' JSON schema.
    pub parameters: Value,
}

/// Which tools the model may or must call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    #[default]
    Auto,
    /// No tool: the tools are not offered to the model at all.
    None,
    /// At least one tool call is expected; the tools are offered as for `Auto`.
    Required,
    /// Only this tool is offered.
    Named(String),
}

/// What the client asked of the model's reasoning.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Thinking {
    /// `false` when the client turned reasoning off (Anthropic `thinking.type: "disabled"`,
    /// Chat `chat_template_kwargs.enable_thinking: false`); `None` when it said nothing.
    pub enabled: Option<bool>,
    /// Send only signatures, not the reasoning text (Anthropic `display: "omitted"`).
    pub omit_text: bool,
}

/// The request, whichever API it came through.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Conversation {
    /// The model, as the client named it (echoed verbatim).
    pub model: String,
    /// The leading system text (Anthropic `system`, Responses `instructions`, an OpenAI first
    /// `system` message), Claude Code's billing header already removed.
    pub system: Vec<Block>,
    /// The messages.
    pub turns: Vec<Turn>,
    /// The tools offered.
    pub tools: Vec<ToolDef>,
    /// Which of them.
    pub tool_choice: ToolChoice,
    /// Whether the model may call several tools in one turn (informational: the parsers accept
    /// any number).
    pub parallel_tool_calls: bool,
    /// Reasoning options.
    pub thinking: Thinking,
    /// Template arguments (`chat_template_kwargs`); `enable_thinking` is set from
    /// [`Thinking::enabled`] when the client said.
    pub template_kwargs: super::template::Kwargs,
    /// What the request says of sampling (checked per API).
    pub sampling: SamplingRequest,
    /// Sampler seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Most tokens to generate; `None` for `frontend.default_max_tokens`.
    pub max_tokens: Option<usize>,
    /// Agent hints (`nvext`).
    pub hints: AgentHints,
    /// The session, as its tenant's [`session_key`](super::Tenant::session_key).
    pub session: Option<String>,
    /// Whose request it is.
    pub tenant: super::Tenant,
    /// A breakpoint on the whole prompt (Anthropic's top-level `cache_control`, OpenAI's
    /// `prompt_cache_retention: "24h"`), besides the blocks' own.
    pub cache: Option<CacheMark>,
    /// The request's `cache_salt`: its blocks are shared only with requests of the same tenant
    /// and the same salt.
    pub cache_salt: Option<String>,
    /// Stream the answer.
    pub stream: bool,
}

impl Conversation {
    /// Text bytes of the whole request: a cheap lower bound on its tokens.
    pub fn text_bytes(&self) -> usize {
        let blocks = self.system.iter().chain(self.turns.iter().flat_map(|t| &t.blocks));
        blocks.map(Block::text_bytes).sum::<usize>()
            + self.tools.iter().map(|t| t.name.len() + t.description.as_ref().map_or(0, String::len)).sum::<usize>()
    }

    /// Drops Claude Code's billing-header lines (`x-anthropic-billing-header: cc_version=…;`,
    /// different on every request) from the system text and from system and developer turns,
    /// wherever they sit: a string of their own, a text block of their own, or the first line of
    /// a block that goes on with the system prompt. Only the header line goes; a block left empty
    /// goes with it. Returns how many lines were dropped.
    pub fn strip_billing_header(&mut self) -> usize {
        let mut dropped = strip_blocks(&mut self.system);
        for turn in &mut self.turns {
            if matches!(turn.role, Role::System | Role::Developer) {
                dropped += strip_blocks(&mut turn.blocks);
            }
        }
        if dropped > 0 {
            self.turns.retain(|t| !(matches!(t.role, Role::System | Role::Developer) && t.blocks.is_empty()));
        }
        dropped
    }

    /// Assistant turns so far (the scripted engine's turn number).
    pub fn assistant_turns(&self) -> usize {
        self.turns.iter().filter(|t| t.role == Role::Assistant).count()
    }
}

/// The line Claude Code puts first in its system text, different on every request.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// `text` without its billing-header lines, and how many there were.
pub fn strip_billing_header(text: &str) -> (String, usize) {
    let mut dropped = 0;
    let kept = text
        .split_inclusive('\n')
        .filter(|line| {
            let header = line.trim_start().starts_with(BILLING_HEADER);
            dropped += usize::from(header);
            !header
        })
        .collect();
    (kept, dropped)
}

/// [`strip_billing_header`] over the text blocks of `blocks`; a block left empty is removed.
fn strip_blocks(blocks: &mut Vec<Block>) -> usize {
    let mut dropped = 0;
    blocks.retain_mut(|block| {
        let Block::Text { text, .. } = block else { return true };
        if !text.contains(BILLING_HEADER) {
            return true;
        }
        let (kept, n) = strip_billing_header(text);
        if n == 0 {
            return true;
        }
        dropped += n;
        *text = kept;
        !text.is_empty()
    });
    dropped
}

/// The kind of an output block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockKind {
    /// Reasoning.
    Thinking,
    /// Text.
    Text,
    /// A tool call, with the id and name it is known by from its start.
    ToolCall {
        /// The call's id (the model's own where its format has one).
        id: String,
        /// The tool.
        name: String,
    },
}

/// Usage of one answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of them, found cached.
    pub cached_tokens: usize,
    /// Of the others, newly leased for up to an hour (written to the cache, as Anthropic says).
    pub cache_creation_5m: usize,
    /// Of the others, newly leased for an hour or more.
    pub cache_creation_1h: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Of them, reasoning.
    pub reasoning_tokens: usize,
}

/// Why an answer ended, as the APIs distinguish it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finish {
    /// Stop (end of turn or a stop string), length, or tool calls.
    pub reason: FinishReason,
    /// The stop string that ended it, if one did.
    pub stop_sequence: Option<String>,
}

/// One event of an answer, in generation order. Blocks are opened and closed one at a time and
/// numbered in the order they open; a new block opens whenever the kind changes.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Block `index` opens.
    Start {
        /// Its position in the answer.
        index: usize,
        /// What it holds.
        kind: BlockKind,
    },
    /// More of block `index`: its text, reasoning, or tool arguments (JSON text).
    Delta {
        /// The block.
        index: usize,
        /// The text.
        text: String,
    },
    /// Block `index` is complete.
    Stop {
        /// The block.
        index: usize,
        /// Its whole text (a thinking block's reasoning, a call's arguments).
        text: String,
        /// A thinking block's replay handle: the `signature` / `encrypted_content` to send.
        handle: Option<String>,
    },
}

/// What a request says of sampling. A value it leaves unset is the model's default (its
/// `generation_config.json`, as vLLM takes it), else the API's: temperature
/// [`fallback_temperature`](Self::fallback_temperature), no top-p, top-k or repetition penalty.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingRequest {
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`, in `(0, 1]`.
    pub top_p: Option<f32>,
    /// `top_k`; 0 (or vLLM's -1) keeps every token.
    pub top_k: Option<u32>,
    /// `repetition_penalty` (vLLM's extension), above 0.
    pub repetition_penalty: Option<f32>,
    /// The API's temperature when neither the request nor the model sets one.
    pub fallback_temperature: f32,
}

impl Default for SamplingRequest {
    /// Nothing set; OpenAI's temperature 1.
    fn default() -> Self {
        SamplingRequest::unset(1.0)
    }
}

impl SamplingRequest {
    /// Nothing set; temperature `fallback` when the model has none either.
    pub fn unset(fallback: f32) -> SamplingRequest {
        SamplingRequest {
            temperature: None,
            top_p: None,
            top_k: None,
            repetition_penalty: None,
            fallback_temperature: fallback,
        }
    }

    /// The sampler: each value from the request, else from `model`, else the API's default.
    pub fn resolve(&self, model: &SamplingRequest) -> dynamo_kernels::sampling::Sampling {
        dynamo_kernels::sampling::Sampling {
            temperature: self.temperature.or(model.temperature).unwrap_or(self.fallback_temperature),
            top_p: self.top_p.or(model.top_p).unwrap_or(1.0),
            top_k: self.top_k.or(model.top_k).unwrap_or(0),
            repetition_penalty: self.repetition_penalty.or(model.repetition_penalty).unwrap_or(1.0),
        }
    }

    /// Checks `top_p`, `top_k` (a negative one is "all", as vLLM's -1) and `repetition_penalty`,
    /// naming the field of a bad one.
    pub fn check(
        temperature: Option<f32>,
        top_p: Option<f32>,
        top_k: Option<i64>,
        repetition_penalty: Option<f32>,
        fallback: f32,
    ) -> Result<SamplingRequest, (String, &'static str)> {
        if let Some(p) = top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err((format!("Invalid 'top_p': {p} is not in (0, 1]."), "top_p"));
        }
        if let Some(r) = repetition_penalty
            && !(r.is_finite() && r > 0.0)
        {
            return Err((format!("Invalid 'repetition_penalty': {r} is not above 0."), "repetition_penalty"));
        }
        Ok(SamplingRequest {
            temperature,
            top_p,
            top_k: top_k.map(|k| u32::try_from(k.max(0)).unwrap_or(u32::MAX)),
            repetition_penalty,
            fallback_temperature: fallback,
        })
    }
}
