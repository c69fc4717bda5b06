//! [`HumanDuration`]: a duration written the way people write it ("30s", "1m30s", "500us").

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ValueParseError;

const NS: u128 = 1;
const US: u128 = 1_000;
const MS: u128 = 1_000_000;
const S: u128 = 1_000_000_000;
const M: u128 = 60 * S;
const H: u128 = 60 * M;
const D: u128 = 24 * H;

/// Units accepted when parsing. Longest names first so that `ms` is not read as `m` + `s`.
const PARSE_UNITS: &[(&str, u128)] =
    &[("ns", NS), ("us", US), ("µs", US), ("ms", MS), ("s", S), ("m", M), ("h", H), ("d", D)];

/// Units used when writing a duration back out, largest first.
const DISPLAY_UNITS: &[(&str, u128)] = &[("h", H), ("m", M), ("s", S), ("ms", MS), ("us", US), ("ns", NS)];

/// A span of time.
///
/// In TOML a string of one or more `<number><unit>` terms, units `ns`, `us` (or `µs`), `ms`, `s`,
/// `m`, `h`, `d`: `"30s"`, `"2ms"`, `"500us"`, `"1m30s"`, `"1.5s"`, `"0s"`. A bare `"0"` is also
/// accepted. Written back in the shortest exact form (`"90s"`, `"10m"`, `"1h30m"` → `"90m"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    /// `n` seconds.
    pub const fn secs(n: u64) -> Self {
        HumanDuration(Duration::from_secs(n))
    }

    /// `n` milliseconds.
    pub const fn millis(n: u64) -> Self {
        HumanDuration(Duration::from_millis(n))
    }

    /// `n` minutes.
    pub const fn mins(n: u64) -> Self {
        HumanDuration(Duration::from_secs(n * 60))
    }

    /// The duration.
    pub const fn as_duration(self) -> Duration {
        self.0
    }
}

impl From<Duration> for HumanDuration {
    fn from(d: Duration) -> Self {
        HumanDuration(d)
    }
}

impl From<HumanDuration> for Duration {
    fn from(d: HumanDuration) -> Self {
        d.0
    }
}

/// The compound form: every non-zero component, largest unit first ("1h2m3s4ms").
fn compound(mut nanos: u128) -> String {
    let mut out = String::new();
    for &(name, unit) in DISPLAY_UNITS {
        let n = nanos / unit;
        if n > 0 {
            out.push_str(&format!("{n}{name}"));
            nanos %= unit;
        }
    }
    out
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        if nanos == 0 {
            return f.write_str("0s");
        }
        // Candidates: the compound form and every single-unit form that is exact. The first of
        // the shortest wins, so ties go to the compound form and then to larger units.
        let mut best = compound(nanos);
        for &(name, unit) in DISPLAY_UNITS {
            if nanos.is_multiple_of(unit) {
                let single = format!("{}{name}", nanos / unit);
                if single.len() < best.len() {
                    best = single;
                }
            }
        }
        f.write_str(&best)
    }
}

fn invalid(s: &str) -> ValueParseError {
    ValueParseError::new(format!(
        "invalid duration `{s}`: expected numbers with units ns, us, ms, s, m, h, d (e.g. \"30s\", \"1m30s\", \"500us\")"
    ))
}

impl FromStr for HumanDuration {
    type Err = ValueParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut rest = s.trim();
        if rest == "0" {
            return Ok(HumanDuration(Duration::ZERO));
        }
        if rest.is_empty() {
            return Err(invalid(s));
        }
        let mut total: u128 = 0;
        while !rest.is_empty() {
            let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(|| invalid(s))?;
            let (number, tail) = rest.split_at(end);
            let tail = tail.trim_start();
            let unit_len = tail.find(|c: char| c.is_ascii_digit() || c.is_whitespace()).unwrap_or(tail.len());
            let (unit, tail) = tail.split_at(unit_len);
            let unit = PARSE_UNITS.iter().find(|(name, _)| *name == unit).map(|&(_, u)| u).ok_or_else(|| invalid(s))?;
            let (int, frac) = number.split_once('.').unwrap_or((number, ""));
            if int.is_empty() || (number.contains('.') && frac.is_empty()) || frac.contains('.') {
                return Err(invalid(s));
            }
            let too_long = || ValueParseError::new(format!("invalid duration `{s}`: too long"));
            if int.len() > 30 || frac.len() > 18 {
                return Err(too_long());
            }
            let int: u128 = int.parse().map_err(|_| invalid(s))?;
            let mut nanos = int.checked_mul(unit).ok_or_else(too_long)?;
            if !frac.is_empty() {
                let scale = 10u128.pow(frac.len() as u32);
                let frac: u128 = frac.parse().map_err(|_| invalid(s))?;
                // Sub-nanosecond remainders are dropped.
                nanos += frac * unit / scale;
            }
            total = total.checked_add(nanos).ok_or_else(too_long)?;
            rest = tail.trim_start();
        }
        let secs =
            u64::try_from(total / S).map_err(|_| ValueParseError::new(format!("invalid duration `{s}`: too long")))?;
        Ok(HumanDuration(Duration::new(secs, (total % S) as u32)))
    }
}

impl Serialize for HumanDuration {
    fn serialize<Ser: Serializer>(&self, serializer: Ser) -> Result<Ser::Ok, Ser::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<De: Deserializer<'de>>(deserializer: De) -> Result<Self, De::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = HumanDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"30s\", \"2ms\" or \"1m30s\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                v.parse().map_err(E::custom)
            }
        }

        deserializer.deserialize_str(DurationVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(s: &str) -> Duration {
        s.parse::<HumanDuration>().unwrap().0
    }

    #[test]
    fn parses_documented_forms() {
        assert_eq!(d("30s"), Duration::from_secs(30));
        assert_eq!(d("2ms"), Duration::from_millis(2));
        assert_eq!(d("500us"), Duration::from_micros(500));
        assert_eq!(d("500µs"), Duration::from_micros(500));
        assert_eq!(d("1m30s"), Duration::from_secs(90));
        assert_eq!(d("1m 30s"), Duration::from_secs(90));
        assert_eq!(d("10m"), Duration::from_secs(600));
        assert_eq!(d("1h"), Duration::from_secs(3600));
        assert_eq!(d("1d"), Duration::from_secs(86_400));
        assert_eq!(d("0s"), Duration::ZERO);
        assert_eq!(d("0"), Duration::ZERO);
        assert_eq!(d("1.5s"), Duration::from_millis(1500));
        assert_eq!(d("7ns"), Duration::from_nanos(7));
    }

    #[test]
    fn rejects_bad_forms_clearly() {
        for s in ["", "30", "s", "30x", "1..5s", "1.s", "-1s", "1s2", "ms1"] {
            let err = s.parse::<HumanDuration>().unwrap_err().to_string();
            assert!(err.starts_with("invalid duration"), "{s}: {err}");
        }
    }

    #[test]
    fn displays_shortest_form() {
        let cases: &[(Duration, &str)] = &[
            (Duration::ZERO, "0s"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(600), "10m"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(5400), "90m"),
            (Duration::from_secs(3661), "3661s"),
            (Duration::from_millis(3_600_001), "1h1ms"),
            (Duration::from_millis(2), "2ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_micros(500), "500us"),
        ];
        for &(dur, want) in cases {
            assert_eq!(HumanDuration(dur).to_string(), want);
        }
    }

    #[test]
    fn integers_are_rejected_in_toml() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct T {
            t: HumanDuration,
        }
        assert!(toml::from_str::<T>("t = 30").is_err());
        assert_eq!(toml::from_str::<T>("t = \"30s\"").unwrap().t, HumanDuration::secs(30));
    }

    proptest! {
        #[test]
        fn display_round_trips(secs in 0u64..20_000_000_000, nanos in 0u32..1_000_000_000) {
            let dur = HumanDuration(Duration::new(secs, nanos));
            prop_assert_eq!(dur.to_string().parse::<HumanDuration>(), Ok(dur));
        }

        #[test]
        fn round_numbers_round_trip(n in 0u64..100_000, unit in prop::sample::select(vec![1u64, 1_000, 1_000_000, 1_000_000_000, 60_000_000_000])) {
            let dur = HumanDuration(Duration::from_nanos(n * unit));
            prop_assert_eq!(dur.to_string().parse::<HumanDuration>(), Ok(dur));
        }
    }
}
