//! Capy Flash engine: checkpoints, model definitions, backends, tokenizer and chat template,
//! sampling, scheduling.
//!
//! Where things are:
//! - `checkpoint/` reads Hugging Face model folders (safetensors, configs);
//! - `model/` holds one file per architecture, written against the ops in `backend/`;
//! - `backend/cpu` is the reference backend (and computes CPU experts);
//! - `hybrid/` places routed experts between VRAM and host RAM (expert cache, split, cost model);
//! - `tokenizer.rs`, `chat_template.rs` turn conversations into tokens and back;
//! - `sampling.rs` picks the next token; `scheduler/` batches sequences;
//! - `cache/` is the prefix cache for agent sessions (RAM and disk tiers);
//! - `demo.rs` builds the built-in demo model.

pub mod backend;
pub mod cache;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod demo;
pub mod hybrid;
pub mod model;
pub mod parallel;
pub mod quant;
pub mod sampling;
pub mod scheduler;
pub mod synthetic;
pub mod tensor;
pub mod tokenizer;
