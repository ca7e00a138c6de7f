//! What the collective benchmarks share: the error type, a spinning barrier and the graph
//! method for single-call timings, the median, the `RESULT {json}` writer, the team's devices
//! (repeated where the machine has fewer GPUs than ranks) and prefixes of own buffers.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuda_multimem::{CaptureMode, Device, DeviceBuffer, Driver, Event, Stream};
use cuda_multimem_collectives::{Dst, Src};

/// The message sizes of a sweep: `explicit` where given, else from `min` (at least `floor`)
/// doubling up to `max`.
#[allow(dead_code)] // the sweeps by size (not moe's and norm's by tokens)
pub fn doubling_sizes(explicit: &[usize], min: usize, floor: usize, max: usize) -> Vec<usize> {
    if !explicit.is_empty() {
        return explicit.to_vec();
    }
    let mut v = Vec::new();
    let mut b = min.max(floor);
    while b <= max {
        v.push(b);
        b *= 2;
    }
    v
}

/// A benchmark's exit status: success when `run` checked every result; otherwise what went
/// wrong, named by the benchmark `bench`, on stderr.
#[allow(dead_code)] // moe and norm word their mismatch on their own
pub fn exit_code(bench: &str, run: Res<bool>) -> std::process::ExitCode {
    match run {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("{bench}: a result did not match the host reference");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{bench}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

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

/// Wait for every stream's work.
pub fn sync(streams: &[Stream]) -> Res<()> {
    for s in streams {
        s.synchronize()?;
    }
    Ok(())
}

/// The pipelined time per call, the same for every collective benchmark: rank r's `iters`
/// calls (`call(r)` queues one on `streams[r]`) captured into one CUDA graph per rank (in
/// `mode`), launched once to warm up, then replayed `runs` times, the last rank's graph first
/// so that rank 0 (which is timed) does not start long before the others; time per call from
/// rank 0's events around each replay, median of the replays. The caller checks the
/// communicator afterwards.
pub fn pipelined_by_graph(
    streams: &[Stream],
    (iters, runs): (usize, usize),
    mode: CaptureMode,
    call: &mut dyn FnMut(usize) -> Res<()>,
) -> Res<f64> {
    let s0 = streams.first().ok_or("pipelined_by_graph: no ranks")?;
    let mut execs = Vec::new();
    for (r, s) in streams.iter().enumerate() {
        let s = s.as_stream_ref();
        s.begin_capture(mode)?;
        let called = (0..iters).try_for_each(|_| call(r));
        let g = s.end_capture()?;
        called?;
        // SAFETY: what `call` captured is the caller's and outlives this function, which drops
        // `execs` before it returns.
        execs.push(unsafe { g.instantiate() }?);
    }
    let launch = || -> Res<()> {
        for (e, s) in execs.iter().zip(streams).rev() {
            e.launch(s.as_stream_ref())?;
        }
        Ok(())
    };
    launch()?;
    sync(streams)?;
    let (start, stop) = (
        Event::new(s0.device(), true)?,
        Event::new(s0.device(), true)?,
    );
    let mut times = Vec::new();
    for _ in 0..runs {
        start.record(s0)?;
        launch()?;
        stop.record(s0)?;
        sync(streams)?;
        times.push(stop.elapsed_since(&start)?.as_secs_f64() / iters as f64);
    }
    Ok(median(times))
}

/// One rank's part of a single-call measurement: its rank, and what it queues on its stream
/// for one call (captured once into a graph, so it runs once, on the rank's own thread).
pub type RankCall<'a> = (usize, RankFn<'a>);

/// What a rank queues on its stream for one call (see [`RankCall`]).
pub type RankFn<'a> = Box<dyn FnOnce(&Stream) -> Res<()> + Send + 'a>;

/// A single call's time by the graph method, the same for every collective benchmark: a
/// thread per rank; each captures its call once into a CUDA graph (thread-local capture) on
/// `streams[rank]`, then `runs + 1` times (the first warms up, untimed) waits at a spinning
/// barrier, records an event, launches the graph and records another event. The host's
/// submission cost of the call is outside the events; the graph launch is inside. Returns the
/// median over the runs of the slowest rank's time, in seconds. Every rank of `streams` must
/// have exactly one entry in `calls` (the caller checks the communicator afterwards).
pub fn single_by_graph(streams: &[Stream], runs: usize, calls: Vec<RankCall<'_>>) -> Res<f64> {
    let n = streams.len();
    let mut seen = vec![false; n];
    for (r, _) in &calls {
        match seen.get_mut(*r) {
            Some(s) if !*s => *s = true,
            _ => return Err(format!("single_by_graph: rank {r} is out of range or twice").into()),
        }
    }
    if calls.len() != n {
        return Err(format!("single_by_graph: {} calls for {n} ranks", calls.len()).into());
    }
    let (barrier, abort) = (SpinBarrier::new(n), AtomicBool::new(false));
    let per_rank: Vec<Result<Vec<f64>, String>> = std::thread::scope(|sc| {
        let sync = (&barrier, &abort);
        let hs: Vec<_> = calls
            .into_iter()
            .map(|(r, call)| {
                let s = &streams[r];
                (r, sc.spawn(move || timed_launches(s, sync, runs, call)))
            })
            .collect();
        hs.into_iter()
            .map(|(r, h)| {
                h.join()
                    .unwrap_or_else(|_| Err("panicked".into()))
                    .map_err(|e| format!("rank {r}: {e}"))
            })
            .collect()
    });
    // the first rank's own failure, not one that stopped because of it
    if let Some(e) = per_rank
        .iter()
        .filter_map(|t| t.as_ref().err())
        .find(|e| !e.ends_with(STOPPED))
        .or_else(|| per_rank.iter().find_map(|t| t.as_ref().err()))
    {
        return Err(e.clone().into());
    }
    let per_rank: Vec<Vec<f64>> = per_rank.into_iter().flatten().collect();
    let times = (0..runs)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0f64, f64::max))
        .collect();
    Ok(median(times))
}

/// What a rank reports when it stopped because another failed.
const STOPPED: &str = "another rank failed; this one stopped";

/// One rank's thread of [`single_by_graph`]: capture `call`, then time `runs + 1` launches.
/// A rank that fails raises `abort` and still passes every barrier round, so that the other
/// ranks stop launching (their graphs would wait for it) instead of spinning until the
/// barrier's deadline.
fn timed_launches(
    s: &Stream,
    (barrier, abort): (&SpinBarrier, &AtomicBool),
    runs: usize,
    call: RankFn<'_>,
) -> Res<Vec<f64>> {
    let prepared = (|| -> Res<_> {
        let r = s.as_stream_ref();
        r.begin_capture(CaptureMode::ThreadLocal)?;
        let called = call(s);
        let g = r.end_capture()?;
        called?;
        // SAFETY: what `call` captured is the caller's and outlives this closure's result,
        // dropped before the function returns.
        let exec = unsafe { g.instantiate() }?;
        let (a, z) = (Event::new(s.device(), true)?, Event::new(s.device(), true)?);
        Ok((exec, a, z))
    })();
    let mut failed = prepared.as_ref().err().map(|e| e.to_string());
    if failed.is_some() {
        abort.store(true, Ordering::Release);
    }
    let mut t = Vec::with_capacity(runs);
    for run in 0..=runs {
        barrier.wait(run);
        let Ok((exec, a, z)) = &prepared else {
            continue;
        };
        if failed.is_some() || abort.load(Ordering::Acquire) {
            continue;
        }
        let once = || -> Res<f64> {
            a.record(s)?;
            exec.launch(s.as_stream_ref())?;
            z.record(s)?;
            s.synchronize()?;
            Ok(z.elapsed_since(a)?.as_secs_f64())
        };
        match once() {
            Ok(secs) if run > 0 => t.push(secs),
            Ok(_) => {}
            Err(e) => {
                failed = Some(e.to_string());
                abort.store(true, Ordering::Release);
            }
        }
    }
    match (failed, t.len() == runs) {
        (Some(e), _) => Err(e.into()),
        (None, true) => Ok(t),
        (None, false) => Err(STOPPED.into()),
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

/// The devices of a team of `ranks`: the first `ranks` devices of `driver`, or, where it has
/// fewer, its devices in turn (several ranks sharing a GPU: `allow_shared_devices`). Returns
/// them and whether ranks share a GPU; when they do, says so on stderr and stdout (a `#` line):
/// such a run checks that the benchmark works, its times are not of a link.
#[allow(dead_code)]
pub fn team_devices(driver: &Driver, ranks: usize, bench: &str) -> Res<(Vec<Device>, bool)> {
    let all = driver.devices();
    if all.is_empty() || ranks == 0 {
        return Err(format!("{ranks} ranks asked, {} devices", all.len()).into());
    }
    let shared = all.len() < ranks;
    let devices: Vec<Device> = (0..ranks).map(|r| all[r % all.len()].clone()).collect();
    if shared {
        let msg = format!(
            "{bench}: {ranks} ranks on {} GPU(s): several ranks SHARE a GPU; this run checks that the benchmark works, its times are NOT a link benchmark",
            all.len()
        );
        eprintln!("{msg}");
        println!("# {msg}");
    }
    Ok((devices, shared))
}

/// Prefixes of the caller's own buffers as operands.
#[allow(dead_code)]
pub trait Prefix<T: cuda_multimem::DeviceRepr> {
    fn slice_src(&self, len: usize) -> Src<'_, T>;
    fn slice_dst(&mut self, len: usize) -> Dst<'_, T>;
}

impl<T: cuda_multimem::DeviceRepr> Prefix<T> for DeviceBuffer<T> {
    fn slice_src(&self, len: usize) -> Src<'_, T> {
        // SAFETY: the first `len` elements of this buffer (at most its length), borrowed for
        // the returned lifetime.
        unsafe { Src::from_raw(self.device_ptr(), len.min(self.len())) }
    }
    fn slice_dst(&mut self, len: usize) -> Dst<'_, T> {
        // SAFETY: as `slice_src`, exclusively borrowed.
        unsafe { Dst::from_raw(self.device_ptr(), len.min(self.len())) }
    }
}
