//! Hyper-connections: the residual is `hc_count` streams of `hidden` values. Before each block
//! a mixer reads one `hidden` input from the normed streams; after it, the block's output is
//! written back into every stream with its own weight. The model's last mixer (no write-back)
//! replaces the final norm.

use super::{tensor, WideNorm};
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::tensor::HostTensor;
use anyhow::Result;

pub struct HyperConnection<B: Backend> {
    norm: WideNorm<B>,
    /// `input_mix_weight_down` `[rank, s·h]` ‖ `block_inject_weight` `[s, s·h]` (absent in the
    /// final mixer).
    down: B::Matrix,
    up: B::Matrix,
    rank: usize,
    streams: usize,
    inject: bool,
}

impl<B: Backend> HyperConnection<B> {
    /// Loads `p` (`…attn_hyper_connection.`, `…mlp_hyper_connection.` or
    /// `model.hyper_connection_mixer.`); `inject` is false for the final mixer.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        b: &B,
        ck: &Checkpoint,
        p: &str,
        hidden: usize,
        streams: usize,
        rank: usize,
        eps: f32,
        inject: bool,
    ) -> Result<Self> {
        let wide = streams * hidden;
        let mut parts = vec![tensor(
            ck,
            &format!("{p}input_mix_weight_down.weight"),
            &[rank, wide],
        )?];
        if inject {
            parts.push(tensor(
                ck,
                &format!("{p}block_inject_weight.weight"),
                &[streams, wide],
            )?);
        }
        Ok(HyperConnection {
            norm: WideNorm::load(b, ck, &format!("{p}hc_norm.weight"), wide, hidden, eps)?,
            down: b.matrix(&HostTensor::concat_rows(&format!("{p}down"), &parts)?)?,
            up: b.matrix(&tensor(
                ck,
                &format!("{p}input_mix_weight_up.weight"),
                &[wide, rank],
            )?)?,
            rank,
            streams,
            inject,
        })
    }

    /// `streams` `[n, s·h]` → the block input `[n, h]` and, unless this is the final mixer, the
    /// mixer's projection `[n, rank + s]` whose last `s` columns are the write-back logits for
    /// [`HyperConnection::write_back`] (read there in place).
    pub fn read(&self, b: &B, streams: &B::Act) -> (B::Act, Option<B::Act>) {
        let s = self.streams;
        let normed = self.norm.forward(b, streams);
        let proj = b.linear(&normed, &self.down);
        let low = b.silu_scaled_cols(&proj, 0..self.rank, 1.0 / s as f32);
        let mix = b.linear(&low, &self.up);
        let input = b.hc_mix(&normed, &mix, s);
        (input, self.inject.then_some(proj))
    }

    /// `streams + out · 2·sigmoid(inject / s)` per stream, `inject` the last `s` columns of the
    /// projection [`HyperConnection::read`] returned.
    pub fn write_back(&self, b: &B, streams: &B::Act, out: &B::Act, proj: &B::Act) -> B::Act {
        b.hc_inject_cols(streams, out, proj, self.rank, self.streams)
    }
}
