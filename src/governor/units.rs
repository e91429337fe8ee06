//! How sizes and durations read in messages and in the `memgov` tool: sizes
//! in the largest binary unit that keeps the number at least one, to one
//! decimal, with the exact count of bytes beside it; durations in
//! milliseconds to the microsecond.

use std::fmt;
use std::time::Duration;

/// A size in bytes, displayed for people: `3.0 MiB (3145728 bytes)`.
///
/// Below one KiB the exact count is the whole figure (`512 bytes`). The
/// alternate form (`{:#}`) leaves out the exact count (`3.0 MiB`), for
/// tables whose columns have no room for it. Every error message that
/// prints a size and the `memgov` tool format sizes with this type, so a
/// reader sees one unit and one precision everywhere and can still match
/// the exact number against a budget or a snapshot.
///
/// ```
/// use memgov::Bytes;
/// assert_eq!(Bytes(3 << 20).to_string(), "3.0 MiB (3145728 bytes)");
/// assert_eq!(format!("{:#}", Bytes(3 << 20)), "3.0 MiB");
/// assert_eq!(Bytes(1).to_string(), "1 byte");
/// assert_eq!(Bytes(512).to_string(), "512 bytes");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Bytes(pub u64);

const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

impl Bytes {
    /// The scaled value and its unit, or `None` below one KiB.
    fn scaled(self) -> Option<(f64, &'static str)> {
        if self.0 < 1024 {
            return None;
        }
        let mut value = self.0 as f64 / 1024.0;
        let mut unit = 0;
        // Step up while the value would print as 1024.0 or more, so that
        // 1048575 bytes reads 1.0 MiB rather than 1024.0 KiB.
        while value >= 1023.95 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        Some((value, UNITS[unit]))
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scaled() {
            None if self.0 == 1 => f.write_str("1 byte"),
            None => write!(f, "{} bytes", self.0),
            Some((value, unit)) if f.alternate() => write!(f, "{value:.1} {unit}"),
            Some((value, unit)) => write!(f, "{value:.1} {unit} ({} bytes)", self.0),
        }
    }
}

impl From<u64> for Bytes {
    fn from(bytes: u64) -> Self {
        Self(bytes)
    }
}

/// A duration displayed for people: always milliseconds with three
/// decimals (`0.042 ms`, `1250.000 ms`), so that figures of one report,
/// from microsecond latencies to second-long teardowns, compare at a glance.
///
/// ```
/// use memgov::Elapsed;
/// use std::time::Duration;
/// assert_eq!(Elapsed(Duration::from_micros(42)).to_string(), "0.042 ms");
/// assert_eq!(Elapsed(Duration::from_millis(1250)).to_string(), "1250.000 ms");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Elapsed(pub Duration);

impl fmt::Display for Elapsed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3} ms", self.0.as_secs_f64() * 1e3)
    }
}

impl From<Duration> for Elapsed {
    fn from(d: Duration) -> Self {
        Self(d)
    }
}

#[cfg(test)]
mod tests {
    use super::{Bytes, Elapsed};
    use std::time::Duration;

    #[test]
    fn durations_in_one_unit_and_precision() {
        for (d, text) in [
            (Duration::ZERO, "0.000 ms"),
            (Duration::from_nanos(400), "0.000 ms"),
            (Duration::from_nanos(1500), "0.002 ms"),
            (Duration::from_micros(60_600), "60.600 ms"),
            (Duration::from_secs(3), "3000.000 ms"),
        ] {
            assert_eq!(Elapsed(d).to_string(), text);
        }
    }

    #[test]
    fn each_unit_with_the_exact_count() {
        let cases = [
            (0, "0 bytes", "0 bytes"),
            (1, "1 byte", "1 byte"),
            (1023, "1023 bytes", "1023 bytes"),
            (1024, "1.0 KiB (1024 bytes)", "1.0 KiB"),
            (1536, "1.5 KiB (1536 bytes)", "1.5 KiB"),
            (3 << 20, "3.0 MiB (3145728 bytes)", "3.0 MiB"),
            ((1 << 20) - 1, "1.0 MiB (1048575 bytes)", "1.0 MiB"),
            (5 << 30, "5.0 GiB (5368709120 bytes)", "5.0 GiB"),
            (3 << 40, "3.0 TiB (3298534883328 bytes)", "3.0 TiB"),
            (
                u64::MAX,
                "16.0 EiB (18446744073709551615 bytes)",
                "16.0 EiB",
            ),
        ];
        for (bytes, full, short) in cases {
            assert_eq!(Bytes(bytes).to_string(), full);
            assert_eq!(format!("{:#}", Bytes(bytes)), short);
        }
    }
}
