//! The simulator's session: one simulated machine per process at a time, its state, handles,
//! call log, failure injection and live-resource accounting.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cuda_multimem_sys::CUresult;
use parking_lot::{Mutex, RwLock};

use crate::config::SimConfig;

/// Result type of a simulated call's body.
pub(crate) type SimResult<T = ()> = Result<T, CUresult>;

/// Kinds of opaque handle; the kind is encoded in the handle's top bits, so a handle of the wrong
/// kind is recognised as invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u64)]
pub(crate) enum Kind {
    Context = 1,
    Stream = 2,
    Event = 3,
    Allocation = 4,
    Module = 5,
    Function = 6,
    Graph = 7,
    GraphExec = 8,
    Multicast = 9,
}

const KIND_SHIFT: u32 = 48;
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// A fresh handle of `kind`, unique in this process for its lifetime (across sessions too).
pub(crate) fn new_handle(kind: Kind) -> u64 {
    ((kind as u64) << KIND_SHIFT)
        | (NEXT_HANDLE.fetch_add(1, Ordering::Relaxed) & ((1 << KIND_SHIFT) - 1))
}

/// Whether `h` is a handle of `kind` (by its tag; the owner's table decides whether it is live).
pub(crate) fn is_kind(h: u64, kind: Kind) -> bool {
    h >> KIND_SHIFT == kind as u64 && h & ((1 << KIND_SHIFT) - 1) != 0
}

/// A failure to inject: the `skip`-th-plus-one call matching `call` (every call when `None`)
/// returns `code` instead of running. One-shot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailurePlan {
    /// The symbol to fail (`cuMemMap`), or any call.
    pub call: Option<String>,
    /// How many matching calls to let through first.
    pub skip: usize,
    /// The status to return.
    pub code: CUresult,
}

pub(crate) struct State {
    pub config: SimConfig,
    pub initialized: AtomicBool,
    failure: Mutex<Option<FailurePlan>>,
    fired: Mutex<Option<String>>,
    calls: Mutex<HashMap<&'static str, u64>>,
    pub proc_address_requests: AtomicU64,
    live: Mutex<BTreeMap<&'static str, i64>>,
    ext: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

impl State {
    fn new(config: SimConfig) -> Self {
        State {
            config,
            initialized: AtomicBool::new(false),
            failure: Mutex::new(None),
            fired: Mutex::new(None),
            calls: Mutex::new(HashMap::new()),
            proc_address_requests: AtomicU64::new(0),
            live: Mutex::new(BTreeMap::new()),
            ext: Mutex::new(HashMap::new()),
        }
    }

    /// The per-feature state of type `T`, created on first use. Each simulated area (VMM, managed
    /// memory, multicast, ...) keeps its tables in its own `T`, so adding an area touches no
    /// shared struct.
    pub fn ext<T: Default + Send + Sync + 'static>(&self) -> Arc<T> {
        let mut m = self.ext.lock();
        let a = m
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()))
            .clone();
        a.downcast::<T>()
            .unwrap_or_else(|_| unreachable!("TypeId keys its own type"))
    }

    /// Count a live resource of kind `what` up (`+1`) or down (`-1`).
    pub fn live_add(&self, what: &'static str, delta: i64) {
        *self.live.lock().entry(what).or_insert(0) += delta;
    }

    /// The device count.
    pub fn device_count(&self) -> usize {
        self.config.devices.len()
    }

    /// Validate a device ordinal.
    pub fn device(&self, dev: i32) -> SimResult<&crate::config::SimDeviceConfig> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.config.devices.get(d))
            .ok_or(CUresult::CUDA_ERROR_INVALID_DEVICE)
    }

    pub fn version(&self) -> i32 {
        self.config.version
    }

    fn inject(&self, name: &'static str) -> Option<CUresult> {
        let mut f = self.failure.lock();
        let plan = f.as_mut()?;
        if plan.call.as_deref().is_some_and(|c| c != name) {
            return None;
        }
        if plan.skip > 0 {
            plan.skip -= 1;
            return None;
        }
        let code = plan.code;
        *f = None;
        *self.fired.lock() = Some(name.to_string());
        Some(code)
    }
}

static CURRENT: RwLock<Option<Arc<State>>> = RwLock::new(None);
static SESSION: OnceLock<Arc<Mutex<()>>> = OnceLock::new();

/// The state of the running session, if any.
pub(crate) fn current() -> Option<Arc<State>> {
    CURRENT.read().clone()
}

/// Calls that work before `cuInit`.
const BEFORE_INIT: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetProcAddress",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Run a simulated call's body: checks the session and `cuInit`, applies failure injection,
/// logs the call, and turns a panic inside the simulator into `CUDA_ERROR_UNKNOWN` (a panic must
/// not cross the `extern "C"` boundary).
pub(crate) fn enter(name: &'static str, body: impl FnOnce(&Arc<State>) -> SimResult) -> CUresult {
    let Some(st) = current() else {
        return CUresult::CUDA_ERROR_DEINITIALIZED;
    };
    if !st.initialized.load(Ordering::Acquire) && !BEFORE_INIT.contains(&name) {
        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
    }
    *st.calls.lock().entry(name).or_insert(0) += 1;
    if let Some(code) = st.inject(name) {
        return code;
    }
    if !crate::device::ignores_sticky(name) {
        if let Some(code) = crate::device::current_sticky_error(&st) {
            return code;
        }
    }
    match catch_unwind(AssertUnwindSafe(|| body(&st))) {
        Ok(Ok(())) => CUresult::CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
    }
}

/// Write `v` through an out-pointer, rejecting null.
///
/// # Safety
/// `p` is null or valid for one write of `T`.
pub(crate) unsafe fn out<T>(p: *mut T, v: T) -> SimResult {
    if p.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller promises validity.
    unsafe { p.write(v) };
    Ok(())
}

/// Read through an in-pointer, rejecting null.
///
/// # Safety
/// `p` is null or valid for one read of `T`.
pub(crate) unsafe fn read<T: Copy>(p: *const T) -> SimResult<T> {
    if p.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller promises validity.
    Ok(unsafe { p.read() })
}

/// A running simulated machine. While one is alive in this process, the simulated driver's entry
/// points answer for it; starting a second one waits until the first is dropped (tests that run
/// in parallel threads of one process take turns).
#[derive(Clone)]
pub struct Simulator {
    pub(crate) session: Arc<Session>,
}

pub(crate) struct Session {
    pub state: Arc<State>,
    _guard: parking_lot::ArcMutexGuard<parking_lot::RawMutex, ()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        crate::teardown(&self.state);
        *CURRENT.write() = None;
        *OWNER.lock() = None;
    }
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
        *CURRENT.write() = Some(state.clone());
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

    /// The machine's description.
    pub fn config(&self) -> &SimConfig {
        &self.session.state.config
    }

    /// The loader entry (`cuGetProcAddress`, `cuDriverGetVersion`) of this simulated driver; it
    /// keeps the session alive.
    pub fn entry(&self) -> cuda_multimem_sys::Entry {
        cuda_multimem_sys::Entry {
            get_proc_address: crate::dispatch::cuGetProcAddress_v12000,
            driver_get_version: crate::dispatch::cuDriverGetVersion_v2020,
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
        *self.session.state.fired.lock() = None;
        *self.session.state.failure.lock() = (plan.code != CUresult::CUDA_SUCCESS).then_some(plan);
    }

    /// Drop a pending failure plan; returns the call that an earlier plan failed, if it fired.
    pub fn clear_failure(&self) -> Option<String> {
        *self.session.state.failure.lock() = None;
        self.session.state.fired.lock().take()
    }

    /// How often `symbol` was called (entered, whether or not it succeeded).
    pub fn calls(&self, symbol: &str) -> u64 {
        self.session
            .state
            .calls
            .lock()
            .get(symbol)
            .copied()
            .unwrap_or(0)
    }

    /// How many times `cuGetProcAddress` was asked.
    pub fn proc_address_requests(&self) -> u64 {
        self.session
            .state
            .proc_address_requests
            .load(Ordering::Relaxed)
    }

    /// Resources alive now, by kind (only non-zero counts): allocations, mappings, streams, ...
    pub fn live_resources(&self) -> BTreeMap<String, i64> {
        self.session
            .state
            .live
            .lock()
            .iter()
            .filter(|(_, v)| **v != 0)
            .map(|(k, v)| (k.to_string(), *v))
            .collect()
    }
}

impl std::fmt::Debug for Simulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Simulator({})", self.config())
    }
}
