//! Chat templates: messages → prompt text, and which retention region every piece of it holds.
//!
//! A [`ChatTemplate`] is a Hugging Face-style Jinja template (the `chat_template` of a model's
//! `tokenizer_config.json`) rendered with `minijinja` the way `transformers` renders it:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, `tojson` (Python's `json.dumps` spacing, as
//! `transformers` renders it), `raise_exception`, and Python
//! string methods (`.strip()`, `.startswith()`, …) through `minijinja-contrib`'s pycompat layer.
//! The context holds `messages`, `tools` (when the request has any), `add_generation_prompt`,
//! `bos_token` and `eos_token`. [`ChatTemplate::builtin`] is a small Llama-3-style template for
//! models that ship none.
//!
//! # Regions
//!
//! [`ChatTemplate::render_regions`] splits the rendered prompt into pieces, each with a
//! [`RegionKind`], by rendering prefixes of the conversation:
//!
//! 1. `render(messages[..k])` for `k = 0..=n` (no generation prompt). The text that
//!    `messages[..k]` adds to `messages[..k-1]` belongs to message `k-1`: `system`/`developer` →
//!    [`RegionKind::System`], `user`/`assistant` → [`RegionKind::Conversation`], `tool` →
//!    [`RegionKind::ToolResult`]. The text before the first message (BOS, a fixed preamble) is
//!    `System`; the generation prompt after the last message is `Conversation`. Past 256 messages
//!    only the prefixes at powers of two and the whole are rendered, so that rendering stays
//!    linear in the conversation (8,000 messages render 13 more prefixes, not 7,744); the
//!    messages between two such cuts make one piece.
//! 2. Templates that rewrite earlier text when a message is added (rare; e.g. one that treats the
//!    last message specially) are handled by cutting at the longest common prefix: the rewritten
//!    tail is given to the newer message.
//! 3. When the request has tools, the full prompt is also rendered without them; the text between
//!    the longest common prefix and the longest common suffix of the two renders is the tool
//!    definitions ([`RegionKind::Tools`]), whatever message the template put them in.
//!
//! The prompt's tokens are the concatenation of each piece's tokens ([`tokenize_pieces`]), not the
//! tokenization of the whole text: a turn's tokens then never depend on what follows it, so the
//! next request of a conversation re-renders a token-identical prefix (what prefix caching needs).
//! Pieces end at message boundaries, where templates put special tokens, so this rarely differs
//! from tokenizing the whole text at all.

use std::ops::Range;
use std::path::{Path, PathBuf};

use dynamo_config::RegionKind;
use serde::Serialize;

use super::generate::RegionRanges;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// The built-in template: Llama-3-style headers, tool definitions as JSON lines in a `tools`
/// block after the BOS token, an assistant turn's reasoning kept in history as
/// `<think>\n…\n</think>\n\n` (so an agent loop's prompts keep their common prefix), its tool
/// calls as JSON.
pub const DEFAULT_TEMPLATE: &str = r#"{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>tools<|end_header_id|>\n\n' }}
{%- for tool in tools %}
{{- tool | tojson }}{{ '\n' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
{%- if message['reasoning_content'] %}{{ '<think>\n' + (message['reasoning_content'] | trim) + '\n</think>\n\n' }}{% endif %}
{%- if message['content'] %}{{ message['content'] | trim }}{% endif %}
{%- if message['tool_calls'] %}
{%- for call in message['tool_calls'] %}{{ call['function'] | tojson }}{% endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"#;

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// `tokenizer_config.json` could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON, or its `chat_template` has an unexpected shape.
    #[error("{}: {message}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The template does not compile.
    #[error("chat template: {0}")]
    Syntax(String),
    /// Rendering failed (often `raise_exception` refusing the conversation, e.g. roles that do
    /// not alternate): a client error.
    #[error("chat template: {0}")]
    Render(String),
}

impl TemplateError {
    /// A stable label for metrics: `io`, `config`, `syntax` or `render`.
    pub fn kind(&self) -> &'static str {
        match self {
            TemplateError::Io { .. } => "io",
            TemplateError::Config { .. } => "config",
            TemplateError::Syntax(_) => "syntax",
            TemplateError::Render(_) => "render",
        }
    }
}

/// One message as the template sees it: content already flattened to text.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TemplateMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (`None` for an assistant turn that only calls tools).
    pub content: Option<String>,
    /// An assistant turn's reasoning, for templates that render it (Qwen3, GLM, Nemotron).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The participant's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's tool calls, as the API sent them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl TemplateMessage {
    /// The region of this message's text.
    pub fn region(&self) -> RegionKind {
        match self.role.as_str() {
            "system" | "developer" => RegionKind::System,
            "tool" | "ipython" => RegionKind::ToolResult,
            _ => RegionKind::Conversation,
        }
    }
}

/// A compiled chat template with its BOS and EOS strings.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// End-of-turn strings the model samples besides EOS (gpt-oss `<|call|>`, GLM's
    /// `<|observation|>`): stop tokens where the tokenizer has them as one token.
    stops: Vec<String>,
    /// Whether the environment holds a `tool_use` template for requests with tools.
    tool_use: bool,
    /// Where the template came from ([`ChatTemplate::origin`]).
    origin: String,
    /// The (default) template's source.
    source: String,
}

/// A family template of this project ([`ChatTemplate::named`]): its name, source, BOS, EOS
/// and the other end-of-turn strings its models sample. `templates/FAMILIES.md` describes each.
struct Family {
    name: &'static str,
    source: &'static str,
    bos: &'static str,
    eos: &'static str,
    stops: &'static [&'static str],
}

/// The family templates, by the names `model.chat_template` takes.
const FAMILIES: &[Family] = &[
    Family { name: "llama3", source: DEFAULT_TEMPLATE, bos: "<|begin_of_text|>", eos: "<|eot_id|>", stops: &[] },
    Family {
        name: "qwen3",
        source: include_str!("templates/qwen3.jinja"),
        bos: "",
        eos: "<|im_end|>",
        stops: &["<|endoftext|>"],
    },
    Family {
        name: "qwen3_preserve",
        source: include_str!("templates/qwen3_preserve.jinja"),
        bos: "",
        eos: "<|im_end|>",
        stops: &["<|endoftext|>"],
    },
    Family {
        name: "deepseek_r1",
        source: include_str!("templates/deepseek_r1.jinja"),
        bos: "<\u{ff5c}begin\u{2581}of\u{2581}sentence\u{ff5c}>",
        eos: "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
        stops: &[],
    },
    Family {
        name: "gpt_oss",
        source: include_str!("templates/gpt_oss.jinja"),
        bos: "",
        eos: "<|return|>",
        stops: &["<|call|>"],
    },
    Family {
        name: "nemotron",
        source: include_str!("templates/nemotron.jinja"),
        bos: "<s>",
        eos: "<|im_end|>",
        stops: &[],
    },
    Family {
        name: "glm47",
        source: include_str!("templates/glm47.jinja"),
        bos: "",
        eos: "<|endoftext|>",
        stops: &["<|observation|>", "<|user|>"],
    },
    Family { name: "kimi_k2", source: include_str!("templates/kimi_k2.jinja"), bos: "", eos: "<|im_end|>", stops: &[] },
];

const NAME: &str = "chat_template";
/// The name of the template that renders requests with tools, where a checkpoint has one.
const TOOL_USE: &str = "tool_use";

/// Python's `strftime` of a UTC time (seconds since the epoch) for the directives templates use:
/// `%Y %y %m %d %e %j %H %M %S %p %b %B %a %A %%`.
fn strftime(format: &str, secs: u64) -> Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = (secs / 86_400) as i64;
    let (hour, minute, second) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    // Civil date of a day count (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[month as usize - 1] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month as usize - 1];
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:2}"),
            Some('j') => out += &format!("{yday:03}"),
            Some('H') => out += &format!("{hour:02}"),
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('p') => out += if hour < 12 { "AM" } else { "PM" },
            Some('b') => out += &month_name[..3],
            Some('B') => out += month_name,
            Some('a') => out += &DAYS[weekday][..3],
            Some('A') => out += DAYS[weekday],
            Some('%') => out.push('%'),
            other => return Err(format!("strftime_now: unsupported directive %{}", other.unwrap_or(' '))),
        }
    }
    Ok(out)
}

/// A JSON file of a checkpoint; `Ok(None)` when it does not exist.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>, TemplateError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TemplateError::Io { path: path.to_owned(), source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TemplateError::Config { path: path.to_owned(), message: e.to_string() })
}

impl ChatTemplate {
    /// [`DEFAULT_TEMPLATE`] with BOS `<|begin_of_text|>` and EOS `<|eot_id|>`.
    pub fn builtin() -> ChatTemplate {
        let mut template = ChatTemplate::new(DEFAULT_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>")
            .expect("the built-in template compiles");
        template.origin = "the built-in llama3 template".into();
        template
    }

    /// The names [`named`](Self::named) knows: `llama3` (the built-in) and the model families
    /// (`qwen3`, `qwen3_preserve`, `deepseek_r1`, `gpt_oss`, `nemotron`, `glm47`, `kimi_k2`).
    pub fn names() -> Vec<&'static str> {
        FAMILIES.iter().map(|f| f.name).collect()
    }

    /// This project's template for a model family, by name ([`names`](Self::names)), with the
    /// family's BOS, EOS and end-of-turn strings.
    pub fn named(name: &str) -> Option<ChatTemplate> {
        let family = FAMILIES.iter().find(|f| f.name == name)?;
        let mut template = ChatTemplate::new(family.source, family.bos, family.eos).expect("family templates compile");
        template.stops = family.stops.iter().map(|s| (*s).to_owned()).collect();
        template.origin = format!("this project's `{name}` template");
        Some(template)
    }

    /// End-of-turn strings the model samples besides EOS.
    pub fn stop_strings(&self) -> &[String] {
        &self.stops
    }

    /// Compiles `source`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
        });
        // `transformers` gives templates the date (Llama 3.x writes "Today Date: 04 Dec 2026").
        env.add_function("strftime_now", |format: String| -> Result<String, minijinja::Error> {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            strftime(&format, now.as_secs())
                .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e))
        });
        // `transformers` renders `tojson` as `json.dumps(x, ensure_ascii=False)`: `", "` and `": "`
        // separators (minijinja's own writes compact JSON), so a prompt is the one the model's
        // template gives under `transformers`. Keys keep the order they arrive in.
        env.add_filter(
            "tojson",
            |value: minijinja::Value, kwargs: minijinja::value::Kwargs| -> Result<minijinja::Value, minijinja::Error> {
                let invalid = |e: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e);
                let indent: Option<usize> = kwargs.get("indent")?;
                kwargs.assert_all_used()?;
                let json = serde_json::to_value(&value).map_err(|e| invalid(e.to_string()))?;
                Ok(minijinja::Value::from_safe_string(crate::frontend::parsers::python_json(&json, indent)))
            },
        );
        env.add_template_owned(NAME, source.to_owned()).map_err(|e| TemplateError::Syntax(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            stops: Vec::new(),
            tool_use: false,
            origin: String::new(),
            source: source.to_owned(),
        })
    }

    /// The template of a checkpoint directory, found where `transformers` looks for it:
    /// `chat_template.jinja` (what `transformers` ≥ 4.43 saves), with the named templates of
    /// `additional_chat_templates/*.jinja` beside it; else `chat_template.json` (a processor's
    /// `{"chat_template": …}`); else `tokenizer_config.json`'s `chat_template` (a string, or a list
    /// of `{name, template}` with a `default`). A `tool_use` template, where there is one, renders
    /// the requests that offer tools, as in `transformers`. BOS and EOS come from
    /// `tokenizer_config.json` (strings or AddedToken objects), else `special_tokens_map.json`.
    /// `Ok(None)` when the directory names no template.
    pub fn from_model_dir(dir: &Path) -> Result<Option<ChatTemplate>, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?;
        let map = read_json(&dir.join("special_tokens_map.json"))?;
        // `bos_token` is a string or an AddedToken object `{"content": ...}`.
        let token = |key: &str| -> String {
            [&config, &map]
                .into_iter()
                .flatten()
                .find_map(|file| match file.get(key)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    v => v.get("content").and_then(|c| c.as_str()).map(str::to_owned),
                })
                .unwrap_or_default()
        };
        let read = |path: PathBuf| -> Result<Option<String>, TemplateError> {
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(Some(text)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(source) => Err(TemplateError::Io { path, source }),
            }
        };
        let mut named: Vec<(String, String)> = Vec::new();
        let (default, origin) = if let Some(source) = read(dir.join("chat_template.jinja"))? {
            if let Some(tool_use) = read(dir.join("additional_chat_templates").join("tool_use.jinja"))? {
                named.push(("tool_use".into(), tool_use));
            }
            (source, dir.join("chat_template.jinja"))
        } else if let Some(file) = read_json(&dir.join("chat_template.json"))?
            && let Some(source) = file.get("chat_template").and_then(|t| t.as_str())
        {
            (source.to_owned(), dir.join("chat_template.json"))
        } else {
            let config_error =
                |message: &str| TemplateError::Config { path: config_path.clone(), message: message.into() };
            let source = match config.as_ref().and_then(|c| c.get("chat_template")) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(list)) => {
                    let mut default = None;
                    for t in list {
                        let (Some(name), Some(template)) =
                            (t.get("name").and_then(|n| n.as_str()), t.get("template").and_then(|t| t.as_str()))
                        else {
                            return Err(config_error("a `chat_template` entry lacks its `name` or `template`"));
                        };
                        match name {
                            "default" => default = Some(template.to_owned()),
                            _ => named.push((name.to_owned(), template.to_owned())),
                        }
                    }
                    default.ok_or_else(|| config_error("`chat_template` is a list without a `default` template"))?
                }
                Some(_) => return Err(config_error("`chat_template` is neither a string nor a list")),
            };
            (source, config_path.clone())
        };
        let mut template = ChatTemplate::new(&default, &token("bos_token"), &token("eos_token"))
            .map_err(|e| TemplateError::Config { path: origin.clone(), message: e.to_string() })?;
        if let Some((_, tool_use)) = named.iter().find(|(name, _)| name == "tool_use") {
            template
                .env
                .add_template_owned(TOOL_USE, tool_use.clone())
                .map_err(|e| TemplateError::Config { path: origin.clone(), message: format!("`tool_use`: {e}") })?;
            template.tool_use = true;
        }
        template.origin = origin.display().to_string();
        Ok(Some(template))
    }

    /// Says where the template came from ([`origin`](Self::origin)).
    pub fn with_origin(mut self, origin: impl Into<String>) -> ChatTemplate {
        self.origin = origin.into();
        self
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template came from: a file of the checkpoint, or `built-in llama3` / a family's
    /// name.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The BOS string.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS string (the stop token of chat answers).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages` (and `tools` when there are any); `add_generation_prompt` appends the
    /// header of the assistant's answer.
    pub fn render(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, tools, add_generation_prompt, &Kwargs::new())
    }

    /// [`render`](Self::render) with template arguments (`enable_thinking`, `preserve_thinking`,
    /// …: a request's `chat_template_kwargs`) as top-level variables.
    pub fn render_with(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: &Kwargs,
    ) -> Result<String, TemplateError> {
        #[derive(Serialize)]
        struct Context<'a> {
            #[serde(flatten)]
            kwargs: &'a Kwargs,
            messages: &'a [TemplateMessage],
            #[serde(skip_serializing_if = "Option::is_none")]
            tools: Option<&'a [serde_json::Value]>,
            add_generation_prompt: bool,
            bos_token: &'a str,
            eos_token: &'a str,
        }
        let tools = tools.filter(|t| !t.is_empty());
        let name = if self.tool_use && tools.is_some() { TOOL_USE } else { NAME };
        let template = self.env.get_template(name).map_err(|e| TemplateError::Syntax(e.to_string()))?;
        let context = Context {
            kwargs,
            messages,
            tools,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        };
        template.render(context).map_err(|e| TemplateError::Render(render_message(&e)))
    }

    /// Renders the prompt (with the generation prompt) as pieces tagged with their region; the
    /// pieces concatenate to [`render`](Self::render)`(messages, tools, true)`. See the module doc
    /// for the method.
    pub fn render_regions(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<Vec<(String, RegionKind)>, TemplateError> {
        Ok(self.render_pieces(messages, tools, &Kwargs::new())?.into_iter().map(|p| (p.text, p.region)).collect())
    }

    /// [`render_regions`](Self::render_regions) with template arguments, each piece with what
    /// it renders ([`Owner`]).
    pub fn render_pieces(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[serde_json::Value]>,
        kwargs: &Kwargs,
    ) -> Result<Vec<Piece>, TemplateError> {
        let render =
            |messages: &[TemplateMessage], tools, generation| self.render_with(messages, tools, generation, kwargs);
        let full = render(messages, tools, true)?;
        // Byte offsets into `full` where each piece ends, with the piece's region and owner.
        let ks = cut_points(messages);
        let mut cuts: Vec<(usize, RegionKind, Owner)> = Vec::with_capacity(ks.len() + 1);
        let mut previous = None;
        for &k in &ks {
            // A template may refuse a prefix it is never asked for alone (`messages[0]` of no
            // messages, a conversation that must end on a user turn): that cut is skipped, and
            // its text belongs to the next piece.
            let Ok(prefix) = render(&messages[..k], tools, false) else { continue };
            let end = common_prefix(&full, &prefix);
            // A rewrite of earlier text moves the boundary back: earlier cuts end there too.
            for cut in cuts.iter_mut() {
                cut.0 = cut.0.min(end);
            }
            // The piece ending here holds what messages[..k] added since the previous cut: the
            // text before the first message (BOS, a preamble) is system; otherwise it is the
            // region of its last message.
            let region = k.checked_sub(1).map_or(RegionKind::System, |last| messages[last].region());
            let owner = match (k, previous) {
                (0, _) => Owner::Preamble,
                (k, Some(p)) if p + 1 == k => Owner::Message(k - 1),
                _ => Owner::Messages,
            };
            cuts.push((end, region, owner));
            previous = Some(k);
        }
        // The generation prompt is conversation.
        let region = if messages.is_empty() { RegionKind::System } else { RegionKind::Conversation };
        cuts.push((full.len(), region, Owner::Generation));

        let mut pieces = Vec::with_capacity(cuts.len());
        let mut start = 0;
        for (end, region, owner) in cuts {
            if end > start {
                pieces.push(Piece { text: full[start..end].to_owned(), region, owner });
                start = end;
            }
        }
        if tools.is_some_and(|t| !t.is_empty()) {
            let without = render(messages, None, true)?;
            let lo = common_prefix(&full, &without);
            let hi = full.len() - common_suffix(&full[lo..], &without[lo.min(without.len())..]);
            if hi > lo {
                let span = align_insertion(&full, lo..hi, &pieces);
                pieces = overlay(pieces, span, RegionKind::Tools);
            }
        }
        Ok(pieces)
    }
}

/// Template arguments: top-level variables beside `messages` (`enable_thinking`, …).
pub type Kwargs = serde_json::Map<String, serde_json::Value>;

/// What a [`Piece`] of a rendered prompt renders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// The text before the first message (BOS, a fixed preamble).
    Preamble,
    /// Message `i`, alone.
    Message(usize),
    /// Several messages (past the exact cuts of a long conversation).
    Messages,
    /// The generation prompt after the last message.
    Generation,
}

/// One piece of a rendered prompt: its text, its retention region and what it renders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The text.
    pub text: String,
    /// Its region.
    pub region: RegionKind,
    /// What it renders.
    pub owner: Owner,
}

/// Conversations up to this many messages are cut at every message (at most 256 prefixes of at
/// most 256 messages: a bounded cost).
const EXACT_MESSAGES: usize = 256;

/// Which prefixes `messages[..k]` [`ChatTemplate::render_regions`] renders to find its cuts:
/// every `k` up to [`EXACT_MESSAGES`]; past it only the powers of two and `n` itself, so the
/// renders add up to a few times one render of the whole conversation (linear, where every
/// prefix was quadratic: 21 s for 8,000 one-word messages). The cuts a prefix gets depend only
/// on the prefix, never on what follows it, so a conversation's earlier turns are cut the same
/// way turn after turn. Past the exact range, the messages between two cuts make one piece,
/// tagged with the region of its last message.
fn cut_points(messages: &[TemplateMessage]) -> Vec<usize> {
    let n = messages.len();
    let mut ks: Vec<usize> = (0..=n.min(EXACT_MESSAGES)).collect();
    let mut k = EXACT_MESSAGES * 2;
    while k < n {
        ks.push(k);
        k *= 2;
    }
    if n > EXACT_MESSAGES {
        ks.push(n);
    }
    ks
}

/// The innermost cause of a render error, which names the template line (or carries the
/// message of `raise_exception`).
fn render_message(e: &minijinja::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        message = format!("{message}: {inner}");
        source = inner.source();
    }
    message
}

/// Length in bytes of the longest common prefix of `a` and `b`, on a char boundary of both.
fn common_prefix(a: &str, b: &str) -> usize {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(n) || !b.is_char_boundary(n) {
        n -= 1;
    }
    n
}

/// Length in bytes of the longest common suffix of `a` and `b`, on a char boundary of both.
fn common_suffix(a: &str, b: &str) -> usize {
    let mut n = a.bytes().rev().zip(b.bytes().rev()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(a.len() - n) || !b.is_char_boundary(b.len() - n) {
        n -= 1;
    }
    n
}

/// An insertion found by common prefix and suffix is ambiguous when its text ends like the text
/// before it (`<|start_header_id|>tools…<|start_header_id|>` inserted before
/// `<|start_header_id|>system…` could start at either header). Of the equivalent spans, take one
/// that starts or ends on a piece boundary, else the leftmost, so that no special-token string is
/// split between two pieces that a template wrote as one.
fn align_insertion(full: &str, span: Range<usize>, pieces: &[Piece]) -> Range<usize> {
    let bytes = full.as_bytes();
    let mut boundaries = std::collections::HashSet::new();
    let mut offset = 0;
    for piece in pieces {
        boundaries.insert(offset);
        offset += piece.text.len();
    }
    boundaries.insert(offset);
    let mut candidates = vec![span.clone()];
    let (mut lo, mut hi) = (span.start, span.end);
    while lo > 0 && bytes[lo - 1] == bytes[hi - 1] {
        lo -= 1;
        hi -= 1;
        if full.is_char_boundary(lo) && full.is_char_boundary(hi) {
            candidates.push(lo..hi);
        }
    }
    let on_boundary = |r: &Range<usize>| boundaries.contains(&r.start) as u8 + boundaries.contains(&r.end) as u8;
    let best = candidates.iter().map(on_boundary).max().unwrap_or(0);
    candidates.into_iter().rev().find(|r| on_boundary(r) == best).unwrap_or(span)
}

/// Re-tags the bytes `span` of the concatenated pieces as `region`, splitting pieces at its ends.
fn overlay(pieces: Vec<Piece>, span: Range<usize>, region: RegionKind) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len() + 2);
    let mut offset = 0;
    for Piece { text, region: r, owner } in pieces {
        let range = offset..offset + text.len();
        offset = range.end;
        let lo = span.start.clamp(range.start, range.end) - range.start;
        let hi = span.end.clamp(range.start, range.end) - range.start;
        for (part, tag) in [(&text[..lo], r), (&text[lo..hi], region), (&text[hi..], r)] {
            if !part.is_empty() {
                out.push(Piece { text: part.to_owned(), region: tag, owner });
            }
        }
    }
    out
}

/// Neutralises special-token strings in untrusted text: a U+2060 WORD JOINER after the first
/// character of every occurrence of one of `specials`, so that the tokenizer encodes it as plain
/// text and a message cannot forge the template's structure (`<|eot_id|>` in a user message ends
/// nothing). The same text always escapes the same way, so re-rendered turns stay token-identical.
pub fn escape_special_tokens<'a>(text: &'a str, specials: &[String]) -> std::borrow::Cow<'a, str> {
    let specials: Vec<&str> = specials.iter().map(String::as_str).filter(|s| s.chars().nth(1).is_some()).collect();
    if !specials.iter().any(|s| text.contains(s)) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for (at, c) in text.char_indices() {
        out.push(c);
        if specials.iter().any(|s| text[at..].starts_with(s)) {
            out.push('\u{2060}');
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Tokenizes each piece on its own and concatenates the ids; returns them with the token range
/// of every region (adjacent pieces of the same region merged).
pub fn tokenize_pieces(
    tokenizer: &Tokenizer,
    pieces: &[(String, RegionKind)],
) -> Result<(Vec<u32>, RegionRanges), TokenizerError> {
    let mut ids = Vec::new();
    let mut regions: RegionRanges = Vec::new();
    for (text, region) in pieces {
        let start = ids.len();
        ids.extend(tokenizer.encode(text)?);
        let end = ids.len();
        if end == start {
            continue;
        }
        match regions.last_mut() {
            Some((range, last)) if *last == *region && range.end == start => range.end = end,
            _ => regions.push((start..end, *region)),
        }
    }
    Ok((ids, regions))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage { role: role.into(), content: Some(content.into()), ..Default::default() }
    }

    fn joined(pieces: &[(String, RegionKind)]) -> String {
        pieces.iter().map(|(t, _)| t.as_str()).collect()
    }

    #[test]
    fn builtin_renders_llama3_style() {
        let t = ChatTemplate::builtin();
        let messages = [msg("system", "Be brief."), msg("user", "  Hi!  ")];
        let text = t.render(&messages, None, true).unwrap();
        assert_eq!(
            text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert!(!t.render(&messages, None, false).unwrap().ends_with("<|end_header_id|>\n\n"));
        assert_eq!(t.eos_token(), "<|eot_id|>");
    }

    #[test]
    fn regions_follow_the_messages() {
        let t = ChatTemplate::builtin();
        let tools = [serde_json::json!({"type": "function", "function": {"name": "ls", "parameters": {}}})];
        let messages = [
            msg("system", "You are a coding agent."),
            msg("user", "List the files."),
            TemplateMessage {
                role: "assistant".into(),
                content: None,
                tool_calls: Some(serde_json::json!([{"id": "c1", "type": "function",
                    "function": {"name": "ls", "arguments": "{}"}}])),
                ..Default::default()
            },
            TemplateMessage { tool_call_id: Some("c1".into()), ..msg("tool", "a.rs b.rs") },
        ];
        let pieces = t.render_regions(&messages, Some(&tools)).unwrap();
        assert_eq!(joined(&pieces), t.render(&messages, Some(&tools), true).unwrap());
        let regions: Vec<RegionKind> = pieces.iter().map(|p| p.1).collect();
        use RegionKind::*;
        assert_eq!(regions, [System, Tools, System, Conversation, Conversation, ToolResult, Conversation]);
        assert_eq!(pieces[0].0, "<|begin_of_text|>");
        assert!(pieces[1].0.starts_with("<|start_header_id|>tools") && pieces[1].0.contains("\"ls\""));
        assert!(pieces[1].0.ends_with("<|eot_id|>"), "{:?}", pieces[1].0);
        assert!(pieces[2].0.contains("You are a coding agent.") && pieces[2].0.ends_with("<|eot_id|>"));
        assert!(pieces[3].0.contains("List the files."));
        assert!(pieces[5].0.contains("a.rs b.rs"));
        assert_eq!(pieces[6].0, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    }

    /// A long conversation renders prefixes whose lengths add up to a few times the whole
    /// (linear time, where rendering every prefix took 21 s for 8,000 messages), its pieces still
    /// make the whole prompt, and a turn's tokens are still a prefix of the next turn's.
    #[test]
    fn long_conversations_render_in_linear_time() {
        let alternating: Vec<TemplateMessage> =
            (0..8000).map(|i| msg(if i % 2 == 0 { "user" } else { "tool" }, &format!("w{i}"))).collect();
        let ks = cut_points(&alternating);
        let rendered: usize = ks.iter().sum();
        let exact: usize = (0..=EXACT_MESSAGES).sum();
        assert!(rendered <= exact + 3 * 8000, "{rendered} messages rendered in all");
        assert_eq!((ks[0], *ks.last().unwrap()), (0, 8000));
        assert!(ks.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(cut_points(&alternating[..5]), [0, 1, 2, 3, 4, 5], "short conversations cut at every message");
        // The cuts of a prefix do not depend on what follows it.
        let longer = cut_points(&alternating[..7000]);
        assert!(ks.iter().filter(|&&k| k < 7000).all(|k| longer.contains(k)));

        let t = ChatTemplate::builtin();
        let pieces = t.render_regions(&alternating, None).unwrap();
        assert_eq!(joined(&pieces), t.render(&alternating, None, true).unwrap());
        use RegionKind::*;
        let regions: Vec<RegionKind> = pieces.iter().map(|p| p.1).collect();
        assert_eq!(regions[..4], [System, Conversation, ToolResult, Conversation]);
        assert_eq!(*regions.last().unwrap(), Conversation);
        assert!(pieces[2].0.contains(">\n\nw1<"), "{:?}", pieces[2].0);

        // Turn N and turn N+1 (its answer and a new message appended) of a long conversation.
        let tokenizer = Tokenizer::builtin();
        let turn: Vec<TemplateMessage> = (0..200)
            .map(|i| {
                msg(["system", "user", "assistant", "tool"][if i == 0 { 0 } else { 1 + i % 3 }], &format!("m {i}"))
            })
            .collect();
        let (first, _) = tokenize_pieces(&tokenizer, &t.render_regions(&turn, None).unwrap()).unwrap();
        let mut next = turn.clone();
        next.push(msg("assistant", "answer"));
        next.push(msg("user", "go on"));
        let (second, _) = tokenize_pieces(&tokenizer, &t.render_regions(&next, None).unwrap()).unwrap();
        assert_eq!(second[..first.len()], first[..], "turn N's prompt is a prefix of turn N+1's");
    }

    #[test]
    fn a_template_that_rewrites_earlier_text_still_covers_the_prompt() {
        // Marks the last message: adding a message rewrites the previous one's text.
        let source = "{% for m in messages %}{% if loop.last %}[LAST {{ m.role }}]{% else %}[{{ m.role }}]{% endif %}\
                      {{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}";
        let t = ChatTemplate::new(source, "", "").unwrap();
        let messages = [msg("system", "s"), msg("user", "u")];
        let pieces = t.render_regions(&messages, None).unwrap();
        assert_eq!(joined(&pieces), "[system]s[LAST user]u>");
        assert_eq!(pieces.last().unwrap().1, RegionKind::Conversation);
        // Rendered alone, the system message was `[LAST system]s`: only `[` is certainly its own.
        assert_eq!(pieces[0], ("[".to_owned(), RegionKind::System));
    }

    /// `tojson` writes what `transformers` writes (`json.dumps(x, ensure_ascii=False)`), with and
    /// without an indent.
    /// Every family template renders here as Python's jinja2 renders it (`transformers`): the
    /// renders `templates/check_templates.py --golden` wrote, byte for byte.
    #[test]
    fn family_templates_render_as_jinja2_does() {
        let golden: Vec<serde_json::Value> =
            serde_json::from_str(include_str!("templates/golden.json")).expect("golden renders");
        assert!(golden.len() > 100, "{}", golden.len());
        let mut families = std::collections::BTreeSet::new();
        for (i, case) in golden.iter().enumerate() {
            let name = case["template"].as_str().unwrap();
            families.insert(name);
            let template = ChatTemplate::named(name).unwrap_or_else(|| panic!("no template `{name}`"));
            let mut context = case["kwargs"].as_object().cloned().unwrap_or_default();
            context.insert("messages".into(), case["messages"].clone());
            if !case["tools"].is_null() {
                context.insert("tools".into(), case["tools"].clone());
            }
            context.insert("add_generation_prompt".into(), case["add_generation_prompt"].clone());
            context.insert("bos_token".into(), template.bos_token().into());
            context.insert("eos_token".into(), template.eos_token().into());
            let rendered = template.env.get_template(NAME).unwrap().render(&context).unwrap();
            let expected = case["expected"].as_str().unwrap();
            assert!(
                rendered == expected,
                "case {i} ({name}, {}):\n{rendered}\n---- jinja2:\n{expected}",
                case["kwargs"]
            );
        }
        let named: std::collections::BTreeSet<&str> =
            ChatTemplate::names().into_iter().filter(|n| *n != "llama3").collect();
        assert_eq!(families, named, "every family has golden renders");
    }

    #[test]
    fn tojson_is_pythons() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ e | tojson }}", "", "").unwrap();
        let rendered = t
            .env
            .get_template(NAME)
            .unwrap()
            .render(
                minijinja::context! { x => serde_json::json!({"a": [1, "é"], "b": {}}), e => serde_json::json!([]) },
            )
            .unwrap();
        assert_eq!(
            rendered,
            "{\"a\": [1, \"é\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    \"é\"\n  ],\n  \"b\": {}\n}|[]"
        );
    }

    #[test]
    fn hugging_face_features_work() {
        let source = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'].strip() }}\
                      {% elif m['role'] == 'assistant' %}{{ m.content | tojson }}{% else %}\
                      {{ raise_exception('roles must be user or assistant') }}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(source, "<s>", "</s>").unwrap();
        assert_eq!(t.render(&[msg("user", " hi "), msg("assistant", "ok")], None, true).unwrap(), "<s>hi\"ok\"");
        let err = t.render(&[msg("system", "x")], None, true).unwrap_err();
        assert_eq!(err.kind(), "render");
        assert!(err.to_string().contains("roles must be user or assistant"), "{err}");
        assert_eq!(ChatTemplate::new("{% for %}", "", "").unwrap_err().kind(), "syntax");
    }

    #[test]
    fn loads_the_template_of_a_model_dir() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());
        let config = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T"},
                              {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}],
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[msg("user", "x")], None, true).unwrap(), "<s>x</s>");
        let tools = [serde_json::json!({"type": "function", "function": {"name": "ls"}})];
        assert_eq!(t.render(&[msg("user", "x")], Some(&tools), true).unwrap(), "T");
        std::fs::write(dir.path().join("tokenizer_config.json"), "{\"eos_token\": \"</s>\"}").unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());
        std::fs::write(dir.path().join("tokenizer_config.json"), "{").unwrap();
        assert_eq!(ChatTemplate::from_model_dir(dir.path()).unwrap_err().kind(), "config");
    }

    #[test]
    fn strftime_writes_pythons_directives() {
        // 2026-12-04 19:05:09 UTC, a Friday; 2024-02-29, a leap day.
        assert_eq!(strftime("%d %b %Y", 1_796_411_109).unwrap(), "04 Dec 2026");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S %A %j", 1_796_411_109).unwrap(), "2026-12-04 19:05:09 Friday 338");
        assert_eq!(strftime("%B %e, %y %a %p %%", 1_709_164_800).unwrap(), "February 29, 24 Thu AM %");
        assert!(strftime("%Q", 0).is_err());
    }

    #[test]
    fn transformers_5_checkpoints_keep_the_template_in_its_own_file() {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": true}});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ bos_token }}D{{ messages[0].content }}").unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert!(t.origin().ends_with("chat_template.jinja"), "{}", t.origin());
        assert_eq!((t.bos_token(), t.eos_token()), ("<s>", "</s>"));
        let tools = [serde_json::json!({"type": "function", "function": {"name": "ls"}})];
        assert_eq!(t.render(&[msg("user", "x")], Some(&tools), true).unwrap(), "<s>Dx");
        // A named `tool_use` template renders the requests that offer tools.
        std::fs::create_dir(dir.path().join("additional_chat_templates")).unwrap();
        std::fs::write(dir.path().join("additional_chat_templates/tool_use.jinja"), "T{{ tools | length }}").unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[msg("user", "x")], Some(&tools), true).unwrap(), "T1");
        assert_eq!(t.render(&[msg("user", "x")], None, true).unwrap(), "<s>Dx");
        // A template that does not compile names its file.
        std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").unwrap();
        let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }

    #[test]
    fn special_token_strings_are_escaped() {
        let specials = ["<|endoftext|>".to_owned(), "<|eot|>".to_owned(), "x".to_owned()];
        assert!(matches!(escape_special_tokens("plain x text", &specials), std::borrow::Cow::Borrowed(_)));
        let escaped = escape_special_tokens("a<|endoftext|>b<|eot|><|eot|>", &specials);
        assert_eq!(escaped, "a<\u{2060}|endoftext|>b<\u{2060}|eot|><\u{2060}|eot|>");
        let t = Tokenizer::builtin();
        assert_eq!(t.encode("<|endoftext|>").unwrap(), [199_999]);
        assert!(!t.encode(&escape_special_tokens("<|endoftext|>", &t.special_tokens())).unwrap().contains(&199_999));
    }

    #[test]
    fn pieces_tokenize_into_region_ranges() {
        let tokenizer = Tokenizer::builtin();
        let t = ChatTemplate::builtin();
        let messages = [msg("system", "Be brief."), msg("user", "Hello there, how are you?")];
        let pieces = t.render_regions(&messages, None).unwrap();
        let (ids, regions) = tokenize_pieces(&tokenizer, &pieces).unwrap();
        assert_eq!(tokenizer.decode(&ids).unwrap(), t.render(&messages, None, true).unwrap());
        assert_eq!(regions.first().unwrap().0.start, 0);
        assert_eq!(regions.last().unwrap().0.end, ids.len());
        assert!(regions.windows(2).all(|w| w[0].0.end == w[1].0.start && w[0].1 != w[1].1));
        assert_eq!(regions.iter().map(|r| r.1).collect::<Vec<_>>(), [RegionKind::System, RegionKind::Conversation]);
    }
}
