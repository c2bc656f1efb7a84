//! Tokenizer: the checkpoint's `tokenizer.json` through the `tokenizers` crate (pure Rust, no C),
//! plus an incremental detokenizer for streaming and the tokenizer assets of the demo model.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

/// Gzip-compressed `tokenizer.json` of the Qwen3.5/3.6 vocabulary (248,044 byte-level BPE ranks
/// and 33 added tokens), built by `tools/make_template_fixtures.py`. See `assets/README.md`.
const DEMO_TOKENIZER_JSON_GZ: &[u8] = include_bytes!("../assets/qwen3_6_tokenizer.json.gz");

/// The Qwen3.6 chat template (XML tool calls, `<think>` handling), used by the demo model.
pub const DEMO_CHAT_TEMPLATE: &str = include_str!("../assets/qwen3_6_chat_template.jinja");

/// Vocabulary size of the demo tokenizer, added tokens included.
pub const DEMO_VOCAB_SIZE: usize = 248_077;
/// Id of `<|endoftext|>` in the demo tokenizer.
pub const DEMO_ENDOFTEXT_ID: u32 = 248_044;
/// Id of `<|im_start|>` in the demo tokenizer.
pub const DEMO_IM_START_ID: u32 = 248_045;
/// Id of `<|im_end|>` in the demo tokenizer (the chat models' end-of-turn / eos token).
pub const DEMO_IM_END_ID: u32 = 248_046;

/// The demo tokenizer's `tokenizer.json` bytes, decompressed from the embedded asset.
pub fn demo_tokenizer_json() -> Vec<u8> {
    let mut json = Vec::with_capacity(DEMO_TOKENIZER_JSON_GZ.len() * 4);
    flate2::read::GzDecoder::new(DEMO_TOKENIZER_JSON_GZ)
        .read_to_end(&mut json)
        .expect("the embedded demo tokenizer asset is a valid gzip stream (checked by tests)");
    json
}

/// A Hugging Face tokenizer (`tokenizer.json`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special_ids: HashSet<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special_tokens", &self.special_ids.len())
            .finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let json = std::fs::read(path).with_context(|| {
            format!(
                "cannot read tokenizer file {}: expected a Hugging Face tokenizer.json there",
                path.display()
            )
        })?;
        Self::from_json_bytes(&json)
            .with_context(|| format!("cannot load tokenizer file {}", path.display()))
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_json_bytes(json: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| {
            anyhow!(
                "not a valid Hugging Face tokenizer.json ({e}); expected the JSON that \
                 `tokenizers` writes (keys \"model\", \"added_tokens\", ...)"
            )
        })?;
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self {
            inner,
            special_ids,
            vocab_size,
        })
    }

    /// Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) become their
    /// ids, as transformers does for chat-template output; `add_special_tokens` applies the
    /// tokenizer's post-processor (BOS/EOS where the tokenizer defines them; Qwen adds none).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| anyhow!("cannot tokenize text of {} bytes: {e}", text.len()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`; with `skip_special_tokens`, special added tokens are left out.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            bail!(
                "token id {bad} is out of range: this tokenizer has {} tokens (ids 0..{})",
                self.vocab_size,
                self.vocab_size
            );
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("cannot decode {} token ids: {e}", ids.len()))
    }

    /// Id of a token string (vocabulary entry or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id, in the tokenizer's own alphabet (byte-level BPE shows a space as
    /// `Ġ`); use [`Tokenizer::decode`] for text.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether `id` is an added token marked special (like `<|im_end|>`; Qwen's `<think>` and
    /// `<tool_call>` are added tokens but not special).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// An incremental detokenizer for streaming generated ids.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }
}

/// Incremental detokenizer for streaming: feeds ids one at a time and returns only text that is
/// final (never splits a multi-byte UTF-8 char; handles byte-level BPE pieces).
///
/// It decodes a short window of recent ids twice, without and with the new ones, and emits the
/// difference once it no longer ends in an incomplete character (decoded as U+FFFD). Decoding a
/// window rather than single tokens keeps decoders that look at neighbours (spaces, byte pieces)
/// right, so the concatenated output equals `decode` of all ids.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the window decoded for context; its text up to `read_offset` was emitted.
    prefix_offset: usize,
    /// End of the ids whose text was emitted.
    read_offset: usize,
}

impl StreamDecoder<'_> {
    /// Adds one id; returns the text that became final (often empty while a character is split).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let emitted = self.decode_window(self.read_offset)?;
        let full = self.decode_window(self.ids.len())?;
        if full.len() > emitted.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new_text) = full.strip_prefix(emitted.as_str()) {
                let new_text = new_text.to_owned();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                self.compact();
                return Ok(new_text);
            }
            // The decoder rewrote earlier text (not the case for byte-level BPE); hold
            // everything until the next clean boundary or `finish`.
        }
        Ok(String::new())
    }

    /// Returns the rest of the text (incomplete characters as U+FFFD) and resets the decoder.
    pub fn finish(&mut self) -> Result<String> {
        let emitted = self.decode_window(self.read_offset)?;
        let full = self.decode_window(self.ids.len())?;
        let rest = match full.strip_prefix(emitted.as_str()) {
            Some(rest) => rest.to_owned(),
            None => full,
        };
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(rest)
    }

    fn decode_window(&self, end: usize) -> Result<String> {
        self.tokenizer
            .decode(&self.ids[self.prefix_offset..end], self.skip_special_tokens)
    }

    /// Drops ids before the context window so a long stream keeps O(1) memory per step.
    fn compact(&mut self) {
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> Tokenizer {
        Tokenizer::from_json_bytes(&demo_tokenizer_json()).expect("demo tokenizer loads")
    }

    #[test]
    fn demo_tokenizer_constants_match_the_asset() {
        let tok = demo();
        assert_eq!(tok.vocab_size(), DEMO_VOCAB_SIZE);
        assert_eq!(tok.token_to_id("<|endoftext|>"), Some(DEMO_ENDOFTEXT_ID));
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(DEMO_IM_START_ID));
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(DEMO_IM_END_ID));
        assert!(tok.is_special(DEMO_IM_END_ID));
        let think = tok
            .token_to_id("<think>")
            .expect("<think> is an added token");
        assert!(
            !tok.is_special(think),
            "<think> is added but not special, as in Qwen"
        );
        assert!(!tok.is_special(0));
    }

    #[test]
    fn decode_rejects_ids_out_of_range() {
        let tok = demo();
        let err = tok.decode(&[1, DEMO_VOCAB_SIZE as u32], false).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
    }

    #[test]
    fn stream_decoder_holds_split_characters() {
        let tok = demo();
        let text = "a🧑🏿‍💻b";
        let ids = tok.encode(text, false).unwrap();
        let mut stream = tok.stream_decoder(false);
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.push(stream.push(id).unwrap());
        }
        pieces.push(stream.finish().unwrap());
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!(pieces.concat(), text);
    }
}
