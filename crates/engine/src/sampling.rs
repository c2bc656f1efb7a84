//! Sampling: turns a position's logits into the next token, and decides when generation stops.
//!
//! Order of operations (the order of Hugging Face `generate`'s logits processors):
//! 1. logit bias (OpenAI `logit_bias`: added to the raw logit);
//! 2. repetition penalty (HF `RepetitionPenaltyLogitsProcessor`): every token that occurs in the
//!    prompt or in the generated text has its logit divided by the penalty when positive and
//!    multiplied by it when negative;
//! 3. presence and frequency penalties (OpenAI semantics): `logit -= presence * (count > 0) +
//!    frequency * count`, where `count` is how often the token occurs in the prompt plus the
//!    generated text so far;
//! 4. greedy (`temperature == 0`) takes the arg-max of the penalised logits; otherwise
//!    temperature scaling, then top-k, top-p (nucleus) and min-p truncation, then a draw from the
//!    sequence's own ChaCha RNG. The same seed and inputs give the same tokens.
//!
//! Stop strings live here too ([`StopStringMatcher`]) so every API shares one implementation.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// How to pick tokens. Defaults are the neutral values (no truncation, no penalty, T = 1).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: usize,
    /// 1.0 means off.
    pub top_p: f32,
    /// 0.0 means off; keeps tokens whose probability is at least `min_p` times the top one's.
    pub min_p: f32,
    /// 1.0 means off.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: HashMap<u32, f32>,
    /// `None` draws a fresh seed per request.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: HashMap::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Checks the ranges; the message names the field, the value and the allowed range.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number, got {v}"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(format!(
                "presence_penalty must be in [-2, 2], got {}",
                self.presence_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(format!(
                "frequency_penalty must be in [-2, 2], got {}",
                self.frequency_penalty
            ));
        }
        Ok(())
    }

    /// Whether [`Sampler::sample`] is a plain argmax of the model's logits (no bias, no
    /// penalty), so that the model may pick on its device ([`crate::model::CausalLm::forward_greedy`]).
    pub fn is_plain_greedy(&self) -> bool {
        (self.temperature <= 0.0 || self.top_k == 1)
            && self.logit_bias.is_empty()
            && !self.has_penalties()
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// Per-sequence sampler: parameters, RNG state, token counts and a reused candidate buffer.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Occurrences of each token in prompt + generated text (only kept when a penalty is set).
    counts: HashMap<u32, u32>,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        let mut counts = HashMap::new();
        if params.has_penalties() {
            for &t in prompt {
                *counts.entry(t).or_insert(0) += 1;
            }
        }
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            counts,
            candidates: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token for the penalties.
    pub fn accept(&mut self, token: u32) {
        if self.params.has_penalties() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Picks the next token from one position's logits. The logits are modified in place
    /// (bias and penalties), which saves a copy of the vocabulary per token.
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        let p = &self.params;
        for (&tok, &bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(tok as usize) {
                *l += bias;
            }
        }
        if p.has_penalties() {
            for (&tok, &count) in &self.counts {
                let Some(l) = logits.get_mut(tok as usize) else {
                    continue;
                };
                if p.repetition_penalty != 1.0 {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
                *l -= p.presence_penalty + p.frequency_penalty * count as f32;
            }
        }
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        let cands = &mut self.candidates;
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if cands.is_empty() {
            return argmax(logits);
        }
        let by_value_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, by_value_desc);
            cands.truncate(p.top_k);
        }
        // Softmax numerators, relative to the maximum.
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f32;
        for c in cands.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1;
        }
        if p.top_p < 1.0 {
            cands.sort_unstable_by(by_value_desc);
            let mut cumulative = 0.0;
            let mut keep = cands.len();
            for (i, c) in cands.iter().enumerate() {
                cumulative += c.1 / total;
                // Keep the smallest prefix whose mass reaches top_p (always at least one token).
                if cumulative >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep);
            total = cands.iter().map(|c| c.1).sum();
        }
        if p.min_p > 0.0 {
            // The top numerator is exp(0) = 1, so the threshold is min_p itself.
            cands.retain(|c| c.1 >= p.min_p);
            total = cands.iter().map(|c| c.1).sum();
        }
        let mut r = self.rng.random::<f32>() * total;
        for c in cands.iter() {
            r -= c.1;
            if r < 0.0 {
                return c.0;
            }
        }
        cands.last().map(|c| c.0).unwrap_or_else(|| argmax(logits))
    }
}

/// Index of the largest value (the first one on ties); NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    argmax_with_value(logits).map_or(0, |(i, _)| i as u32)
}

/// The first index of the largest value above −∞ and that value (NaNs never win), or None
/// where there is none.
///
/// Written by hand because it is on every greedy step's path: the vocabulary is 248K logits,
/// and `Iterator::max_by` took ~0.45 ms a token on the GPU box (5% of a 27B decode step; a
/// plain index-tracking loop is not much faster). Here 32 lanes keep their own best value and
/// the chunk it came from, a loop the compiler turns into vector compares and blends (AVX2
/// where the CPU has it); strict `>` keeps each lane's first maximum, and the lanes' tie goes
/// to the lowest index.
pub fn argmax_with_value(logits: &[f32]) -> Option<(usize, f32)> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { argmax_lanes_avx2(logits) };
    }
    argmax_lanes(logits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_lanes_avx2(logits: &[f32]) -> Option<(usize, f32)> {
    argmax_lanes(logits)
}

#[inline(always)]
fn argmax_lanes(logits: &[f32]) -> Option<(usize, f32)> {
    const LANES: usize = 32;
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut chunk_of = [0u32; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, values) in chunks.enumerate() {
        for l in 0..LANES {
            let better = values[l] > best[l];
            best[l] = if better { values[l] } else { best[l] };
            chunk_of[l] = if better { c as u32 } else { chunk_of[l] };
        }
    }
    let mut found: Option<(usize, f32)> = None;
    for l in 0..LANES {
        let (i, v) = (chunk_of[l] as usize * LANES + l, best[l]);
        let wins = match found {
            None => v > f32::NEG_INFINITY,
            Some((bi, bv)) => v > bv || (v == bv && i < bi),
        };
        if wins {
            found = Some((i, v));
        }
    }
    let tail_start = logits.len() - tail.len();
    for (j, &v) in tail.iter().enumerate() {
        // Tail indices come after every chunk's, so only a larger value wins.
        if found.is_none_or(|(_, bv)| v > bv) && v > f32::NEG_INFINITY {
            found = Some((tail_start + j, v));
        }
    }
    found
}

/// Where a [`StopStringMatcher`] push ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// Text that is safe to emit now.
    pub emit: String,
    /// Index into the stop-string list of the one that matched, when one did.
    pub stopped: Option<usize>,
}

/// Finds stop strings in streamed text that arrives in arbitrary pieces.
///
/// A stop string may span any number of pieces, so text that could be the start of a stop
/// string is held back until it either completes the match (and is dropped with everything
/// after it: the stop string is not part of the output, as in the OpenAI and Anthropic APIs)
/// or is shown not to match (and is emitted). [`StopStringMatcher::finish`] releases what is
/// held back when generation ends for another reason.
#[derive(Debug, Clone, Default)]
pub struct StopStringMatcher {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopStringMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopStringMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    pub fn push(&mut self, piece: &str) -> StopMatch {
        if self.stopped {
            return StopMatch {
                emit: String::new(),
                stopped: None,
            };
        }
        if self.stops.is_empty() {
            return StopMatch {
                emit: piece.to_string(),
                stopped: None,
            };
        }
        self.pending.push_str(piece);
        // The earliest match wins; on equal positions, the longer stop string.
        let mut best: Option<(usize, usize)> = None;
        for (i, s) in self.stops.iter().enumerate() {
            if let Some(pos) = self.pending.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((bpos, bi)) => {
                        pos < bpos || (pos == bpos && s.len() > self.stops[bi].len())
                    }
                };
                if better {
                    best = Some((pos, i));
                }
            }
        }
        if let Some((pos, i)) = best {
            self.stopped = true;
            let emit = self.pending[..pos].to_string();
            self.pending.clear();
            return StopMatch {
                emit,
                stopped: Some(i),
            };
        }
        let hold = self.held_suffix_len();
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopMatch {
            emit,
            stopped: None,
        }
    }

    /// Releases the held-back text (generation ended without a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let text = self.pending.as_str();
        let mut longest = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(text.len());
            for k in (longest + 1..=max).rev() {
                let start = text.len() - k;
                if text.is_char_boundary(start)
                    && s.as_bytes().starts_with(&text.as_bytes()[start..])
                {
                    longest = k;
                    break;
                }
            }
        }
        longest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(7),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn argmax_is_the_first_largest_value_as_a_plain_loop_finds_it() {
        let plain = |v: &[f32]| {
            let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
            for (i, &x) in v.iter().enumerate() {
                if x > best_v {
                    (best, best_v) = (i, x);
                }
            }
            best as u32
        };
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for len in [0, 1, 5, 15, 16, 17, 31, 33, 100, 1000, 248_044] {
            for case in 0..6 {
                // Few distinct values, so ties across lanes and chunks are common.
                let mut v: Vec<f32> = (0..len).map(|_| (next() % 7) as f32 - 3.0).collect();
                match case {
                    1 if len > 3 => v[len / 3] = f32::NAN,
                    2 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                    3 if len > 0 => {
                        v.iter_mut().for_each(|x| *x = f32::NAN);
                        v[len - 1] = -1.0;
                    }
                    4 if len > 2 => v[len - 2] = 100.0,
                    5 if len > 0 => v[0] = 100.0,
                    _ => {}
                }
                assert_eq!(argmax(&v), plain(&v), "length {len}, case {case}");
                // The portable build of the same loop (the dispatch above may take AVX2).
                let portable = argmax_lanes(&v).map_or(0, |(i, _)| i as u32);
                assert_eq!(portable, plain(&v), "portable, length {len}, case {case}");
            }
        }
    }

    #[test]
    fn greedy_takes_argmax_and_ignores_seed() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        let mut logits = vec![0.1, 2.0, -1.0, 1.9];
        assert_eq!(s.sample(&mut logits), 1);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.1).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(|p| p.seed = Some(seed)), &[]);
            (0..64)
                .map(|_| s.sample(&mut logits.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn top_k_limits_support() {
        let logits: Vec<f32> = vec![5.0, 4.0, 3.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(params(|p| p.top_k = 2), &[]);
        for _ in 0..500 {
            let t = s.sample(&mut logits.clone());
            assert!(t == 0 || t == 1, "top_k=2 drew {t}");
        }
    }

    #[test]
    fn top_p_keeps_smallest_nucleus() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps tokens 0 and 1.
        let logits: Vec<f32> = vec![3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(params(|p| p.top_p = 0.8), &[]);
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&mut logits.clone()) as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // relative probabilities 1, e^-1 = 0.37, e^-3 = 0.05: min_p 0.1 drops the last.
        let logits: Vec<f32> = vec![3.0, 2.0, 0.0];
        let mut s = Sampler::new(params(|p| p.min_p = 0.1), &[]);
        for _ in 0..1000 {
            assert_ne!(s.sample(&mut logits.clone()), 2);
        }
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let logits: Vec<f32> = vec![1.0, 0.0];
        let freq = |t: f32| {
            let mut s = Sampler::new(params(|p| p.temperature = t), &[]);
            (0..4000)
                .filter(|_| s.sample(&mut logits.clone()) == 0)
                .count() as f32
                / 4000.0
        };
        // P(0) = sigmoid(1/T): T=0.25 → 0.982, T=4 → 0.562.
        assert!((freq(0.25) - 0.982).abs() < 0.02);
        assert!((freq(4.0) - 0.562).abs() < 0.04);
    }

    #[test]
    fn repetition_penalty_follows_hf_sign_rule() {
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::greedy()
            },
            &[0, 2],
        );
        let mut logits = vec![4.0, 3.0, -1.0, -1.5];
        assert_eq!(s.sample(&mut logits), 1);
        assert_eq!(logits, vec![2.0, 3.0, -2.0, -1.5]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_prompt_and_generated() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(p, &[0, 0]);
        s.accept(0);
        s.accept(1);
        let mut logits = vec![10.0, 10.0, 10.0];
        assert_eq!(s.sample(&mut logits), 2);
        assert_eq!(logits, vec![10.0 - 0.5 - 0.75, 10.0 - 0.5 - 0.25, 10.0]);
    }

    #[test]
    fn logit_bias_can_force_and_ban() {
        let mut p = SamplingParams::greedy();
        p.logit_bias.insert(3, 100.0);
        p.logit_bias.insert(9999, 5.0); // out of vocabulary: ignored
        let mut s = Sampler::new(p, &[]);
        assert_eq!(s.sample(&mut [1.0, 2.0, 3.0, 0.0]), 3);
        let mut p = params(|_| {});
        p.logit_bias.insert(0, -100.0);
        let mut s = Sampler::new(p, &[]);
        for _ in 0..200 {
            assert_ne!(s.sample(&mut [5.0, 0.0]), 0);
        }
    }

    #[test]
    fn validate_names_the_field() {
        assert!(SamplingParams::default().validate().is_ok());
        let e = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("top_p"), "{e}");
        let e = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("temperature"), "{e}");
    }

    fn run_matcher(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopStringMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.emit);
            if r.stopped.is_some() {
                return (out, r.stopped);
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    #[test]
    fn stop_string_inside_one_piece() {
        assert_eq!(
            run_matcher(&["STOP"], &["abcSTOPdef"]),
            ("abc".into(), Some(0))
        );
    }

    #[test]
    fn stop_string_spanning_pieces() {
        assert_eq!(
            run_matcher(&["</end>"], &["hello </", "en", "d> after"]),
            ("hello ".into(), Some(0))
        );
    }

    #[test]
    fn held_back_text_is_released_when_it_does_not_match() {
        let mut m = StopStringMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abE").emit, "ab");
        assert_eq!(m.push("N").emit, "");
        assert_eq!(m.push("x").emit, "ENx");
        assert_eq!(m.push("E").emit, "");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_text_is_safe() {
        assert_eq!(run_matcher(&["b", "a"], &["xxab"]), ("xx".into(), Some(1)));
        assert_eq!(
            run_matcher(&["é!"], &["caf", "é", "?é", "!"]),
            ("café?".into(), Some(0))
        );
        assert_eq!(run_matcher(&["🦫x"], &["a🦫", "b"]), ("a🦫b".into(), None));
    }

    #[test]
    fn no_stop_strings_passes_through() {
        let mut m = StopStringMatcher::new(vec![String::new()]);
        assert_eq!(m.push("abc").emit, "abc");
        assert_eq!(m.finish(), "");
    }
}
