//! Fused allreduce + residual add + RMSNorm: residual_out equals the host reference bit for bit
//! and out within the documented sum-of-squares tolerance, for every type, both forms, teams of
//! 2 to 8, token counts 1 to 1000, hidden 8192 and odd sizes, on symmetric buffers and on the
//! caller's own memory; graph replays; calls interleaved with allreduce calls on the same pad;
//! bad arguments refused before any launch; disagreement and absence reported, not waited for.

use std::time::Duration;

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::kernels::norm::{SPLIT, SPLIT_MIN_ROW_BYTES};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, random_input, rms_norm_within_tolerance,
};
use cuda_multimem_collectives::{
    bf16, f16, Algorithm, CommConfig, Communicator, DType, Element, MulticastPolicy, ReduceOp,
    SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{self as table, Call, Elem, Mem, Params, Queued};
use cuda_multimem_tests::{env, sim, sim_delayed, Rng};

const EPS: f32 = 1e-6;

/// A team of `n` on the driver `CUDA_MULTIMEM_DRIVER` selects (the real GPUs under test-hw)
/// when it has `n` devices, else on a simulated machine of `n`.
fn team(n: usize, config: CommConfig) -> (cuda_multimem_tests::Env, Communicator, Vec<Stream>) {
    let e = env();
    let e = if e.driver.devices().len() >= n {
        e
    } else {
        drop(e);
        sim(SimConfig::new(n, 13000))
    };
    let devices = e.driver.devices()[..n].to_vec();
    let (comm, s) = cuda_multimem_tests::team_on(&devices, config, MulticastPolicy::Never);
    (e, comm, s)
}

fn forced(algorithm: Option<Algorithm>) -> CommConfig {
    CommConfig {
        algorithm,
        ..Default::default()
    }
}

/// One call's data: every rank's x, the (replicated) residual and weight.
struct Case<T> {
    xs: Vec<Vec<T>>,
    r: Vec<T>,
    gamma: Vec<T>,
    hidden: usize,
}

impl<T: Element> Case<T> {
    fn new(n: usize, tokens: usize, hidden: usize, seed: u64) -> Case<T> {
        let mut s = seed | 1;
        Case {
            xs: (0..n)
                .map(|_| random_input(tokens * hidden, &mut s))
                .collect(),
            r: random_input(tokens * hidden, &mut s),
            gamma: random_input(hidden, &mut s),
            hidden,
        }
    }

    /// Check rank `rank`'s residual_out (exact) and out (tolerance) against the reference.
    fn check(&self, what: &str, rank: usize, res: &[T], out: &[T]) {
        let xs: Vec<&[T]> = self.xs.iter().map(|v| v.as_slice()).collect();
        let (wr, wo) = add_rms_norm_reference(&xs, &self.r, &self.gamma, self.hidden, EPS);
        if let Some(i) = (0..wr.len()).find(|&i| res[i] != wr[i]) {
            panic!(
                "{what}: rank {rank}: residual_out[{i}] (row {}) = {:?}, reference {:?}",
                i / self.hidden,
                res[i],
                wr[i]
            );
        }
        if let Some(i) = (0..wo.len()).find(|&i| !rms_norm_within_tolerance(out[i], wo[i])) {
            panic!(
                "{what}: rank {rank}: out[{i}] (row {}) = {:?}, reference {:?}",
                i / self.hidden,
                out[i],
                wo[i]
            );
        }
    }
}

/// Run the fused norm on `tokens` rows of `hidden` random elements of `T` (from `seed`) on
/// every rank — the table's runner, symmetric buffers or (`own`) the caller's own memory —
/// check every rank against the reference and against rank 0, and return rank 0's
/// (residual_out, out).
#[allow(clippy::too_many_arguments)]
fn run<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    tokens: usize,
    hidden: usize,
    seed: u64,
    own: bool,
    what: &str,
) -> (Vec<T>, Vec<T>) {
    let q = queued::<T>(
        comm,
        tokens,
        hidden,
        if own { Mem::OWN } else { Mem::SYM },
        false,
    );
    finish(comm, s, q, seed, what)
}

/// The norm's case at `tokens × hidden`, allocated, nothing written.
fn queued<T: Elem>(
    comm: &Communicator,
    tokens: usize,
    hidden: usize,
    mem: Mem,
    in_place: bool,
) -> Queued<T> {
    let call = Call::norm(hidden);
    let params = Params {
        eps: EPS,
        ..call.params
    };
    Queued::new(comm, call.at(), tokens * hidden, params, mem, in_place)
}

/// Fill `q` from `seed`, call every rank, wait, check every rank against the reference and
/// against rank 0; rank 0's (residual_out, out).
fn finish<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    mut q: Queued<T>,
    seed: u64,
    what: &str,
) -> (Vec<T>, Vec<T>) {
    q.fill(&mut Rng::new(seed));
    q.call_all(comm, s);
    for st in s {
        st.synchronize().unwrap();
    }
    comm.check().unwrap();
    q.verify().unwrap_or_else(|m| panic!("{what}: {m}"));
    // results: out, then residual_out
    let got: Vec<Vec<Vec<T>>> = (0..q.n).map(|r| q.results(r)).collect();
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g, &got[0], "{what}: rank {r} differs from rank 0");
    }
    let mut r0 = got.into_iter().next().unwrap();
    let res = r0.pop().unwrap();
    (res, r0.pop().unwrap())
}

fn each_dtype(
    n: usize,
    algorithm: Option<Algorithm>,
    tokens: &[usize],
    hiddens: &[usize],
    own: bool,
) {
    let (_e, comm, s) = team(n, forced(algorithm));
    for &hidden in hiddens {
        for (i, &t) in tokens.iter().enumerate() {
            let what = |d: &str| format!("{n} ranks, {algorithm:?}, {t} x {hidden} {d}, own {own}");
            let seed = (n * 1000 + t * 7 + hidden + i) as u64;
            run::<f32>(&comm, &s, t, hidden, seed, own, &what("f32"));
            run::<f16>(&comm, &s, t, hidden, seed + 1, own, &what("f16"));
            run::<bf16>(&comm, &s, t, hidden, seed + 2, own, &what("bf16"));
        }
    }
}

#[test]
fn one_shot_matches_the_reference_for_every_dtype_at_hidden_8192_and_4100() {
    each_dtype(
        2,
        Some(Algorithm::OneShot),
        &[1, 3, 16],
        &[8192, 4100],
        false,
    );
}

#[test]
fn low_latency_one_shot_matches_the_reference_for_every_dtype_at_hidden_8192_and_4100() {
    each_dtype(
        2,
        Some(Algorithm::OneShotLl),
        &[1, 3, 16],
        &[8192, 4100],
        false,
    );
}

#[test]
fn low_latency_one_shot_serves_the_callers_own_memory() {
    each_dtype(
        2,
        Some(Algorithm::OneShotLl),
        &[1, 3, 16],
        &[8192, 4100],
        true,
    );
}

/// Operands 4-byte but not 16-byte aligned (element units, a 16-bit element taking half of a
/// polled word), and an odd number of words per row.
#[test]
fn low_latency_one_shot_runs_element_units_on_rows_not_16_byte_aligned() {
    each_dtype(2, Some(Algorithm::OneShotLl), &[1, 3], &[4098, 130], true);
    each_dtype(3, Some(Algorithm::OneShotLl), &[5], &[4098], false);
}

/// The low-latency form's results are the barrier one-shot's bits: the same threads, units and
/// sum-of-squares order. Rows of `SPLIT_MIN_ROW_BYTES` or more run both split over clusters of
/// `SPLIT` blocks (the same byte slices, partials added in slice order): still the same bits,
/// and `tokens × SPLIT` blocks in the choice.
#[test]
fn low_latency_and_barrier_one_shot_give_the_same_bits() {
    let cases = [
        (1, 2040),
        (3, 1026),
        (16, 2000),
        (2, 1022),
        (1, 8192),
        (3, 4100),
        (2, 4098),
    ];
    // every case on one team per form (a team per case and form cost a minute on 2 cores):
    // each form's bf16 and f32 (rows of the same bytes) results, then compared
    let mut results = Vec::new();
    for (alg, what) in [
        (Algorithm::OneShotLl, "low-latency"),
        (Algorithm::OneShot, "barrier one-shot"),
    ] {
        let (_e, comm, s) = team(2, forced(Some(alg)));
        let mut mine = Vec::new();
        for (t, h) in cases {
            let blocks = if 2 * h >= SPLIT_MIN_ROW_BYTES {
                t * SPLIT
            } else {
                t
            };
            let c = comm.add_rms_norm_choice(DType::Bf16, t, h).unwrap();
            assert_eq!(c.blocks as usize, blocks, "{t} x {h}: {what} {c:?}");
            let a = run::<bf16>(&comm, &s, t, h, (t * h) as u64, true, what);
            let hf = h / 2;
            let b = run::<f32>(
                &comm,
                &s,
                t,
                hf,
                (t + hf) as u64,
                false,
                &format!("{what} f32"),
            );
            mine.push((a, b));
        }
        results.push(mine);
    }
    for (i, (t, h)) in cases.into_iter().enumerate() {
        assert_eq!(
            results[0][i].0, results[1][i].0,
            "{t} x {h}: the two one-shots differ"
        );
        assert_eq!(
            results[0][i].1,
            results[1][i].1,
            "{t} x {} f32: the two one-shots differ",
            h / 2
        );
    }
}

#[test]
fn teams_of_2_to_8_match_the_reference_in_the_low_latency_form() {
    for n in [2, 3, 4, 5, 8] {
        let (_e, comm, s) = team(n, forced(Some(Algorithm::OneShotLl)));
        for (t, h) in [(1, 8192), (3, 1000), (16, 520)] {
            let what = format!("{n} ranks low-latency {t} x {h}");
            let c = comm
                .add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, t, h)
                .unwrap();
            assert!(is_ll(c.algorithm), "{what}: {c}");
            run::<bf16>(&comm, &s, t, h, (n + t) as u64, t % 2 == 1, &what);
            run::<f16>(&comm, &s, t, h, (n * t + 1) as u64, t % 2 == 0, &what);
        }
    }
}

/// Up to `norm_ll_max_bytes` on 4-byte words the default choice is the low-latency form; above
/// it and on rows of odd 16-bit elements the barrier one-shot runs; operands that are not 4-byte
/// aligned on one rank still run the team's low-latency form, through that rank's scratch (and
/// give the reference's results).
#[test]
fn the_low_latency_form_runs_up_to_its_limit_on_whole_aligned_words_only() {
    use cuda_multimem_collectives::DType;
    let (_e, comm, s) = team(2, CommConfig::default());
    let ll = |t, h, d| is_ll(comm.add_rms_norm_choice(d, t, h).unwrap().algorithm);
    let one = |t, h, d| is_one_shot(comm.add_rms_norm_choice(d, t, h).unwrap().algorithm);
    assert!(ll(1, 8192, DType::Bf16));
    assert!(ll(16, 8192, DType::Bf16));
    assert!(one(17, 8192, DType::Bf16));
    assert!(ll(8, 8192, DType::F32));
    assert!(one(9, 8192, DType::F32));
    assert!(one(3, 4099, DType::Bf16));
    assert!(ll(3, 4099, DType::F32));
    // odd elements, and operands 2 bytes off a word: the barrier one-shot, correct
    run::<bf16>(&comm, &s, 3, 4099, 7, true, "odd row, default");
    let (t, h) = (2, 1000);
    let case = Case::<bf16>::new(2, t, h, 8);
    let mut got = Vec::new();
    let mut keep = Vec::new();
    for r in 0..2 {
        let d = comm.device(r).unwrap();
        let pad = |v: &[bf16]| [&[bf16::ZERO][..], v].concat();
        keep.push((
            DeviceBuffer::from_host(d, &pad(&case.xs[r])).unwrap(),
            DeviceBuffer::from_host(d, &pad(&case.r)).unwrap(),
            DeviceBuffer::from_host(d, &case.gamma).unwrap(),
            DeviceBuffer::<bf16>::zeroed(d, t * h + 1).unwrap(),
        ));
    }
    for (r, (x, res, g, out)) in keep.iter().enumerate() {
        // SAFETY: ranges inside these buffers, alive until the streams are synchronised below.
        let (xs, rs, os) = unsafe {
            use cuda_multimem_collectives::{Dst, Src};
            (
                Src::<bf16>::from_raw(x.device_ptr() + 2, t * h),
                Dst::<bf16>::from_raw(res.device_ptr() + 2, t * h),
                Dst::<bf16>::from_raw(out.device_ptr() + 2, t * h),
            )
        };
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce_add_rms_norm(xs, rs, g, os, h, EPS, &s[r])
            .unwrap();
        // the form is the team's (every rank runs what the others run, whatever its own
        // addresses): this rank's operands 2 bytes off a word go through its scratch
        assert!(is_ll(c.algorithm), "operands off a word: {c}");
        assert_eq!(c.staged_chunks, 1, "operands off a word: {c}");
    }
    for st in &s {
        st.synchronize().unwrap();
    }
    comm.check().unwrap();
    for (r, (_, res, _, out)) in keep.iter().enumerate() {
        got.push((
            res.to_vec().unwrap()[1..].to_vec(),
            out.to_vec().unwrap()[1..].to_vec(),
        ));
        case.check("operands 2 bytes off a word", r, &got[r].0, &got[r].1);
    }
}

#[test]
fn two_shot_matches_the_reference_for_every_dtype_at_hidden_8192_and_4100() {
    each_dtype(
        2,
        Some(Algorithm::TwoShot),
        &[1, 3, 16],
        &[8192, 4100],
        false,
    );
}

#[test]
fn both_forms_serve_the_callers_own_memory() {
    each_dtype(2, Some(Algorithm::OneShot), &[3, 16], &[4100], true);
    each_dtype(3, Some(Algorithm::TwoShot), &[3, 16], &[4100], true);
}

#[test]
fn a_128_and_a_1000_token_call_match_the_reference_in_both_forms() {
    for alg in [Algorithm::OneShot, Algorithm::TwoShot] {
        let (_e, comm, s) = team(2, forced(Some(alg)));
        run::<bf16>(&comm, &s, 128, 8192, 5, false, &format!("{alg} 128 x 8192"));
        run::<bf16>(
            &comm,
            &s,
            1000,
            4100,
            6,
            true,
            &format!("{alg} 1000 x 4100"),
        );
    }
}

#[test]
fn teams_of_3_5_and_8_match_the_reference_in_both_forms() {
    for n in [3, 5, 8] {
        for alg in [Algorithm::OneShot, Algorithm::TwoShot] {
            let (_e, comm, s) = team(n, forced(Some(alg)));
            for (t, h) in [(1, 264), (3, 1000), (16, 520), (37, 130)] {
                let what = format!("{n} ranks {alg} {t} x {h}");
                run::<bf16>(&comm, &s, t, h, (n + t) as u64, t % 2 == 0, &what);
                run::<f32>(&comm, &s, t, h, (n * t) as u64, false, &what);
            }
        }
    }
}

/// Small staging: a call larger than one launch's share runs in several launches, each a call
/// of its own on every rank.
#[test]
fn calls_larger_than_the_staging_run_in_several_launches() {
    for alg in [Algorithm::OneShot, Algorithm::TwoShot] {
        let (_e, comm, s) = team(
            3,
            CommConfig {
                algorithm: Some(alg),
                one_shot_max_bytes: Some(16 << 10),
                stage_bytes: Some(16 << 10),
                ..Default::default()
            },
        );
        run::<f16>(&comm, &s, 100, 1000, 9, false, &format!("{alg} chunked"));
    }
}

#[test]
fn the_form_is_one_shot_up_to_3_ranks_and_two_shot_above_the_limit_for_larger_teams() {
    use cuda_multimem_collectives::DType;
    {
        let (_e, comm, _s) = team(
            2,
            CommConfig {
                norm_ll_max_bytes: 0,
                ..Default::default()
            },
        );
        for t in [1, 16, 1024] {
            let c = comm.add_rms_norm_choice(DType::Bf16, t, 8192).unwrap();
            assert!(is_one_shot(c.algorithm), "{t} tokens on 2 ranks: {c}");
            assert_eq!(c.staged_chunks, 0);
        }
    }
    let (_e, comm, _s) = team(
        4,
        CommConfig {
            norm_ll_max_bytes: 0,
            ..Default::default()
        },
    );
    assert!(is_one_shot(
        comm.add_rms_norm_choice(DType::Bf16, 16, 8192)
            .unwrap()
            .algorithm
    ));
    assert_eq!(
        comm.add_rms_norm_choice(DType::Bf16, 128, 8192)
            .unwrap()
            .algorithm,
        Algorithm::NormTwoShot
    );
}

#[test]
fn out_may_be_x_itself() {
    for alg in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::OneShotLl] {
        let (_e, comm, s) = team(2, forced(Some(alg)));
        let (t, h) = (5, 1000);
        // in place: `out` is `x` itself (the caller's own memory)
        let q = queued::<bf16>(&comm, t, h, Mem::OWN, true);
        finish(&comm, &s, q, 21, &format!("{alg} in place"));
    }
}

/// f32: an allreduce followed by the unfused kernel rounds nowhere the fused call does not, so
/// both give the same bits (for 16-bit types the allreduce rounds the sum to T before r is
/// added, which the fused call does not).
#[test]
fn the_unfused_baseline_after_an_allreduce_gives_the_fused_bits_for_f32() {
    // rows under SPLIT_MIN_ROW_BYTES: the fused call runs one block per row, as the unfused
    // kernel does, so the sums of squares add in the same order and every bit agrees; longer
    // rows run the split forms (slices added in order), whose `out` agrees within the
    // reference's tolerance only — and residual_out exactly
    for (t, h) in [(7, 1000), (7, 4100)] {
        let same_order = 4 * h < SPLIT_MIN_ROW_BYTES;
        let (_e, comm, s) = team(2, CommConfig::default());
        let mut fused = queued::<f32>(&comm, t, h, Mem::SYM, false);
        fused.fill(&mut Rng::new(33));
        fused.call_all(&comm, &s);
        for st in &s {
            st.synchronize().unwrap();
        }
        comm.check().unwrap();
        fused.check();
        let (fo, fr) = {
            let mut g = fused.results(0);
            let res = g.pop().unwrap();
            (g.pop().unwrap(), res)
        };
        // the same data through an allreduce and the unfused kernel
        let mut x: SymmetricBuffer<f32> = comm.alloc(t * h).unwrap();
        let mut res: SymmetricBuffer<f32> = comm.alloc(t * h).unwrap();
        let g: SymmetricBuffer<f32> = comm.alloc(h).unwrap();
        let mut out: SymmetricBuffer<f32> = comm.alloc(t * h).unwrap();
        for r in 0..2 {
            x.write(r, 0, fused.input(r)).unwrap();
            res.write(r, 0, fused.side_data(0)).unwrap();
            g.write(r, 0, fused.side_data(1)).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            let h_ = comm.rank(r).unwrap();
            h_.all_reduce_in_place(&mut x, ReduceOp::Sum, st).unwrap();
            h_.add_rms_norm(&x, &mut res, &g, &mut out, h, EPS, st)
                .unwrap();
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        comm.check().unwrap();
        assert_eq!(res.to_vec(0).unwrap(), fr, "{t} x {h}");
        let uo = out.to_vec(0).unwrap();
        if same_order {
            assert_eq!(uo, fo, "{t} x {h}");
        } else {
            let bad = (0..fo.len()).find(|&i| !rms_norm_within_tolerance(uo[i], fo[i]));
            assert_eq!(
                bad, None,
                "{t} x {h}: unfused and fused out differ beyond the order"
            );
        }
    }
}

/// Each rank captures one fused call into a graph and replays it with new inputs: nothing is
/// reset from the host between replays.
#[test]
fn a_captured_graph_replays_the_fused_norm_in_every_form() {
    for alg in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::OneShotLl] {
        let (_e, comm, s) = team(2, forced(Some(alg)));
        let (t, h) = (16, 1024);
        let mut q = queued::<bf16>(&comm, t, h, Mem::SYM, false);
        table::capture_and_replay(
            &comm,
            &s,
            &mut [&mut q],
            CaptureMode::Global,
            4,
            &mut Rng::new(100 + alg as u64),
        );
    }
}

/// Norm calls of every form and allreduce calls of every algorithm, back to back on the same
/// pad and staging, with random per-device delays: every result exact (allreduce) or within
/// tolerance (norm), on teams of 2, 3, 5 and 8.
#[test]
fn norm_and_allreduce_calls_interleave_on_the_same_pad_with_random_delays() {
    for (n, seed) in [(2usize, 1u64), (3, 2), (5, 3), (8, 4)] {
        let e = sim_delayed(SimConfig::new(n, 13000), Duration::from_micros(300), seed);
        let devices = e.driver.devices();
        let comm = cuda_multimem_tests::team_on(
            &devices,
            CommConfig {
                // norm calls of 6 rows of 520 bytes run low-latency, of 7 one-shot, of 8 to 10
                // two-shot
                norm_ll_max_bytes: 3200,
                one_shot_max_bytes: Some(4 << 10),
                ll_max_bytes: 2 << 10,
                stage_bytes: Some(16 << 10),
                max_blocks: 4,
                threads: 64,
                ..Default::default()
            },
            MulticastPolicy::Never,
        )
        .0;
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let mut rng = Rng::new(seed * 77 + 1);
        let calls = 12;
        let (t, h) = (6, 260);
        let mut cases = Vec::new();
        for c in 0..calls {
            let mut norm = queued::<bf16>(&comm, t + c % 5, h, Mem::SYM, false);
            norm.fill(&mut rng);
            // an allreduce of a size that picks another algorithm each time
            let count = [100usize, 3000, 9000, 20_000][c % 4];
            let call = Call::all_reduce(ReduceOp::Sum);
            let mut ar = Queued::<bf16>::new(&comm, call.at(), count, call.params, Mem::SYM, true);
            ar.fill(&mut rng);
            cases.push((ar, norm));
        }
        for (ar, norm) in cases.iter_mut() {
            for (r, st) in s.iter().enumerate() {
                ar.call(&comm, r, st).unwrap();
                norm.call(&comm, r, st).unwrap();
            }
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        comm.check().unwrap();
        for (c, (ar, norm)) in cases.iter().enumerate() {
            ar.verify()
                .unwrap_or_else(|m| panic!("team of {n}, call {c}: {m}"));
            norm.verify()
                .unwrap_or_else(|m| panic!("team of {n}, call {c}: {m}"));
        }
    }
}

fn invalid_arg(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn bad_lengths_hidden_eps_and_overlaps_are_refused_before_any_launch() {
    let (_e, comm, s) = team(2, CommConfig::default());
    let h0 = comm.rank(0).unwrap();
    let d = comm.device(0).unwrap();
    let x = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let mut res = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let g = DeviceBuffer::<f32>::zeroed(d, 16).unwrap();
    let mut out = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let short = DeviceBuffer::<f32>::zeroed(d, 63).unwrap();
    let mut short_mut = DeviceBuffer::<f32>::zeroed(d, 48).unwrap();
    let call =
        |x: &DeviceBuffer<f32>,
         res: &mut DeviceBuffer<f32>,
         g: &DeviceBuffer<f32>,
         out: &mut DeviceBuffer<f32>,
         hidden: usize,
         eps: f32| { h0.all_reduce_add_rms_norm(x, res, g, out, hidden, eps, &s[0]) };
    assert_eq!(
        invalid_arg(call(&x, &mut res, &g, &mut out, 0, EPS).unwrap_err()),
        "hidden"
    );
    assert_eq!(
        invalid_arg(call(&x, &mut res, &g, &mut out, 16, -1.0).unwrap_err()),
        "eps"
    );
    assert_eq!(
        invalid_arg(call(&x, &mut res, &g, &mut out, 16, f32::NAN).unwrap_err()),
        "eps"
    );
    assert_eq!(
        invalid_arg(call(&x, &mut res, &g, &mut out, 16, f32::INFINITY).unwrap_err()),
        "eps"
    );
    assert_eq!(
        invalid_arg(call(&short, &mut res, &g, &mut out, 16, EPS).unwrap_err()),
        "x"
    );
    assert_eq!(
        invalid_arg(call(&x, &mut short_mut, &g, &mut out, 16, EPS).unwrap_err()),
        "residual"
    );
    assert_eq!(
        invalid_arg(call(&x, &mut res, &g, &mut short_mut, 16, EPS).unwrap_err()),
        "out"
    );
    assert_eq!(
        invalid_arg(call(&x, &mut res, &x, &mut out, 16, EPS).unwrap_err()),
        "weight"
    );
    // a row too large for the staging
    let big = 64 << 20;
    assert_eq!(
        invalid_arg(
            comm.add_rms_norm_choice(cuda_multimem_collectives::DType::F32, 1, big)
                .unwrap_err()
        ),
        "hidden"
    );
    // overlaps: residual over x, out partly over x; another device's memory; misalignment
    let p = x.device_ptr();
    // SAFETY: ranges inside x's allocation; refused before any launch.
    unsafe {
        use cuda_multimem_collectives::{Dst, Src};
        let e = h0
            .all_reduce_add_rms_norm(
                &x,
                Dst::<f32>::from_raw(p, 64),
                &g,
                &mut out,
                16,
                EPS,
                &s[0],
            )
            .unwrap_err();
        assert_eq!(invalid_arg(e), "residual");
        let x2 = DeviceBuffer::<f32>::zeroed(d, 80).unwrap();
        let q = x2.device_ptr();
        let e = h0
            .all_reduce_add_rms_norm(
                Src::<f32>::from_raw(q, 64),
                &mut res,
                &g,
                Dst::<f32>::from_raw(q + 64, 64),
                16,
                EPS,
                &s[0],
            )
            .unwrap_err();
        assert_eq!(invalid_arg(e), "out");
        let e = h0
            .all_reduce_add_rms_norm(
                Src::<f32>::from_raw(q + 2, 64),
                &mut res,
                &g,
                &mut out,
                16,
                EPS,
                &s[0],
            )
            .unwrap_err();
        assert_eq!(invalid_arg(e), "x");
    }
    let other = DeviceBuffer::<f32>::zeroed(comm.device(1).unwrap(), 64).unwrap();
    assert_eq!(
        invalid_arg(call(&other, &mut res, &g, &mut out, 16, EPS).unwrap_err()),
        "x"
    );
    assert_eq!(
        invalid_arg(
            h0.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, 16, EPS, &s[1])
                .unwrap_err()
        ),
        "stream"
    );
    // nothing ran: the team is healthy and the outputs untouched
    s[0].synchronize().unwrap();
    comm.check().unwrap();
    assert!(res.to_vec().unwrap().iter().all(|&v| v == 0.0));
}

fn short_timeout(
    n: usize,
    alg: Algorithm,
) -> (cuda_multimem_tests::Env, Communicator, Vec<Stream>) {
    team(
        n,
        CommConfig {
            algorithm: Some(alg),
            timeout: Duration::from_millis(200),
            first_call_timeout: Some(Duration::from_millis(200)),
            ..Default::default()
        },
    )
}

#[test]
fn ranks_that_disagree_on_hidden_are_reported_not_waited_for() {
    for alg in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::OneShotLl] {
        // every form reports the disagreement when the ranks meet (the barrier forms by the
        // headers, the low-latency form by the flags of this call's counter): no timeout may
        // fire first
        let (_e, comm, s) = team(2, forced(Some(alg)));
        let x: SymmetricBuffer<f32> = comm.alloc(512).unwrap();
        let mut res: SymmetricBuffer<f32> = comm.alloc(512).unwrap();
        let g: SymmetricBuffer<f32> = comm.alloc(256).unwrap();
        let mut out: SymmetricBuffer<f32> = comm.alloc(512).unwrap();
        // rank 0: 2 rows of 256; rank 1: 4 rows of 128 (same bytes)
        for (r, hidden) in [(0, 256), (1, 128)] {
            comm.rank(r)
                .unwrap()
                .all_reduce_add_rms_norm(
                    &x,
                    &mut res,
                    g.slice(..hidden).unwrap(),
                    &mut out,
                    hidden,
                    EPS,
                    &s[r],
                )
                .unwrap();
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        match (alg, comm.check()) {
            (_, Err(Error::RanksDisagree { .. })) => {}
            (_, other) => panic!("{alg}: expected a disagreement, got {other:?}"),
        }
        assert!(matches!(
            comm.rank(0)
                .unwrap()
                .all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, 256, EPS, &s[0]),
            Err(Error::Unusable { .. })
        ));
    }
}

#[test]
fn a_peer_that_never_calls_the_norm_is_a_timeout_not_a_hang() {
    for alg in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::OneShotLl] {
        let (_e, comm, s) = short_timeout(3, alg);
        let x: SymmetricBuffer<bf16> = comm.alloc(4 * 300).unwrap();
        let mut res: SymmetricBuffer<bf16> = comm.alloc(4 * 300).unwrap();
        let g: SymmetricBuffer<bf16> = comm.alloc(300).unwrap();
        let mut out: SymmetricBuffer<bf16> = comm.alloc(4 * 300).unwrap();
        // rank 2 never calls
        for (r, st) in s[..2].iter().enumerate() {
            comm.rank(r)
                .unwrap()
                .all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, 300, EPS, st)
                .unwrap();
        }
        for st in &s[..2] {
            st.synchronize().unwrap();
        }
        match comm.check() {
            Err(Error::Timeout { after, .. }) => assert_eq!(after, Duration::from_millis(200)),
            other => panic!("{alg}: expected a timeout, got {other:?}"),
        }
    }
}

/// The fused norm's low-latency forms (rows whole or cut over a cluster).
fn is_ll(a: Algorithm) -> bool {
    matches!(a, Algorithm::NormOneShotLl | Algorithm::NormOneShotLlSplit)
}

/// The fused norm's barrier one-shot forms (rows whole or cut over a cluster).
fn is_one_shot(a: Algorithm) -> bool {
    matches!(a, Algorithm::NormOneShot | Algorithm::NormOneShotSplit)
}
