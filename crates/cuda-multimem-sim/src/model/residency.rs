//! Co-residency: the resident-block slots of each device, which launches take while they run.
//!
//! A launch whose blocks fit `b` to a multiprocessor (`occupancy::blocks_per_sm`) needs
//! `min(grid, capacity)` slots, its capacity being `multiprocessors × b` blocks (for a cluster
//! kernel: the clusters that fit, times the cluster size); each of its blocks takes `1/b` of a
//! multiprocessor. A device has its multiprocessors' worth of slots. A launch takes its slots on
//! its stream's worker when the stream reaches it and gives them back when its kernel returns;
//! a launch that finds too few free waits, holding those it got, as blocks that cannot start
//! wait on a GPU. Launches of one device are served in the order they reached their streams
//! (only the first waiting one collects slots). So spin-waiting kernels of several ranks whose
//! grids together exceed the device do not all run: the first ones spin until their own
//! deadlines, as on hardware, and the rest start once slots free. A launch that waits longer
//! than the session's limit (`RESIDENCY_LIMIT` unless set) fails with
//! `CUDA_ERROR_LAUNCH_TIMEOUT` instead of hanging forever.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use cuda_multimem_sys::CUresult;
use parking_lot::{Condvar, Mutex};

use crate::state::{SimResult, State};

/// One multiprocessor in slot units: a block of a launch with `b` blocks per multiprocessor
/// takes `UNITS_PER_SM / b` of them, exactly, for every `b` from 1 to 32 (the least common
/// multiple of 1..=32).
pub(crate) const UNITS_PER_SM: u64 = 144_403_552_893_600;

/// How long a simulated launch waits for resident-block slots on its device before the
/// simulator calls it a deadlock and fails it with `CUDA_ERROR_LAUNCH_TIMEOUT` (a GPU would
/// wait forever); `Simulator::set_residency_limit` changes it for a session. A launch waits
/// while the kernels that hold the slots run, so this is far longer than any kernel of the
/// suite runs, on a machine loaded four times over. See `docs/simulator.md`, "Occupancy and
/// co-residency".
pub const DEFAULT_LIMIT: Duration = Duration::from_secs(300);

#[derive(Default)]
struct Inner {
    /// device -> free units (created full at first use)
    free: HashMap<i32, u64>,
    /// device -> waiting launches, in arrival order (tickets)
    queue: HashMap<i32, VecDeque<u64>>,
    next_ticket: u64,
    /// Launches that found too few free slots.
    waits: u64,
    /// Set at the end of the session: every wait ends.
    closed: bool,
    /// The session's wait limit (`None`: the default).
    limit: Option<Duration>,
}

/// The slots of every device of a session.
#[derive(Default)]
pub(crate) struct Residency {
    inner: Mutex<Inner>,
    freed: Condvar,
}

/// Slots a running launch holds; given back when dropped.
pub(crate) struct Resident<'a> {
    pool: &'a Residency,
    device: i32,
    units: u64,
}

impl Drop for Resident<'_> {
    fn drop(&mut self) {
        let mut g = self.pool.inner.lock();
        *g.free.entry(self.device).or_insert(0) += self.units;
        drop(g);
        self.pool.freed.notify_all();
    }
}

/// The slot units a launch of `grid` blocks needs on a device of `sms` multiprocessors, its
/// blocks fitting `per_sm` to a multiprocessor and `capacity` blocks on the device at once.
pub(crate) fn units_for(grid: u64, per_sm: u32, capacity: u64) -> u64 {
    grid.min(capacity) * (UNITS_PER_SM / per_sm.max(1) as u64)
}

impl Residency {
    /// Take `units` of device `dev` (which has `sms` multiprocessors), waiting for them in
    /// arrival order; `Err` after the session's limit (`CUDA_ERROR_LAUNCH_TIMEOUT`) or at the
    /// end of the session. `what` names the launch in the limit's message.
    pub fn acquire(&self, dev: i32, sms: u32, units: u64, what: &str) -> SimResult<Resident<'_>> {
        let mut g = self.inner.lock();
        let limit = g.limit.unwrap_or(DEFAULT_LIMIT);
        let ticket = g.next_ticket;
        g.next_ticket += 1;
        g.queue.entry(dev).or_default().push_back(ticket);
        let deadline = Instant::now().checked_add(limit);
        let mut held = 0u64;
        let mut counted = false;
        loop {
            let head = g.queue.get(&dev).and_then(|q| q.front().copied()) == Some(ticket);
            if head && !g.closed {
                let free = g.free.entry(dev).or_insert(sms as u64 * UNITS_PER_SM);
                let take = (*free).min(units - held);
                *free -= take;
                held += take;
                if held == units {
                    g.queue.get_mut(&dev).map(VecDeque::pop_front);
                    drop(g);
                    self.freed.notify_all();
                    return Ok(Resident {
                        pool: self,
                        device: dev,
                        units,
                    });
                }
            }
            if !counted {
                counted = true;
                g.waits += 1;
            }
            let timed_out = g.closed
                || match deadline {
                    Some(d) => self.freed.wait_until(&mut g, d).timed_out(),
                    None => {
                        self.freed.wait(&mut g);
                        false
                    }
                };
            if timed_out || g.closed {
                // Give back what was collected and leave the queue.
                *g.free.entry(dev).or_insert(0) += held;
                if let Some(q) = g.queue.get_mut(&dev) {
                    q.retain(|&t| t != ticket);
                }
                let closed = g.closed;
                drop(g);
                self.freed.notify_all();
                if !closed {
                    eprintln!(
                        "cuda-multimem-sim: {what} on device {dev} waited {limit:?} for resident-block slots that never freed (the kernels running there did not end); failing it with CUDA_ERROR_LAUNCH_TIMEOUT"
                    );
                }
                return Err(CUresult::CUDA_ERROR_LAUNCH_TIMEOUT);
            }
        }
    }
}

/// The slots of the session `st`.
pub(crate) fn of(st: &State) -> std::sync::Arc<Residency> {
    st.ext::<Residency>()
}

/// How many launches so far found too few free slots and waited.
pub(crate) fn waits(st: &State) -> u64 {
    of(st).inner.lock().waits
}

/// Set how long a launch may wait for slots (`Simulator::set_residency_limit`).
pub(crate) fn set_limit(st: &State, limit: Duration) {
    of(st).inner.lock().limit = Some(limit);
}

/// End of the session: every waiting launch gives up (its stream's worker can stop).
pub(crate) fn close(st: &State) {
    let r = of(st);
    r.inner.lock().closed = true;
    r.freed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_blocks_per_sm_divides_a_multiprocessor_exactly() {
        for b in 1..=32u64 {
            assert_eq!(UNITS_PER_SM % b, 0, "{b}");
        }
        // a full device of 132 multiprocessors stays far inside u64
        assert!(132u64.checked_mul(UNITS_PER_SM).is_some());
        assert_eq!(units_for(1000, 2, 264), 264 * (UNITS_PER_SM / 2));
        assert_eq!(units_for(10, 4, 528), 10 * (UNITS_PER_SM / 4));
    }
}
