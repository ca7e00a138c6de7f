//! The simulator's session: one simulated machine per process at a time. [`Simulator`] starts
//! it (installs its [`State`]), hands out its loader entry, arms failures, reports call counts,
//! live resources and the model's test-only views, and ends it in teardown order when the last
//! clone goes.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cuda_multimem_sys::CUmemLocationType;
use parking_lot::Mutex;

use crate::config::SimConfig;
use crate::model;
use crate::state::{set_current, FailurePlan, State};

static SESSION: OnceLock<Arc<Mutex<()>>> = OnceLock::new();

/// A running simulated machine. While one is alive in this process, the simulated driver's entry
/// points answer for it; starting a second one waits until the first is dropped (tests that run
/// in parallel threads of one process take turns).
#[derive(Clone)]
pub struct Simulator {
    session: Arc<Session>,
}

struct Session {
    state: Arc<State>,
    _guard: parking_lot::ArcMutexGuard<parking_lot::RawMutex, ()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        teardown(&self.state);
        set_current(None);
        *OWNER.lock() = None;
    }
}

/// End of a session, in order: end the launches' waits for slots and stop the stream workers
/// (nothing runs any more), then free what
/// is still allocated — VMM ranges (whose deferred unmaps waited for those workers) first, then
/// the endpoints' and multicast objects' views, then plain memory.
fn teardown(st: &State) {
    // A launch waiting for resident-block slots would keep its stream's worker from stopping.
    model::residency::close(st);
    model::stream::shutdown_all(st);
    model::vmm::teardown(st);
    model::endpoint::teardown(st);
    model::multicast::teardown(st);
    model::memory::teardown(st);
}

/// The thread that started the running session.
static OWNER: Mutex<Option<std::thread::ThreadId>> = Mutex::new(None);

/// Errors of starting a simulator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The description is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// This thread already runs a simulator session; a second would wait for itself forever.
    #[error("this thread already holds a simulator session; drop it before starting another")]
    AlreadyRunning,
    /// Another thread's session did not end in time.
    #[error("timed out after {0:?} waiting for another simulator session in this process to end")]
    Timeout(std::time::Duration),
}

impl Simulator {
    /// Start a simulated machine described by `config`.
    pub fn start(config: SimConfig) -> Result<Simulator, StartError> {
        config.validate()?;
        if *OWNER.lock() == Some(std::thread::current().id()) {
            return Err(StartError::AlreadyRunning);
        }
        let lock = SESSION.get_or_init(|| Arc::new(Mutex::new(()))).clone();
        let wait = std::time::Duration::from_secs(900);
        let guard = lock
            .try_lock_arc_for(wait)
            .ok_or(StartError::Timeout(wait))?;
        let state = Arc::new(State::new(config));
        set_current(Some(state.clone()));
        *OWNER.lock() = Some(std::thread::current().id());
        Ok(Simulator {
            session: Arc::new(Session {
                state,
                _guard: guard,
            }),
        })
    }

    /// Start from the options of `CUDA_MULTIMEM_DRIVER=sim:<options>` (see [`SimConfig::parse`]).
    pub fn start_from_options(options: &str) -> Result<Simulator, StartError> {
        Simulator::start(SimConfig::parse(options)?)
    }

    fn state(&self) -> &State {
        &self.session.state
    }

    /// The machine's description.
    pub fn config(&self) -> &SimConfig {
        &self.state().config
    }

    /// The loader entry (`cuGetProcAddress`, `cuDriverGetVersion`) of this simulated driver; it
    /// keeps the session alive.
    pub fn entry(&self) -> cuda_multimem_sys::Entry {
        cuda_multimem_sys::Entry {
            get_proc_address: crate::api::table::cuGetProcAddress_v12000,
            driver_get_version: crate::api::table::cuDriverGetVersion_v2020,
            origin: cuda_multimem_sys::Origin::Custom(self.config().to_string()),
            keepalive: Some(Arc::new(self.clone())),
        }
    }

    /// A loaded [`cuda_multimem_sys::Driver`] over this simulator.
    pub fn driver(&self) -> Result<cuda_multimem_sys::Driver, cuda_multimem_sys::LoadError> {
        cuda_multimem_sys::Driver::from_entry(self.entry())
    }

    /// Make a later call fail (see [`FailurePlan`]); replaces any pending plan. A plan whose
    /// code is `CUDA_SUCCESS` is no failure: it only drops the pending plan (armed, it would
    /// skip the call's work and report success, leaving its outputs unwritten).
    pub fn inject_failure(&self, plan: FailurePlan) {
        self.state().arm_failure(plan);
    }

    /// Drop a pending failure plan; returns the call that an earlier plan failed, if it fired.
    pub fn clear_failure(&self) -> Option<String> {
        self.state().disarm_failure()
    }

    /// How often `symbol` was called (entered, whether or not it succeeded).
    pub fn calls(&self, symbol: &str) -> u64 {
        self.state().calls(symbol)
    }

    /// How many times `cuGetProcAddress` was asked.
    pub fn proc_address_requests(&self) -> u64 {
        self.state().proc_address_requests.load(Ordering::Relaxed)
    }

    /// Resources alive now, by kind (only non-zero counts): allocations, mappings, streams, ...
    pub fn live_resources(&self) -> BTreeMap<String, i64> {
        self.state().live_resources()
    }

    /// Inject random delays: every kernel launch, every [`LaunchArgs::jitter`] inside a
    /// host-side kernel and every asynchronous copy first sleeps a random time in `0..=max`
    /// (drawn from `seed`), so devices drift apart and protocol races show. `Duration::ZERO`
    /// turns it off; `max` is taken in whole microseconds (up to `u64::MAX - 1` of them).
    ///
    /// [`LaunchArgs::jitter`]: crate::LaunchArgs::jitter
    pub fn set_kernel_delays(&self, max: Duration, seed: u64) {
        model::delay::set(self.state(), max, seed);
    }

    /// How many kernel launches so far found too few free resident-block slots on their device
    /// and waited for running kernels to end (co-residency, see `docs/simulator.md`).
    pub fn residency_waits(&self) -> u64 {
        model::residency::waits(self.state())
    }

    /// How long a launch may wait for resident-block slots before it fails with
    /// `CUDA_ERROR_LAUNCH_TIMEOUT` ([`RESIDENCY_LIMIT`] by default); applies to waits that
    /// start afterwards.
    ///
    /// [`RESIDENCY_LIMIT`]: crate::RESIDENCY_LIMIT
    pub fn set_residency_limit(&self, limit: Duration) {
        model::residency::set_limit(self.state(), limit);
    }

    /// Unmapped ranges whose host pages still wait for work queued before the unmap on the
    /// devices granted access to them (`cuMemUnmap` does not wait; see docs/architecture.md).
    /// They are no live resources — for the driver's API the mapping is gone — but their
    /// addresses stay taken until that work has finished.
    pub fn pending_unmaps(&self) -> usize {
        model::vmm::pending_unmaps(self.state())
    }

    /// Where the simulated driver keeps the managed range `[ptr, ptr + len)` now: the location
    /// type and id when every page of it lives at one location (after the stream operations that
    /// moved it ran), `None` when its pages are spread, not populated, discarded, or the range is
    /// not managed memory. For tests; the real driver has no such query.
    pub fn managed_residence(&self, ptr: u64, len: usize) -> Option<(CUmemLocationType, i32)> {
        model::managed::residence(self.state(), ptr, len)
    }
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Simulator({})", self.config())
    }
}
