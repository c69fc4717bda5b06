//! Text ↔ token ids: a model's Hugging Face `tokenizer.json`, or the built-in o200k BPE.
//!
//! [`Tokenizer::from_dir`] loads the `tokenizer.json` of a checkpoint directory with the Hugging
//! Face `tokenizers` crate (regexes through `fancy-regex`, so no C toolchain is needed).
//! [`Tokenizer::builtin`] is OpenAI's o200k_base BPE from `tiktoken-rs`, whose ranks are compiled
//! into the binary: a node serving random weights (the `tiny`, `llama-1b`, `llama-8b` shapes)
//! tokenizes real text without downloading anything.
//!
//! Both kinds behave alike: [`encode`](Tokenizer::encode) adds no BOS/EOS of its own (the chat
//! template writes them) but recognises special tokens written in the text, so the frontend must
//! escape special-token strings in untrusted content before rendering; [`decode`](Tokenizer::decode)
//! keeps special tokens, refuses ids outside the vocabulary, and turns bytes that are not valid
//! UTF-8 (a sequence cut inside a character) into U+FFFD.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dynamo_kernels::sampling::TokenSet;

/// Number of ids of o200k_base: ranks `0..199_998` and the special tokens `<|endoftext|>`
/// (199_999) and `<|endofprompt|>` (200_018). Ids in between are unused.
const O200K_VOCAB: usize = 200_019;

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The tokenizer file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a tokenizer that the `tokenizers` crate can load.
    #[error("{}: not a valid tokenizer.json: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the line and column for JSON errors).
        message: String,
    },
    /// The tokenizer failed on this text.
    #[error("{tokenizer}: cannot encode: {message}")]
    Encode {
        /// The tokenizer's name.
        tokenizer: String,
        /// Why.
        message: String,
    },
    /// An id is not in the vocabulary.
    #[error("{tokenizer}: token id {id} is not in the vocabulary ({vocab} ids)")]
    UnknownToken {
        /// The tokenizer's name.
        tokenizer: String,
        /// The id.
        id: u32,
        /// [`Tokenizer::vocab_size`].
        vocab: usize,
    },
    /// The tokenizer failed on these ids.
    #[error("{tokenizer}: cannot decode: {message}")]
    Decode {
        /// The tokenizer's name.
        tokenizer: String,
        /// Why.
        message: String,
    },
}

impl TokenizerError {
    /// A stable label for metrics: `io`, `parse`, `encode`, `unknown_token` or `decode`.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizerError::Io { .. } => "io",
            TokenizerError::Parse { .. } => "parse",
            TokenizerError::Encode { .. } => "encode",
            TokenizerError::UnknownToken { .. } => "unknown_token",
            TokenizerError::Decode { .. } => "decode",
        }
    }
}

/// A tokenizer; cheap to clone and shareable between threads.
#[derive(Clone)]
pub struct Tokenizer {
    name: Arc<str>,
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    /// A Hugging Face `tokenizer.json`.
    HuggingFace(Arc<tokenizers::Tokenizer>),
    /// A tiktoken BPE (o200k_base), built once per process.
    Tiktoken(&'static tiktoken_rs::CoreBPE),
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer").field("name", &self.name).field("vocab_size", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`; the tokenizer is named after `dir`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        Self::load(&dir.join("tokenizer.json"), dir)
    }

    /// Loads a `tokenizer.json` file (`model.tokenizer`); the tokenizer is named after it.
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        Self::load(path, path)
    }

    fn load(path: &Path, name: &Path) -> Result<Tokenizer, TokenizerError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_owned(), source })?;
        let inner = text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| TokenizerError::Parse { path: path.to_owned(), message: e.to_string() })?;
        Ok(Tokenizer { name: name.display().to_string().into(), kind: Kind::HuggingFace(Arc::new(inner)) })
    }

    /// OpenAI's o200k_base BPE, compiled into the binary; named `o200k_base`. Parsing its ranks
    /// takes a moment on the first call of the process; later calls share the result.
    pub fn builtin() -> Tokenizer {
        Tokenizer { name: "o200k_base".into(), kind: Kind::Tiktoken(tiktoken_rs::o200k_base_singleton()) }
    }

    /// Whether this is the built-in o200k BPE ([`builtin`](Self::builtin)).
    pub fn is_builtin(&self) -> bool {
        matches!(self.kind, Kind::Tiktoken(_))
    }

    /// `o200k_base`, or the directory a `tokenizer.json` was loaded from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// One more than the largest id this tokenizer produces or decodes (added tokens included).
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            Kind::HuggingFace(t) => t.get_vocab_size(true),
            Kind::Tiktoken(_) => O200K_VOCAB,
        }
    }

    /// The ids [`decode`](Self::decode) accepts: every id below [`vocab_size`](Self::vocab_size)
    /// that names a token (o200k leaves 199,998 and 200,000–200,017 unused; a `tokenizer.json`
    /// may skip ids too). The sampler picks only these.
    pub fn decodable(&self) -> TokenSet {
        match &self.kind {
            Kind::HuggingFace(t) => TokenSet::from_fn(self.vocab_size(), |id| t.id_to_token(id).is_some()),
            Kind::Tiktoken(bpe) => TokenSet::from_fn(self.vocab_size(), |id| bpe.decode_bytes(&[id]).is_ok()),
        }
    }

    /// The most bytes of text one token stands for (an upper bound, counted on the tokens'
    /// own strings): a text of `n` bytes has at least `n / max_token_bytes()` tokens, so an
    /// over-long prompt can be refused before it is tokenized.
    pub fn max_token_bytes(&self) -> usize {
        match &self.kind {
            Kind::HuggingFace(t) => t.get_vocab(true).keys().map(String::len).max().unwrap_or(1),
            Kind::Tiktoken(bpe) => (0..self.vocab_size() as u32)
                .filter_map(|id| bpe.decode_bytes(&[id]).ok().map(|b| b.len()))
                .max()
                .unwrap_or(1),
        }
    }

    /// The strings of the special tokens, which [`encode`](Self::encode) turns into their ids
    /// wherever they appear in the text: `<|endoftext|>` and `<|endofprompt|>` for o200k, the
    /// added tokens marked `special` for a `tokenizer.json`.
    pub fn special_tokens(&self) -> Vec<String> {
        match &self.kind {
            Kind::HuggingFace(t) => {
                let mut specials: Vec<(u32, String)> = t
                    .get_added_tokens_decoder()
                    .into_iter()
                    .filter(|(_, token)| token.special)
                    .map(|(id, token)| (id, token.content))
                    .collect();
                specials.sort_unstable();
                specials.into_iter().map(|(_, content)| content).collect()
            }
            Kind::Tiktoken(_) => vec!["<|endoftext|>".to_owned(), "<|endofprompt|>".to_owned()],
        }
    }

    /// The ids of `text`, without BOS/EOS; special tokens written in `text` are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.kind {
            Kind::HuggingFace(t) => t
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode { tokenizer: self.name.to_string(), message: e.to_string() }),
            Kind::Tiktoken(bpe) => Ok(bpe.encode_with_special_tokens(text)),
        }
    }

    /// [`encode`](Self::encode), with the byte offset in `text` where each token's text starts.
    pub fn encode_with_starts(&self, text: &str) -> Result<(Vec<u32>, Vec<usize>), TokenizerError> {
        match &self.kind {
            Kind::HuggingFace(t) => {
                let encoding = t
                    .encode(text, false)
                    .map_err(|e| TokenizerError::Encode { tokenizer: self.name.to_string(), message: e.to_string() })?;
                Ok((encoding.get_ids().to_vec(), encoding.get_offsets().iter().map(|&(start, _)| start).collect()))
            }
            Kind::Tiktoken(bpe) => {
                let ids = bpe.encode_with_special_tokens(text);
                let mut starts = Vec::with_capacity(ids.len());
                let mut at = 0;
                for &id in &ids {
                    starts.push(at);
                    at += bpe.decode_bytes(&[id]).map_or(0, |b| b.len());
                }
                Ok((ids, starts))
            }
        }
    }

    /// The text of `ids`, special tokens included. Bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let unknown =
            |id| TokenizerError::UnknownToken { tokenizer: self.name.to_string(), id, vocab: self.vocab_size() };
        match &self.kind {
            Kind::HuggingFace(t) => {
                // `tokenizers` silently drops unknown ids; refuse them instead.
                if let Some(&id) = ids.iter().find(|&&id| t.id_to_token(id).is_none()) {
                    return Err(unknown(id));
                }
                t.decode(ids, false)
                    .map_err(|e| TokenizerError::Decode { tokenizer: self.name.to_string(), message: e.to_string() })
            }
            Kind::Tiktoken(bpe) => {
                let bytes = bpe.decode_bytes(ids).map_err(|e| unknown(e.token))?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WordLevel tokenizer.json as `tokenizers` writes it: whitespace pre-tokenizer, `[UNK]`
    /// for unknown words, and a special token `<|eot|>` added after the model vocabulary.
    const WORD_LEVEL: &str = r#"{
      "version": "1.0",
      "truncation": null,
      "padding": null,
      "added_tokens": [
        {"id": 5, "content": "<|eot|>", "single_word": false, "lstrip": false, "rstrip": false,
         "normalized": false, "special": true}
      ],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": null,
      "decoder": null,
      "model": {
        "type": "WordLevel",
        "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "fn": 3, "(": 4},
        "unk_token": "[UNK]"
      }
    }"#;

    fn round_trip(t: &Tokenizer, text: &str) -> Vec<u32> {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text, "{}", t.name());
        assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()));
        ids
    }

    #[test]
    fn builtin_round_trips() {
        let t = Tokenizer::builtin();
        assert_eq!(t.name(), "o200k_base");
        assert_eq!(t.vocab_size(), O200K_VOCAB);
        let ids = round_trip(&t, "hello world");
        assert_eq!(ids, [24912, 2375], "o200k_base ids of \"hello world\"");
        round_trip(&t, "The quick brown fox jumps over the lazy dog.\n\n\tTabs and  double  spaces.");
        round_trip(&t, "Grüße, naïve café — 日本語のテキスト, русский, emoji 🦀👩‍💻, math ∀x∈ℝ: x²≥0");
        let code =
            "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{v:?}\");\n}\n";
        assert!(round_trip(&t, code).len() < code.len() / 2, "BPE merges code");
        round_trip(&t, "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # comment\n");
        round_trip(&t, "");
        assert_eq!(t.encode("<|endoftext|>").unwrap(), [199_999]);
        assert_eq!(t.decode(&[200_018]).unwrap(), "<|endofprompt|>");
    }

    /// The sampler's set is exactly what decode accepts: o200k's unused ids are out of it.
    #[test]
    fn decodable_ids_are_exactly_the_ones_decode_accepts() {
        let t = Tokenizer::builtin();
        let set = t.decodable();
        assert_eq!(set.end(), O200K_VOCAB);
        for id in [199_998u32, 200_000, 200_002, 200_017] {
            assert!(!set.contains(id) && t.decode(&[id]).is_err(), "{id}");
        }
        for id in [0u32, 24_912, 199_997, 199_999, 200_018] {
            assert!(set.contains(id) && t.decode(&[id]).is_ok(), "{id}");
        }
        assert_eq!(set.count(), 199_998 + 2);
        let hf = Tokenizer { name: "w".into(), kind: Kind::HuggingFace(Arc::new(WORD_LEVEL.parse().unwrap())) };
        let set = hf.decodable();
        assert!((0..hf.vocab_size() as u32).all(|id| set.contains(id) == hf.decode(&[id]).is_ok()));
    }

    #[test]
    fn builtin_decode_is_lossy_inside_a_character_and_refuses_unknown_ids() {
        let t = Tokenizer::builtin();
        // Rare 4-byte characters (Egyptian hieroglyphs) are split into byte tokens.
        let text = "𓀀𓁐𓂀";
        let ids = round_trip(&t, text);
        let pieces: Vec<String> = ids.iter().map(|&id| t.decode(&[id]).unwrap()).collect();
        assert!(pieces.iter().any(|p| p.contains('\u{FFFD}')), "{pieces:?}");
        for id in [O200K_VOCAB as u32, 200_010, u32::MAX] {
            let err = t.decode(&[1, id]).unwrap_err();
            assert_eq!(err.kind(), "unknown_token");
            assert!(err.to_string().contains(&format!("token id {id} is not in the vocabulary")), "{err}");
        }
    }

    #[test]
    fn builtin_ids_fit_the_tiny_model() {
        let tiny = dynamo_config::ModelShape::named("tiny").unwrap();
        assert!(Tokenizer::builtin().vocab_size() <= tiny.vocab);
    }

    #[test]
    fn tokenizer_json_loads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), WORD_LEVEL).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.name(), dir.path().display().to_string());
        assert_eq!(t.vocab_size(), 6);
        assert_eq!(t.encode("hello world").unwrap(), [1, 2]);
        assert_eq!(t.encode("hello <|eot|> world").unwrap(), [1, 5, 2]);
        assert_eq!(t.special_tokens(), ["<|eot|>"]);
        assert_eq!(Tokenizer::builtin().special_tokens(), ["<|endoftext|>", "<|endofprompt|>"]);
        assert_eq!(t.encode("hello there").unwrap(), [1, 0]);
        assert_eq!(t.decode(&[1, 2]).unwrap(), "hello world");
        assert_eq!(t.decode(&[1, 5, 2]).unwrap(), "hello <|eot|> world");
        let by_file = Tokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
        assert_eq!(by_file.encode("world hello").unwrap(), [2, 1]);
        let err = t.decode(&[1, 6]).unwrap_err();
        assert_eq!(err.kind(), "unknown_token");
        assert!(err.to_string().contains("token id 6 is not in the vocabulary (6 ids)"), "{err}");
    }

    #[test]
    fn byte_level_bpe_tokenizer_json_round_trips() {
        use tokenizers::models::bpe::{BPE, Vocab};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;

        // Every byte as a token, plus two merges: any text round-trips.
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        let mut vocab: Vocab = alphabet.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect();
        vocab.insert("he".into(), 256);
        vocab.insert("hel".into(), 257);
        let merges = vec![("h".into(), "e".into()), ("he".into(), "l".into())];
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().unwrap();
        let mut built = tokenizers::Tokenizer::new(bpe);
        let byte_level = ByteLevel::default().add_prefix_space(false);
        built.with_pre_tokenizer(Some(byte_level)).with_decoder(Some(byte_level));
        let dir = tempfile::tempdir().unwrap();
        built.save(dir.path().join("tokenizer.json"), true).unwrap();

        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.vocab_size(), 258);
        let ids = round_trip(&t, "hello");
        assert_eq!(ids[0], 257, "merged `hel`");
        assert_eq!(ids.len(), 3);
        round_trip(&t, "Grüße 日本 🦀\n\tfn x() {}");
    }

    #[test]
    fn malformed_tokenizer_json_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert_eq!(err.kind(), "io");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");

        std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": {\"type\": \"WordLevel\"").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert_eq!(err.kind(), "parse");
        assert!(err.to_string().contains("not a valid tokenizer.json"), "{err}");

        std::fs::write(dir.path().join("tokenizer.json"), WORD_LEVEL.replace("WordLevel", "NoSuchModel")).unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert_eq!(err.kind(), "parse");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }
}
