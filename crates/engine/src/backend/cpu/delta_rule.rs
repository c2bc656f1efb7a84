//! The gated delta rule (Gated DeltaNet's recurrence) on the CPU, in both forms:
//! - recurrent, one token at a time (decode): `S ← S·e^g; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq`;
//! - chunked (prefill): 64-token chunks where the delta updates inside a chunk are condensed
//!   by the UT transform `(I + A)⁻¹` into matrix products, as in the reference implementation.
//!
//! `S` is `[dk, dv]` per value head. q and k are L2-normalised and q is scaled by `1/√dk`
//! here, as the reference does with `use_qk_l2norm_in_kernel`.

use super::simd;
use crate::backend::{DeltaRuleMode, DeltaRuleShape};
use rayon::prelude::*;

const CHUNK: usize = 64;

fn l2_normalised(x: &[f32], scale: f32) -> Vec<f32> {
    let inv = 1.0 / (simd::dot(x, x) + 1e-6).sqrt();
    x.iter().map(|v| v * inv * scale).collect()
}

/// Runs the rule for one sequence's `n` tokens; returns `[n, v_heads·dv]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    n: usize,
    s: DeltaRuleShape,
    mode: DeltaRuleMode,
) -> Vec<f32> {
    let (nk, nv, dk, dv) = (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim);
    let ratio = nv / nk;
    let scale = 1.0 / (dk as f32).sqrt();
    assert_eq!(state.len(), nv * dk * dv);
    let outs: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, sh)| {
            let kh = h / ratio;
            let qs: Vec<Vec<f32>> = (0..n)
                .map(|t| {
                    l2_normalised(
                        &q[t * nk * dk + kh * dk..t * nk * dk + (kh + 1) * dk],
                        scale,
                    )
                })
                .collect();
            let ks: Vec<Vec<f32>> = (0..n)
                .map(|t| l2_normalised(&k[t * nk * dk + kh * dk..t * nk * dk + (kh + 1) * dk], 1.0))
                .collect();
            let vs: Vec<&[f32]> = (0..n)
                .map(|t| &v[t * nv * dv + h * dv..t * nv * dv + (h + 1) * dv])
                .collect();
            let gs: Vec<f32> = (0..n).map(|t| g[t * nv + h]).collect();
            let bs: Vec<f32> = (0..n).map(|t| beta[t * nv + h]).collect();
            match mode {
                DeltaRuleMode::Recurrent => recurrent(&qs, &ks, &vs, &gs, &bs, sh, dk, dv),
                DeltaRuleMode::Chunked => chunked(&qs, &ks, &vs, &gs, &bs, sh, dk, dv),
            }
        })
        .collect();
    let mut out = vec![0f32; n * nv * dv];
    for (h, o) in outs.iter().enumerate() {
        for t in 0..n {
            out[t * nv * dv + h * dv..t * nv * dv + (h + 1) * dv]
                .copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    out
}

/// `out[b] = Σ_a x[a]·S[a][b]` (a row vector times the state).
fn vec_times_state(x: &[f32], state: &[f32], dv: usize, out: &mut [f32]) {
    out.iter_mut().for_each(|o| *o = 0.0);
    for (a, xa) in x.iter().enumerate() {
        simd::axpy(*xa, &state[a * dv..(a + 1) * dv], out);
    }
}

#[allow(clippy::too_many_arguments)]
fn recurrent(
    qs: &[Vec<f32>],
    ks: &[Vec<f32>],
    vs: &[&[f32]],
    gs: &[f32],
    bs: &[f32],
    st: &mut [f32],
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    let n = qs.len();
    let mut out = vec![0f32; n * dv];
    let mut kv_mem = vec![0f32; dv];
    let mut delta = vec![0f32; dv];
    for t in 0..n {
        let decay = gs[t].exp();
        st.iter_mut().for_each(|x| *x *= decay);
        vec_times_state(&ks[t], st, dv, &mut kv_mem);
        for b in 0..dv {
            delta[b] = (vs[t][b] - kv_mem[b]) * bs[t];
        }
        for a in 0..dk {
            simd::axpy(ks[t][a], &delta, &mut st[a * dv..(a + 1) * dv]);
        }
        vec_times_state(&qs[t], st, dv, &mut out[t * dv..(t + 1) * dv]);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn chunked(
    qs: &[Vec<f32>],
    ks: &[Vec<f32>],
    vs: &[&[f32]],
    gs: &[f32],
    bs: &[f32],
    st: &mut [f32],
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    let n = qs.len();
    let mut out = vec![0f32; n * dv];
    let mut tmp = vec![0f32; dv];
    for c0 in (0..n).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(n);
        let l = c1 - c0;
        // Cumulative log-decay inside the chunk.
        let mut cum = vec![0f32; l];
        let mut acc = 0f32;
        for i in 0..l {
            acc += gs[c0 + i];
            cum[i] = acc;
        }
        // A[i][j] = β_i (k_i·k_j) e^{cum_i − cum_j} for j < i; solve (I + A) X = B by forward
        // substitution for U (values) and W (decayed keys).
        let mut u = vec![0f32; l * dv];
        let mut w = vec![0f32; l * dk];
        for i in 0..l {
            let bi = bs[c0 + i];
            for b in 0..dv {
                u[i * dv + b] = bi * vs[c0 + i][b];
            }
            let ei = cum[i].exp();
            for a in 0..dk {
                w[i * dk + a] = bi * ei * ks[c0 + i][a];
            }
            for j in 0..i {
                let aij = bi * simd::dot(&ks[c0 + i], &ks[c0 + j]) * (cum[i] - cum[j]).exp();
                let (done, cur) = u.split_at_mut(i * dv);
                simd::axpy(-aij, &done[j * dv..(j + 1) * dv], &mut cur[..dv]);
                let (done, cur) = w.split_at_mut(i * dk);
                simd::axpy(-aij, &done[j * dk..(j + 1) * dk], &mut cur[..dk]);
            }
        }
        // v_new = U − W·S (the part of the values the old state does not already predict).
        let mut v_new = u;
        for i in 0..l {
            vec_times_state(&w[i * dk..(i + 1) * dk], st, dv, &mut tmp);
            for b in 0..dv {
                v_new[i * dv + b] -= tmp[b];
            }
        }
        // Outputs: read of the old state plus causal attention inside the chunk.
        for i in 0..l {
            let o = &mut out[(c0 + i) * dv..(c0 + i + 1) * dv];
            vec_times_state(&qs[c0 + i], st, dv, o);
            let ei = cum[i].exp();
            o.iter_mut().for_each(|x| *x *= ei);
            for j in 0..=i {
                let a = simd::dot(&qs[c0 + i], &ks[c0 + j]) * (cum[i] - cum[j]).exp();
                simd::axpy(a, &v_new[j * dv..(j + 1) * dv], o);
            }
        }
        // State update: decay the old state over the chunk, add the chunk's corrections.
        let last = cum[l - 1];
        let chunk_decay = last.exp();
        st.iter_mut().for_each(|x| *x *= chunk_decay);
        for j in 0..l {
            let dj = (last - cum[j]).exp();
            for a in 0..dk {
                simd::axpy(
                    ks[c0 + j][a] * dj,
                    &v_new[j * dv..(j + 1) * dv],
                    &mut st[a * dv..(a + 1) * dv],
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn chunked_equals_recurrent_across_chunk_boundaries_and_with_initial_state() {
        let shape = DeltaRuleShape {
            num_k_heads: 2,
            num_v_heads: 4,
            k_head_dim: 8,
            v_head_dim: 6,
        };
        for n in [1, 5, 64, 65, 130] {
            let q = rnd(n * 16, 1);
            let k = rnd(n * 16, 2);
            let v = rnd(n * 24, 3);
            let g: Vec<f32> = rnd(n * 4, 4).iter().map(|x| -(x.abs() * 0.5)).collect();
            let beta: Vec<f32> = rnd(n * 4, 5).iter().map(|x| x.abs()).collect();
            let init = rnd(4 * 8 * 6, 6);
            let mut s1 = init.clone();
            let mut s2 = init.clone();
            let o1 = gated_delta_rule(
                &q,
                &k,
                &v,
                &g,
                &beta,
                &mut s1,
                n,
                shape,
                DeltaRuleMode::Recurrent,
            );
            let o2 = gated_delta_rule(
                &q,
                &k,
                &v,
                &g,
                &beta,
                &mut s2,
                n,
                shape,
                DeltaRuleMode::Chunked,
            );
            for (a, b) in o1.iter().zip(&o2) {
                assert!((a - b).abs() < 1e-4, "n={n}: out {a} vs {b}");
            }
            for (a, b) in s1.iter().zip(&s2) {
                assert!((a - b).abs() < 1e-4, "n={n}: state {a} vs {b}");
            }
        }
    }
}
