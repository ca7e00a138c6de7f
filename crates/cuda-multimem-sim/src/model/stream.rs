//! Streams (one worker thread each, so devices run concurrently), events, and graph capture.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_uint;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use cuda_multimem_sys::*;
use parking_lot::{Condvar, Mutex};

use super::context::{self, current_device};
use crate::state::{is_kind, new_handle, Kind, SimResult, State};

/// Work queued on a stream. `Fn`, not `FnOnce`: a captured graph replays it.
pub(crate) type Op = Arc<dyn Fn() -> SimResult + Send + Sync>;

/// Host work to run once a stream has finished the operations queued before it was asked for
/// (see [`Stream::after_queued`]).
pub(crate) type Callback = Box<dyn FnOnce() + Send>;

pub(crate) struct Stream {
    pub device: i32,
    /// The device's legacy default stream (handles 0, 1 and 2).
    legacy: bool,
    /// Created without `CU_STREAM_NON_BLOCKING` (the legacy stream counts as blocking): ordered
    /// against the legacy stream, as the real driver does implicitly.
    blocking: bool,
    /// Requests to finish staged work early (see [`Stream::wait_flush`]).
    flush: Mutex<u64>,
    flush_cv: Condvar,
    q: Mutex<Queue>,
    cv: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The stream whose capture this one joined by waiting on an event recorded in it (a fork
    /// of that capture); its work goes into that capture until the capture ends.
    joined: Mutex<Option<Arc<Stream>>>,
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    submitted: u64,
    completed: u64,
    error: Option<CUresult>,
    shutdown: bool,
    capture: Option<Vec<Op>>,
    /// Streams that joined this stream's capture (forks), with how many operations each has
    /// put into it and up to which of them the capture has waited on it again (joined back).
    forks: Vec<Fork>,
    /// Callbacks waiting for `completed` to reach their epoch (a value of `submitted`).
    callbacks: Vec<(u64, Callback)>,
}

impl Queue {
    /// The callbacks whose epoch is `completed` or earlier.
    fn take_due(&mut self, completed: u64) -> Vec<Callback> {
        let (due, waiting) = std::mem::take(&mut self.callbacks)
            .into_iter()
            .partition(|(epoch, _)| *epoch <= completed);
        self.callbacks = waiting;
        due.into_iter().map(|(_, f)| f).collect()
    }
}

/// A stream forked into a capture: the graph is kept as one list in program order, so a fork's
/// work is serialised with the rest (the simulator does not run graph branches concurrently).
struct Fork {
    stream: Arc<Stream>,
    ops: u64,
    joined_upto: u64,
}

impl Stream {
    fn spawn(device: i32, legacy: bool, blocking: bool) -> Arc<Stream> {
        let s = Arc::new(Stream {
            device,
            legacy,
            blocking,
            flush: Mutex::new(0),
            flush_cv: Condvar::new(),
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            thread: Mutex::new(None),
            joined: Mutex::new(None),
        });
        let w = s.clone();
        let h = std::thread::Builder::new()
            .name(format!("sim-stream-dev{device}"))
            .spawn(move || w.run())
            .expect("spawning a stream worker thread");
        *s.thread.lock() = Some(h);
        s
    }

    fn run(&self) {
        loop {
            let op = {
                let mut q = self.q.lock();
                loop {
                    if q.shutdown {
                        return;
                    }
                    if let Some(op) = q.ops.front().cloned() {
                        break op;
                    }
                    self.cv.wait(&mut q);
                }
            };
            let r = catch_unwind(AssertUnwindSafe(|| op()))
                .unwrap_or(Err(CUresult::CUDA_ERROR_UNKNOWN));
            if let Err(e) = r {
                if context::is_sticky(e) {
                    // A kernel fault kills the device's context, not only this stream.
                    if let Some(st) = crate::state::current() {
                        context::poison(&st, self.device, e);
                    }
                }
            }
            let mut q = self.q.lock();
            q.ops.pop_front();
            if let Err(e) = r {
                q.error.get_or_insert(e);
            }
            // Callbacks whose epoch this operation completes run before anybody can see it
            // complete (a synchronise that returns has seen them run), and without the lock.
            loop {
                let next = q.completed + 1;
                let due = q.take_due(next);
                if due.is_empty() {
                    break;
                }
                drop(q);
                for f in due {
                    // A panicking callback must not take the stream's worker down with it.
                    let _ = catch_unwind(AssertUnwindSafe(f));
                }
                q = self.q.lock();
            }
            q.completed += 1;
            self.cv.notify_all();
        }
    }

    /// Run `f` once every operation queued on this stream so far has completed: at once, on
    /// the calling thread, when none is outstanding; otherwise on the worker, right after the
    /// last of them has run and before the stream reports it complete (so a synchronise that
    /// returns has seen `f` run). A stream that shuts down first drops `f` unrun: the session's
    /// teardown then does what `f` would have done.
    pub fn after_queued(&self, f: Callback) {
        let mut q = self.q.lock();
        if q.completed >= q.submitted {
            drop(q);
            f();
            return;
        }
        let epoch = q.submitted;
        q.callbacks.push((epoch, f));
    }

    /// Queue `op`, or record it if the stream is capturing (or joined a capture).
    pub fn enqueue(self: &Arc<Self>, op: Op) -> SimResult {
        let origin = self.joined.lock().clone();
        if let Some(o) = origin {
            let mut oq = o.q.lock();
            let Some(c) = oq.capture.as_mut() else {
                return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            };
            c.push(op);
            if let Some(f) = oq.forks.iter_mut().find(|f| Arc::ptr_eq(&f.stream, self)) {
                f.ops += 1;
            }
            return Ok(());
        }
        let mut q = self.q.lock();
        if let Some(c) = q.capture.as_mut() {
            c.push(op);
            return Ok(());
        }
        q.ops.push_back(op);
        q.submitted += 1;
        self.cv.notify_all();
        Ok(())
    }

    /// Whether the stream is capturing a graph (its own, or one it joined).
    pub fn capturing(&self) -> bool {
        self.joined.lock().is_some() || self.q.lock().capture.is_some()
    }

    /// The stream whose capture this one takes part in: itself, or the one it joined.
    fn capture_origin(self: &Arc<Self>) -> Option<Arc<Stream>> {
        if let Some(o) = self.joined.lock().clone() {
            return Some(o);
        }
        self.q.lock().capture.is_some().then(|| self.clone())
    }

    /// Somebody waits for this stream's work: staged work (a pageable copy's DMA) should land
    /// now rather than at its deadline.
    pub fn request_flush(&self) {
        *self.flush.lock() += 1;
        self.flush_cv.notify_all();
    }

    /// Flush requests so far.
    pub fn flushes(&self) -> u64 {
        *self.flush.lock()
    }

    /// Block (on this stream's worker) until a flush is requested after `since`, or `max`
    /// passed: how staged work lands "some time later" in a way tests can rely on.
    pub fn wait_flush(&self, since: u64, max: std::time::Duration) {
        let deadline = Instant::now() + max;
        let mut f = self.flush.lock();
        while *f == since {
            if self.flush_cv.wait_until(&mut f, deadline).timed_out() {
                break;
            }
        }
    }

    /// Wait for everything queued so far; report (and clear) an error of an earlier operation.
    pub fn synchronize(&self) -> SimResult {
        if self.legacy {
            self.request_flush();
        }
        if self.joined.lock().is_some() {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut q = self.q.lock();
        if q.capture.is_some() {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let target = q.submitted;
        while q.completed < target && !q.shutdown {
            self.cv.wait(&mut q);
        }
        q.error.take().map_or(Ok(()), Err)
    }

    pub fn idle(&self) -> bool {
        let q = self.q.lock();
        q.completed == q.submitted
    }

    fn shutdown(&self) {
        let unrun = {
            let mut q = self.q.lock();
            q.shutdown = true;
            q.ops.clear();
            self.cv.notify_all();
            std::mem::take(&mut q.callbacks)
        };
        // Dropped outside the lock: a callback may hold the last reference to anything.
        drop(unrun);
        if let Some(h) = self.thread.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

#[derive(Default)]
pub(crate) struct Streams {
    by_handle: Mutex<HashMap<u64, Arc<Stream>>>,
    default: Mutex<HashMap<i32, Arc<Stream>>>,
    events: Mutex<HashMap<u64, Arc<Event>>>,
    graphs: Mutex<HashMap<u64, Arc<Vec<Op>>>>,
    execs: Mutex<HashMap<u64, Arc<Vec<Op>>>>,
}

/// The stream behind handle `h` (null and the legacy/per-thread handles: the current device's
/// default stream).
pub(crate) fn stream(st: &State, h: CUstream) -> SimResult<Arc<Stream>> {
    let h = h as u64;
    let s = st.ext::<Streams>();
    if h <= 2 {
        let dev = current_device(st)?;
        return Ok(s
            .default
            .lock()
            .entry(dev)
            .or_insert_with(|| Stream::spawn(dev, true, true))
            .clone());
    }
    if !is_kind(h, Kind::Stream) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    let found = s.by_handle.lock().get(&h).cloned();
    found.ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

/// Queue `op` on stream `h` (after the implicit ordering against the legacy stream).
pub(crate) fn enqueue(st: &State, h: CUstream, op: Op) -> SimResult {
    enqueue_on(st, &stream(st, h)?, op)
}

/// [`enqueue`] on a stream already looked up.
pub(crate) fn enqueue_on(st: &State, s: &Arc<Stream>, op: Op) -> SimResult {
    implicit_order(st, s)?;
    s.enqueue(op)
}

/// A one-shot signal between two streams' workers.
struct Marker {
    done: Mutex<bool>,
    cv: Condvar,
}

/// Make `from` wait (in stream order) for everything queued on `on` so far.
fn wait_for_tail(from: &Arc<Stream>, on: &Arc<Stream>) -> SimResult {
    on.request_flush();
    let m = Arc::new(Marker {
        done: Mutex::new(false),
        cv: Condvar::new(),
    });
    let m2 = m.clone();
    on.enqueue(Arc::new(move || {
        *m2.done.lock() = true;
        m2.cv.notify_all();
        Ok(())
    }))?;
    from.enqueue(Arc::new(move || {
        let mut d = m.done.lock();
        while !*d {
            m.cv.wait(&mut d);
        }
        Ok(())
    }))
}

/// The real driver's implicit synchronisation: work queued on the legacy default stream waits
/// for earlier work of the device's blocking streams, and work queued on a blocking stream waits
/// for earlier work of the legacy stream. Non-blocking streams are ordered against nothing.
/// Nothing is inserted while a stream captures (the real driver refuses such mixing there).
pub(crate) fn implicit_order(st: &State, s: &Arc<Stream>) -> SimResult {
    if !s.blocking || s.capturing() {
        return Ok(());
    }
    let streams = st.ext::<Streams>();
    if s.legacy {
        let busy: Vec<Arc<Stream>> = streams
            .by_handle
            .lock()
            .values()
            .filter(|x| x.device == s.device && x.blocking && !x.idle() && !x.capturing())
            .cloned()
            .collect();
        for b in busy {
            wait_for_tail(s, &b)?;
        }
    } else {
        let legacy = streams.default.lock().get(&s.device).cloned();
        if let Some(l) = legacy.filter(|l| !l.idle() && !l.capturing()) {
            wait_for_tail(s, &l)?;
        }
    }
    Ok(())
}

/// What a synchronous copy or memset waits for before it starts ("a stream sync is performed
/// before the copy is initiated"): the legacy stream and the blocking streams of device `dev`,
/// not its non-blocking streams.
pub(crate) fn synchronize_legacy(st: &State, dev: i32) -> SimResult {
    let s = st.ext::<Streams>();
    let mut all: Vec<Arc<Stream>> = s
        .by_handle
        .lock()
        .values()
        .filter(|x| x.device == dev && x.blocking)
        .cloned()
        .collect();
    all.extend(s.default.lock().get(&dev).cloned());
    synchronize_all(all)
}

/// Wait for every stream of device `dev`.
pub(crate) fn synchronize_device(st: &State, dev: i32) -> SimResult {
    synchronize_all(device_streams(st, dev))
}

/// Every stream of device `dev` (its legacy default stream too, once it exists).
pub(crate) fn device_streams(st: &State, dev: i32) -> Vec<Arc<Stream>> {
    let s = st.ext::<Streams>();
    let mut all: Vec<_> = s
        .by_handle
        .lock()
        .values()
        .filter(|x| x.device == dev)
        .cloned()
        .collect();
    all.extend(s.default.lock().get(&dev).cloned());
    all
}

/// Synchronise every stream of `streams`; the first error, after waiting for all.
/// Wait for every stream of `streams` (any devices).
pub(crate) fn synchronize_streams(streams: Vec<Arc<Stream>>) -> SimResult {
    synchronize_all(streams)
}

fn synchronize_all(streams: Vec<Arc<Stream>>) -> SimResult {
    let mut first = Ok(());
    for x in streams {
        if let Err(e) = x.synchronize() {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// Stop every stream's worker (end of the session).
pub(crate) fn shutdown_all(st: &State) {
    let s = st.ext::<Streams>();
    let all: Vec<_> = s
        .by_handle
        .lock()
        .drain()
        .map(|(_, v)| v)
        .chain(s.default.lock().drain().map(|(_, v)| v))
        .collect();
    for x in all {
        x.shutdown();
    }
}

pub(crate) struct Event {
    timing: bool,
    m: Mutex<EventState>,
    cv: Condvar,
    /// Recorded inside a capture: where (see [`CaptureMark`]).
    captured: Mutex<Option<CaptureMark>>,
}

/// An event recorded inside a capture: the capture's origin stream, the stream it was recorded
/// on and that stream's operation count then (for join-back accounting).
type CaptureMark = (Arc<Stream>, Arc<Stream>, u64);

#[derive(Default)]
struct EventState {
    recorded: u64,
    completed: u64,
    time: Option<Instant>,
}

impl Event {
    fn wait_for(&self, generation: u64) {
        let mut g = self.m.lock();
        while g.completed < generation {
            self.cv.wait(&mut g);
        }
    }
}

pub(crate) fn event(st: &State, h: CUevent) -> SimResult<Arc<Event>> {
    let h = h as u64;
    if !is_kind(h, Kind::Event) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    st.ext::<Streams>()
        .events
        .lock()
        .get(&h)
        .cloned()
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

pub(crate) fn new_stream(st: &State, flags: c_uint) -> SimResult<u64> {
    if flags > 1 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let dev = current_device(st)?;
    let h = new_handle(Kind::Stream);
    st.ext::<Streams>()
        .by_handle
        .lock()
        .insert(h, Stream::spawn(dev, false, flags & 1 == 0));
    st.live_add("streams", 1);
    Ok(h)
}

/// Destroy stream `h`: its queued work finishes first, then its worker stops.
pub(crate) fn destroy(st: &State, h: CUstream) -> SimResult {
    let key = h as u64;
    if !is_kind(key, Kind::Stream) {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    let s = st
        .ext::<Streams>()
        .by_handle
        .lock()
        .remove(&key)
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    // Destroying a stream with queued work lets that work finish first.
    let _ = s.synchronize();
    s.shutdown();
    st.live_add("streams", -1);
    Ok(())
}

/// `cuStreamWaitEvent`: `s` waits, in stream order, for the work before `e`'s latest record.
pub(crate) fn wait_event(st: &State, s: &Arc<Stream>, e: Arc<Event>) -> SimResult {
    let mark = e.captured.lock().clone();
    if let Some((origin, from, seq)) = mark {
        // An event of a capture: the waiting stream joins that capture (a fork), or, already
        // in it, has waited on `from`'s work up to `seq` (a join back). The graph is one
        // list in program order, so nothing needs to wait at replay.
        match s.capture_origin() {
            Some(o) if Arc::ptr_eq(&o, &origin) => {
                let mut oq = origin.q.lock();
                if let Some(f) = oq.forks.iter_mut().find(|f| Arc::ptr_eq(&f.stream, &from)) {
                    f.joined_upto = f.joined_upto.max(seq);
                }
            }
            Some(_) => return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE),
            None => {
                let mut oq = origin.q.lock();
                if oq.capture.is_none() {
                    return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                }
                oq.forks.push(Fork {
                    stream: s.clone(),
                    ops: 0,
                    joined_upto: 0,
                });
                *s.joined.lock() = Some(origin.clone());
            }
        }
        return Ok(());
    }
    let generation = e.m.lock().recorded;
    implicit_order(st, s)?;
    s.enqueue(Arc::new(move || {
        e.wait_for(generation);
        Ok(())
    }))
}

/// Start capturing stream `s`.
pub(crate) fn begin_capture(s: &Stream) -> SimResult {
    if s.joined.lock().is_some() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    let mut q = s.q.lock();
    if q.capture.is_some() {
        return Err(CUresult::CUDA_ERROR_ILLEGAL_STATE);
    }
    q.capture = Some(Vec::new());
    q.forks.clear();
    Ok(())
}

/// End the capture that stream `s` began; the new graph's handle.
pub(crate) fn end_capture(st: &State, s: &Stream) -> SimResult<u64> {
    if s.joined.lock().is_some() {
        // only the stream that began the capture ends it
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    }
    let (ops, forks) = {
        let mut q = s.q.lock();
        let ops = q.capture.take().ok_or(CUresult::CUDA_ERROR_ILLEGAL_STATE)?;
        (ops, std::mem::take(&mut q.forks))
    };
    // every fork leaves the capture; one with work the capture never waited on again is
    // an unjoined fork, and the capture fails as the real driver's does
    let mut unjoined = false;
    for f in forks {
        *f.stream.joined.lock() = None;
        unjoined |= f.ops > f.joined_upto;
    }
    if unjoined {
        return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
    }
    let g = new_handle(Kind::Graph);
    st.ext::<Streams>().graphs.lock().insert(g, Arc::new(ops));
    st.live_add("graphs", 1);
    Ok(g)
}

/// Instantiate graph `graph`; the executable graph's handle.
pub(crate) fn instantiate(st: &State, graph: CUgraph) -> SimResult<u64> {
    let ops = st
        .ext::<Streams>()
        .graphs
        .lock()
        .get(&(graph as u64))
        .cloned()
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    let e = new_handle(Kind::GraphExec);
    st.ext::<Streams>().execs.lock().insert(e, ops);
    st.live_add("graph execs", 1);
    Ok(e)
}

/// Queue executable graph `exec`'s work on stream `h`.
pub(crate) fn launch_graph(st: &State, exec: CUgraphExec, h: CUstream) -> SimResult {
    let ops = st
        .ext::<Streams>()
        .execs
        .lock()
        .get(&(exec as u64))
        .cloned()
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    let s = stream(st, h)?;
    implicit_order(st, &s)?;
    for op in ops.iter() {
        s.enqueue(op.clone())?;
    }
    Ok(())
}

/// Destroy graph `graph`.
pub(crate) fn destroy_graph(st: &State, graph: CUgraph) -> SimResult {
    st.ext::<Streams>()
        .graphs
        .lock()
        .remove(&(graph as u64))
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    st.live_add("graphs", -1);
    Ok(())
}

/// Destroy executable graph `exec`.
pub(crate) fn destroy_graph_exec(st: &State, exec: CUgraphExec) -> SimResult {
    st.ext::<Streams>()
        .execs
        .lock()
        .remove(&(exec as u64))
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
    st.live_add("graph execs", -1);
    Ok(())
}

/// A new event (`timing`: it records times); its handle.
pub(crate) fn create_event(st: &State, timing: bool) -> u64 {
    let h = new_handle(Kind::Event);
    st.ext::<Streams>().events.lock().insert(
        h,
        Arc::new(Event {
            timing,
            m: Mutex::new(EventState::default()),
            cv: Condvar::new(),
            captured: Mutex::new(None),
        }),
    );
    st.live_add("events", 1);
    h
}

/// Destroy event `ev`.
pub(crate) fn destroy_event(st: &State, ev: CUevent) -> SimResult {
    event(st, ev)?;
    st.ext::<Streams>().events.lock().remove(&(ev as u64));
    st.live_add("events", -1);
    Ok(())
}

/// `cuEventRecord`: record `e` on stream `s` (inside a capture: a marker to fork from or join on).
pub(crate) fn record_event(st: &State, e: Arc<Event>, s: &Arc<Stream>) -> SimResult {
    if let Some(origin) = s.capture_origin() {
        // recorded inside a capture: a marker for other streams to fork from or join on
        let seq = if Arc::ptr_eq(&origin, s) {
            0
        } else {
            origin
                .q
                .lock()
                .forks
                .iter()
                .find(|f| Arc::ptr_eq(&f.stream, s))
                .map_or(0, |f| f.ops)
        };
        *e.captured.lock() = Some((origin, s.clone(), seq));
        return Ok(());
    }
    *e.captured.lock() = None;
    implicit_order(st, s)?;
    let generation = {
        let mut g = e.m.lock();
        g.recorded += 1;
        g.recorded
    };
    s.enqueue(Arc::new(move || {
        let mut g = e.m.lock();
        g.completed = g.completed.max(generation);
        g.time = Some(Instant::now());
        e.cv.notify_all();
        Ok(())
    }))
}

impl Event {
    /// Whether the work before its latest record has completed.
    pub fn is_complete(&self) -> bool {
        let g = self.m.lock();
        g.completed >= g.recorded
    }

    /// Wait for the work before its latest record.
    pub fn synchronize(&self) {
        let generation = self.m.lock().recorded;
        self.wait_for(generation);
    }
}

/// Milliseconds from event `a`'s completion to event `b`'s (both recorded with timing).
pub(crate) fn elapsed_ms(a: &Event, b: &Event) -> SimResult<f32> {
    if !a.timing || !b.timing {
        return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
    // One lock at a time: `start` and `end` may be the same event (parking_lot's mutex is
    // not reentrant, and a tuple's temporaries live to the end of the statement).
    let ga = a.m.lock().time;
    let gb = b.m.lock().time;
    let (ta, tb) = (
        ga.ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?,
        gb.ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?,
    );
    let d = if tb >= ta {
        (tb - ta).as_secs_f64()
    } else {
        -(ta - tb).as_secs_f64()
    };
    Ok((d * 1e3) as f32)
}
