//! Row-wise CPU ops of Flash-Next's hyper-connections and PLE (reference for every backend).

use super::ops::{sigmoid, silu};
use super::simd;

/// Every row of `x` times `scale` (one value per column).
pub fn scale_cols(x: &[f32], scale: &[f32]) -> Vec<f32> {
    let cols = scale.len();
    let mut out = x.to_vec();
    for row in out.chunks_exact_mut(cols) {
        row.iter_mut().zip(scale).for_each(|(v, s)| *v *= s);
    }
    out
}

/// `silu(x · scale)`.
pub fn silu_scaled(x: &[f32], scale: f32) -> Vec<f32> {
    x.iter().map(|v| silu(v * scale)).collect()
}

/// Mean over `streams` of `sigmoid(mix) · normed`: `[n, s·h]` twice → `[n, h]`.
pub fn hc_mix(normed: &[f32], mix_logits: &[f32], n: usize, h: usize, streams: usize) -> Vec<f32> {
    assert_eq!(normed.len(), n * streams * h);
    assert_eq!(mix_logits.len(), normed.len());
    let mut out = vec![0f32; n * h];
    for r in 0..n {
        let o = &mut out[r * h..(r + 1) * h];
        for s in 0..streams {
            let base = (r * streams + s) * h;
            for (j, oj) in o.iter_mut().enumerate() {
                *oj += sigmoid(mix_logits[base + j]) * normed[base + j];
            }
        }
        o.iter_mut().for_each(|v| *v /= streams as f32);
    }
    out
}

/// `residual + out · 2·sigmoid(logit_s / streams)` on each stream `s`.
pub fn hc_inject(
    residual: &[f32],
    out: &[f32],
    inject_logits: &[f32],
    n: usize,
    h: usize,
    streams: usize,
) -> Vec<f32> {
    assert_eq!(residual.len(), n * streams * h);
    assert_eq!(out.len(), n * h);
    assert_eq!(inject_logits.len(), n * streams);
    let mut res = residual.to_vec();
    for r in 0..n {
        for s in 0..streams {
            let w = 2.0 * sigmoid(inject_logits[r * streams + s] / streams as f32);
            let dst = &mut res[(r * streams + s) * h..(r * streams + s + 1) * h];
            dst.iter_mut()
                .zip(&out[r * h..(r + 1) * h])
                .for_each(|(d, o)| *d += o * w);
        }
    }
    res
}

/// PLE gate per stream: `g = <key_s, query_s> / sqrt(h)`, `g ← sign(g)·sqrt(max(|g|, 1e-6))`,
/// output stream `s` = `sigmoid(g) · value`.
pub fn ple_gate(
    key: &[f32],
    query: &[f32],
    value: &[f32],
    n: usize,
    h: usize,
    streams: usize,
) -> Vec<f32> {
    assert_eq!(key.len(), n * streams * h);
    assert_eq!(query.len(), key.len());
    assert_eq!(value.len(), n * h);
    let mut out = vec![0f32; n * streams * h];
    let inv = 1.0 / (h as f32).sqrt();
    for r in 0..n {
        let v = &value[r * h..(r + 1) * h];
        for s in 0..streams {
            let at = (r * streams + s) * h;
            let g = simd::dot(&key[at..at + h], &query[at..at + h]) * inv;
            let sign = if g > 0.0 {
                1.0
            } else if g < 0.0 {
                -1.0
            } else {
                0.0
            };
            let gate = sigmoid(g.abs().max(1e-6).sqrt() * sign);
            out[at..at + h]
                .iter_mut()
                .zip(v)
                .for_each(|(o, x)| *o = gate * x);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_averages_gated_streams() {
        // Two streams of width 2; logits 0 give sigmoid 0.5.
        let normed = [1.0, 2.0, 3.0, 4.0];
        let out = hc_mix(&normed, &[0.0; 4], 1, 2, 2);
        assert_eq!(out, vec![(0.5 + 1.5) / 2.0, (1.0 + 2.0) / 2.0]);
    }

    #[test]
    fn inject_weights_each_stream() {
        let res = hc_inject(&[0.0; 4], &[1.0, 2.0], &[0.0, 1e9], 1, 2, 2);
        assert_eq!(res, vec![1.0, 2.0, 2.0, 4.0]);
    }

    #[test]
    fn ple_gate_is_signed_sqrt_of_scaled_dot() {
        let (k, q, v) = ([2.0f32, 0.0], [2.0f32, 0.0], [1.0f32, -1.0]);
        let out = ple_gate(&k, &q, &v, 1, 2, 1);
        let g = sigmoid((4.0f32 / 2f32.sqrt()).sqrt());
        assert!(
            (out[0] - g).abs() < 1e-7 && (out[1] + g).abs() < 1e-7,
            "{out:?}"
        );
        let zero = ple_gate(&[0.0, 0.0], &[1.0, 1.0], &[1.0, 1.0], 1, 2, 1);
        assert_eq!(zero, vec![0.5, 0.5]);
    }
}
