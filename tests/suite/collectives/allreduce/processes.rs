//! Teams across processes (one process per device, a Unix-socket rendezvous) and over a
//! Bootstrap test double (the ranks as threads): results, and peers that die or misbehave.

use super::*;

// ---- teams across processes: one process per device, rendezvous over a Unix socket ----

const MP_RANK: &str = "CMM_TEST_MP_RANK";
const MP_PATH: &str = "CMM_TEST_MP_PATH";
const MP_MODE: &str = "CMM_TEST_MP_MODE";

/// The driver of one rank's process: the real one under `CUDA_MULTIMEM_DRIVER=cuda`, else a
/// simulated two-device machine of its own (device memory shared through memfd handles).
fn mp_driver() -> Env {
    if std::env::var(cuda_multimem::DRIVER_ENV).as_deref() == Ok("cuda") {
        ar_env()
    } else {
        ar_sim(2)
    }
}

/// The team's configuration in `mode`: a short timeout where the test expects it to fire (a
/// peer process that dies before a collective), else the suite's generous one (each process
/// computes its references on the host between the calls, at its own pace).
fn mp_config(mode: &str) -> CommConfig {
    CommConfig {
        one_shot_max_bytes: Some(64 << 10),
        // 80 KB and 300 KB calls by the copy-engine two-shot, 1.2 MB by the write-only one
        ce_max_bytes: 512 << 10,
        ce_min_bytes: 0,
        timeout: if mode == "die-before-collective" {
            Duration::from_millis(1500)
        } else {
            cuda_multimem_tests::TEAM_TIMEOUT
        },
        first_call_timeout: (mode == "die-before-collective")
            .then_some(Duration::from_millis(1500)),
        scratch_bytes: 256 << 10,
        // all-gathers into symmetric outputs of 512 KiB and more through the copy engines (the
        // low-latency forms, which come first, up to 512 KiB)
        gather_ce_min_bytes: 256 << 10,
        gather_ll_max_bytes: 512 << 10,
        ..Default::default()
    }
}

/// The calls both ranks make, and each rank's data (seeded by call and rank, so any process can
/// compute every rank's input).
fn mp_calls() -> Vec<(usize, DType, ReduceOp)> {
    vec![
        (1000, DType::F32, ReduceOp::Sum),
        (40_001, DType::Bf16, ReduceOp::Max),
        (150_003, DType::F16, ReduceOp::Sum),
        (300_000, DType::F32, ReduceOp::Min),
    ]
}

fn mp_input(call: usize, rank: usize, dtype: DType, count: usize) -> Vec<u8> {
    random_bytes(dtype, count, &mut (1000 + 10 * call as u64 + rank as u64))
}

/// One rank's whole life in a two-process team; returns a description of the first problem.
fn mp_rank(rank: usize, path: &std::path::Path, mode: &str) -> Result<(), String> {
    use cuda_multimem_collectives::UnixBootstrap;
    if mode.starts_with("recover") {
        return mp_recover(rank, path, mode == "recover-gone");
    }
    let e = mp_driver();
    // "shared-*": both processes on device 0 (with and without the builder's opt-in)
    let shared = mode.starts_with("shared");
    let device = e
        .driver
        .device(if shared { 0 } else { rank })
        .map_err(|x| x.to_string())?;
    let boot =
        UnixBootstrap::new(path, rank, 2, Duration::from_secs(30)).map_err(|x| x.to_string())?;
    if mode == "die-in-rendezvous" && rank == 1 {
        std::process::exit(0);
    }
    let comm = Communicator::builder_with_bootstrap(&device, Box::new(boot))
        .config(mp_config(mode))
        .allow_shared_devices(mode == "shared-device")
        .build()
        .map_err(|x| format!("rank {rank}: communicator: {x}"))?;
    let mut buf = comm.alloc::<u8>(2 << 20).map_err(|x| x.to_string())?;
    if mode == "die-before-collective" && rank == 1 {
        std::process::exit(0);
    }
    let stream = Stream::new(&device).map_err(|x| x.to_string())?;
    for (c, (count, dtype, op)) in mp_calls().into_iter().enumerate() {
        let len = count * dtype.size();
        buf.write(rank, 0, &mp_input(c, rank, dtype, count))
            .map_err(|x| x.to_string())?;
        comm.rank(rank)
            .and_then(|h| h.all_reduce_dyn_in_place(dtype, buf.slice_mut(..len)?, op, &stream))
            .map_err(|x| x.to_string())?;
        stream.synchronize().map_err(|x| x.to_string())?;
        comm.check()
            .map_err(|x| format!("rank {rank}, call {c}: {x}"))?;
        let inputs: Vec<Vec<u8>> = (0..2).map(|r| mp_input(c, r, dtype, count)).collect();
        let want = reference_bytes(dtype, op, &refs(&inputs));
        let mut got = vec![0u8; len];
        buf.read(rank, 0, &mut got).map_err(|x| x.to_string())?;
        if let Some(m) = first_mismatch_bytes(dtype, &got, &want) {
            return Err(format!(
                "rank {rank}, call {c} ({count} x {dtype} {op}): {m}"
            ));
        }
    }
    // the caller's own memory, staged through the scratch across processes
    let count = 100_001;
    let mine = random_input::<f32>(count, &mut (77 + rank as u64));
    let i = DeviceBuffer::from_host(&device, &mine).map_err(|x| x.to_string())?;
    let mut o = DeviceBuffer::<f32>::zeroed(&device, count).map_err(|x| x.to_string())?;
    let ch = comm
        .rank(rank)
        .and_then(|h| h.all_reduce(&i, &mut o, ReduceOp::Sum, &stream))
        .map_err(|x| x.to_string())?;
    stream.synchronize().map_err(|x| x.to_string())?;
    comm.check()
        .map_err(|x| format!("rank {rank}, own memory: {x}"))?;
    if ch.staged_chunks == 0 {
        return Err(format!("rank {rank}: own memory was not staged ({ch})"));
    }
    let inputs: Vec<Vec<f32>> = (0..2)
        .map(|r| random_input::<f32>(count, &mut (77 + r as u64)))
        .collect();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    if let Some(m) = first_mismatch(&o.to_vec().map_err(|x| x.to_string())?, &want) {
        return Err(format!("rank {rank}, own memory: {m}"));
    }
    mp_other_collectives(rank, &comm, &device, &stream)
}

/// One rank of the recovery across processes: a first call (the warm-up, with the generous
/// first-call bound), then rank 1 comes 3 s late to the second (300 ms bound): rank 0's next
/// call reports the timeout naming rank 1 (from its error mirror, without `check`), both ranks
/// call `recover` (meeting through the bootstrap), and their next allreduce (a first call again)
/// equals the host reference.
///
/// `gone`: rank 1 exits after the build instead, and rank 0's `recover` fails saying to rebuild.
fn mp_recover(rank: usize, path: &std::path::Path, gone: bool) -> Result<(), String> {
    use cuda_multimem_collectives::UnixBootstrap;
    let e = mp_driver();
    let x = |e: Error| format!("rank {rank}: {e}");
    let device = e.driver.device(rank).map_err(x)?;
    let boot = UnixBootstrap::new(path, rank, 2, Duration::from_secs(30)).map_err(x)?;
    let comm = Communicator::builder_with_bootstrap(&device, Box::new(boot))
        .config(CommConfig {
            timeout: Duration::from_millis(300),
            first_call_timeout: Some(cuda_multimem_tests::TEAM_TIMEOUT),
            ll_max_bytes: 0,
            ..Default::default()
        })
        .build()
        .map_err(x)?;
    let mut buf = comm.alloc::<f32>(4096).map_err(x)?;
    let stream = Stream::new(&device).map_err(x)?;
    if gone {
        if rank == 1 {
            std::process::exit(0);
        }
        return match comm.recover() {
            Err(Error::Unusable { cause }) if cause.contains("build a new one") => Ok(()),
            other => Err(format!(
                "rank 0: recover without its peer returned {other:?}"
            )),
        };
    }
    let h = comm.rank(rank).map_err(x)?;
    let call = |buf: &mut SymmetricBuffer<f32>| {
        h.all_reduce_in_place(buf.slice_mut(..1000)?, ReduceOp::Sum, &stream)
            .map(|_| ())
    };
    call(&mut buf).map_err(x)?;
    stream.synchronize().map_err(x)?;
    if rank == 1 {
        std::thread::sleep(Duration::from_secs(3));
    }
    call(&mut buf).map_err(x)?;
    stream.synchronize().map_err(x)?;
    if rank == 0 {
        match call(&mut buf) {
            Err(Error::Timeout { what, .. }) if what.contains("rank 1 did not arrive") => {}
            other => return Err(format!("rank 0: the next call returned {other:?}")),
        }
    }
    comm.recover().map_err(x)?;
    let input =
        |r: usize| -> Vec<f32> { (0..1000).map(|i| ((i * 3 + r * 5) % 17) as f32).collect() };
    buf.write(rank, 0, &input(rank)).map_err(x)?;
    call(&mut buf).map_err(x)?;
    stream.synchronize().map_err(x)?;
    comm.check().map_err(x)?;
    let want = reference(ReduceOp::Sum, &[&input(0), &input(1)]);
    let mut got = vec![0f32; 1000];
    buf.read(rank, 0, &mut got).map_err(x)?;
    if got != want {
        return Err(format!(
            "rank {rank}: after the recovery the sums differ from the reference"
        ));
    }
    Ok(())
}

/// The other collectives across the two processes: reduce-scatter on symmetric buffers (a
/// low-latency and a staged size), all-gather and broadcast on the caller's own memory, an
/// all-gather into a symmetric output through the copy engines, and
/// the fused allreduce + residual add + RMSNorm (split over clusters of blocks on the GPU),
/// each against its host reference.
fn mp_other_collectives(
    rank: usize,
    comm: &Communicator,
    device: &Device,
    stream: &Stream,
) -> Result<(), String> {
    use cuda_multimem_collectives::testing::{
        add_rms_norm_reference, all_gather_reference, broadcast_reference,
        reduce_scatter_reference, rms_norm_within_tolerance,
    };
    let e = |x: Error| format!("rank {rank}: {x}");
    let h = comm.rank(rank).map_err(e)?;
    let data = |seed: u64, r: usize, len: usize| random_input::<bf16>(len, &mut (seed + r as u64));
    let done = |what: &str| -> Result<(), String> {
        stream.synchronize().map_err(e)?;
        comm.check()
            .map_err(|x| format!("rank {rank}, {what}: {x}"))
    };
    for count in [1000usize, 300_001] {
        let inputs: Vec<Vec<bf16>> = (0..2)
            .map(|r| data(500 + count as u64, r, 2 * count))
            .collect();
        let i: SymmetricBuffer<bf16> = comm.alloc(2 * count).map_err(e)?;
        let mut o: SymmetricBuffer<bf16> = comm.alloc(count).map_err(e)?;
        i.write(rank, 0, &inputs[rank]).map_err(e)?;
        h.reduce_scatter(&i, &mut o, ReduceOp::Sum, stream)
            .map_err(e)?;
        done("reduce-scatter")?;
        let want = &reduce_scatter_reference(ReduceOp::Sum, &refs(&inputs))[rank];
        if let Some(m) = first_mismatch(&o.to_vec(rank).map_err(e)?, want) {
            return Err(format!(
                "rank {rank}, reduce-scatter of {count} per rank: {m}"
            ));
        }
    }
    let count = 70_001;
    let inputs: Vec<Vec<bf16>> = (0..2).map(|r| data(900, r, count)).collect();
    let i = DeviceBuffer::from_host(device, &inputs[rank]).map_err(e)?;
    let mut o = DeviceBuffer::<bf16>::zeroed(device, 2 * count).map_err(e)?;
    h.all_gather(&i, &mut o, stream).map_err(e)?;
    done("all-gather")?;
    let want = all_gather_reference(&refs(&inputs));
    if let Some(m) = first_mismatch(&o.to_vec().map_err(e)?, &want) {
        return Err(format!("rank {rank}, all-gather: {m}"));
    }
    // through the copy engines: my input into the other process's mapping of the output
    let big = 300_001;
    let inputs_big: Vec<Vec<bf16>> = (0..2).map(|r| data(950, r, big)).collect();
    let ib = DeviceBuffer::from_host(device, &inputs_big[rank]).map_err(e)?;
    let mut ob: SymmetricBuffer<bf16> = comm.alloc(2 * big).map_err(e)?;
    let c = h.all_gather(&ib, &mut ob, stream).map_err(e)?;
    if c.algorithm != cuda_multimem_collectives::Algorithm::CopyEngine {
        return Err(format!("rank {rank}: symmetric all-gather ran {c}"));
    }
    done("copy-engine all-gather")?;
    let want = all_gather_reference(&refs(&inputs_big));
    if let Some(m) = first_mismatch(&ob.to_vec(rank).map_err(e)?, &want) {
        return Err(format!("rank {rank}, copy-engine all-gather: {m}"));
    }
    let mut o = DeviceBuffer::<bf16>::zeroed(device, count).map_err(e)?;
    h.broadcast(&i, &mut o, 1, stream).map_err(e)?;
    done("broadcast")?;
    let want = broadcast_reference(&refs(&inputs), 1);
    if let Some(m) = first_mismatch(&o.to_vec().map_err(e)?, &want) {
        return Err(format!("rank {rank}, broadcast: {m}"));
    }
    let (tokens, hidden) = (3, 4096);
    let xs: Vec<Vec<bf16>> = (0..2).map(|r| data(1300, r, tokens * hidden)).collect();
    let r0 = data(1400, 0, tokens * hidden);
    let gamma = data(1500, 0, hidden);
    let x = DeviceBuffer::from_host(device, &xs[rank]).map_err(e)?;
    let mut res = DeviceBuffer::from_host(device, &r0).map_err(e)?;
    let g = DeviceBuffer::from_host(device, &gamma).map_err(e)?;
    let mut out = DeviceBuffer::<bf16>::zeroed(device, tokens * hidden).map_err(e)?;
    h.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, hidden, 1e-6, stream)
        .map_err(e)?;
    done("fused norm")?;
    let (wr, wo) = add_rms_norm_reference(&refs(&xs), &r0, &gamma, hidden, 1e-6);
    if let Some(m) = first_mismatch(&res.to_vec().map_err(e)?, &wr) {
        return Err(format!("rank {rank}, fused norm residual_out: {m}"));
    }
    let got = out.to_vec().map_err(e)?;
    if let Some(i) = (0..wo.len()).find(|&i| !rms_norm_within_tolerance(got[i], wo[i])) {
        return Err(format!(
            "rank {rank}, fused norm out[{i}] = {:?}, reference {:?}",
            got[i], wo[i]
        ));
    }
    Ok(())
}

/// The child side (run by the parent test as a separate process of this binary).
#[test]
#[ignore = "runs only as the child process of the multi-process tests"]
fn multi_process_child_rank() {
    let (Ok(rank), Ok(path)) = (std::env::var(MP_RANK), std::env::var(MP_PATH)) else {
        return skip(
            "multi_process_child_rank",
            "only runs as a child of the multi-process tests",
        );
    };
    let mode = std::env::var(MP_MODE).unwrap_or_default();
    if let Err(e) = mp_rank(rank.parse().unwrap(), std::path::Path::new(&path), &mode) {
        panic!("{e}");
    }
}

fn spawn_child(path: &std::path::Path, mode: &str) -> std::process::Child {
    cuda_multimem_tests::child_test("collectives::allreduce::processes::multi_process_child_rank")
        .env(MP_RANK, "1")
        .env(MP_PATH, path)
        .env(MP_MODE, mode)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn mp_skip(name: &str) -> bool {
    let e = mp_driver();
    let d = e.driver.devices();
    if d.len() < 2 || !d[0].supports_posix_fd_handle().unwrap_or(false) {
        skip(name, "needs 2 devices with POSIX-fd VMM handles");
        return true;
    }
    false
}

fn rendezvous_path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cmm-ar-{tag}-{}", std::process::id()))
}

#[test]
fn a_team_of_two_processes_allreduces_over_a_unix_socket_rendezvous() {
    if mp_skip("two_processes") {
        return;
    }
    let path = rendezvous_path("ok");
    let child = spawn_child(&path, "");
    let mine = mp_rank(0, &path, "");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "child rank failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child ran no rank: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    mine.unwrap();
}

/// Two processes on one GPU (POSIX-fd handles of one device imported by the other process),
/// with the builder's opt-in: every collective of the two-process test against its host
/// reference.
#[test]
fn a_team_of_two_processes_on_one_gpu_runs_every_collective() {
    let e = mp_driver();
    if !e
        .driver
        .device(0)
        .unwrap()
        .supports_posix_fd_handle()
        .unwrap_or(false)
    {
        return skip("two_processes_one_gpu", "needs POSIX-fd VMM handles");
    }
    drop(e);
    let path = rendezvous_path("shared");
    let child = spawn_child(&path, "shared-device");
    let mine = mp_rank(0, &path, "shared-device");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "child rank failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    mine.unwrap();
}

/// Without the opt-in, two processes on one GPU are refused on both ranks, naming the device
/// and the builder's setting (every rank sees every rank's device key).
#[test]
fn two_processes_on_one_gpu_are_refused_without_the_opt_in() {
    let e = mp_driver();
    if !e
        .driver
        .device(0)
        .unwrap()
        .supports_posix_fd_handle()
        .unwrap_or(false)
    {
        return skip(
            "two_processes_one_gpu_refused",
            "needs POSIX-fd VMM handles",
        );
    }
    drop(e);
    let path = rendezvous_path("shared-refused");
    let child = spawn_child(&path, "shared-refused");
    let mine = mp_rank(0, &path, "shared-refused").unwrap_err();
    let out = child.wait_with_output().unwrap();
    assert!(mine.contains("allow_shared_devices"), "{mine}");
    assert!(!out.status.success(), "the child's build was not refused");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("allow_shared_devices")
            || String::from_utf8_lossy(&out.stdout).contains("allow_shared_devices"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_peer_process_that_dies_during_rendezvous_is_an_error_not_a_hang() {
    if mp_skip("dies_in_rendezvous") {
        return;
    }
    let path = rendezvous_path("die1");
    let mut child = spawn_child(&path, "die-in-rendezvous");
    let t = Instant::now();
    let err = mp_rank(0, &path, "").unwrap_err();
    let _ = child.wait();
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t.elapsed()
    );
    assert!(err.contains("communicator"), "{err}");
}

#[test]
fn a_late_peer_process_is_reported_by_the_next_call_and_both_recover() {
    if mp_skip("late_peer_recovers") {
        return;
    }
    let path = rendezvous_path("recover");
    let child = spawn_child(&path, "recover");
    let mine = mp_rank(0, &path, "recover");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "child rank failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    mine.unwrap();
}

/// A peer process that is gone: `recover` fails on the rank left, saying to rebuild the team.
#[test]
fn recover_without_a_peer_process_fails_saying_to_rebuild() {
    if mp_skip("recover_gone") {
        return;
    }
    let path = rendezvous_path("recover-gone");
    let mut child = spawn_child(&path, "recover-gone");
    let mine = mp_rank(0, &path, "recover-gone");
    let _ = child.wait();
    mine.unwrap();
}

#[test]
fn a_peer_process_that_dies_before_a_collective_is_a_timeout() {
    if mp_skip("dies_before_collective") {
        return;
    }
    let path = rendezvous_path("die2");
    let mut child = spawn_child(&path, "die-before-collective");
    // rank 0 takes the mode for the configuration only (both ranks build with the same)
    let err = mp_rank(0, &path, "die-before-collective").unwrap_err();
    let _ = child.wait();
    assert!(err.contains("did not arrive"), "{err}");
}

// ---- a Bootstrap test double: the ranks of a team as threads of this process ----

/// What the hub does wrong, at exchange `k` (counted per rank, bytes and descriptors alike):
/// the same for every rank, so all fail at the same point instead of waiting for each other.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    None,
    /// One entry fewer than the team size.
    Short(usize),
    /// The last rank's entry one byte (or one descriptor) off.
    Malformed(usize),
}

enum Entry {
    Bytes(Vec<u8>),
    Fds(Vec<OwnedFd>),
}

/// The rendezvous of the threads: exchange k collects one entry per rank.
struct Hub {
    n: usize,
    fault: Fault,
    exchanges: Mutex<HashMap<usize, Vec<Option<Entry>>>>,
    arrived: Condvar,
}

struct ThreadBootstrap {
    hub: Arc<Hub>,
    rank: usize,
    next: AtomicUsize,
    fds: bool,
}

impl ThreadBootstrap {
    fn exchange<X>(
        &self,
        mine: Entry,
        take: impl Fn(&Entry) -> X,
    ) -> cuda_multimem::Result<(usize, Vec<X>)> {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        let hub = &*self.hub;
        let mut ex = hub.exchanges.lock().unwrap();
        ex.entry(k)
            .or_insert_with(|| (0..hub.n).map(|_| None).collect())[self.rank] = Some(mine);
        hub.arrived.notify_all();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ex[&k].iter().all(Option::is_some) {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(Error::Timeout {
                    what: format!("test bootstrap exchange {k}"),
                    after: Duration::from_secs(30),
                });
            };
            ex = hub.arrived.wait_timeout(ex, left).unwrap().0;
        }
        Ok((
            k,
            ex[&k].iter().map(|e| take(e.as_ref().unwrap())).collect(),
        ))
    }
}

impl Bootstrap for ThreadBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn timeout(&self) -> Option<Duration> {
        Some(Duration::from_secs(600))
    }
    fn size(&self) -> usize {
        self.hub.n
    }
    fn all_gather(&self, data: &[u8]) -> cuda_multimem::Result<Vec<Vec<u8>>> {
        let (k, mut all) = self.exchange(Entry::Bytes(data.to_vec()), |e| match e {
            Entry::Bytes(b) => b.clone(),
            Entry::Fds(_) => Vec::new(),
        })?;
        match self.hub.fault {
            Fault::Short(at) if at == k => {
                all.pop();
            }
            Fault::Malformed(at) if at == k => all.last_mut().unwrap().push(0xEE),
            _ => {}
        }
        Ok(all)
    }
    fn all_gather_fds(&self, fds: &[BorrowedFd<'_>]) -> cuda_multimem::Result<Vec<Vec<OwnedFd>>> {
        let mine = fds
            .iter()
            .map(|f| f.try_clone_to_owned())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::os("dup", e))?;
        let (k, all) = self.exchange(Entry::Fds(mine), |e| match e {
            Entry::Fds(f) => f.iter().map(|x| x.try_clone()).collect(),
            Entry::Bytes(_) => Ok(Vec::new()),
        })?;
        let mut all = all
            .into_iter()
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::os("dup", e))?;
        match self.hub.fault {
            Fault::Short(at) if at == k => {
                all.pop();
            }
            Fault::Malformed(at) if at == k => {
                all.last_mut().unwrap().pop();
            }
            _ => {}
        }
        Ok(all)
    }
    fn passes_fds(&self) -> bool {
        self.fds
    }
}

/// Run `body(rank, device, bootstrap)` for every rank of a team of the first `n` devices of `e`,
/// each in its own thread, with one hub; the results by rank.
fn thread_team<R: Send>(
    e: &Env,
    n: usize,
    fault: Fault,
    body: impl Fn(usize, Device, Box<dyn Bootstrap>) -> R + Sync,
) -> Vec<R> {
    let hub = Arc::new(Hub {
        n,
        fault,
        exchanges: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
    });
    let devices = e.driver.devices();
    let fds = devices[0].supports_posix_fd_handle().unwrap_or(false);
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let boot = Box::new(ThreadBootstrap {
                    hub: hub.clone(),
                    rank,
                    next: AtomicUsize::new(0),
                    fds,
                });
                let d = devices[rank].clone();
                let body = &body;
                sc.spawn(move || body(rank, d, boot))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A small configuration for the thread teams (little memory per build).
fn thread_config() -> CommConfig {
    CommConfig {
        one_shot_max_bytes: Some(16 << 10),
        stage_bytes: Some(16 << 10),
        scratch_bytes: 64 << 10,
        // generous: the suite runs many simulated teams at once
        timeout: cuda_multimem_tests::TEAM_TIMEOUT,
        ..Default::default()
    }
}

fn thread_build(d: &Device, boot: Box<dyn Bootstrap>) -> cuda_multimem::Result<Communicator> {
    Communicator::builder_with_bootstrap(d, boot)
        .config(thread_config())
        .build()
}

/// One checked in-place sum of `count` f32 on `buf` by `rank` of a team of `n` (threads).
fn thread_sum(
    comm: &Communicator,
    rank: usize,
    n: usize,
    buf: &mut SymmetricBuffer<f32>,
    count: usize,
) -> cuda_multimem::Result<()> {
    let input = |r: usize| random_input::<f32>(count, &mut (500 + r as u64));
    buf.write(rank, 0, &input(rank))?;
    let s = Stream::new(comm.device(rank)?)?;
    comm.rank(rank)?
        .all_reduce_in_place(buf.slice_mut(..count)?, ReduceOp::Sum, &s)?;
    s.synchronize()?;
    comm.check()?;
    let inputs: Vec<Vec<f32>> = (0..n).map(input).collect();
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    let mut got = vec![0f32; count];
    buf.read(rank, 0, &mut got)?;
    assert_eq!(first_mismatch(&got, &want), None, "rank {rank}");
    Ok(())
}

#[test]
fn a_team_over_a_test_bootstrap_in_threads_allreduces() {
    let e = ar_sim(2);
    let ok = thread_team(&e, 2, Fault::None, |rank, d, boot| {
        let comm = thread_build(&d, boot)?;
        assert_eq!(comm.local_ranks(), vec![rank]);
        // the first call waits as long as the bootstrap does (its 600 s over the default 120)
        assert_eq!(comm.first_call_timeout(), Duration::from_secs(600));
        let mut buf = comm.alloc::<f32>(50_000)?;
        // one-shot and the write-only two-shot
        thread_sum(&comm, rank, 2, &mut buf, 1000)?;
        thread_sum(&comm, rank, 2, &mut buf, 50_000)
    });
    for (r, x) in ok.into_iter().enumerate() {
        x.unwrap_or_else(|err| panic!("rank {r}: {err}"));
    }
}

/// Fault every exchange of building in turn: each must fail the build on every rank with
/// `Error::Peer`, never give an Ok communicator; returns how many exchanges were faulted.
fn every_exchange_faulted(fault: fn(usize) -> Fault) -> usize {
    let e = ar_sim(2);
    for k in 0.. {
        let results = thread_team(&e, 2, fault(k), |_, d, boot| {
            thread_build(&d, boot).map(|_| ())
        });
        if results.iter().all(Result::is_ok) {
            return k;
        }
        for (r, x) in results.into_iter().enumerate() {
            match x {
                Err(Error::Peer { .. }) => {}
                other => panic!(
                    "{:?}, rank {r}: expected Error::Peer, got {other:?}",
                    fault(k)
                ),
            }
        }
        assert!(k < 200, "building never completed");
    }
    unreachable!()
}

#[test]
fn a_bootstrap_that_returns_fewer_entries_than_the_team_fails_the_build_with_a_peer_error() {
    let exchanges = every_exchange_faulted(Fault::Short);
    // counts, configurations, pad readiness, and a size and a handle exchange per symmetric area
    assert!(exchanges >= 8, "only {exchanges} exchanges");
}

#[test]
fn a_bootstrap_that_returns_a_malformed_entry_fails_the_build_with_a_peer_error() {
    let exchanges = every_exchange_faulted(Fault::Malformed);
    assert!(exchanges >= 8, "only {exchanges} exchanges");
}

#[test]
fn a_rank_that_refuses_a_collective_allocation_makes_every_rank_fail_and_the_team_stays_usable() {
    let e = ar_sim(2);
    let results = thread_team(&e, 2, Fault::None, |rank, d, boot| {
        let comm = thread_build(&d, boot).unwrap();
        let refused = comm.alloc::<f32>(if rank == 0 { 0 } else { 1024 });
        match (rank, refused) {
            (0, Err(Error::InvalidArgument { arg: "len", .. })) => {}
            (1, Err(Error::RanksDisagree { what })) => {
                assert!(what.contains("rank 0 refused"), "{what}")
            }
            (r, other) => panic!("rank {r}: {other:?}"),
        }
        let mut buf = comm.alloc::<f32>(1024).unwrap();
        thread_sum(&comm, rank, 2, &mut buf, 1000)
    });
    for (r, x) in results.into_iter().enumerate() {
        x.unwrap_or_else(|err| panic!("rank {r}: {err}"));
    }
}

#[test]
fn ranks_that_ask_for_different_allocation_sizes_all_fail_with_a_disagreement() {
    let e = ar_sim(2);
    let results = thread_team(&e, 2, Fault::None, |rank, d, boot| {
        let comm = thread_build(&d, boot).unwrap();
        let r = comm.alloc::<f32>(1024 + rank);
        assert!(
            matches!(r, Err(Error::RanksDisagree { .. })),
            "rank {rank}: {r:?}"
        );
        let mut buf = comm.alloc::<f32>(1024).unwrap();
        thread_sum(&comm, rank, 2, &mut buf, 1000)
    });
    for (r, x) in results.into_iter().enumerate() {
        x.unwrap_or_else(|err| panic!("rank {r}: {err}"));
    }
}
