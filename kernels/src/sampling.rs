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

/// The index of the largest logit (the first one among equals). NaNs are never chosen.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// Picks a token.
pub fn sample(logits: &[f32], how: Sampling, rng: &mut SeededRng) -> u32 {
    match how {
        Sampling::Greedy => argmax(logits),
        Sampling::Temperature { temperature } if temperature <= 0.0 => argmax(logits),
        Sampling::Temperature { temperature } => {
            let max = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f64> = logits
                .iter()
                .map(|&l| if l.is_nan() { 0.0 } else { (((l - max) / temperature) as f64).exp() })
                .collect();
            let total: f64 = weights.iter().sum();
            let mut target = rng.next_f64() * total;
            for (i, w) in weights.iter().enumerate() {
                if target < *w {
                    return i as u32;
                }
                target -= w;
            }
            argmax(logits)
        }
    }
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
}
