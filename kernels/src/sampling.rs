//! Choosing the next token from logits: greedy, or temperature sampling with a seeded generator
//! (the same seed and logits always give the same token).

/// How to pick the next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among ties).
    Greedy,
    /// Sample from `softmax(logits / temperature)`.
    Temperature {
        /// Above 0.
        temperature: f32,
    },
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
    sample_in(logits, None, how, rng)
}

/// Picks a token among the ids in `allowed` (all of them when `None`): an id outside it is never
/// returned while `allowed` holds any id below `logits.len()`.
pub fn sample_in(logits: &[f32], allowed: Option<&TokenSet>, how: Sampling, rng: &mut SeededRng) -> u32 {
    let temperature = match how {
        Sampling::Temperature { temperature } if temperature > 0.0 => temperature,
        _ => return argmax_in(logits, allowed),
    };
    let ok = |i: usize, l: f32| !l.is_nan() && allowed.is_none_or(|a| a.contains(i as u32));
    let max = logits.iter().enumerate().filter(|&(i, &l)| ok(i, l)).fold(f32::NEG_INFINITY, |m, (_, &l)| m.max(l));
    let weights: Vec<f64> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| if ok(i, l) { (((l - max) / temperature) as f64).exp() } else { 0.0 })
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn temperature_sampling_is_seeded_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let how = Sampling::Temperature { temperature: 1.0 };
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
        assert_eq!(sample(&logits, Sampling::Temperature { temperature: 0.0 }, &mut rng), 1);
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
        let greedy = sample_in(&logits, Some(&allowed), Sampling::Greedy, &mut rng);
        assert!(allowed.contains(greedy), "greedy picked {greedy}");
        for seed in 0..8 {
            let mut rng = SeededRng::new(seed);
            for temperature in [0.5f32, 2.0, 50.0] {
                for _ in 0..500 {
                    let id = sample_in(&logits, Some(&allowed), Sampling::Temperature { temperature }, &mut rng);
                    assert!(allowed.contains(id), "seed {seed}, temperature {temperature}: picked {id}");
                }
            }
        }
        // All-NaN logits still give an allowed id.
        let nan = vec![f32::NAN; vocab];
        assert!(allowed.contains(sample_in(&nan, Some(&allowed), Sampling::Greedy, &mut rng)));
        let mut first = TokenSet::from_fn(vocab, |id| id >= 3);
        assert_eq!(sample_in(&nan, Some(&first), Sampling::Greedy, &mut rng), 3);
        first = TokenSet::below(2);
        assert_eq!(first.end(), 2);
    }
}
