//! Samples and their summaries (median, p99, throughput), and how durations are printed.
//!
//! Percentiles are nearest-rank on the sorted samples: the median of 1,000 samples is the 500th,
//! the p99 the 990th. Nothing here measures: callers push what they timed.

use std::time::Duration;

/// Timed samples, in nanoseconds.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    ns: Vec<u64>,
}

/// What a table shows of a set of samples.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub n: usize,
    pub median: Duration,
    pub p99: Duration,
}

impl Samples {
    pub fn with_capacity(n: usize) -> Self {
        Self {
            ns: Vec::with_capacity(n),
        }
    }

    pub fn push(&mut self, d: Duration) {
        self.ns
            .push(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    pub fn extend(&mut self, other: Samples) {
        self.ns.extend(other.ns);
    }

    pub fn len(&self) -> usize {
        self.ns.len()
    }

    pub fn summary(&self) -> Summary {
        let mut sorted = self.ns.clone();
        sorted.sort_unstable();
        Summary {
            n: sorted.len(),
            median: Duration::from_nanos(percentile(&sorted, 50.0)),
            p99: Duration::from_nanos(percentile(&sorted, 99.0)),
        }
    }
}

/// Nearest-rank percentile of sorted samples (0 when there are none).
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `812 ns`, `74.1 µs`, `2.31 ms`, `1.20 s`.
pub fn dur(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    if ns < 1_000.0 {
        format!("{ns:.0} ns")
    } else if ns < 1_000_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else if ns < 1_000_000_000.0 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

/// A signed difference of two durations, printed like [`dur`] with a sign.
pub fn delta(a: Duration, b: Duration) -> String {
    if a >= b {
        format!("+{}", dur(a - b))
    } else {
        format!("−{}", dur(b - a))
    }
}

/// `a / b` with two decimals.
pub fn ratio(a: Duration, b: Duration) -> f64 {
    if b.is_zero() {
        return f64::INFINITY;
    }
    a.as_secs_f64() / b.as_secs_f64()
}

/// Calls per second, rounded (`21,340`).
pub fn rate(calls: u64, wall: Duration) -> f64 {
    if wall.is_zero() {
        return 0.0;
    }
    calls as f64 / wall.as_secs_f64()
}

/// An integer with thousands separators.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// KiB as MiB with one decimal.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut s = Samples::default();
        for i in 1..=1000u64 {
            s.push(Duration::from_nanos(i));
        }
        let sum = s.summary();
        assert_eq!(sum.median, Duration::from_nanos(500));
        assert_eq!(sum.p99, Duration::from_nanos(990));
        assert_eq!(Samples::default().summary().median, Duration::ZERO);
    }

    #[test]
    fn formatting() {
        assert_eq!(thousands(21340), "21,340");
        assert_eq!(thousands(999), "999");
        assert_eq!(dur(Duration::from_micros(74)), "74.0 µs");
        assert_eq!(dur(Duration::from_micros(2310)), "2.31 ms");
        assert_eq!(
            delta(Duration::from_micros(10), Duration::from_micros(12)),
            "−2.0 µs"
        );
    }
}
