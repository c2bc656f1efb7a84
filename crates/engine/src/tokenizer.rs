//! Tokenizer: the checkpoint's `tokenizer.json` through the `tokenizers` crate.
