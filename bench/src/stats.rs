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

/// The work a boundary must add to a call on top of a relay hop, measured in this run's
/// sections 3 and 5 and its fdatasync probe (medians): a decision, a record line, and where the
/// record is `always`, one fdatasync before the answer (back to back: the smaller figure).
#[derive(Clone, Copy)]
pub struct MustAdd {
    pub decide: Duration,
    pub append: Duration,
    pub fsync: Duration,
}

impl MustAdd {
    /// "; floor of what the boundary must add{what}: the relay's hop + …", with the ratio of
    /// that sum to the hop, and whether it alone puts a ≤ 1.0× goal out of reach.
    pub fn floor(&self, relay: Duration, what: &str, durable: bool) -> String {
        let sync = durable.then_some(self.fsync);
        let required = relay + self.decide + self.append + sync.unwrap_or_default();
        let rr = ratio(required, relay);
        format!(
            "; floor of what the boundary must add{what}: the relay's {} + a decision {} + a \
             record line {}{} = {} = {rr:.2}× the relay's{}",
            dur(relay),
            dur(self.decide),
            dur(self.append),
            sync.map(|d| format!(" + an fdatasync {}", dur(d)))
                .unwrap_or_default(),
            dur(required),
            reach(rr > 1.0)
        )
    }
}

/// The words a floor row ends with: whether that floor alone already misses the goal.
pub fn reach(out_of_reach: bool) -> &'static str {
    if out_of_reach {
        ", so this goal is out of reach here"
    } else {
        ""
    }
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

#[cfg(test)]
mod floor {
    use std::time::Duration;

    use super::MustAdd;

    /// Sections 2 and 9 say their floor in the same words: a `batch` row without the
    /// fdatasync, a durable row with it.
    #[test]
    fn the_floor_is_said_the_same_way_in_every_section() {
        let us = Duration::from_micros;
        let m = MustAdd {
            decide: us(8),
            append: us(2),
            fsync: us(50),
        };
        assert_eq!(
            m.floor(us(20), "", false),
            "; floor of what the boundary must add: the relay's 20.0 µs + a decision 8.0 µs + a \
             record line 2.0 µs = 30.0 µs = 1.50× the relay's, so this goal is out of reach here"
        );
        assert_eq!(
            m.floor(us(20), " (record_sync `always`)", true),
            "; floor of what the boundary must add (record_sync `always`): the relay's 20.0 µs + \
             a decision 8.0 µs + a record line 2.0 µs + an fdatasync 50.0 µs = 80.0 µs = 4.00× \
             the relay's, so this goal is out of reach here"
        );
    }
}
