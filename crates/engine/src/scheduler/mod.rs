//! The scheduler: continuous batching of sequences over a [`crate::model::CausalLm`].
