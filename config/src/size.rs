//! [`ByteSize`]: a byte count written the way people write it ("64GiB", "512MiB", "1.5GiB").

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ValueParseError;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Suffixes accepted after the number, with their multipliers. Binary (`KiB`, 1024-based) and
/// decimal (`KB`, 1000-based) units; a bare number or `B` is bytes.
const UNITS: &[(&str, u64)] = &[
    ("", 1),
    ("B", 1),
    ("KiB", KIB),
    ("MiB", MIB),
    ("GiB", GIB),
    ("TiB", TIB),
    ("KB", 1_000),
    ("kB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
];

/// Units tried, largest first, when writing a size back out.
const DISPLAY_UNITS: &[(&str, u64)] = &[("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)];

/// A number of bytes.
///
/// In TOML either an integer (bytes) or a string: a number, optionally with a fraction, followed by
/// `B`, `KiB`, `MiB`, `GiB`, `TiB` (1024-based) or `KB`, `MB`, `GB`, `TB` (1000-based):
/// `"64GiB"`, `"1.5GiB"`, `"4096"`, `"1GB"`. The value must be a whole number of bytes.
/// It is written back in the shortest exact binary form (`"64GiB"`, `"1536MiB"`, `"4097B"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` KiB.
    pub const fn kib(n: u64) -> Self {
        ByteSize(n * KIB)
    }

    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        ByteSize(n * MIB)
    }

    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        ByteSize(n * GIB)
    }

    /// The number of bytes.
    pub const fn as_u64(self) -> u64 {
        self.0
    }
}

impl From<u64> for ByteSize {
    fn from(bytes: u64) -> Self {
        ByteSize(bytes)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 != 0 {
            for &(suffix, unit) in DISPLAY_UNITS {
                if self.0.is_multiple_of(unit) {
                    return write!(f, "{}{suffix}", self.0 / unit);
                }
            }
        }
        write!(f, "{}B", self.0)
    }
}

fn invalid(s: &str) -> ValueParseError {
    ValueParseError::new(format!(
        "invalid size `{s}`: expected a number followed by B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
    ))
}

impl FromStr for ByteSize {
    type Err = ValueParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let trimmed = s.trim();
        let split = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let unit = unit.trim_start();
        let multiplier =
            UNITS.iter().find(|(name, _)| *name == unit).map(|&(_, m)| u128::from(m)).ok_or_else(|| invalid(s))?;
        let (int, frac) = number.split_once('.').unwrap_or((number, ""));
        if int.is_empty() || (number.contains('.') && frac.is_empty()) || frac.contains('.') {
            return Err(invalid(s));
        }
        let too_large = || ValueParseError::new(format!("invalid size `{s}`: larger than {} bytes", u64::MAX));
        // At most 20 integer digits fit in u64; more cannot be exact in u128 arithmetic below.
        if int.trim_start_matches('0').len() > 20 || frac.len() > 18 {
            return Err(if frac.len() > 18 {
                ValueParseError::new(format!("invalid size `{s}`: too many fractional digits"))
            } else {
                too_large()
            });
        }
        let int: u128 = int.parse().map_err(|_| invalid(s))?;
        let mut bytes = int.checked_mul(multiplier).ok_or_else(too_large)?;
        if !frac.is_empty() {
            let scale = 10u128.pow(frac.len() as u32);
            let frac: u128 = frac.parse().map_err(|_| invalid(s))?;
            let scaled = frac * multiplier;
            if !scaled.is_multiple_of(scale) {
                return Err(ValueParseError::new(format!("invalid size `{s}`: not a whole number of bytes")));
            }
            bytes += scaled / scale;
        }
        u64::try_from(bytes).map(ByteSize).map_err(|_| too_large())
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;

        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"64GiB\", \"512MiB\" or an integer number of bytes")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size `{v}`: must not be negative")))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_any(SizeVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_documented_forms() {
        let cases: &[(&str, u64)] = &[
            ("64GiB", 64 * GIB),
            ("512MiB", 512 * MIB),
            ("4KiB", 4 * KIB),
            ("1.5GiB", 3 * GIB / 2),
            ("4096", 4096),
            ("4096B", 4096),
            ("1GB", 1_000_000_000),
            ("1MB", 1_000_000),
            ("1KB", 1_000),
            ("2TiB", 2 * TIB),
            (" 8 MiB ", 8 * MIB),
            ("0", 0),
            ("18446744073709551615", u64::MAX),
        ];
        for &(s, want) in cases {
            assert_eq!(s.parse::<ByteSize>(), Ok(ByteSize(want)), "{s}");
        }
    }

    #[test]
    fn rejects_bad_forms_clearly() {
        let err = "12XB".parse::<ByteSize>().unwrap_err().to_string();
        assert_eq!(err, "invalid size `12XB`: expected a number followed by B, KiB, MiB, GiB, TiB, KB, MB, GB, TB");
        for s in ["", "GiB", "1..5GiB", "1.GiB", ".5GiB", "-1", "1 2", "1e3"] {
            assert!(s.parse::<ByteSize>().is_err(), "{s}");
        }
        assert!("0.3GiB".parse::<ByteSize>().unwrap_err().to_string().contains("whole number"));
        assert!("18446744073709551616".parse::<ByteSize>().unwrap_err().to_string().contains("larger"));
        assert!("20TB0".parse::<ByteSize>().is_err());
        assert!("99999999TiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn displays_shortest_exact_binary_form() {
        assert_eq!(ByteSize::gib(64).to_string(), "64GiB");
        assert_eq!(ByteSize::mib(512).to_string(), "512MiB");
        assert_eq!(ByteSize(3 * GIB / 2).to_string(), "1536MiB");
        assert_eq!(ByteSize(4097).to_string(), "4097B");
        assert_eq!(ByteSize(1_000_000_000).to_string(), "1000000000B");
        assert_eq!(ByteSize(0).to_string(), "0B");
    }

    #[test]
    fn deserializes_from_integer_and_string() {
        #[derive(Deserialize)]
        struct T {
            a: ByteSize,
            b: ByteSize,
        }
        let t: T = toml::from_str("a = 4096\nb = \"2MiB\"").unwrap();
        assert_eq!((t.a, t.b), (ByteSize(4096), ByteSize::mib(2)));
        assert!(toml::from_str::<T>("a = -1\nb = 0").is_err());
    }

    proptest! {
        #[test]
        fn display_round_trips(bytes in any::<u64>()) {
            let size = ByteSize(bytes);
            prop_assert_eq!(size.to_string().parse::<ByteSize>(), Ok(size));
        }

        #[test]
        fn binary_multiples_round_trip(n in 0u64..1 << 20, shift in prop::sample::select(vec![0u32, 10, 20, 30, 40])) {
            let size = ByteSize(n << shift);
            prop_assert_eq!(size.to_string().parse::<ByteSize>(), Ok(size));
        }
    }
}
