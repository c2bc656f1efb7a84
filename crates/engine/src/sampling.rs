//! Sampling: turns a position's logits into the next token.
