//! Contexts: each device's primary context (retain count, handle), the calling thread's current
//! context, enabled peer access, and the sticky error of a context that a kernel fault killed.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use cuda_multimem_sys::*;
use parking_lot::Mutex;

use super::device::same_clique;
use crate::state::{is_kind, new_handle, Kind, SimResult, State};

/// Contexts: primary context per device (retain counts) and enabled peer access.
#[derive(Default)]
pub(crate) struct Contexts {
    inner: Mutex<CtxInner>,
}

#[derive(Default)]
struct CtxInner {
    /// device -> (handle, retain count)
    primary: HashMap<i32, (u64, u32)>,
    /// handle -> device
    by_handle: HashMap<u64, i32>,
    /// (from device, to device) pairs with peer access enabled
    peers: HashSet<(i32, i32)>,
    /// device -> the sticky error of its primary context (a kernel fault); cleared when the
    /// context is destroyed (its last release)
    sticky: HashMap<i32, CUresult>,
}

/// Statuses after which a real context is unusable ("sticky"): every later call in it returns
/// the error again, until the process (or the primary context) starts over.
pub(crate) fn is_sticky(code: CUresult) -> bool {
    code == CUresult::CUDA_ERROR_ILLEGAL_ADDRESS || code == CUresult::CUDA_ERROR_LAUNCH_FAILED
}

/// Mark device `dev`'s context as dead with `code` (the first fault wins).
pub(crate) fn poison(st: &State, dev: i32, code: CUresult) {
    st.ext::<Contexts>()
        .inner
        .lock()
        .sticky
        .entry(dev)
        .or_insert(code);
}

/// The sticky error of device `dev`'s context, if it faulted.
pub(crate) fn sticky_error(st: &State, dev: i32) -> Option<CUresult> {
    st.ext::<Contexts>().inner.lock().sticky.get(&dev).copied()
}

/// The sticky error of the calling thread's current context, if it faulted.
pub(crate) fn current_sticky_error(st: &State) -> Option<CUresult> {
    let h = CURRENT_CTX.with(|c| c.get());
    if h == 0 {
        return None;
    }
    let c = st.ext::<Contexts>();
    let g = c.inner.lock();
    let dev = g.by_handle.get(&h)?;
    g.sticky.get(dev).copied()
}

thread_local! {
    static CURRENT_CTX: Cell<u64> = const { Cell::new(0) };
}

/// The device of the calling thread's current context.
pub(crate) fn current_device(st: &State) -> SimResult<i32> {
    let h = CURRENT_CTX.with(|c| c.get());
    if h == 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    st.ext::<Contexts>()
        .inner
        .lock()
        .by_handle
        .get(&h)
        .copied()
        .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)
}

/// The device of context handle `ctx` (null: the current one).
pub(crate) fn context_device(st: &State, ctx: CUcontext) -> SimResult<i32> {
    if ctx.is_null() {
        return current_device(st);
    }
    st.ext::<Contexts>()
        .inner
        .lock()
        .by_handle
        .get(&(ctx as u64))
        .copied()
        .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)
}

/// The calling thread's current context handle (0: none).
pub(crate) fn current_handle() -> u64 {
    CURRENT_CTX.with(|c| c.get())
}

/// Make context handle `h` current on the calling thread (0: none).
pub(crate) fn set_current(st: &State, h: u64) -> SimResult {
    if h != 0
        && (!is_kind(h, Kind::Context)
            || !st.ext::<Contexts>().inner.lock().by_handle.contains_key(&h))
    {
        return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    CURRENT_CTX.with(|c| c.set(h));
    Ok(())
}

/// Retain device `dev`'s primary context (created at its first retain); its handle.
pub(crate) fn retain_primary(st: &State, dev: i32) -> u64 {
    let c = st.ext::<Contexts>();
    let mut g = c.inner.lock();
    let entry = g.primary.entry(dev).or_insert((0, 0));
    if entry.1 == 0 {
        entry.0 = new_handle(Kind::Context);
        st.live_add("primary contexts", 1);
    }
    entry.1 += 1;
    let h = entry.0;
    g.by_handle.insert(h, dev);
    h
}

/// Release device `dev`'s primary context once; the last release destroys it (its peer access
/// and its sticky error go with it).
pub(crate) fn release_primary(st: &State, dev: i32) -> SimResult {
    let c = st.ext::<Contexts>();
    let mut g = c.inner.lock();
    let entry = g
        .primary
        .get_mut(&dev)
        .filter(|e| e.1 > 0)
        .ok_or(CUresult::CUDA_ERROR_INVALID_CONTEXT)?;
    entry.1 -= 1;
    if entry.1 == 0 {
        let h = entry.0;
        g.by_handle.remove(&h);
        g.peers.retain(|&(a, b)| a != dev && b != dev);
        // A new primary context starts healthy.
        g.sticky.remove(&dev);
        st.live_add("primary contexts", -1);
    }
    Ok(())
}

/// How many times device `dev`'s primary context is retained (0: inactive).
pub(crate) fn primary_retains(st: &State, dev: i32) -> u32 {
    st.ext::<Contexts>()
        .inner
        .lock()
        .primary
        .get(&dev)
        .map_or(0, |e| e.1)
}

/// Let the current context's device reach `peer`'s memory (`cuCtxEnablePeerAccess`).
pub(crate) fn enable_peer(st: &State, peer: CUcontext) -> SimResult {
    let me = current_device(st)?;
    let other = context_device(st, peer)?;
    if me == other || !same_clique(st, me, other) {
        return Err(CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
    }
    if !st.ext::<Contexts>().inner.lock().peers.insert((me, other)) {
        return Err(CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
    }
    Ok(())
}

/// Undo [`enable_peer`].
pub(crate) fn disable_peer(st: &State, peer: CUcontext) -> SimResult {
    let me = current_device(st)?;
    let other = context_device(st, peer)?;
    if !st.ext::<Contexts>().inner.lock().peers.remove(&(me, other)) {
        return Err(CUresult::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
    }
    Ok(())
}
