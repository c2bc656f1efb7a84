//! SwiGLU MLP (the dense model's MLP and Flash-Next's shared expert).

use super::tensor;
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::tensor::HostTensor;
use anyhow::Result;

pub struct Mlp<B: Backend> {
    /// Fused `gate_proj ‖ up_proj`.
    gate_up: B::Matrix,
    down: B::Matrix,
}

impl<B: Backend> Mlp<B> {
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        p: &str,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self> {
        let (h, i) = (hidden, intermediate);
        let gate = tensor(ck, &format!("{p}gate_proj.weight"), &[i, h])?;
        let up = tensor(ck, &format!("{p}up_proj.weight"), &[i, h])?;
        Ok(Mlp {
            gate_up: b.matrix(&HostTensor::concat_rows(
                &format!("{p}gate_up_proj"),
                &[gate, up],
            )?)?,
            down: b.matrix(&tensor(ck, &format!("{p}down_proj.weight"), &[h, i])?)?,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Act) -> B::Act {
        let gu = b.linear(x, &self.gate_up);
        b.linear(&b.silu_mul_halves(&gu), &self.down)
    }
}
