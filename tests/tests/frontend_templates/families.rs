//! The template families of the matrix: each one's special tokens and answer format, and its
//! byte-level tokenizer built in the `tokenizers` JSON format.

use super::*;

/// One family template with what serving it takes.
#[derive(Debug)]
pub(super) struct Family {
    /// The `ChatTemplate::named` name.
    pub(super) template: &'static str,
    /// The special-token strings of its tokenizer (FAMILIES.md, "Special tokens").
    pub(super) specials: &'static [&'static str],
    /// `frontend.reasoning_parser`.
    pub(super) reasoning_parser: Option<&'static str>,
    /// `frontend.tool_call_parser`.
    pub(super) tool_call_parser: &'static str,
    /// How its model writes answers.
    pub(super) format: Format,
    /// What its template does with history reasoning.
    pub(super) history: History,
    /// The `chat_template_kwargs` entry that keeps history reasoning, where there is one.
    pub(super) keep_reasoning: Option<(&'static str, bool)>,
    /// Whether its model may make several calls in one turn.
    pub(super) parallel_calls: bool,
}

pub(super) const QWEN3_SPECIALS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
];

/// Every family template, as FAMILIES.md describes it. `llama3` is the built-in template; its
/// tokenizer has Llama 3's header tokens and the Hermes tags its answers use.
pub(super) const FAMILIES: &[Family] = &[
    Family {
        template: "qwen3",
        specials: QWEN3_SPECIALS,
        reasoning_parser: Some("qwen3"),
        tool_call_parser: "hermes",
        format: Format::Hermes { eos: "<|im_end|>" },
        history: History::DroppedAtNewQuery,
        keep_reasoning: Some(("preserve_thinking", true)),
        parallel_calls: true,
    },
    Family {
        template: "qwen3_preserve",
        specials: QWEN3_SPECIALS,
        reasoning_parser: Some("qwen3"),
        tool_call_parser: "hermes",
        format: Format::Hermes { eos: "<|im_end|>" },
        history: History::Kept,
        keep_reasoning: None,
        parallel_calls: true,
    },
    Family {
        template: "deepseek_r1",
        specials: &[
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<think>",
            "</think>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        reasoning_parser: Some("deepseek_r1"),
        tool_call_parser: "deepseek_v3",
        format: Format::DeepseekR1,
        history: History::DroppedAlways,
        keep_reasoning: Some(("preserve_thinking", true)),
        parallel_calls: true,
    },
    Family {
        template: "gpt_oss",
        specials: &[
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|call|>",
            "<|return|>",
            "<|startoftext|>",
            "<|endoftext|>",
        ],
        reasoning_parser: Some("gpt_oss"),
        tool_call_parser: "harmony",
        format: Format::GptOss,
        history: History::DroppedAfterAnswer,
        keep_reasoning: None,
        parallel_calls: false,
    },
    Family {
        template: "nemotron",
        specials: &[
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<s>",
            "</s>",
        ],
        reasoning_parser: Some("nemotron3"),
        tool_call_parser: "qwen3_coder",
        format: Format::Nemotron,
        history: History::DroppedAtNewQuery,
        keep_reasoning: Some(("truncate_history_thinking", false)),
        parallel_calls: true,
    },
    Family {
        template: "glm47",
        specials: &[
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<|endoftext|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<tool_response>",
            "</tool_response>",
        ],
        reasoning_parser: Some("glm45"),
        tool_call_parser: "glm47",
        format: Format::Glm47,
        history: History::DroppedAtNewQuery,
        keep_reasoning: Some(("clear_thinking", false)),
        parallel_calls: true,
    },
    Family {
        template: "kimi_k2",
        specials: &[
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_middle|>",
            "<|im_end|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "[BOS]",
            "[EOS]",
        ],
        reasoning_parser: None,
        tool_call_parser: "kimi_k2",
        format: Format::KimiK2,
        history: History::Kept,
        keep_reasoning: None,
        parallel_calls: true,
    },
    Family {
        template: "llama3",
        specials: &[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
        ],
        reasoning_parser: Some("qwen3"),
        tool_call_parser: "hermes",
        format: Format::Hermes { eos: "<|eot_id|>" },
        history: History::Kept,
        keep_reasoning: None,
        parallel_calls: true,
    },
];

/// The family named `name` in [`FAMILIES`].
pub(super) fn family(name: &str) -> &'static Family {
    FAMILIES.iter().find(|f| f.template == name).unwrap_or_else(|| panic!("no family `{name}`"))
}

// ---------------------------------------------------------------------------------------------
// The family tokenizer.
// ---------------------------------------------------------------------------------------------

/// GPT-2's byte-level alphabet: the character that stands for each byte (printable Latin-1 as
/// itself, the other bytes as U+0100 onwards).
pub(super) fn byte_level_alphabet() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut shifted = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap()
            }
        })
        .collect()
}

/// The `tokenizer.json` of `family`: a byte-level BPE whose vocabulary is the 256 byte
/// characters (ids 0..255, id = byte), no merges, ByteLevel pre-tokenizer and decoder, and the
/// family's special tokens added as special tokens (ids 256..).
pub(super) fn tokenizer_json(family: &Family) -> Value {
    let vocab: serde_json::Map<String, Value> =
        byte_level_alphabet().into_iter().enumerate().map(|(id, c)| (c.to_string(), json!(id))).collect();
    let added: Vec<Value> = family
        .specials
        .iter()
        .enumerate()
        .map(|(i, content)| {
            json!({"id": 256 + i, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    })
}

/// Writes `family`'s tokenizer to a temporary `tokenizer.json`, loads it as the node does, and
/// checks that every special string encodes to its one id and that text round-trips byte by byte.
pub(super) fn family_tokenizer(family: &Family) -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, tokenizer_json(family).to_string()).unwrap();
    let tokenizer = Tokenizer::from_file(&path).unwrap();
    for (i, special) in family.specials.iter().enumerate() {
        assert_eq!(
            tokenizer.encode(special).unwrap(),
            [256 + i as u32],
            "{}: `{special}` is one token",
            family.template
        );
    }
    let text = "Héllo, wörld 🦀\n\t{\"a\": 1}";
    let ids = tokenizer.encode(text).unwrap();
    assert_eq!(ids.len(), text.len(), "one id per byte");
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    tokenizer
}

// ---------------------------------------------------------------------------------------------
// The scripted model.
// ---------------------------------------------------------------------------------------------
