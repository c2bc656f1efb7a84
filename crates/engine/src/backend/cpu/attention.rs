//! Causal softmax attention of one sequence over its KV cache (CPU reference), parallel over
//! heads.

use super::simd;
use crate::backend::AttentionShape;
use rayon::prelude::*;

/// `q [n, heads·d]`, `k`/`v` `[past+n, kv_heads·d]` → `[n, heads·d]`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    past: usize,
    s: AttentionShape,
) -> Vec<f32> {
    let d = s.head_dim;
    let qd = s.num_heads * d;
    let kvd = s.num_kv_heads * d;
    let group = s.num_heads / s.num_kv_heads;
    let total = past + n;
    assert_eq!(
        k.len(),
        total * kvd,
        "attention: cache has {} rows, expected {total}",
        k.len() / kvd.max(1)
    );
    let heads: Vec<Vec<f32>> = (0..s.num_heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let mut out = vec![0f32; n * d];
            let mut scores = vec![0f32; total];
            for i in 0..n {
                let qi = &q[i * qd + h * d..i * qd + (h + 1) * d];
                let len = past + i + 1;
                let mut max = f32::NEG_INFINITY;
                for (t, sc) in scores[..len].iter_mut().enumerate() {
                    *sc = simd::dot(qi, &k[t * kvd + kvh * d..t * kvd + (kvh + 1) * d]) * s.scale;
                    max = max.max(*sc);
                }
                let mut sum = 0f32;
                for sc in &mut scores[..len] {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let o = &mut out[i * d..(i + 1) * d];
                for (t, sc) in scores[..len].iter().enumerate() {
                    simd::axpy(sc / sum, &v[t * kvd + kvh * d..t * kvd + (kvh + 1) * d], o);
                }
            }
            out
        })
        .collect();
    let mut out = vec![0f32; n * qd];
    for (h, ho) in heads.iter().enumerate() {
        for i in 0..n {
            out[i * qd + h * d..i * qd + (h + 1) * d].copy_from_slice(&ho[i * d..(i + 1) * d]);
        }
    }
    out
}
