//! Row-wise CPU ops: norms, activations, RoPE, the causal conv, GDN gates.

use super::simd;

/// RMSNorm of each group of `w.len()` values; `one_plus` scales by `(1 + w)`, else by `w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, one_plus: bool) -> Vec<f32> {
    let g = w.len();
    let mut out = vec![0f32; x.len()];
    for (xs, os) in x.chunks_exact(g).zip(out.chunks_exact_mut(g)) {
        let ms = simd::dot(xs, xs) / g as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), wi) in os.iter_mut().zip(xs).zip(w) {
            let scale = if one_plus { 1.0 + wi } else { *wi };
            *o = v * inv * scale;
        }
    }
    out
}

/// Gated RMSNorm: `norm(x) · w · silu(gate)` per group of `w.len()`.
pub fn rms_norm_gated(x: &[f32], gate: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = rms_norm(x, w, eps, false);
    for (o, z) in out.iter_mut().zip(gate) {
        *o *= silu(*z);
    }
    out
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `softplus(x) = log(1 + e^x)`, with torch's threshold of 20 for large inputs.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Rotate-half RoPE on the first `rotary_dim` dims of each `head_dim` group of one row.
pub fn rope_row(row: &mut [f32], pos: usize, head_dim: usize, rotary_dim: usize, inv_freq: &[f32]) {
    let half = rotary_dim / 2;
    // Angles are computed in f32 as transformers does (inv_freq · position in float32).
    let mut cos = vec![0f32; half];
    let mut sin = vec![0f32; half];
    for i in 0..half {
        let a = inv_freq[i] * pos as f32;
        cos[i] = a.cos();
        sin[i] = a.sin();
    }
    for head in row.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let x1 = head[i];
            let x2 = head[i + half];
            head[i] = x1 * cos[i] - x2 * sin[i];
            head[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// Depthwise causal conv + SiLU over `n` rows of `channels`, kernel `k` taps per channel
/// (`weight[c·k + j]`, tap `k-1` on the current input); `state` holds the `k-1` previous rows.
pub fn causal_conv1d_silu(
    x: &[f32],
    n: usize,
    channels: usize,
    state: &mut [f32],
    weight: &[f32],
    k: usize,
) -> Vec<f32> {
    let hist = k - 1;
    // Window of previous inputs followed by the new ones.
    let mut window = Vec::with_capacity((hist + n) * channels);
    window.extend_from_slice(state);
    window.extend_from_slice(x);
    let mut out = vec![0f32; n * channels];
    for t in 0..n {
        let o = &mut out[t * channels..(t + 1) * channels];
        for (c, oc) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                acc += weight[c * k + j] * window[(t + j) * channels + c];
            }
            *oc = silu(acc);
        }
    }
    state.copy_from_slice(&window[n * channels..]);
    out
}
