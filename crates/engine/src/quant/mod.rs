//! Quantised weight formats: how published checkpoints store weights in fewer bits, and how
//! to turn them back into f32.
//!
//! - [`ggml`]: the GGUF block types (Q8_0, Q2_0, IQ2_XS, IQ3_XXS, IQ3_S, F16, BF16, F32);
//! - [`gguf`]: the GGUF v3 file reader (metadata, tensor infos, alignment, memory map);
//! - [`nvfp4`]: ModelOpt NVFP4 (E2M1 codes, FP8 scales per 16, an f32 per-tensor multiplier);
//! - [`fp8`]: FP8 E4M3 with 128×128 block scales or row scales;
//! - [`iq_tables`]: the lattice and sign tables the IQ types decode through.
//!
//! The CPU kernels that compute with these formats are in `backend/cpu/experts`.

pub mod fp8;
pub mod ggml;
pub mod gguf;
pub mod iq_tables;
pub mod nvfp4;

pub use ggml::GgmlType;
