//! Choosing the next token from logits: greedy, or temperature sampling with a seeded generator
//! (the same seed and logits always give the same token), with the logit processors of
//! `transformers` and vLLM in their order: repetition penalty, temperature, top-k, top-p.

/// How to pick the next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (the most likely token, the lowest id among ties); otherwise sample from
    /// `softmax(logits / temperature)`.
    pub temperature: f32,
    /// Sample only among the most likely tokens whose probabilities reach `top_p` together
    /// (nucleus sampling); 1 keeps all.
    pub top_p: f32,
    /// Sample only among the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Divides a positive logit, multiplies a negative one, of every token already in the
    /// sequence (prompt and answer), as `transformers`' `RepetitionPenaltyLogitsProcessor`; 1 is
    /// none. Applies to greedy decoding too.
    pub repetition_penalty: f32,
}

impl Sampling {
    /// The most likely token, nothing else applied.
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_p: 1.0, top_k: 0, repetition_penalty: 1.0 };

    /// Plain temperature sampling (greedy at 0).
    pub fn temperature(temperature: f32) -> Sampling {
        Sampling { temperature, ..Sampling::GREEDY }
    }

    /// Whether every processor is off: the logits are used as they are.
    fn plain(&self) -> bool {
        self.top_p >= 1.0 && self.top_k == 0 && self.repetition_penalty == 1.0
    }
}

/// A small, fast, seedable generator (SplitMix64) so that sampling is reproducible everywhere.
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The token ids a sampler may pick: the ids a tokenizer can decode. A model's vocabulary is
/// often larger than its tokenizer's (padded to a multiple of 64 or 128), and a tokenizer's ids
/// need not be contiguous (o200k leaves 199,998 and 200,000–200,017 unused); an id outside this
/// set is never sampled, whatever the logits say.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSet {
    /// One bit per id below `len`.
    words: Vec<u64>,
    len: usize,
    count: usize,
}

impl std::fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSet").field("ids_below", &self.len).field("allowed", &self.count).finish()
    }
}

impl TokenSet {
    /// The ids below `len` for which `allowed` holds.
    pub fn from_fn(len: usize, mut allowed: impl FnMut(u32) -> bool) -> Self {
        let mut words = vec![0u64; len.div_ceil(64)];
        let mut count = 0;
        for id in 0..len {
            if allowed(id as u32) {
                words[id / 64] |= 1 << (id % 64);
                count += 1;
            }
        }
        Self { words, len, count }
    }

    /// Every id below `len`.
    pub fn below(len: usize) -> Self {
        Self::from_fn(len, |_| true)
    }

    /// Whether `id` may be sampled.
    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        let id = id as usize;
        id < self.len && self.words[id / 64] & (1 << (id % 64)) != 0
    }

    /// How many ids may be sampled.
    pub fn count(&self) -> usize {
        self.count
    }

    /// One more than the largest id that may be sampled (0 when none may).
    pub fn end(&self) -> usize {
        self.len
    }
}

/// The index of the largest logit (the first one among equals). NaNs are never chosen.
pub fn argmax(logits: &[f32]) -> u32 {
    argmax_in(logits, None)
}

/// [`argmax`] over the ids in `allowed` (all of them when `None`).
fn argmax_in(logits: &[f32], allowed: Option<&TokenSet>) -> u32 {
    let mut best = None;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if (v > best_v || best.is_none() && !v.is_nan()) && allowed.is_none_or(|a| a.contains(i as u32)) {
            best = Some(i);
            best_v = v;
        }
    }
    // Only when no id is allowed (or every logit is NaN): the first allowed id, else 0.
    best.or_else(|| (0..logits.len()).find(|&i| allowed.is_none_or(|a| a.contains(i as u32)))).unwrap_or(0) as u32
}

/// Picks a token.
pub fn sample(logits: &[f32], how: Sampling, rng: &mut SeededRng) -> u32 {
    sample_in(logits, None, how, &[], rng)
}

/// Picks a token among the ids in `allowed` (all of them when `None`), after the tokens of
/// `sequence` (what the repetition penalty reads): an id outside `allowed` is never returned
/// while it holds any id below `logits.len()`.
pub fn sample_in(
    logits: &[f32],
    allowed: Option<&TokenSet>,
    how: Sampling,
    sequence: &[u32],
    rng: &mut SeededRng,
) -> u32 {
    if how.plain() && how.temperature <= 0.0 {
        return argmax_in(logits, allowed);
    }
    let mut penalized;
    let logits = if how.repetition_penalty != 1.0 && how.repetition_penalty > 0.0 {
        penalized = logits.to_vec();
        let mut seen = vec![false; logits.len()];
        for &id in sequence {
            if (id as usize) < penalized.len() && !std::mem::replace(&mut seen[id as usize], true) {
                let l = &mut penalized[id as usize];
                *l = if *l < 0.0 { *l * how.repetition_penalty } else { *l / how.repetition_penalty };
            }
        }
        &penalized[..]
    } else {
        logits
    };
    let temperature = how.temperature;
    if temperature <= 0.0 {
        return argmax_in(logits, allowed);
    }
    let ok = |i: usize, l: f32| !l.is_nan() && allowed.is_none_or(|a| a.contains(i as u32));
    let max = logits.iter().enumerate().filter(|&(i, &l)| ok(i, l)).fold(f32::NEG_INFINITY, |m, (_, &l)| m.max(l));
    let mut weights: Vec<f64> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| if ok(i, l) { (((l - max) / temperature) as f64).exp() } else { 0.0 })
        .collect();
    if how.top_k > 0 || how.top_p < 1.0 {
        truncate(&mut weights, how.top_k as usize, how.top_p);
    }
    let total: f64 = weights.iter().sum();
    let mut target = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return i as u32;
        }
        target -= w;
    }
    argmax_in(logits, allowed)
}

/// Zeroes every weight outside the `top_k` largest (0: no limit) and, of those, outside the
/// smallest set of the largest whose share of the total reaches `top_p` (the token that crosses
/// it is kept, and always the most likely one). Ties are broken by the lower id.
fn truncate(weights: &mut [f64], top_k: usize, top_p: f32) {
    let mut order: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
    order.sort_unstable_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
    let mut keep = if top_k > 0 { top_k.min(order.len()) } else { order.len() };
    if top_p < 1.0 {
        let total: f64 = order[..keep].iter().map(|&i| weights[i]).sum();
        let mut sum = 0.0;
        for (n, &i) in order[..keep].iter().enumerate() {
            sum += weights[i];
            if sum >= f64::from(top_p) * total {
                keep = n + 1;
                break;
            }
        }
    }
    for &i in &order[keep.max(1)..] {
        weights[i] = 0.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Top-k, top-p and the repetition penalty as `transformers` applies them.
    #[test]
    fn processors_follow_transformers() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
        let logits = [2f32.ln() * 3.0, 2f32.ln() * 2.0, 2f32.ln(), 2f32.ln()];
        let draw = |how: Sampling| {
            let mut rng = SeededRng::new(3);
            let mut seen = [0usize; 4];
            for _ in 0..2000 {
                seen[sample(&logits, how, &mut rng) as usize] += 1;
            }
            seen
        };
        let top_k = draw(Sampling { top_k: 2, ..Sampling::temperature(1.0) });
        assert!(top_k[2] == 0 && top_k[3] == 0 && top_k[0] > top_k[1] && top_k[1] > 500, "{top_k:?}");
        // 0.5 + 0.25 reaches 0.7: the third token is out.
        let top_p = draw(Sampling { top_p: 0.7, ..Sampling::temperature(1.0) });
        assert!(top_p[2] == 0 && top_p[3] == 0 && top_p[1] > 500, "{top_p:?}");
        // 0.5 alone reaches 0.5: only the most likely token, however small top_p is.
        assert_eq!(draw(Sampling { top_p: 0.01, ..Sampling::temperature(1.0) }), [2000, 0, 0, 0]);
        assert_eq!(draw(Sampling::temperature(1.0)).iter().filter(|&&n| n > 100).count(), 4);
        // The penalty divides positive logits and multiplies negative ones, even when greedy.
        let logits = [3.0f32, 2.5, -1.0];
        let penalized = Sampling { repetition_penalty: 1.5, ..Sampling::GREEDY };
        let mut rng = SeededRng::new(0);
        assert_eq!(sample_in(&logits, None, penalized, &[0, 0, 7], &mut rng), 1, "3 / 1.5 < 2.5");
        assert_eq!(sample_in(&logits, None, penalized, &[2], &mut rng), 0);
        assert_eq!(sample_in(&logits, None, Sampling::GREEDY, &[0], &mut rng), 0);
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn temperature_sampling_is_seeded_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let how = Sampling::temperature(1.0);
        let draw = |seed| {
            let mut rng = SeededRng::new(seed);
            (0..4000).map(|_| sample(&logits, how, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(9), draw(9), "same seed, same tokens");
        let d = draw(9);
        let ones = d.iter().filter(|&&t| t == 1).count() as f64 / d.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "p(1) = {ones}");
        assert!(!d.contains(&2), "a -inf logit is never sampled");
        let mut rng = SeededRng::new(1);
        assert_eq!(sample(&logits, Sampling::temperature(0.0), &mut rng), 1);
    }

    /// A vocabulary with gaps (as o200k's: ids a tokenizer cannot decode) and ids past its end:
    /// no draw, greedy or at any temperature, lands outside it, even where the model favours
    /// those ids most.
    #[test]
    fn sampling_never_picks_an_id_outside_the_allowed_set() {
        let vocab = 300;
        let gaps = [7u32, 8, 9, 100, 250];
        let allowed = TokenSet::from_fn(vocab - 20, |id| !gaps.contains(&id));
        assert_eq!(allowed.count(), vocab - 20 - gaps.len());
        let mut rng = SeededRng::new(5);
        let mut logits: Vec<f32> = (0..vocab).map(|_| rng.next_f64() as f32).collect();
        for &g in &gaps {
            logits[g as usize] = 40.0;
        }
        logits[vocab - 1] = 50.0;
        assert!(gaps.contains(&argmax(&logits)) || argmax(&logits) as usize == vocab - 1);
        let greedy = sample_in(&logits, Some(&allowed), Sampling::GREEDY, &[], &mut rng);
        assert!(allowed.contains(greedy), "greedy picked {greedy}");
        for seed in 0..8 {
            let mut rng = SeededRng::new(seed);
            for temperature in [0.5f32, 2.0, 50.0] {
                for _ in 0..500 {
                    let id = sample_in(&logits, Some(&allowed), Sampling::temperature(temperature), &[], &mut rng);
                    assert!(allowed.contains(id), "seed {seed}, temperature {temperature}: picked {id}");
                }
            }
        }
        // All-NaN logits still give an allowed id.
        let nan = vec![f32::NAN; vocab];
        assert!(allowed.contains(sample_in(&nan, Some(&allowed), Sampling::GREEDY, &[], &mut rng)));
        let mut first = TokenSet::from_fn(vocab, |id| id >= 3);
        assert_eq!(sample_in(&nan, Some(&first), Sampling::GREEDY, &[], &mut rng), 3);
        first = TokenSet::below(2);
        assert_eq!(first.end(), 2);
    }
}
