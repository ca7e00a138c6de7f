//! What every layer of the simulator shares: the running session's state (its machine, the
//! per-area tables, handle tags, call counts, live-resource counts and the pending failure plan)
//! and which session is current. It knows no driver call and no area: the areas keep their
//! tables in it ([`State::ext`]), the gate of the entry points counts and fails calls through it,
//! and the session (`session.rs`) creates and installs it.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use cuda_multimem_sys::CUresult;
use parking_lot::{Mutex, RwLock};

use crate::config::{SimConfig, SimDeviceConfig};

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
    pub fn new(config: SimConfig) -> Self {
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

    /// Resources alive now, by kind (only non-zero counts).
    pub fn live_resources(&self) -> BTreeMap<String, i64> {
        self.live
            .lock()
            .iter()
            .filter(|(_, v)| **v != 0)
            .map(|(k, v)| (k.to_string(), *v))
            .collect()
    }

    /// The device count.
    pub fn device_count(&self) -> usize {
        self.config.devices.len()
    }

    /// Validate a device ordinal.
    pub fn device(&self, dev: i32) -> SimResult<&SimDeviceConfig> {
        usize::try_from(dev)
            .ok()
            .and_then(|d| self.config.devices.get(d))
            .ok_or(CUresult::CUDA_ERROR_INVALID_DEVICE)
    }

    pub fn version(&self) -> i32 {
        self.config.version
    }

    /// Count one call of `name` (entered, whether or not it succeeds).
    pub fn count_call(&self, name: &'static str) {
        *self.calls.lock().entry(name).or_insert(0) += 1;
    }

    /// How often `symbol` was called.
    pub fn calls(&self, symbol: &str) -> u64 {
        self.calls.lock().get(symbol).copied().unwrap_or(0)
    }

    /// Arm a failure plan (replacing any pending one); a plan whose code is `CUDA_SUCCESS` only
    /// drops the pending plan.
    pub fn arm_failure(&self, plan: FailurePlan) {
        *self.fired.lock() = None;
        *self.failure.lock() = (plan.code != CUresult::CUDA_SUCCESS).then_some(plan);
    }

    /// Drop a pending plan; the call that an earlier plan failed, if it fired.
    pub fn disarm_failure(&self) -> Option<String> {
        *self.failure.lock() = None;
        self.fired.lock().take()
    }

    /// The status the pending plan injects into this call of `name`, if it fires now.
    pub fn inject(&self, name: &'static str) -> Option<CUresult> {
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

/// The state of the running session, if any.
pub(crate) fn current() -> Option<Arc<State>> {
    CURRENT.read().clone()
}

/// Make `state` the running session's (`None`: no session runs).
pub(crate) fn set_current(state: Option<Arc<State>>) {
    *CURRENT.write() = state;
}
