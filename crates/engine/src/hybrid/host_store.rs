//! The host expert store: every layer's routed experts in the CPU kernels' record layout.
//!
//! Float checkpoints (the tiny fixtures, BF16 builds) are packed here; quantised ones
//! (NVFP4, GGUF) are repacked by their readers into the same [`ExpertSet`] layout.

use crate::backend::cpu::experts::{ExpertLayout, ExpertMatrix, ExpertSet, ExpertShape, RowFormat};
use crate::backend::ExpertMatrices;
use crate::quant::GgmlType;
use crate::tensor::{DType, HostTensor};
use anyhow::{bail, Result};

/// Packs one layer's float experts (per expert `gate ‖ up` `[2I, H]`, `down` `[H, I]`, as
/// [`crate::model::layers::moe::read_expert_tensors`] returns them) into an [`ExpertSet`].
/// BF16 and F16 stay in their own format (no precision change); F32 stays F32.
pub fn pack_float_experts(tensors: &[ExpertMatrices<HostTensor>]) -> Result<ExpertSet> {
    let Some(first) = tensors.first() else {
        bail!("no experts to pack");
    };
    let (two_i, hidden) = (first.gate_up.shape[0], first.gate_up.shape[1]);
    let intermediate = two_i / 2;
    let dtype = first.gate_up.dtype;
    let format = match dtype {
        DType::F32 => RowFormat::Ggml(GgmlType::F32),
        DType::BF16 => RowFormat::Ggml(GgmlType::BF16),
        DType::F16 => RowFormat::Ggml(GgmlType::F16),
        other => bail!(
            "{}: expert weights of dtype {other} are not a float format; quantised experts are repacked by their reader",
            first.gate_up.name
        ),
    };
    let shape = ExpertShape {
        hidden,
        intermediate,
    };
    let mut set = ExpertSet::zeroed(ExpertLayout::new(format, format, shape)?, tensors.len());
    let esize = dtype.size();
    for (e, t) in tensors.iter().enumerate() {
        for (m, want) in [
            (&t.gate_up, [2 * intermediate, hidden]),
            (&t.down, [hidden, intermediate]),
        ] {
            if m.shape != want || m.dtype != dtype {
                bail!(
                    "expert {e}: {} is {} {:?}, expected {dtype} {want:?} like expert 0",
                    m.name,
                    m.dtype,
                    m.shape
                );
            }
        }
        let gu = t.gate_up.data.as_slice();
        let row = hidden * esize;
        for i in 0..intermediate {
            set.set_row(e, ExpertMatrix::Gate, i, &gu[i * row..(i + 1) * row])?;
            let u = (intermediate + i) * row;
            set.set_row(e, ExpertMatrix::Up, i, &gu[u..u + row])?;
        }
        let d = t.down.data.as_slice();
        let drow = intermediate * esize;
        for r in 0..hidden {
            set.set_row(e, ExpertMatrix::Down, r, &d[r * drow..(r + 1) * drow])?;
        }
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_gate_up_and_down_rows_exactly() {
        let (h, i) = (32, 8);
        let gu: Vec<f32> = (0..2 * i * h).map(|v| v as f32 * 0.5).collect();
        let down: Vec<f32> = (0..h * i).map(|v| -(v as f32)).collect();
        let t = ExpertMatrices {
            gate_up: HostTensor::from_f32("gu", vec![2 * i, h], &gu),
            down: HostTensor::from_f32("d", vec![h, i], &down),
        };
        let set = pack_float_experts(&[t]).unwrap();
        assert_eq!(set.matrix_f32(0, ExpertMatrix::Gate), gu[..i * h]);
        assert_eq!(set.matrix_f32(0, ExpertMatrix::Up), gu[i * h..]);
        assert_eq!(set.matrix_f32(0, ExpertMatrix::Down), down);
    }

    #[test]
    fn refuses_mismatched_experts() {
        let a = ExpertMatrices {
            gate_up: HostTensor::from_f32("a.gu", vec![4, 32], &[0.0; 128]),
            down: HostTensor::from_f32("a.d", vec![32, 2], &[0.0; 64]),
        };
        let b = ExpertMatrices {
            gate_up: HostTensor::from_f32("b.gu", vec![4, 32], &[0.0; 128]),
            down: HostTensor::from_f32("b.d", vec![32, 4], &[0.0; 128]),
        };
        let err = pack_float_experts(&[a, b]).err().unwrap().to_string();
        assert!(err.contains("b.d") && err.contains("[32, 2]"), "{err}");
    }
}
