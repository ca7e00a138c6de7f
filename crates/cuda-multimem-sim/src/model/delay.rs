//! Random delays for protocol tests: each kernel launch, each `LaunchArgs::jitter` inside a
//! host-side kernel and each asynchronous copy sleeps a random time, so devices drift apart.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::state::State;

/// Random per-launch delays (for protocol tests): each launch, and each [`LaunchArgs::jitter`]
/// call inside a kernel, sleeps a random time in `0..=max`.
#[derive(Debug, Default)]
pub(crate) struct Delays {
    max_us: AtomicU64,
    seed: AtomicU64,
}

impl Delays {
    fn draw(&self) -> Duration {
        let max = self.max_us.load(Ordering::Relaxed);
        if max == 0 {
            return Duration::ZERO;
        }
        // splitmix64 over a shared counter: cheap, thread-safe, reproducible in distribution.
        let mut z = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Duration::from_micros(z % (max + 1))
    }
}

/// Sleep a random time if the session injects delays (kernel launches, host-side kernel steps,
/// asynchronous copies).
pub(crate) fn delay(st: &State) {
    let d = st.ext::<Delays>().draw();
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

/// Set the random delay bound of the session (`Simulator::set_kernel_delays`).
pub(crate) fn set(st: &State, max: Duration, seed: u64) {
    let d = st.ext::<Delays>();
    // whole microseconds, at most u64::MAX - 1 so that `draw`'s `max + 1` holds (a delay of
    // half a million years is as good as any longer one)
    let us = u64::try_from(max.as_micros())
        .unwrap_or(u64::MAX)
        .min(u64::MAX - 1);
    d.max_us.store(us, Ordering::Relaxed);
    d.seed.store(seed, Ordering::Relaxed);
}
