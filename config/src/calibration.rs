//! [`Calibration`]: measured bandwidths and prefill times that drive the simulated engine and
//! the router's cost model. The file format is that of `calibration/h200.toml`, which is embedded
//! as the default.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Problem};
use crate::located;

/// The embedded H200 calibration file.
const H200_TOML: &str = include_str!("../calibration/h200.toml");

/// Host ↔ device copy bandwidths, `[link]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkCalibration {
    /// Host (pinned) → device, GB/s.
    pub h2d_pinned_gb_s: f64,
    /// Device → host (pinned), GB/s.
    pub d2h_pinned_gb_s: f64,
    /// Host (pageable) → device, GB/s.
    pub h2d_pageable_gb_s: f64,
    /// Device → device copy, GB/s.
    pub d2d_copy_gb_s: f64,
}

/// Local disk throughput, `[disk]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskCalibration {
    /// Sequential write, GB/s.
    pub seq_write_gb_s: f64,
    /// Sequential read, GB/s.
    pub seq_read_gb_s: f64,
    /// Random 4 KiB reads per second.
    pub rand_read_4k_iops: u64,
}

/// Raw compute, `[compute]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeCalibration {
    /// FP32 GEMM throughput, TFLOP/s.
    pub sgemm_fp32_tflops: f64,
}

/// Measured prefill time of one model, one `[[prefill]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillCalibration {
    /// Model shape name (`"llama-8b"`).
    pub model: String,
    /// KV bytes per token in the measured dtype.
    pub kv_bytes_per_token: u64,
    /// `[tokens, milliseconds]` pairs, tokens strictly increasing.
    pub points_ms: Vec<(u64, f64)>,
}

impl PrefillCalibration {
    /// Milliseconds to prefill `tokens`: piecewise-linear over the points, with an implicit
    /// `(0, 0)` point below the first, and the last segment extended beyond the last point.
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        // The points with the implicit origin in front, without allocating (the simulated engine
        // asks this for every block it considers loading).
        let origin = self.points_ms.first().is_none_or(|&(t, _)| t > 0).then_some((0.0, 0.0));
        let mut points = origin.into_iter().chain(self.points_ms.iter().map(|&(t, ms)| (t as f64, ms)));
        let (Some(mut a), Some(mut b)) = (points.next(), points.next()) else { return 0.0 };
        if tokens == 0 {
            return 0.0;
        }
        let x = tokens as f64;
        // The first segment that reaches x, or the last one.
        while x > b.0 {
            match points.next() {
                Some(next) => (a, b) = (b, next),
                None => break,
            }
        }
        let ((x0, y0), (x1, y1)) = (a, b);
        (y0 + (x - x0) * (y1 - y0) / (x1 - x0)).max(0.0)
    }
}

/// Measured numbers of one machine: link and disk bandwidths, compute, and prefill times per
/// model. Unknown keys are errors, like in the node configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// `[link]`.
    pub link: LinkCalibration,
    /// `[disk]`.
    pub disk: DiskCalibration,
    /// `[compute]`.
    pub compute: ComputeCalibration,
    /// `[[prefill]]`, one per model.
    pub prefill: Vec<PrefillCalibration>,
}

impl Calibration {
    /// The embedded calibration of one H200 (`calibration/h200.toml`).
    pub fn h200() -> Calibration {
        // A test parses the embedded file, so this cannot fail in a tested build.
        Self::parse(H200_TOML, "calibration/h200.toml").unwrap_or_else(|e| panic!("embedded h200.toml is invalid: {e}"))
    }

    /// Parses and validates a calibration file's contents. `origin` prefixes error locations.
    pub fn parse(src: &str, origin: &str) -> Result<Calibration, ConfigError> {
        let (calibration, source) = located::parse::<Calibration>(src, origin)?;
        let problems = calibration.problems();
        if problems.is_empty() { Ok(calibration) } else { Err(ConfigError::Invalid(source.locate(problems))) }
    }

    /// Reads, parses and validates the calibration file at `path`.
    pub fn load(path: &Path) -> Result<Calibration, ConfigError> {
        let src = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.to_owned(), source })?;
        Self::parse(&src, &path.display().to_string())
    }

    /// The prefill entry of `model`.
    pub fn prefill_for(&self, model: &str) -> Option<&PrefillCalibration> {
        self.prefill.iter().find(|p| p.model == model)
    }

    /// Milliseconds to prefill `tokens` prompt tokens of `model`, or `None` when the model was
    /// not measured. See [`PrefillCalibration::prefill_ms`].
    pub fn prefill_ms(&self, model: &str, tokens: u64) -> Option<f64> {
        self.prefill_for(model).map(|p| p.prefill_ms(tokens))
    }

    fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut positive = |key: &str, v: f64| {
            if !(v.is_finite() && v > 0.0) {
                problems.push(Problem::new(key, format!("{v} must be a positive number")));
            }
        };
        positive("link.h2d_pinned_gb_s", self.link.h2d_pinned_gb_s);
        positive("link.d2h_pinned_gb_s", self.link.d2h_pinned_gb_s);
        positive("link.h2d_pageable_gb_s", self.link.h2d_pageable_gb_s);
        positive("link.d2d_copy_gb_s", self.link.d2d_copy_gb_s);
        positive("disk.seq_write_gb_s", self.disk.seq_write_gb_s);
        positive("disk.seq_read_gb_s", self.disk.seq_read_gb_s);
        positive("compute.sgemm_fp32_tflops", self.compute.sgemm_fp32_tflops);
        for (i, p) in self.prefill.iter().enumerate() {
            if self.prefill[..i].iter().any(|q| q.model == p.model) {
                problems
                    .push(Problem::new(format!("prefill[{i}].model"), format!("`{}` is calibrated twice", p.model)));
            }
            let key = format!("prefill[{i}].points_ms");
            if p.points_ms.is_empty() {
                problems.push(Problem::new(key.clone(), "needs at least one [tokens, ms] point"));
            }
            if p.points_ms.iter().any(|&(_, ms)| !(ms.is_finite() && ms >= 0.0)) {
                problems.push(Problem::new(key.clone(), "milliseconds must be finite and >= 0"));
            }
            if p.points_ms.windows(2).any(|w| w[0].0 >= w[1].0) {
                problems.push(Problem::new(key, "token counts must be strictly increasing"));
            }
        }
        problems
    }
}

/// The embedded H200 calibration.
impl Default for Calibration {
    fn default() -> Self {
        Calibration::h200()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, ModelShape};

    #[test]
    fn h200_parses() {
        let c = Calibration::h200();
        assert_eq!(c.link.h2d_pinned_gb_s, 55.5);
        assert_eq!(c.disk.seq_read_gb_s, 1.62);
        assert_eq!(c.disk.rand_read_4k_iops, 59181);
        assert_eq!(c.compute.sgemm_fp32_tflops, 51.4);
        assert_eq!(c.prefill.len(), 2);
        assert_eq!(c, Calibration::default());
    }

    #[test]
    fn kv_bytes_agree_with_model_shapes() {
        for p in &Calibration::h200().prefill {
            let shape = ModelShape::named(&p.model).expect("calibrated model is a known shape");
            assert_eq!(shape.kv_bytes_per_token(Dtype::Bf16), p.kv_bytes_per_token);
        }
    }

    #[test]
    fn prefill_interpolates() {
        let c = Calibration::h200();
        let ms = |tokens| c.prefill_ms("llama-8b", tokens).unwrap();
        assert_eq!(ms(0), 0.0);
        assert_eq!(ms(2048), 61.4);
        assert_eq!(ms(8192), 256.7);
        assert!((ms(5120) - (61.4 + 256.7) / 2.0).abs() < 1e-9);
        // Below the first point: towards (0, 0).
        assert!((ms(1024) - 30.7).abs() < 1e-9);
        // Beyond the last point: the last segment extended.
        let slope = (1409.3 - 256.7) / (32768.0 - 8192.0);
        assert!((ms(65536) - (1409.3 + slope * 32768.0)).abs() < 1e-6);
        assert_eq!(c.prefill_ms("llama-70b", 10), None);
    }

    #[test]
    fn unknown_keys_are_located() {
        let src = H200_TOML.replace("d2d_copy_gb_s", "d2d_copy_gbs");
        let err = Calibration::parse(&src, "cal.toml").unwrap_err();
        assert_eq!(err.kind(), "unknown_key");
        assert_eq!(err.key(), Some("link.d2d_copy_gbs"));
        assert_eq!(err.line(), Some(9));
        assert_eq!(err.column(), Some(1));
    }

    #[test]
    fn missing_keys_and_bad_points_are_reported() {
        let src = H200_TOML.replace("seq_read_gb_s = 1.62", "");
        let err = Calibration::parse(&src, "cal.toml").unwrap_err();
        assert_eq!(err.key(), Some("disk.seq_read_gb_s"), "{err}");

        let src = H200_TOML.replace("[8192, 50.2]", "[1024, 50.2]");
        let err = Calibration::parse(&src, "cal.toml").unwrap_err();
        assert_eq!(err.kind(), "invalid");
        assert_eq!(err.key(), Some("prefill[0].points_ms"));
        assert_eq!(err.line(), Some(25), "{err}");
    }
}
