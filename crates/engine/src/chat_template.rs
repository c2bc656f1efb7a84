//! Chat templates: the checkpoint's Jinja template rendered with minijinja, byte-identical to transformers.
