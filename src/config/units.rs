//! Value types that TOML settings are written in: memory thresholds (`"25%"`, `"1.5GiB"`,
//! `"off"`), byte sizes (`"10MiB"`) and durations that may be switched off (`"off"`).
//!
//! Each type parses from a string (or, where it makes sense, an integer) and writes itself back
//! in the same form, so `throttlehost config check` prints values the way a user types them.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A memory threshold: off, a share of the machine's memory, or an absolute size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryThreshold {
    /// The condition is never evaluated.
    Off,
    /// A percentage (0 < p <= 100) of physical memory (or of the cgroup limit, if lower).
    Percent(f64),
    /// An absolute number of bytes.
    Bytes(u64),
}

impl MemoryThreshold {
    /// The threshold in bytes for a machine with `total` bytes of memory; `None` when off.
    pub fn resolve(self, total: u64) -> Option<u64> {
        match self {
            MemoryThreshold::Off => None,
            MemoryThreshold::Percent(p) => Some((total as f64 * p / 100.0) as u64),
            MemoryThreshold::Bytes(b) => Some(b),
        }
    }
}

impl FromStr for MemoryThreshold {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("off") {
            return Ok(MemoryThreshold::Off);
        }
        if let Some(num) = t.strip_suffix('%') {
            let p: f64 = num
                .trim()
                .parse()
                .map_err(|_| format!("`{s}` is not a percentage; write for example \"25%\""))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!(
                    "`{s}`: a percentage must be above 0% and at most 100%"
                ));
            }
            return Ok(MemoryThreshold::Percent(p));
        }
        let bytes = parse_byte_size(t).map_err(|e| {
            format!("`{s}` is not a memory threshold ({e}); write \"25%\", \"1.5GiB\" or \"off\"")
        })?;
        if bytes == 0 {
            return Err(format!(
                "`{s}`: a memory threshold of 0 bytes; write \"off\" to disable"
            ));
        }
        Ok(MemoryThreshold::Bytes(bytes))
    }
}

impl fmt::Display for MemoryThreshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryThreshold::Off => f.write_str("off"),
            MemoryThreshold::Percent(p) => write!(f, "{p}%"),
            MemoryThreshold::Bytes(b) => f.write_str(&format_byte_size(*b)),
        }
    }
}

impl Serialize for MemoryThreshold {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MemoryThreshold {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = MemoryThreshold;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a memory threshold such as \"25%\", \"1.5GiB\" or \"off\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                if v {
                    Err(E::custom(
                        "`true` is not a memory threshold; write \"25%\" or \"1GiB\"",
                    ))
                } else {
                    Ok(MemoryThreshold::Off)
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// A size in bytes, written as `"10MiB"`, `"512KB"`, `"1.5GiB"` or a plain integer of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_byte_size(self.0))
    }
}

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_byte_size(s).map(ByteSize)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as \"10MiB\", \"512KB\" or a number of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                parse_byte_size(v).map(ByteSize).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("{v} is negative; a size must be >= 0")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(ByteSize(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses `"1.5GiB"`, `"10 MB"`, `"512k"`, `"100"` into bytes. Binary (KiB) and decimal (KB)
/// suffixes both mean what they say.
pub fn parse_byte_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` does not start with a number"))?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{s}`; use B, KB, MB, GB, KiB, MiB or GiB"
            ));
        }
    };
    Ok((value * multiplier).round() as u64)
}

/// Writes bytes in the largest binary unit that keeps the number readable.
pub fn format_byte_size(b: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, size) in UNITS {
        if b >= size {
            let v = b as f64 / size as f64;
            if b.is_multiple_of(size) {
                return format!("{}{name}", b / size);
            }
            return format!("{}{name}", (v * 100.0).round() / 100.0);
        }
    }
    format!("{b}B")
}

/// Serde helpers for a `Duration` written as `"500ms"`, `"15s"`, `"5m"`.
pub mod duration {
    use super::*;

    /// Serializes a duration the way a user writes it.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    /// Deserializes `"500ms"` and friends, naming the accepted forms on error.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(de::Error::custom)
    }

    /// Parses a humantime duration with an error that shows an example. Longer than
    /// [`MAX_SETTING_DURATION`] is refused: the host adds settings to clock readings, and a
    /// sum past the clock's range would end the task that computed it.
    pub fn parse(s: &str) -> Result<Duration, String> {
        let d = humantime::parse_duration(s.trim()).map_err(|e| {
            format!("`{s}` is not a duration ({e}); write for example \"500ms\" or \"15s\"")
        })?;
        if d > MAX_SETTING_DURATION {
            return Err(format!(
                "`{}` is longer than the longest duration a setting may have (365 days)",
                s.trim()
            ));
        }
        Ok(d)
    }

    /// The longest duration any setting accepts: 365 days.
    pub const MAX_SETTING_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);
}

/// Serde helpers for an optional duration written as a duration or `"off"`.
pub mod optional_duration {
    use super::*;

    /// Writes `"off"` for `None`.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.collect_str(&humantime::format_duration(*d)),
            None => s.serialize_str("off"),
        }
    }

    /// Reads `"off"` as `None`, anything else as a duration.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = String::deserialize(d)?;
        if s.trim().eq_ignore_ascii_case("off") {
            Ok(None)
        } else {
            super::duration::parse(&s)
                .map(Some)
                .map_err(de::Error::custom)
        }
    }
}

/// Serde helpers for an optional duration that may simply be absent (`None`); used with
/// `#[serde(default)]`.
pub mod optional_duration_opt {
    use super::*;

    /// Writes the duration, or nothing.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.collect_str(&humantime::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    /// Reads a duration string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = String::deserialize(d)?;
        super::duration::parse(&s)
            .map(Some)
            .map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_thresholds_parse_in_every_documented_form() {
        assert_eq!("25%".parse(), Ok(MemoryThreshold::Percent(25.0)));
        assert_eq!("off".parse(), Ok(MemoryThreshold::Off));
        assert_eq!("1.5GiB".parse(), Ok(MemoryThreshold::Bytes(1_610_612_736)));
        assert_eq!("512MB".parse(), Ok(MemoryThreshold::Bytes(512_000_000)));
        assert!("150%".parse::<MemoryThreshold>().is_err());
        assert!(
            "lots"
                .parse::<MemoryThreshold>()
                .unwrap_err()
                .contains("lots")
        );
        assert!("0".parse::<MemoryThreshold>().unwrap_err().contains("off"));
    }

    #[test]
    fn memory_threshold_resolves_against_total_memory() {
        assert_eq!(MemoryThreshold::Percent(25.0).resolve(1000), Some(250));
        assert_eq!(MemoryThreshold::Bytes(7).resolve(1000), Some(7));
        assert_eq!(MemoryThreshold::Off.resolve(1000), None);
    }

    #[test]
    fn byte_sizes_round_trip_through_display() {
        for s in ["10MiB", "1.5GiB", "512B", "3KiB"] {
            let b: ByteSize = s.parse().unwrap();
            assert_eq!(b.to_string(), s, "round trip of {s}");
        }
        assert_eq!(parse_byte_size("2 KB"), Ok(2000));
        assert!(
            parse_byte_size("2 parsecs")
                .unwrap_err()
                .contains("parsecs")
        );
    }

    #[test]
    fn durations_name_the_bad_value() {
        assert_eq!(duration::parse("500ms"), Ok(Duration::from_millis(500)));
        assert!(
            duration::parse("2 fortnights")
                .unwrap_err()
                .contains("2 fortnights")
        );
    }
}
