//! Hostile use of the collectives' public API: arguments a careless or malicious caller passes
//! (lengths, offsets, views, roots, shapes, streams, configurations, drop orders) must give an
//! error value naming the argument, never a panic, a hang or memory corruption.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::time::Duration;

use cuda_multimem::{DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::kernels::MAX_BLOCKS;
use cuda_multimem_collectives::{
    add_rms_norm_reference, all_gather_reference, bf16, random_input, reduce_scatter_reference,
    reference, rms_norm_within_tolerance, Algorithm, Bootstrap, CommConfig, Communicator,
    CrossDomain, DType, Element, HierBuilder, HierCommunicator, HierLayout, MulticastPolicy,
    Operands, ReduceOp, UnixBootstrap,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::sim;

use cuda_multimem_tests::{
    invalid_arg_of as arg_of, sim_team as team, sim_team_as_is as team_as_is, sync_all as sync,
};

fn rendezvous(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cmm-hostile-{tag}-{}", std::process::id()))
}

// ---- bootstrap ----

/// `Instant::now() + Duration::MAX` overflows: a timeout no deadline can hold must be refused
/// naming it, not panic inside the rendezvous.
#[test]
fn a_bootstrap_timeout_no_deadline_can_hold_is_refused_naming_it() {
    let path = rendezvous("boot-max");
    for rank in [0, 1] {
        assert_eq!(
            arg_of(UnixBootstrap::new(&path, rank, 2, Duration::MAX)),
            "timeout",
            "rank {rank}"
        );
    }
}

/// The rendezvous sends the team size as 32 bits, and rank 0 waits for `size - 1` peers: a size
/// past 32 bits must be refused naming it, and a huge one that fits must time out, not size
/// anything by it up front (a table of 2^32 peers is an abort, not an error).
#[test]
fn a_bootstrap_team_size_past_what_a_rendezvous_holds_is_an_error_not_an_abort() {
    let path = rendezvous("boot-size");
    assert_eq!(
        arg_of(UnixBootstrap::new(
            &path,
            0,
            usize::MAX,
            Duration::from_millis(20)
        )),
        "size"
    );
    assert_eq!(
        arg_of(UnixBootstrap::new(
            &path,
            1,
            1 << 40,
            Duration::from_millis(20)
        )),
        "size"
    );
    match UnixBootstrap::new(&path, 0, u32::MAX as usize, Duration::from_millis(50)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
}

/// A rank 0 that relays an exchange whose entry announces a length near `u64::MAX`: the peer
/// must answer an `Error::Peer`, not overflow its bounds arithmetic.
#[test]
fn an_exchange_entry_announcing_an_absurd_length_is_a_peer_error() {
    let path = rendezvous("boot-len");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let fake_root = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 12];
        s.read_exact(&mut hello).unwrap();
        // rank 1's entry: its length, then its bytes
        let mut len = [0u8; 8];
        s.read_exact(&mut len).unwrap();
        let mut data = vec![0u8; u64::from_le_bytes(len) as usize];
        s.read_exact(&mut data).unwrap();
        // the relayed exchange: 8 bytes, one entry header announcing u64::MAX - 3 bytes
        let packed = (u64::MAX - 3).to_le_bytes();
        s.write_all(&(packed.len() as u64).to_le_bytes()).unwrap();
        s.write_all(&packed).unwrap();
        // keep the connection until the peer is done
        let _ = s.read(&mut [0u8; 1]);
    });
    let b = UnixBootstrap::new(&path, 1, 2, Duration::from_secs(5)).unwrap();
    match b.all_gather(b"hello") {
        Err(Error::Peer { rank: 0, .. }) => {}
        other => panic!("expected a peer error naming rank 0, got {other:?}"),
    }
    drop(b);
    fake_root.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

// ---- the communicator's reports ----

/// `Communicator::choice` reports `staged_chunks` as a u32 (0 means "no copies"): a count whose
/// chunks through the scratch do not fit must be refused naming it, not truncated to a report
/// that says the operands are used in place.
#[test]
fn a_choice_whose_chunk_count_does_not_fit_its_report_is_refused() {
    let (_e, comm, _s) = team(
        2,
        CommConfig {
            // the smallest scratch: three 4 KiB regions
            scratch_bytes: 1,
            ..Default::default()
        },
    );
    // 2^45 bytes in 4 KiB chunks: 2^33 chunks, 0 as a u32
    let count = 1usize << 43;
    assert_eq!(
        arg_of(comm.choice(DType::F32, ReduceOp::Sum, count, Operands::Local)),
        "count"
    );
    // a count that fits is reported with its chunks (16 MiB, above the 8 MiB one-shot limit)
    let c = comm
        .choice(DType::F32, ReduceOp::Sum, 1 << 22, Operands::Local)
        .unwrap();
    assert_eq!(c.staged_chunks, 4096);
}

// ---- the hierarchical communicator ----

/// A team of 2 ranks (threads over one simulator, a Unix-socket bootstrap) whose rank r has
/// domain id `domain_of(r)`; each rank builds with `config`, `nccl_timeout` and the host test
/// double for the cross-domain step, then runs `body` on what the build gave.
fn hier_pair<R: Send + 'static>(
    tag: &str,
    domain_of: fn(usize) -> u64,
    config: CommConfig,
    nccl_timeout: Duration,
    body: fn(usize, cuda_multimem::Result<HierCommunicator>, &Stream) -> R,
) -> Vec<R> {
    hier_pair_with(
        tag,
        domain_of,
        config,
        nccl_timeout,
        HierBuilder::cross_domain_test_double,
        body,
    )
}

/// [`hier_pair`] with the builder's last step (the cross-domain step) given by `cross`.
fn hier_pair_with<R: Send + 'static>(
    tag: &str,
    domain_of: fn(usize) -> u64,
    config: CommConfig,
    nccl_timeout: Duration,
    cross: fn(HierBuilder) -> HierBuilder,
    body: fn(usize, cuda_multimem::Result<HierCommunicator>, &Stream) -> R,
) -> Vec<R> {
    let n = 2;
    let e = sim(SimConfig::new(n, 13000));
    let path = rendezvous(tag);
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (driver, path, config) = (e.driver.clone(), path.clone(), config.clone());
            std::thread::spawn(move || {
                let device = driver.device(rank).unwrap();
                let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(10)).unwrap();
                let b = HierCommunicator::builder(&device, Box::new(boot))
                    .domain_id(domain_of(rank))
                    .multicast(MulticastPolicy::Never)
                    .config(config)
                    .nccl_timeout(nccl_timeout);
                let built = cross(b).build();
                let s = Stream::new(&device).unwrap();
                body(rank, built, &s)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn short_config() -> CommConfig {
    CommConfig {
        timeout: Duration::from_secs(5),
        one_shot_max_bytes: Some(16 << 10),
        stage_bytes: Some(16 << 10),
        scratch_bytes: 64 << 10,
        ..Default::default()
    }
}

/// Out of place, the hierarchical allreduce copies the input into the output and reduces the
/// output: an input shorter than the output must be refused (naming the output), not leave the
/// output's tail holding whatever it held, reduced as if it were data.
#[test]
fn a_hierarchical_allreduce_refuses_an_input_shorter_than_its_output() {
    let r = hier_pair(
        "ar-short",
        |_| 7,
        short_config(),
        Duration::from_secs(60),
        {
            |rank, built, s| {
                let hier = built.unwrap();
                assert_eq!(hier.layout().domain_count(), 1);
                let d = hier.device();
                let input = DeviceBuffer::from_host(d, &[rank as f32 + 1.0; 8]).unwrap();
                let mut output = DeviceBuffer::from_host(d, &[100.0f32; 16]).unwrap();
                let got = hier.all_reduce(&input, &mut output, ReduceOp::Sum, s);
                s.synchronize().unwrap();
                (arg_of(got), output.to_vec().unwrap())
            }
        },
    );
    for (rank, (arg, out)) in r.into_iter().enumerate() {
        assert_eq!(arg, "output", "rank {rank}");
        assert!(
            out.iter().all(|&v| v == 100.0),
            "rank {rank}: the refused call wrote its output: {out:?}"
        );
    }
}

/// Domains of one GPU have no domain communicator: the builder must still refuse an invalid
/// configuration (naming the field), as it does for larger domains, and a NCCL timeout that no
/// deadline can hold.
#[test]
fn a_hierarchical_builder_refuses_invalid_settings_whatever_the_layout() {
    let zero_timeout = CommConfig {
        timeout: Duration::ZERO,
        ..short_config()
    };
    let r = hier_pair(
        "cfg-one-gpu",
        |rank| rank as u64,
        zero_timeout,
        Duration::from_secs(60),
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(r, ["config.timeout"; 2]);
    let r = hier_pair(
        "nccl-timeout",
        |rank| rank as u64,
        short_config(),
        Duration::MAX,
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(r, ["nccl_timeout"; 2]);
}

/// The layout's accessors take indices: out of range they answer nothing, they do not panic.
#[test]
fn layout_accessors_out_of_range_answer_empty_not_panic() {
    let l = HierLayout::from_keys(1, &[0, 0, 1, 1]).unwrap();
    assert_eq!(l.domain_members(1), &[2, 3]);
    assert_eq!(l.rail_members(1), vec![1, 3]);
    assert!(l.domain_members(2).is_empty());
    assert!(l.domain_members(usize::MAX).is_empty());
    assert!(l.rail_members(2).is_empty());
    assert!(l.rail_members(usize::MAX).is_empty());
    // a rank in no domain, and no ranks at all, are errors naming the rank
    assert_eq!(arg_of(HierLayout::from_keys(4, &[0, 0, 1, 1])), "rank");
    assert_eq!(arg_of(HierLayout::from_keys(0, &[])), "rank");
}

/// A zero-sized element type is a valid `DeviceRepr` (no padding, every bit pattern valid): a
/// symmetric buffer of it has no bytes, which must be refused naming the length, like 0.
#[test]
fn a_symmetric_buffer_of_a_zero_sized_type_is_refused_naming_the_length() {
    #[derive(Clone, Copy)]
    struct Nothing;
    // SAFETY: a zero-sized type: no bytes, no padding, no invariants.
    unsafe impl cuda_multimem::DeviceRepr for Nothing {}
    let (e, comm, _s) = team(2, CommConfig::default());
    let sim = e.sim.as_ref().unwrap();
    let before = sim.live_resources();
    assert_eq!(arg_of(comm.alloc::<Nothing>(16)), "len");
    assert_eq!(
        sim.live_resources(),
        before,
        "the refused allocation left something"
    );
    // the team is unaffected
    comm.alloc::<f32>(16).unwrap();
}

/// `reserve_scratch` takes a byte count: one whose power-of-two rounding overflows must be
/// refused naming it.
#[test]
fn a_hierarchical_scratch_reservation_past_usize_is_refused_naming_it() {
    let r = hier_pair(
        "scratch-max",
        |_| 3,
        short_config(),
        Duration::from_secs(60),
        |_, built, _| {
            let hier = built.unwrap();
            let huge = arg_of(hier.reserve_scratch(usize::MAX));
            let past = arg_of(hier.reserve_scratch((1 << 63) + 1));
            // a sane one still works afterwards
            hier.reserve_scratch(4096).unwrap();
            (huge, past)
        },
    );
    assert_eq!(r, [("bytes", "bytes"); 2]);
}

// ---- configurations at the edges of what `validate` accepts ----

trait Elem: Element + Default + Copy + std::fmt::Debug {}
impl<T: Element + Default + Copy + std::fmt::Debug> Elem for T {}

fn bits<T: Elem>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Every collective once at `count` elements per rank (allreduce on symmetric buffers and on
/// the caller's own memory, reduce-scatter, all-gather, broadcast from the last rank, the fused
/// norm at hidden `count` up to 400), each compared with its host reference.
fn every_collective<T: Elem>(comm: &Communicator, s: &[Stream], count: usize, what: &str) {
    let n = comm.size();
    let mut seed = 17 + count as u64;
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(n * count, &mut seed)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let firsts: Vec<&[T]> = inputs.iter().map(|v| &v[..count]).collect();
    let what = format!("{what}, {count} x {}", T::DTYPE);
    // allreduce, symmetric, in place
    let mut buf = comm.alloc::<T>(count).unwrap();
    for (r, x) in firsts.iter().enumerate() {
        buf.write(r, 0, x).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(ReduceOp::Sum, &firsts);
    for r in 0..n {
        assert_eq!(
            bits(&buf.to_vec(r).unwrap()),
            bits(&want),
            "{what}: allreduce rank {r}"
        );
    }
    // allreduce, the caller's own memory, out of place
    let ins: Vec<DeviceBuffer<T>> = (0..n)
        .map(|r| DeviceBuffer::from_host(comm.device(r).unwrap(), firsts[r]).unwrap())
        .collect();
    let mut outs: Vec<DeviceBuffer<T>> = (0..n)
        .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), count).unwrap())
        .collect();
    for r in 0..n {
        comm.rank(r)
            .unwrap()
            .all_reduce(&ins[r], &mut outs[r], ReduceOp::Max, &s[r])
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let want = reference(ReduceOp::Max, &firsts);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(
            bits(&o.to_vec().unwrap()),
            bits(&want),
            "{what}: own allreduce rank {r}"
        );
    }
    // reduce-scatter, all-gather, broadcast on symmetric buffers
    let whole = comm.alloc::<T>(n * count).unwrap();
    let mut part = comm.alloc::<T>(count).unwrap();
    let mut gathered = comm.alloc::<T>(n * count).unwrap();
    for r in 0..n {
        whole.write(r, 0, refs[r]).unwrap();
        part.write(r, 0, firsts[r]).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .reduce_scatter(&whole, &mut part, ReduceOp::Min, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let want = reduce_scatter_reference(ReduceOp::Min, &refs);
    for (r, w) in want.iter().enumerate() {
        assert_eq!(
            bits(&part.to_vec(r).unwrap()),
            bits(w),
            "{what}: reduce-scatter rank {r}"
        );
    }
    let chunks: Vec<Vec<T>> = (0..n).map(|r| part.to_vec(r).unwrap()).collect();
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_gather(&part, &mut gathered, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    let crefs: Vec<&[T]> = chunks.iter().map(|v| v.as_slice()).collect();
    let want = all_gather_reference(&crefs);
    for r in 0..n {
        assert_eq!(
            bits(&gathered.to_vec(r).unwrap()),
            bits(&want),
            "{what}: all-gather rank {r}"
        );
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .broadcast_in_place(&mut part, n - 1, st)
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    for r in 0..n {
        assert_eq!(
            bits(&part.to_vec(r).unwrap()),
            bits(&chunks[n - 1]),
            "{what}: broadcast rank {r}"
        );
    }
    // the fused norm: 3 tokens of hidden `count` (at most 400: a row fits a 4 KiB staging slot
    // twice), the caller's own memory
    let (tokens, hidden) = (3, count.min(400));
    let xs: Vec<Vec<T>> = (0..n)
        .map(|_| random_input(tokens * hidden, &mut seed))
        .collect();
    let res0: Vec<T> = random_input(tokens * hidden, &mut seed);
    let gamma: Vec<T> = random_input(hidden, &mut seed);
    let xrefs: Vec<&[T]> = xs.iter().map(|v| v.as_slice()).collect();
    let (want_res, want_out) = add_rms_norm_reference(&xrefs, &res0, &gamma, hidden, 1e-6);
    let mut bufs: Vec<_> = (0..n)
        .map(|r| {
            let d = comm.device(r).unwrap();
            (
                DeviceBuffer::from_host(d, &xs[r]).unwrap(),
                DeviceBuffer::from_host(d, &res0).unwrap(),
                DeviceBuffer::from_host(d, &gamma).unwrap(),
                DeviceBuffer::<T>::zeroed(d, tokens * hidden).unwrap(),
            )
        })
        .collect();
    for (r, (x, res, g, out)) in bufs.iter_mut().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_reduce_add_rms_norm(&*x, &mut *res, &*g, &mut *out, hidden, 1e-6, &s[r])
            .unwrap();
    }
    sync(s);
    comm.check().unwrap();
    for (r, (_, res, _, out)) in bufs.iter().enumerate() {
        assert_eq!(
            bits(&res.to_vec().unwrap()),
            bits(&want_res),
            "{what}: norm residual rank {r}"
        );
        let out = out.to_vec().unwrap();
        for (i, (&g, &w)) in out.iter().zip(&want_out).enumerate() {
            assert!(
                rms_norm_within_tolerance(g, w),
                "{what}: norm out rank {r} element {i}: {g:?} vs {w:?}"
            );
        }
    }
}

/// Configurations `validate` accepts at the edges of every field, thresholds inverted or
/// turned off: every collective still equals its host reference (no panic, no hang, no wrong
/// bits), on a team of 3 (chunks that do not divide evenly) at counts from 1 to beyond the
/// smallest staging slot.
#[test]
fn configurations_at_the_edges_of_validity_still_give_the_reference() {
    let base = CommConfig {
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let configs = [
        (
            "everything smallest, low-latency and one-shot off",
            CommConfig {
                threads: 64,
                push_threads: 64,
                max_blocks: 1,
                stage_bytes: Some(4096),
                one_shot_max_bytes: Some(0),
                ll_max_bytes: 0,
                gather_ll_max_bytes: 0,
                broadcast_ll_max_bytes: 0,
                norm_ll_max_bytes: 0,
                scratch_bytes: 1,
                multimem_capacity: 0,
                ..base.clone()
            },
        ),
        (
            "copy engines from 0 bytes, inverted ce thresholds",
            CommConfig {
                ll_max_bytes: 0,
                one_shot_max_bytes: Some(0),
                ce_min_bytes: 0,
                ce_max_bytes: 64 << 10,
                gather_ce_min_bytes: 0,
                broadcast_ce_min_bytes: 0,
                gather_ll_max_bytes: 0,
                broadcast_ll_max_bytes: 0,
                stage_bytes: Some(4096),
                ..base.clone()
            },
        ),
        (
            "everything largest per launch, low-latency limits above the one-shot limit",
            CommConfig {
                threads: 1024,
                push_threads: 1024,
                max_blocks: MAX_BLOCKS as u32,
                one_shot_max_bytes: Some(4096),
                stage_bytes: Some(4096),
                ll_max_bytes: 1 << 20,
                norm_ll_max_bytes: 1 << 20,
                gather_ll_max_bytes: 1 << 20,
                broadcast_ll_max_bytes: 1 << 20,
                ..base.clone()
            },
        ),
        (
            "one-shot forced, the smallest staging",
            CommConfig {
                algorithm: Some(Algorithm::OneShot),
                stage_bytes: Some(4096),
                one_shot_max_bytes: Some(0),
                ..base.clone()
            },
        ),
    ];
    for (what, config) in configs {
        config.validate().unwrap();
        let forced = config.algorithm.is_some();
        let (_e, comm, s) = team_as_is(3, config);
        for count in [1, 7, 1000, 5000] {
            if forced && count * 4 > 4096 {
                // a forced one-shot on symmetric buffers larger than its staging is refused
                let mut big = comm.alloc::<f32>(count).unwrap();
                let r = comm.rank(0).unwrap();
                assert_eq!(
                    arg_of(r.all_reduce_in_place(&mut big, ReduceOp::Sum, &s[0])),
                    "count"
                );
                continue;
            }
            every_collective::<f32>(&comm, &s, count, what);
        }
        every_collective::<bf16>(&comm, &s, 999, what);
    }
}

// ---- hierarchical: a cross-domain step that miscounts its rail ----

/// A cross-domain step whose idea of the rail is off by `skew` (rank and size), never called.
struct Miscounted {
    rank: usize,
    size: usize,
}

impl CrossDomain for Miscounted {
    fn name(&self) -> String {
        "miscounted".into()
    }
    fn rail_rank(&self) -> usize {
        self.rank
    }
    fn rail_size(&self) -> usize {
        self.size
    }
    fn graph_capturable(&self) -> bool {
        false
    }
    unsafe fn all_reduce(
        &self,
        _: DType,
        _: ReduceOp,
        _: u64,
        _: u64,
        _: usize,
        _: &cuda_multimem::StreamRef<'_>,
    ) -> cuda_multimem::Result<()> {
        panic!("a miscounted cross-domain step was called")
    }
    unsafe fn reduce_scatter(
        &self,
        _: DType,
        _: ReduceOp,
        _: u64,
        _: u64,
        _: usize,
        _: &cuda_multimem::StreamRef<'_>,
    ) -> cuda_multimem::Result<()> {
        panic!("a miscounted cross-domain step was called")
    }
    unsafe fn all_gather(
        &self,
        _: DType,
        _: u64,
        _: u64,
        _: usize,
        _: &cuda_multimem::StreamRef<'_>,
    ) -> cuda_multimem::Result<()> {
        panic!("a miscounted cross-domain step was called")
    }
    fn check(&self) -> cuda_multimem::Result<()> {
        Ok(())
    }
}

/// The hierarchy sizes its calls to the cross-domain step by the rail (M chunks of its scratch,
/// chunk r of the caller's buffer), and the step's contract is in its own rail size and rank: a
/// step (a safe factory's product) whose rank or size differs from the rail's would read and
/// write past those ranges. The builder must refuse it, naming it.
#[test]
fn a_cross_domain_step_that_miscounts_its_rail_is_refused_at_build() {
    let bigger = hier_pair_with(
        "cross-size",
        |rank| rank as u64,
        short_config(),
        Duration::from_secs(60),
        |b| {
            b.cross_domain_with(|rail| {
                Ok(Box::new(Miscounted {
                    rank: rail.rank,
                    size: rail.size + 1,
                }) as _)
            })
        },
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(bigger, ["cross_domain"; 2]);
    let swapped = hier_pair_with(
        "cross-rank",
        |rank| rank as u64,
        short_config(),
        Duration::from_secs(60),
        |b| {
            b.cross_domain_with(|rail| {
                Ok(Box::new(Miscounted {
                    rank: rail.size - 1 - rail.rank,
                    size: rail.size,
                }) as _)
            })
        },
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(swapped, ["cross_domain"; 2]);
}

// ---- a team that broke refuses every call ----

/// After a timeout, every collective (reduce-scatter, all-gather, broadcast, in place or not,
/// the fused norm) and every allocation is refused as `Unusable` before any launch; `check`
/// keeps reporting (the rank that timed out its own timeout, the team `Unusable`).
#[test]
fn after_a_timeout_every_collective_and_the_norm_are_refused_without_a_launch() {
    let (e, comm, s) = team(
        2,
        CommConfig {
            timeout: Duration::from_millis(50),
            gather_ll_max_bytes: 0,
            ..Default::default()
        },
    );
    let sim = e.sim.as_ref().unwrap();
    let mut a = comm.alloc::<f32>(64).unwrap();
    let mut b = comm.alloc::<f32>(128).unwrap();
    // rank 0 all-gathers alone: its barrier times out
    let h0 = comm.rank(0).unwrap();
    h0.all_gather(&a, &mut b, &s[0]).unwrap();
    sync(&s);
    assert!(matches!(comm.check(), Err(Error::Timeout { .. })));
    assert!(matches!(comm.check(), Err(Error::Unusable { .. })));
    assert!(matches!(h0.check(), Err(Error::Timeout { .. })));
    assert!(matches!(
        comm.rank(1).unwrap().check(),
        Err(Error::Unusable { .. })
    ));
    let before = sim.calls("cuLaunchKernel");
    let unusable = |r: cuda_multimem::Result<cuda_multimem_collectives::Choice>, what: &str| {
        assert!(matches!(r, Err(Error::Unusable { .. })), "{what}: {r:?}");
    };
    for (rank, st) in s.iter().enumerate() {
        let h = comm.rank(rank).unwrap();
        unusable(h.all_gather(&a, &mut b, st), "all_gather");
        unusable(h.all_gather_in_place(&mut b, st), "all_gather_in_place");
        unusable(
            h.reduce_scatter(&b, &mut a, ReduceOp::Sum, st),
            "reduce_scatter",
        );
        unusable(
            h.reduce_scatter_in_place(&mut b, ReduceOp::Max, st),
            "reduce_scatter_in_place",
        );
        unusable(
            h.broadcast(&a, b.slice_mut(..64).unwrap(), 1, st),
            "broadcast",
        );
        unusable(h.broadcast_in_place(&mut a, 0, st), "broadcast_in_place");
        let x = comm.alloc::<f32>(1);
        assert!(matches!(x, Err(Error::Unusable { .. })), "alloc");
        let d = comm.device(rank).unwrap();
        let xs = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
        let mut res = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
        let g = DeviceBuffer::<f32>::zeroed(d, 16).unwrap();
        let mut out = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
        unusable(
            h.all_reduce_add_rms_norm(&xs, &mut res, &g, &mut out, 16, 1e-6, st),
            "all_reduce_add_rms_norm",
        );
    }
    assert_eq!(
        sim.calls("cuLaunchKernel"),
        before,
        "a refused call launched"
    );
}

// ---- operands that belong elsewhere ----

/// Reduce-scatter, all-gather, broadcast and the fused norm take the allreduce's operand
/// checks: a buffer of another communicator, a view of another rank's part
/// (`SymmetricBuffer::parts_mut`) and a stream of another device are refused naming the
/// argument, before any launch; the right rank's part is accepted.
#[test]
fn operands_of_another_team_rank_or_device_are_refused_by_every_collective() {
    let (e, comm, s) = team(2, CommConfig::default());
    let other = Communicator::builder(&e.driver.devices())
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    let sim = e.sim.as_ref().unwrap();
    let foreign = other.alloc::<f32>(128).unwrap();
    let mut foreign_out = other.alloc::<f32>(128).unwrap();
    let a = comm.alloc::<f32>(64).unwrap();
    let mut b = comm.alloc::<f32>(128).unwrap();
    let h0 = comm.rank(0).unwrap();
    let st = &s[0];
    let before = sim.calls("cuLaunchKernel");
    // another communicator's buffers
    let mut part = comm.alloc::<f32>(64).unwrap();
    assert_eq!(
        arg_of(h0.reduce_scatter(&foreign, &mut part, ReduceOp::Sum, st)),
        "input"
    );
    assert_eq!(
        arg_of(h0.reduce_scatter(&b, foreign_out.slice_mut(..64).unwrap(), ReduceOp::Sum, st)),
        "output"
    );
    assert_eq!(
        arg_of(h0.all_gather(foreign.slice(..64).unwrap(), &mut b, st)),
        "input"
    );
    assert_eq!(arg_of(h0.all_gather(&a, &mut foreign_out, st)), "output");
    assert_eq!(
        arg_of(h0.broadcast(
            foreign.slice(..64).unwrap(),
            b.slice_mut(..64).unwrap(),
            1,
            st
        )),
        "input"
    );
    // in place, the one operand is `buf` (not an `input` or `output` the call does not have)
    assert_eq!(
        arg_of(h0.broadcast_in_place(&mut foreign_out, 1, st)),
        "buf"
    );
    assert_eq!(arg_of(h0.all_gather_in_place(&mut foreign_out, st)), "buf");
    assert_eq!(
        arg_of(h0.reduce_scatter_in_place(&mut foreign_out, ReduceOp::Min, st)),
        "buf"
    );
    // a view of rank 1's part in rank 0's call
    {
        let mut parts = b.parts_mut();
        let (p0, p1) = parts.split_at_mut(1);
        let (p0, p1) = (&mut p0[0], &mut p1[0]);
        assert_eq!((p0.rank(), p1.rank()), (0, 1));
        assert_eq!(arg_of(h0.all_gather_in_place(p1.as_mut_slice(), st)), "buf");
        assert_eq!(
            arg_of(h0.broadcast(&a, p1.slice_mut(..64).unwrap(), 0, st)),
            "output"
        );
        let v = p1.as_mut_slice();
        assert_eq!(
            arg_of(h0.reduce_scatter(&v, p0.slice_mut(..64).unwrap(), ReduceOp::Sum, st)),
            "input"
        );
    }
    // a stream of device 1 for rank 0
    assert_eq!(arg_of(h0.all_gather(&a, &mut b, &s[1])), "stream");
    assert_eq!(
        arg_of(h0.reduce_scatter(&b, &mut part, ReduceOp::Max, &s[1])),
        "stream"
    );
    assert_eq!(arg_of(h0.broadcast_in_place(&mut b, 0, &s[1])), "stream");
    // the norm: another communicator's x, residual, weight, out
    let d0 = comm.device(0).unwrap();
    let x = DeviceBuffer::<f32>::zeroed(d0, 128).unwrap();
    let mut res = DeviceBuffer::<f32>::zeroed(d0, 128).unwrap();
    let g = DeviceBuffer::<f32>::zeroed(d0, 64).unwrap();
    let mut out = DeviceBuffer::<f32>::zeroed(d0, 128).unwrap();
    let norm = |r: cuda_multimem::Result<cuda_multimem_collectives::Choice>| arg_of(r);
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(&foreign, &mut res, &g, &mut out, 64, 1e-6, st)),
        "x"
    );
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(&x, &mut foreign_out, &g, &mut out, 64, 1e-6, st)),
        "residual"
    );
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(
            &x,
            &mut res,
            foreign.slice(..64).unwrap(),
            &mut out,
            64,
            1e-6,
            st
        )),
        "weight"
    );
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(&x, &mut res, &g, &mut foreign_out, 64, 1e-6, st)),
        "out"
    );
    {
        let mut parts = b.parts_mut();
        let p1 = &mut parts[1];
        assert_eq!(
            norm(h0.all_reduce_add_rms_norm(&x, &mut res, &g, p1.as_mut_slice(), 64, 1e-6, st)),
            "out"
        );
    }
    // the unfused baseline: another device's memory and stream
    let d1 = comm.device(1).unwrap();
    let x1 = DeviceBuffer::<f32>::zeroed(d1, 128).unwrap();
    assert_eq!(
        arg_of(h0.add_rms_norm(&x1, &mut res, &g, &mut out, 64, 1e-6, st)),
        "x"
    );
    assert_eq!(
        arg_of(h0.add_rms_norm(&x, &mut res, &g, &mut out, 64, 1e-6, &s[1])),
        "stream"
    );
    assert_eq!(
        sim.calls("cuLaunchKernel"),
        before,
        "a refused call launched"
    );
    // nothing ran: the team is healthy, and each rank's own part serves its calls
    sync(&s);
    comm.check().unwrap();
    {
        let mut parts = b.parts_mut();
        for (r, p) in parts.iter_mut().enumerate() {
            p.write(64 * r, &[r as f32 + 1.0; 64]).unwrap();
            comm.rank(r)
                .unwrap()
                .all_gather_in_place(p.as_mut_slice(), &s[r])
                .unwrap();
        }
    }
    sync(&s);
    comm.check().unwrap();
    let want: Vec<f32> = (0..128).map(|i| (i / 64) as f32 + 1.0).collect();
    for r in 0..2 {
        assert_eq!(b.to_vec(r).unwrap(), want, "rank {r}");
    }
}

/// The queries that report what a call would run take any count: an overflowing byte size is
/// an error naming the count or the row, extremes that fit are answered, nothing panics.
#[test]
fn choice_queries_at_extreme_counts_answer_or_name_the_argument() {
    let (_e, comm, _s) = team(3, CommConfig::default());
    for dtype in DType::ALL {
        for operands in [Operands::Symmetric, Operands::Local] {
            assert_eq!(
                arg_of(comm.choice(dtype, ReduceOp::Sum, usize::MAX, operands)),
                "count"
            );
            // the largest count whose bytes fit: an answer or a refusal of the count
            let big = usize::MAX / dtype.size();
            match comm.choice(dtype, ReduceOp::Max, big, operands) {
                Ok(c) => assert_eq!(operands, Operands::Symmetric, "{c:?}"),
                Err(e) => assert_eq!(arg_of::<()>(Err(e)), "count"),
            }
            comm.choice(dtype, ReduceOp::Min, 0, operands).unwrap();
        }
        assert_eq!(arg_of(comm.add_rms_norm_choice(dtype, 1, 0)), "hidden");
        assert_eq!(
            arg_of(comm.add_rms_norm_choice(dtype, 1, usize::MAX)),
            "hidden"
        );
        for tokens in [0, 1, usize::MAX / 2, usize::MAX] {
            let c = comm.add_rms_norm_choice(dtype, tokens, 1).unwrap();
            assert!(c.blocks >= 1 && c.threads >= 64, "{tokens} tokens: {c:?}");
        }
    }
}

/// One stream per rank at a time: a call on a second stream while the first still has this
/// rank's work is refused naming the stream; once that work is done the second stream is
/// taken — and the first, destroyed meanwhile, is never queried (its handle may be dangling:
/// the check asks the rank's own event, recorded behind its last call).
#[test]
fn a_second_stream_is_refused_while_the_first_has_work_and_a_destroyed_one_is_never_queried() {
    let (e, comm, s) = team(2, CommConfig::default());
    let sim = e.sim.as_ref().unwrap();
    let d0 = e.driver.device(0).unwrap();
    let mut buf = comm.alloc::<f32>(1024).unwrap();
    let a = Stream::new(&d0).unwrap();
    let r0 = comm.rank(0).unwrap();
    let r1 = comm.rank(1).unwrap();
    // rank 0 alone: its kernel waits for rank 1's data
    r0.all_reduce_in_place(&mut buf, ReduceOp::Sum, &a).unwrap();
    let b = Stream::new(&d0).unwrap();
    let launches = sim.calls("cuLaunchKernel");
    let err = r0.all_reduce_in_place(&mut buf, ReduceOp::Sum, &b);
    assert_eq!(arg_of(err), "stream");
    assert_eq!(
        sim.calls("cuLaunchKernel"),
        launches,
        "refused before any launch"
    );
    r1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap();
    a.synchronize().unwrap();
    s[1].synchronize().unwrap();
    comm.check().unwrap();
    drop(a);
    let queries = sim.calls("cuStreamQuery");
    r0.all_reduce_in_place(&mut buf, ReduceOp::Sum, &b).unwrap();
    r1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap();
    assert_eq!(
        sim.calls("cuStreamQuery"),
        queries,
        "the destroyed stream's handle was queried"
    );
    b.synchronize().unwrap();
    s[1].synchronize().unwrap();
    comm.check().unwrap();
}

/// Two threads calling the same rank at once, on its one stream: each call (here staged
/// through the scratch, several copies and launches) must reach the stream whole, never
/// interleaved with the other thread's. Every call is the same in-place sum, so whatever the
/// order, 2K calls per rank leave N^(2K-1) times the sum of the inputs, exactly.
#[test]
fn two_threads_calling_one_rank_queue_whole_calls() {
    let (e, comm, s) = team(
        2,
        CommConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 0,
            scratch_bytes: 48 << 10,
            timeout: Duration::from_secs(10),
            ..CommConfig::default()
        },
    );
    let (n, len, k) = (2usize, 16 << 10, 3u32);
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..len).map(|i| ((i * 7 + r * 3) % 4) as f32).collect())
        .collect();
    let bufs: Vec<DeviceBuffer<f32>> = (0..n)
        .map(|r| DeviceBuffer::from_host(&e.driver.device(r).unwrap(), &inputs[r]).unwrap())
        .collect();
    std::thread::scope(|scope| {
        for r in 0..n {
            for _ in 0..2 {
                let (comm, s, p) = (&comm, &s, bufs[r].device_ptr());
                scope.spawn(move || {
                    let h = comm.rank(r).unwrap();
                    for _ in 0..k {
                        // SAFETY: the buffer lives until after the streams are synchronised
                        // below; the calls on it are ordered by the one stream.
                        let c = h
                            .all_reduce_in_place(
                                unsafe { cuda_multimem_collectives::Dst::<f32>::from_raw(p, len) },
                                ReduceOp::Sum,
                                &s[r],
                            )
                            .unwrap();
                        assert!(c.staged_chunks > 1, "{c:?}");
                    }
                });
            }
        }
    });
    sync(&s);
    comm.check().unwrap();
    let scale = (n as f32).powi(2 * k as i32 - 1);
    let want: Vec<f32> = (0..len)
        .map(|i| scale * inputs.iter().map(|x| x[i]).sum::<f32>())
        .collect();
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(b.to_vec().unwrap(), want, "rank {r}");
    }
}

/// One-shot forced, the caller's own memory, chunks of the scratch larger than the one-shot's
/// staging: refused naming the count before anything reaches the stream (the chunk's form is
/// decided before its copy into the scratch).
#[test]
fn a_forced_form_that_cannot_take_a_staged_chunk_is_refused_before_any_copy() {
    let (e, comm, s) = team(
        2,
        CommConfig {
            algorithm: Some(Algorithm::OneShot),
            one_shot_max_bytes: Some(4 << 10),
            stage_bytes: Some(4 << 10),
            ll_max_bytes: 0,
            scratch_bytes: 3 << 20,
            ..CommConfig::default()
        },
    );
    let sim = e.sim.as_ref().unwrap();
    let d0 = e.driver.device(0).unwrap();
    let mut own = DeviceBuffer::<f32>::zeroed(&d0, 256 << 10).unwrap();
    let (copies, launches) = (sim.calls("cuMemcpyDtoDAsync"), sim.calls("cuLaunchKernel"));
    let r = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut own, ReduceOp::Sum, &s[0]);
    assert_eq!(arg_of(r), "count");
    assert_eq!(
        sim.calls("cuMemcpyDtoDAsync"),
        copies,
        "a copy reached the stream"
    );
    assert_eq!(sim.calls("cuLaunchKernel"), launches);
}
