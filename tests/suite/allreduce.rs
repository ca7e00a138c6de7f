//! Allreduce: results equal a host reference (reduced in rank order) for every type and
//! operator, sizes with odd counts and misaligned offsets, back-to-back calls with random
//! per-device delays on teams of 2 to 8, graph replays; bad input is refused and a peer that
//! disagrees or never arrives is reported, not waited for forever.

use std::time::Duration;

use cuda_multimem::{Driver, Error, Stream};
use cuda_multimem_collectives::{
    half, reference, Algorithm, AllReduceConfig, Communicator, DType, Op, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, sim, skip, Env, Rng};

/// Random elements of `dtype` in [-1, 1), little-endian.
fn random(rng: &mut Rng, dtype: DType, count: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        half::store(dtype, &mut v, rng.f32());
    }
    v
}

fn streams(comm: &Communicator) -> Vec<Stream> {
    (0..comm.size())
        .map(|r| Stream::new(comm.device(r).unwrap()).unwrap())
        .collect()
}

fn sync(streams: &[Stream]) {
    for s in streams {
        s.synchronize().unwrap();
    }
}

/// Write `data[r]` at element `offset` of rank r's part (read-modify-write of the whole part).
fn put(buf: &SymmetricBuffer, rank: usize, byte_offset: usize, data: &[u8]) {
    let mut all = vec![0u8; buf.len()];
    buf.copy_to_host(rank, &mut all).unwrap();
    all[byte_offset..byte_offset + data.len()].copy_from_slice(data);
    buf.copy_from_host(rank, &all).unwrap();
}

fn get(buf: &SymmetricBuffer, rank: usize, byte_offset: usize, len: usize) -> Vec<u8> {
    let mut all = vec![0u8; buf.len()];
    buf.copy_to_host(rank, &mut all).unwrap();
    all[byte_offset..byte_offset + len].to_vec()
}

fn first_mismatch(dtype: DType, got: &[u8], want: &[u8]) -> Option<String> {
    let es = dtype.size();
    (0..want.len() / es)
        .find(|&i| got[i * es..(i + 1) * es] != want[i * es..(i + 1) * es])
        .map(|i| {
            format!(
                "element {i}: got {} want {}",
                half::load(dtype, got, i),
                half::load(dtype, want, i)
            )
        })
}

/// One checked allreduce on every rank: random inputs at `in_off`, output at `out_off`.
#[allow(clippy::too_many_arguments)]
fn check_once(
    comm: &Communicator,
    s: &[Stream],
    rng: &mut Rng,
    buf_in: &SymmetricBuffer,
    buf_out: &SymmetricBuffer,
    (in_off, out_off): (usize, usize),
    count: usize,
    dtype: DType,
    op: Op,
) {
    let n = comm.size();
    let es = dtype.size();
    let inputs: Vec<Vec<u8>> = (0..n).map(|_| random(rng, dtype, count)).collect();
    for (r, d) in inputs.iter().enumerate() {
        put(buf_in, r, in_off * es, d);
    }
    for (r, st) in s.iter().enumerate() {
        comm.all_reduce(r, buf_in, in_off, buf_out, out_off, count, dtype, op, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(dtype, op, &refs);
    for r in 0..n {
        let got = get(buf_out, r, out_off * es, count * es);
        if let Some(m) = first_mismatch(dtype, &got, &want) {
            panic!(
                "rank {r}, {count} x {} {} ({:?}), offsets {in_off}/{out_off}: {m}",
                dtype.name(),
                op.name(),
                comm.choice(count, dtype).algorithm
            );
        }
    }
}

fn team(e: &Env) -> Option<Communicator> {
    let devices = e.driver.devices();
    if devices.len() < 2 {
        skip(
            "allreduce",
            format!("needs 2 devices, the machine has {}", devices.len()),
        );
        return None;
    }
    if !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        skip(
            "allreduce",
            "devices 0 and 1 cannot access each other (no P2P)",
        );
        return None;
    }
    Some(Communicator::new(&devices[..2]).unwrap())
}

#[test]
fn peer_to_peer_allreduce_equals_the_host_reference_for_every_dtype_and_op() {
    let e = env();
    let Some(comm) = team(&e) else { return };
    let s = streams(&comm);
    let mut rng = Rng::new(5);
    let buf = comm.alloc(4 << 20).unwrap();
    let out = comm.alloc(4 << 20).unwrap();
    // small (one-shot), odd, vector-width tails, two-shot sizes; offsets break 16-byte alignment
    let sizes = [1usize, 7, 1000, 4099, 40_000, 300_001];
    for dtype in DType::ALL {
        for op in Op::ALL {
            for (i, &count) in sizes.iter().enumerate() {
                let offs = match i % 3 {
                    0 => (0, 0),
                    1 => (3, 3),
                    _ => (0, 5),
                };
                check_once(&comm, &s, &mut rng, &buf, &out, offs, count, dtype, op);
                check_once(
                    &comm,
                    &s,
                    &mut rng,
                    &buf,
                    &buf,
                    (offs.0, offs.0),
                    count,
                    dtype,
                    op,
                );
            }
        }
    }
}

#[test]
fn both_algorithms_give_the_same_bits_when_forced() {
    let e = env();
    let devices = e.driver.devices();
    if devices.len() < 2 {
        return skip("both_algorithms", "needs 2 devices");
    }
    let mut rng = Rng::new(11);
    for algorithm in [
        Algorithm::OneShotLl,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::TwoShotPush,
        Algorithm::TwoShotCe,
    ] {
        let cfg = AllReduceConfig {
            algorithm: Some(algorithm),
            ce_max_bytes: 1 << 20,
            ..Default::default()
        };
        let comm = Communicator::with_config(&devices[..2], cfg).unwrap();
        let s = streams(&comm);
        let buf = comm.alloc(1 << 20).unwrap();
        for count in [6usize, 12_346, 32_768] {
            assert_eq!(comm.choice(count, DType::Bf16).algorithm, algorithm);
            check_once(
                &comm,
                &s,
                &mut rng,
                &buf,
                &buf,
                (0, 0),
                count,
                DType::Bf16,
                Op::Sum,
            );
        }
    }
}

/// Back-to-back calls on a simulated team of `n` with random per-device delays: every call
/// writes its own output region, all are checked at the end.
fn back_to_back(n: usize, calls: usize, seed: u64) {
    let e = sim(SimConfig::new(n, 13000));
    let sim = e.sim.as_ref().unwrap();
    sim.set_kernel_delays(Duration::from_micros(300), seed);
    let comm = Communicator::with_config(
        &e.driver.devices(),
        AllReduceConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 4 << 10,
            // small slots: the write-only two-shot runs in several rounds per block
            stage_bytes: Some(8 << 10),
            // and between 8 and 24 KiB the copy-engine two-shot
            ce_max_bytes: 24 << 10,
            ce_min_bytes: 0,
            max_blocks: 4,
            threads: 64,
            ..Default::default()
        },
    )
    .unwrap();
    let s = streams(&comm);
    let mut rng = Rng::new(seed);
    let region = 64 << 10;
    let inp = comm.alloc(region).unwrap();
    let out = comm.alloc(region * calls).unwrap();
    let mut expected = Vec::new();
    for c in 0..calls {
        let dtype = DType::ALL[(rng.next_u64() % 3) as usize];
        let op = Op::ALL[(rng.next_u64() % 3) as usize];
        let es = dtype.size();
        let count = 1 + (rng.next_u64() % (region as u64 / es as u64 - 16)) as usize;
        let count = if c % 4 == 0 { count % 3000 + 1 } else { count };
        // aligned half of the time (the write-only two-shot), else the reading two-shot
        let off = if rng.next_u64() & 1 == 0 {
            0
        } else {
            (rng.next_u64() % 8) as usize
        };
        let count = count.min(region / es - off);
        // inputs are written before any call is queued: they are read-only afterwards, so each
        // call gets fresh data through its own input region (one per call)
        let inputs: Vec<Vec<u8>> = (0..n).map(|_| random(&mut rng, dtype, count)).collect();
        expected.push((dtype, op, count, off, inputs));
    }
    // the input buffer is shared, so run in groups: write inputs, then queue every call that
    // reads them ... simplest honest form: one input region per call would need calls x region;
    // instead each call's inputs are placed in its own slice of a large input buffer.
    drop(inp);
    let inp = comm.alloc(region * calls).unwrap();
    for r in 0..n {
        let mut all = vec![0u8; region * calls];
        for (c, (dtype, _, _, off, inputs)) in expected.iter().enumerate() {
            let at = c * region + off * dtype.size();
            all[at..at + inputs[r].len()].copy_from_slice(&inputs[r]);
        }
        inp.copy_from_host(r, &all).unwrap();
    }
    for (c, (dtype, op, count, off, _)) in expected.iter().enumerate() {
        let es = dtype.size();
        let base = c * region / es;
        for (r, st) in s.iter().enumerate() {
            comm.all_reduce(
                r,
                &inp,
                base + off,
                &out,
                base + off,
                *count,
                *dtype,
                *op,
                st,
            )
            .unwrap();
        }
    }
    sync(&s);
    comm.check().unwrap();
    for r in 0..n {
        let mut all = vec![0u8; region * calls];
        out.copy_to_host(r, &mut all).unwrap();
        for (c, (dtype, op, count, off, inputs)) in expected.iter().enumerate() {
            let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference(*dtype, *op, &refs);
            let at = c * region + off * dtype.size();
            let got = &all[at..at + count * dtype.size()];
            if let Some(m) = first_mismatch(*dtype, got, &want) {
                panic!("team of {n}, call {c} ({count} x {dtype:?} {op:?}), rank {r}: {m}");
            }
        }
    }
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_2() {
    back_to_back(2, 24, 1);
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_3() {
    back_to_back(3, 16, 2);
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_5() {
    back_to_back(5, 10, 3);
}

#[test]
fn back_to_back_calls_with_random_delays_are_exact_on_a_team_of_8() {
    back_to_back(8, 8, 4);
}

#[test]
fn a_captured_graph_replays_the_allreduce_without_host_resets() {
    let e = env();
    let Some(comm) = team(&e) else { return };
    graph_replay(&e, &comm, 5000);
}

/// The copy-engine two-shot's copies are memcpy nodes of the captured graph: replays copy the
/// new inputs and reduce them, nothing reset from the host.
#[test]
fn a_captured_graph_replays_the_copy_engine_two_shot() {
    let e = env();
    let devices = e.driver.devices();
    if devices.len() < 2 {
        return skip("graph_ce", "needs 2 devices");
    }
    let comm = Communicator::with_config(
        &devices[..2],
        AllReduceConfig {
            one_shot_max_bytes: Some(16 << 10),
            ce_max_bytes: 1 << 20,
            ce_min_bytes: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        comm.choice(100_000, DType::F32).algorithm,
        Algorithm::TwoShotCe
    );
    graph_replay(&e, &comm, 100_000);
}

/// Capture one f32 sum of `count` elements per rank, replay it four times with new inputs.
fn graph_replay(e: &Env, comm: &Communicator, count: usize) {
    let s = streams(comm);
    let d: &Driver = &e.driver;
    let (dtype, op) = (DType::F32, Op::Sum);
    let inp = comm.alloc(count * 4).unwrap();
    let out = comm.alloc(count * 4).unwrap();
    let mut execs = Vec::new();
    for (r, st) in s.iter().enumerate() {
        comm.device(r).unwrap().bind().unwrap();
        let mut graph = std::ptr::null_mut();
        let mut exec = std::ptr::null_mut();
        // SAFETY: a live stream of this device; capture mode global; out-pointers valid.
        unsafe {
            let begin = d.sys().cuStreamBeginCapture_v10010().unwrap();
            assert_eq!(
                begin(
                    st.raw(),
                    cuda_multimem_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL
                ),
                cuda_multimem_sys::CUresult::CUDA_SUCCESS
            );
        }
        comm.all_reduce(r, &inp, 0, &out, 0, count, dtype, op, st)
            .unwrap();
        // SAFETY: ends the capture begun above; out-pointers valid.
        unsafe {
            let end = d.sys().cuStreamEndCapture().unwrap();
            assert_eq!(
                end(st.raw(), &mut graph),
                cuda_multimem_sys::CUresult::CUDA_SUCCESS
            );
            let inst = d.sys().cuGraphInstantiateWithFlags().unwrap();
            assert_eq!(
                inst(&mut exec, graph, 0),
                cuda_multimem_sys::CUresult::CUDA_SUCCESS
            );
            let destroy = d.sys().cuGraphDestroy().unwrap();
            destroy(graph);
        }
        execs.push(exec);
    }
    let mut rng = Rng::new(77);
    for replay in 0..4 {
        let inputs: Vec<Vec<u8>> = (0..2).map(|_| random(&mut rng, dtype, count)).collect();
        for (r, x) in inputs.iter().enumerate() {
            inp.copy_from_host(r, x).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            comm.device(r).unwrap().bind().unwrap();
            // SAFETY: an executable graph of this device, a live stream.
            unsafe {
                let launch = d.sys().cuGraphLaunch().unwrap();
                assert_eq!(
                    launch(execs[r], st.raw()),
                    cuda_multimem_sys::CUresult::CUDA_SUCCESS
                );
            }
        }
        sync(&s);
        comm.check().unwrap();
        let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference(dtype, op, &refs);
        for r in 0..2 {
            let got = get(&out, r, 0, count * 4);
            assert!(
                first_mismatch(dtype, &got, &want).is_none(),
                "replay {replay}, rank {r}"
            );
        }
    }
    for (r, x) in execs.into_iter().enumerate() {
        comm.device(r).unwrap().bind().unwrap();
        // SAFETY: an executable graph we made, no longer running (streams synchronised).
        unsafe { d.sys().cuGraphExecDestroy().unwrap()(x) };
    }
}

fn invalid_arg(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        e => panic!("expected an invalid argument, got {e}"),
    }
}

#[test]
fn bad_lengths_pointers_and_foreign_memory_are_refused_before_any_launch() {
    let e = env();
    let Some(comm) = team(&e) else { return };
    let s = streams(&comm);
    let buf = comm.alloc(4096).unwrap();
    let p = buf.ptr(0).unwrap();
    // SAFETY (each call): live streams of the rank's device; pointers are checked by the call.
    unsafe {
        assert_eq!(
            invalid_arg(
                comm.all_reduce_raw(0, p, p, 6, DType::F32, Op::Sum, s[0].raw())
                    .unwrap_err()
            ),
            "bytes"
        );
        assert_eq!(
            invalid_arg(
                comm.all_reduce_raw(0, p + 2, p + 2, 8, DType::F32, Op::Sum, s[0].raw())
                    .unwrap_err()
            ),
            "input"
        );
        assert_eq!(
            invalid_arg(
                comm.all_reduce_raw(0, p, p + 4096, 8, DType::F32, Op::Sum, s[0].raw())
                    .unwrap_err()
            ),
            "output"
        );
        assert_eq!(
            invalid_arg(
                comm.all_reduce_raw(0, p, p, 8192, DType::F32, Op::Sum, s[0].raw())
                    .unwrap_err()
            ),
            "input"
        );
        // rank 1's buffer is not rank 0's
        let q = buf.ptr(1).unwrap();
        assert_eq!(
            invalid_arg(
                comm.all_reduce_raw(0, q, q, 8, DType::F32, Op::Sum, s[0].raw())
                    .unwrap_err()
            ),
            "input"
        );
        assert_eq!(
            invalid_arg(
                comm.all_reduce_raw(2, p, p, 8, DType::F32, Op::Sum, s[0].raw())
                    .unwrap_err()
            ),
            "rank"
        );
    }
    // overlapping but different ranges
    assert_eq!(
        invalid_arg(
            comm.all_reduce(0, &buf, 0, &buf, 4, 64, DType::F32, Op::Sum, &s[0])
                .unwrap_err()
        ),
        "output"
    );
    // a stream of the other device
    assert_eq!(
        invalid_arg(
            comm.all_reduce(0, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[1])
                .unwrap_err()
        ),
        "stream"
    );
    let other = Communicator::new(&e.driver.devices()[..2]).unwrap();
    let foreign = other.alloc(4096).unwrap();
    assert_eq!(
        invalid_arg(
            comm.all_reduce(0, &foreign, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[0])
                .unwrap_err()
        ),
        "input"
    );
    assert!(Communicator::new(&e.driver.devices()[..1]).is_err());
    // nothing was launched: a real call still works
    let mut rng = Rng::new(3);
    check_once(
        &comm,
        &s,
        &mut rng,
        &buf,
        &buf,
        (0, 0),
        100,
        DType::F32,
        Op::Max,
    );
}

fn short_timeout_team(n: usize) -> (Env, Communicator) {
    let e = sim(SimConfig::new(n, 13000));
    let comm = Communicator::with_config(
        &e.driver.devices(),
        AllReduceConfig {
            timeout: Duration::from_millis(300),
            ..Default::default()
        },
    )
    .unwrap();
    (e, comm)
}

/// On a team of two with a short timeout: rank 0 calls `mine` (count, dtype), rank 1 `theirs`,
/// both sum in place in one buffer; what rank 0's call chose, and what `check` reports.
fn disagree(
    comm: &Communicator,
    s: &[Stream],
    buf: &SymmetricBuffer,
    mine: (usize, DType),
    theirs: (usize, DType),
) -> (Algorithm, Error) {
    let a = comm
        .all_reduce(0, buf, 0, buf, 0, mine.0, mine.1, Op::Sum, &s[0])
        .unwrap();
    comm.all_reduce(1, buf, 0, buf, 0, theirs.0, theirs.1, Op::Sum, &s[1])
        .unwrap();
    sync(s);
    (a.algorithm, comm.check().unwrap_err())
}

#[test]
fn ranks_that_disagree_on_the_size_are_reported_not_waited_for() {
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let buf = comm.alloc(1 << 20).unwrap();
    // above the low-latency limit, the call header names the disagreement
    let (_, err) = disagree(&comm, &s, &buf, (20_000, DType::F32), (20_001, DType::F32));
    assert!(err.to_string().contains("different sizes"), "{err}");
    // the team refuses further work
    assert!(comm
        .all_reduce(0, &buf, 0, &buf, 0, 100, DType::F32, Op::Sum, &s[0])
        .is_err());
}

#[test]
fn small_calls_that_disagree_are_reported_as_a_peer_that_did_not_arrive() {
    // the low-latency protocol folds the call header into its flags: no data is taken from a
    // rank that called something else, and the wait ends at the timeout
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let buf = comm.alloc(1 << 16).unwrap();
    let (a, err) = disagree(&comm, &s, &buf, (100, DType::F16), (100, DType::Bf16));
    assert_eq!(a, Algorithm::OneShotLl);
    assert!(err.to_string().contains("called something else"), "{err}");
}

#[test]
fn ranks_that_disagree_on_the_dtype_are_reported() {
    let (_e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let buf = comm.alloc(1 << 20).unwrap();
    let (_, err) = disagree(&comm, &s, &buf, (40_000, DType::F16), (40_000, DType::Bf16));
    assert!(err.to_string().contains("different sizes, types"), "{err}");
}

#[test]
fn a_peer_that_never_arrives_is_a_timeout_not_a_hang() {
    let (_e, comm) = short_timeout_team(3);
    let s = streams(&comm);
    let buf = comm.alloc(1 << 16).unwrap();
    let t = std::time::Instant::now();
    comm.all_reduce(0, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[0])
        .unwrap();
    comm.all_reduce(1, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[1])
        .unwrap();
    sync(&s);
    assert!(t.elapsed() < Duration::from_secs(20));
    match comm.check().unwrap_err() {
        Error::Timeout { what, .. } => assert!(what.contains("barrier"), "{what}"),
        e => panic!("expected a timeout, got {e}"),
    }
}

#[test]
fn a_second_stream_is_refused_while_the_first_has_work_in_flight() {
    let (e, comm) = short_timeout_team(2);
    let s = streams(&comm);
    let extra = Stream::new(comm.device(0).unwrap()).unwrap();
    let buf = comm.alloc(1 << 16).unwrap();
    e.sim
        .as_ref()
        .unwrap()
        .set_kernel_delays(Duration::from_millis(50), 9);
    // rank 0 queues on s[0]; its kernel waits for rank 1, which has not been called yet
    comm.all_reduce(0, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[0])
        .unwrap();
    let err = comm
        .all_reduce(0, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &extra)
        .unwrap_err();
    assert_eq!(invalid_arg(err), "stream");
    comm.all_reduce(1, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[1])
        .unwrap();
    sync(&s);
    comm.check().unwrap();
    // once idle, the other stream may take over
    comm.all_reduce(0, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &extra)
        .unwrap();
    comm.all_reduce(1, &buf, 0, &buf, 0, 64, DType::F32, Op::Sum, &s[1])
        .unwrap();
    extra.synchronize().unwrap();
    sync(&s);
    comm.check().unwrap();
}

#[test]
fn a_team_leaves_nothing_behind() {
    let e = sim(SimConfig::new(2, 13000));
    let sim = e.sim.as_ref().unwrap();
    let before = sim.live_resources();
    {
        let comm = Communicator::new(&e.driver.devices()).unwrap();
        let s = streams(&comm);
        let buf = comm.alloc(1 << 12).unwrap();
        comm.all_reduce(0, &buf, 0, &buf, 0, 10, DType::F32, Op::Sum, &s[0])
            .unwrap();
        comm.all_reduce(1, &buf, 0, &buf, 0, 10, DType::F32, Op::Sum, &s[1])
            .unwrap();
        sync(&s);
    }
    let after: std::collections::BTreeMap<_, _> = sim
        .live_resources()
        .into_iter()
        .filter(|(k, _)| k != "primary contexts")
        .collect();
    let before: std::collections::BTreeMap<_, _> = before
        .into_iter()
        .filter(|(k, _)| k != "primary contexts")
        .collect();
    assert_eq!(after, before);
}

// ---- teams across processes: one process per device, rendezvous over a Unix socket ----

const MP_RANK: &str = "CMM_TEST_MP_RANK";
const MP_PATH: &str = "CMM_TEST_MP_PATH";
const MP_MODE: &str = "CMM_TEST_MP_MODE";

/// The driver of one rank's process: the real one under `CUDA_MULTIMEM_DRIVER=cuda`, else a
/// simulated two-device machine of its own (device memory shared through memfd handles).
fn mp_driver() -> Env {
    if std::env::var(cuda_multimem::DRIVER_ENV).as_deref() == Ok("cuda") {
        env()
    } else {
        sim(SimConfig::new(2, 13000))
    }
}

fn mp_config() -> AllReduceConfig {
    AllReduceConfig {
        one_shot_max_bytes: Some(64 << 10),
        // 80 KB and 300 KB calls by the copy-engine two-shot, 1.2 MB by the write-only one
        ce_max_bytes: 512 << 10,
        ce_min_bytes: 0,
        timeout: Duration::from_millis(1500),
        ..Default::default()
    }
}

/// The calls both ranks make, and each rank's data (seeded by call and rank, so any process can
/// compute every rank's input).
fn mp_calls() -> Vec<(usize, DType, Op)> {
    vec![
        (1000, DType::F32, Op::Sum),
        (40_001, DType::Bf16, Op::Max),
        (150_003, DType::F16, Op::Sum),
        (300_000, DType::F32, Op::Min),
    ]
}

fn mp_input(call: usize, rank: usize, dtype: DType, count: usize) -> Vec<u8> {
    random(
        &mut Rng::new(1000 + 10 * call as u64 + rank as u64),
        dtype,
        count,
    )
}

/// One rank's whole life in a two-process team; returns a description of the first problem.
fn mp_rank(rank: usize, path: &std::path::Path, mode: &str) -> Result<(), String> {
    use cuda_multimem_collectives::UnixBootstrap;
    let e = mp_driver();
    let device = e.driver.device(rank).map_err(|x| x.to_string())?;
    let boot =
        UnixBootstrap::new(path, rank, 2, Duration::from_secs(30)).map_err(|x| x.to_string())?;
    if mode == "die-in-rendezvous" && rank == 1 {
        std::process::exit(0);
    }
    let comm = Communicator::with_bootstrap(&device, Box::new(boot), mp_config())
        .map_err(|x| format!("rank {rank}: communicator: {x}"))?;
    let buf = comm.alloc(2 << 20).map_err(|x| x.to_string())?;
    if mode == "die-before-collective" && rank == 1 {
        std::process::exit(0);
    }
    let stream = Stream::new(&device).map_err(|x| x.to_string())?;
    for (c, (count, dtype, op)) in mp_calls().into_iter().enumerate() {
        buf.copy_from_host(rank, &mp_input(c, rank, dtype, count))
            .map_err(|x| x.to_string())?;
        comm.all_reduce(rank, &buf, 0, &buf, 0, count, dtype, op, &stream)
            .map_err(|x| x.to_string())?;
        stream.synchronize().map_err(|x| x.to_string())?;
        comm.check()
            .map_err(|x| format!("rank {rank}, call {c}: {x}"))?;
        let inputs: Vec<Vec<u8>> = (0..2).map(|r| mp_input(c, r, dtype, count)).collect();
        let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference(dtype, op, &refs);
        let got = get(&buf, rank, 0, want.len());
        if let Some(m) = first_mismatch(dtype, &got, &want) {
            return Err(format!(
                "rank {rank}, call {c} ({count} x {dtype:?} {op:?}): {m}"
            ));
        }
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
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "allreduce::multi_process_child_rank",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
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

#[test]
fn a_peer_process_that_dies_during_rendezvous_is_an_error_not_a_hang() {
    if mp_skip("dies_in_rendezvous") {
        return;
    }
    let path = rendezvous_path("die1");
    let mut child = spawn_child(&path, "die-in-rendezvous");
    let t = std::time::Instant::now();
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
fn a_peer_process_that_dies_before_a_collective_is_a_timeout() {
    if mp_skip("dies_before_collective") {
        return;
    }
    let path = rendezvous_path("die2");
    let mut child = spawn_child(&path, "die-before-collective");
    let err = mp_rank(0, &path, "").unwrap_err();
    let _ = child.wait();
    assert!(err.contains("did not arrive"), "{err}");
}

// ---- the multimem path (simulator only: real GPUs here must never create multicast objects) ----

use cuda_multimem_collectives::{multimem_pays_off, MultimemAllReduce, Path};

fn multimem_round(n: usize, seed: u64, forced: Option<Algorithm>) {
    let e = sim(SimConfig::new(n, 13000));
    e.sim
        .as_ref()
        .unwrap()
        .set_kernel_delays(Duration::from_micros(200), seed);
    let devices = e.driver.devices();
    let mm = MultimemAllReduce::new(
        &devices,
        256 << 10,
        AllReduceConfig {
            algorithm: forced,
            one_shot_max_bytes: Some(16 << 10),
            max_blocks: 3,
            threads: 64,
            ..Default::default()
        },
    )
    .unwrap();
    let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
    let mut rng = Rng::new(seed);
    for dtype in DType::ALL {
        for op in Op::ALL {
            if dtype == DType::F32 && op != Op::Sum {
                let err = mm.all_reduce(0, 8, dtype, op, &s[0]).unwrap_err();
                assert_eq!(invalid_arg(err), "op");
                continue;
            }
            for count in [5usize, 1001, 20_003] {
                let count = count.min(mm.capacity() / dtype.size());
                let inputs: Vec<Vec<u8>> = (0..n).map(|_| random(&mut rng, dtype, count)).collect();
                for (r, x) in inputs.iter().enumerate() {
                    mm.copy_in(r, x).unwrap();
                }
                for (r, st) in s.iter().enumerate() {
                    let c = mm.all_reduce(r, count, dtype, op, st).unwrap();
                    assert_eq!(c.path, Path::Multimem);
                }
                sync(&s);
                mm.check().unwrap();
                let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
                let want = reference(dtype, op, &refs);
                for r in 0..n {
                    let mut got = vec![0u8; want.len()];
                    mm.copy_out(r, &mut got).unwrap();
                    // sums: the switch's order, not rank order (within a tolerance); min/max exact
                    let m = match op {
                        Op::Sum => {
                            cuda_multimem_tests::first_beyond_sum_tolerance(dtype, n, &got, &want)
                        }
                        _ => first_mismatch(dtype, &got, &want),
                    };
                    if let Some(m) = m {
                        panic!(
                            "team of {n}, {count} x {dtype:?} {op:?} ({:?}), rank {r}: {m}",
                            mm.choice(count, dtype).algorithm
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn multimem_allreduce_equals_the_host_reference_on_a_simulated_team_of_2() {
    multimem_round(2, 21, None);
}

#[test]
fn multimem_allreduce_equals_the_host_reference_on_a_simulated_team_of_4() {
    multimem_round(4, 22, None);
}

#[test]
fn multimem_one_shot_and_two_shot_forced_on_a_simulated_team_of_5() {
    multimem_round(5, 23, Some(Algorithm::OneShot));
    multimem_round(5, 24, Some(Algorithm::TwoShot));
}

/// Ranks of a multimem team that disagree (same grid, so the barriers alone would pass and the
/// reduction would mix different calls) are reported as a disagreement, not as results.
#[test]
fn multimem_ranks_that_disagree_are_reported_not_reduced() {
    let e = sim(SimConfig::new(3, 13000));
    let devices = e.driver.devices();
    let cfg = AllReduceConfig {
        max_blocks: 2,
        threads: 64,
        timeout: Duration::from_secs(2),
        ..Default::default()
    };
    // (rank 0's call, the other ranks' call): another op, another dtype of the same size,
    // another count with the same grid
    let cases = [
        (
            (4096usize, DType::Bf16, Op::Sum),
            (4096usize, DType::Bf16, Op::Max),
        ),
        ((4096, DType::F16, Op::Sum), (4096, DType::Bf16, Op::Sum)),
        ((4096, DType::F32, Op::Sum), (4000, DType::F32, Op::Sum)),
    ];
    for (mine, theirs) in cases {
        let mm = MultimemAllReduce::new(&devices, 64 << 10, cfg.clone()).unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        assert_eq!(
            mm.choice(mine.0, mine.1).blocks,
            mm.choice(theirs.0, theirs.1).blocks
        );
        for (r, st) in s.iter().enumerate() {
            let (count, dtype, op) = if r == 0 { mine } else { theirs };
            mm.all_reduce(r, count, dtype, op, st).unwrap();
        }
        sync(&s);
        let err = mm.check().unwrap_err();
        assert_eq!(invalid_arg(err), "ranks", "{mine:?} against {theirs:?}");
        // and the team refuses further calls
        let again = mm
            .all_reduce(0, 16, DType::F32, Op::Sum, &s[0])
            .unwrap_err();
        assert_eq!(invalid_arg(again), "ranks");
    }
}

#[test]
fn multimem_pays_off_only_for_teams_larger_than_3() {
    assert!(!multimem_pays_off(2) && !multimem_pays_off(3));
    assert!(multimem_pays_off(4) && multimem_pays_off(8));
}

#[test]
fn the_multimem_path_is_refused_where_multicast_is_disabled() {
    let disabled = std::env::var("CUDA_MULTIMEM_DISABLE_MULTICAST").as_deref() == Ok("1")
        || std::env::var("NCCL_NVLS_ENABLE").as_deref() == Ok("0");
    let e = env();
    if e.sim.is_some() {
        return skip(
            "multimem_refused",
            "the guard applies to the real driver; see the multicast tests for the simulator",
        );
    }
    if !disabled {
        return skip("multimem_refused", "multicast is not disabled here, and this suite never creates a multicast object on real GPUs");
    }
    let devices = e.driver.devices();
    if devices.len() < 2 {
        return skip("multimem_refused", "needs 2 devices");
    }
    match MultimemAllReduce::new(&devices[..2], 1 << 20, AllReduceConfig::default()) {
        Err(Error::Disabled { .. }) => {}
        Err(e) => panic!("expected Disabled, got {e}"),
        Ok(_) => panic!("a multicast team was built where multicast is disabled"),
    }
}

// ---- failure half-way: nothing leaks ----

fn live_without_contexts(
    sim: &cuda_multimem_sim::Simulator,
) -> std::collections::BTreeMap<String, i64> {
    sim.live_resources()
        .into_iter()
        .filter(|(k, _)| k != "primary contexts")
        .collect()
}

#[test]
fn a_communicator_that_fails_half_way_leaks_nothing() {
    use cuda_multimem_sim::FailurePlan;
    use cuda_multimem_sys::CUresult;
    let e = sim(SimConfig::new(2, 13000));
    let sim = e.sim.as_ref().unwrap();
    let devices = e.driver.devices();
    let small = AllReduceConfig {
        one_shot_max_bytes: Some(4096),
        ll_max_bytes: 4096,
        ..Default::default()
    };
    // warm up: contexts retained, kernels registered
    drop(Communicator::with_config(&devices, small.clone()).unwrap());
    let before = live_without_contexts(sim);
    let mut failures = 0;
    for skip in 0.. {
        sim.inject_failure(FailurePlan {
            call: None,
            skip,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let r = Communicator::with_config(&devices, small.clone()).and_then(|c| {
            let b = c.alloc(1 << 16)?;
            Ok((c, b))
        });
        let fired = sim.clear_failure();
        match r {
            Ok(cb) => {
                drop(cb);
                assert_eq!(live_without_contexts(sim), before);
                if fired.is_none() {
                    break;
                }
            }
            Err(err) => {
                assert!(fired.is_some(), "failed without an injected failure: {err}");
                failures += 1;
                assert_eq!(
                    live_without_contexts(sim),
                    before,
                    "after a failure at call #{skip} ({fired:?}): {err}"
                );
            }
        }
        assert!(skip < 2000, "construction never completed");
    }
    assert!(failures > 20, "only {failures} driver calls were exercised");
}

/// A team whose staging slots are one 4 KiB page: the write-only two-shot then needs many
/// rounds (with G blocks each block owns 256 / G vectors of a slot).
fn small_stage_team(e: &Env, max_blocks: u32) -> Option<Communicator> {
    let devices = e.driver.devices();
    if devices.len() < 2 {
        skip("two_shot_push", "needs 2 devices");
        return None;
    }
    Some(
        Communicator::with_config(
            &devices[..2],
            AllReduceConfig {
                one_shot_max_bytes: Some(4 << 10),
                ll_max_bytes: 1 << 10,
                stage_bytes: Some(4 << 10),
                max_blocks,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

#[test]
fn the_write_only_two_shot_is_the_default_above_one_shot_and_runs_in_rounds() {
    let e = env();
    for max_blocks in [0u32, 3] {
        let Some(comm) = small_stage_team(&e, max_blocks) else {
            return;
        };
        let s = streams(&comm);
        let buf = comm.alloc(2 << 20).unwrap();
        let out = comm.alloc(2 << 20).unwrap();
        let mut rng = Rng::new(99 + max_blocks as u64);
        assert_eq!(
            comm.choice(100_000, DType::F32).algorithm,
            Algorithm::TwoShotPush
        );
        assert_eq!(comm.choice(1000, DType::F32).algorithm, Algorithm::OneShot);
        // counts that leave vector tails, in place and out of place, every dtype
        for (count, dtype, op) in [
            (100_003usize, DType::F32, Op::Sum),
            (300_001, DType::Bf16, Op::Max),
            (400_000, DType::F16, Op::Min),
            (2_047, DType::F32, Op::Max),
        ] {
            check_once(&comm, &s, &mut rng, &buf, &buf, (0, 0), count, dtype, op);
            check_once(&comm, &s, &mut rng, &buf, &out, (8, 16), count, dtype, op);
        }
        // misaligned operands: the reading two-shot runs instead, still exact
        let r = comm
            .all_reduce(0, &buf, 1, &out, 1, 50_000, DType::F32, Op::Sum, &s[0])
            .unwrap();
        assert_eq!(r.algorithm, Algorithm::TwoShot);
        comm.all_reduce(1, &buf, 1, &out, 1, 50_000, DType::F32, Op::Sum, &s[1])
            .unwrap();
        sync(&s);
        comm.check().unwrap();
        check_once(
            &comm,
            &s,
            &mut rng,
            &buf,
            &out,
            (3, 5),
            50_000,
            DType::Bf16,
            Op::Sum,
        );
    }
}

/// Push calls (many rounds, both slot parities) queued back to back with one-shot calls that use
/// the same staging slots, nothing synchronised in between: a slot reused too early shows as a
/// wrong element.
#[test]
fn write_only_two_shot_and_one_shot_share_the_staging_back_to_back() {
    let e = env();
    let Some(comm) = small_stage_team(&e, 5) else {
        return;
    };
    let s = streams(&comm);
    let calls = 12usize;
    let region = 256 << 10;
    let inp = comm.alloc(region * calls).unwrap();
    let out = comm.alloc(region * calls).unwrap();
    let mut rng = Rng::new(123);
    let mut plan = Vec::new();
    for c in 0..calls {
        let dtype = DType::ALL[c % 3];
        let op = Op::ALL[(c / 3) % 3];
        // alternate: push (16 KiB .. 256 KiB), one-shot (<= 4 KiB)
        let bytes = if c % 2 == 0 {
            (16 << 10) + (rng.next_u64() % (240 << 10)) as usize
        } else {
            1024 + (rng.next_u64() % 3072) as usize
        };
        let count = bytes / dtype.size();
        let inputs: Vec<Vec<u8>> = (0..2).map(|_| random(&mut rng, dtype, count)).collect();
        plan.push((dtype, op, count, inputs));
    }
    for r in 0..2 {
        let mut all = vec![0u8; region * calls];
        for (c, (_, _, _, inputs)) in plan.iter().enumerate() {
            all[c * region..c * region + inputs[r].len()].copy_from_slice(&inputs[r]);
        }
        inp.copy_from_host(r, &all).unwrap();
    }
    for (c, (dtype, op, count, _)) in plan.iter().enumerate() {
        let base = c * region / dtype.size();
        for (r, st) in s.iter().enumerate() {
            let got = comm
                .all_reduce(r, &inp, base, &out, base, *count, *dtype, *op, st)
                .unwrap();
            let want = if c % 2 == 0 {
                Algorithm::TwoShotPush
            } else {
                Algorithm::OneShot
            };
            assert_eq!(got.algorithm, want, "call {c}");
        }
    }
    sync(&s);
    comm.check().unwrap();
    for r in 0..2 {
        let mut all = vec![0u8; region * calls];
        out.copy_to_host(r, &mut all).unwrap();
        for (c, (dtype, op, count, inputs)) in plan.iter().enumerate() {
            let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
            let want = reference(*dtype, *op, &refs);
            let got = &all[c * region..c * region + count * dtype.size()];
            if let Some(m) = first_mismatch(*dtype, got, &want) {
                panic!("call {c} ({count} x {dtype:?} {op:?}), rank {r}: {m}");
            }
        }
    }
}

/// The copy-engine two-shot: chosen between the one-shot limit and `ce_max_bytes`, exact for
/// every dtype and op in place and out of place with vector tails, misaligned operands fall back
/// to the reading two-shot, a forced call larger than the landing slots is refused.
#[test]
fn the_copy_engine_two_shot_is_chosen_up_to_its_limit_and_exact() {
    let e = env();
    let devices = e.driver.devices();
    if devices.len() < 2 {
        return skip("two_shot_ce", "needs 2 devices");
    }
    let comm = Communicator::with_config(
        &devices[..2],
        AllReduceConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 1 << 10,
            ce_max_bytes: 1 << 20,
            ce_min_bytes: 16 << 10,
            ..Default::default()
        },
    )
    .unwrap();
    let s = streams(&comm);
    let buf = comm.alloc(4 << 20).unwrap();
    let out = comm.alloc(4 << 20).unwrap();
    let mut rng = Rng::new(4242);
    assert_eq!(
        comm.choice(100_000, DType::F32).algorithm,
        Algorithm::TwoShotCe
    );
    assert_eq!(
        comm.choice(300_000, DType::F32).algorithm,
        Algorithm::TwoShotPush
    );
    // below ce_min_bytes (16 KiB) but above the one-shot limit: the write-only two-shot
    assert_eq!(
        comm.choice(3_000, DType::F32).algorithm,
        Algorithm::TwoShotPush
    );
    for dtype in DType::ALL {
        for op in Op::ALL {
            for count in [5_000usize, 131_075] {
                let count = count.min((1 << 20) / dtype.size());
                check_once(&comm, &s, &mut rng, &buf, &buf, (0, 0), count, dtype, op);
                check_once(&comm, &s, &mut rng, &buf, &out, (8, 24), count, dtype, op);
            }
        }
    }
    // misaligned: the reading two-shot
    let c = comm
        .all_reduce(0, &buf, 3, &out, 3, 60_000, DType::F32, Op::Sum, &s[0])
        .unwrap();
    assert_eq!(c.algorithm, Algorithm::TwoShot);
    comm.all_reduce(1, &buf, 3, &out, 3, 60_000, DType::F32, Op::Sum, &s[1])
        .unwrap();
    sync(&s);
    comm.check().unwrap();
    // forced beyond the landing slots: refused before anything is queued
    let forced = Communicator::with_config(
        &devices[..2],
        AllReduceConfig {
            algorithm: Some(Algorithm::TwoShotCe),
            ce_max_bytes: 64 << 10,
            ..Default::default()
        },
    )
    .unwrap();
    let big = forced.alloc(1 << 20).unwrap();
    let err = forced
        .all_reduce(0, &big, 0, &big, 0, 200_000, DType::F32, Op::Sum, &s[0])
        .unwrap_err();
    assert_eq!(invalid_arg(err), "bytes");
}
