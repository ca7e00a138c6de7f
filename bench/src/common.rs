//! What the collective benchmarks share: the error type, a spinning barrier for single-call
//! timings, the median, and the `RESULT {json}` writer.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The benchmarks' error type (Send: ranks run on threads).
pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A barrier that spins (a futex wake-up can skew the ranks' launches by tens of µs, which a
/// single-call latency would measure instead of the call). Bounded: after 30 s it lets a
/// thread through (a rank died; its own thread reports the error).
pub struct SpinBarrier {
    n: usize,
    arrived: AtomicUsize,
}

impl SpinBarrier {
    /// A barrier for `n` threads.
    pub fn new(n: usize) -> Self {
        SpinBarrier {
            n,
            arrived: AtomicUsize::new(0),
        }
    }

    /// The barrier of round `round` (0, 1, ...; every thread passes the same rounds in order).
    pub fn wait(&self, round: usize) {
        self.arrived.fetch_add(1, Ordering::AcqRel);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while self.arrived.load(Ordering::Acquire) < self.n * (round + 1) {
            if std::time::Instant::now() > deadline {
                break;
            }
            std::hint::spin_loop();
        }
    }
}

/// The median (NaN for no values).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Print one `RESULT {json}` line; serde_json would write a non-finite float as null, so a
/// non-finite time or bandwidth is an error instead of a silently dropped value.
pub fn result_line(fields: serde_json::Value) -> Res<()> {
    for k in ["time_us", "algbw_gbs", "busbw_gbs"] {
        if !fields[k].as_f64().is_some_and(f64::is_finite) {
            return Err(format!("a non-finite {k} in {fields}").into());
        }
    }
    println!("RESULT {}", serde_json::to_string(&fields)?);
    Ok(())
}
