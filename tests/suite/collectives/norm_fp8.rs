//! The fused allreduce + residual add + RMSNorm with FP8 (e4m3) outputs, and the local one: for
//! every scaling (static, per token, per group f32, per group UE8M0) with and without the
//! unquantised rows, teams of 2 to 8 and ranks sharing one device, the e4m3 rows and scales are
//! the host quantisation (`fp8_quantise`) of the plain norm's output bit for bit (the plain
//! and FP8 kernels share the sum-of-squares order), residual_out and the unquantised rows are
//! the plain norm's bits; hostile data (all-zero rows, NaN, ±∞, saturation) give the documented
//! results; bad arguments are refused naming the argument; a captured graph replays.

// `usize::is_multiple_of` needs Rust 1.87; the workspace keeps `%` for older toolchains.
#![allow(clippy::manual_is_multiple_of)]
// Ranks index their streams and buffers.
#![allow(clippy::needless_range_loop)]

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, fp8_quantise, random_input, rms_norm_within_tolerance, ue8m0_pack,
};
use cuda_multimem_collectives::{
    bf16, f16, Algorithm, Choice, CommConfig, Communicator, Dst, Element, Fp8Out, Fp8Scaling,
    MulticastPolicy, F8E4M3, FP8_GROUP,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{env, placed, sim, sync_all};

const EPS: f32 = 1e-6;
/// The static scale of the tests: normalised values of a few units become some hundreds, some
/// saturate.
const STATIC: f32 = 0.0078125;

/// A team of `n` on the driver `CUDA_MULTIMEM_DRIVER` selects: its first `n` devices when it
/// has them; on a real machine with fewer GPUs, `n` ranks placed round-robin on them (ranks
/// sharing a GPU: test-hw on a one-GPU machine runs every test here on the real kernels);
/// else a simulated machine of `n`.
fn team(n: usize, config: CommConfig) -> (cuda_multimem_tests::Env, Communicator, Vec<Stream>) {
    let e = env();
    let devices = if e.driver.devices().len() >= n {
        e.driver.devices()[..n].to_vec()
    } else if !e.driver.is_simulated() {
        placed(&e, n)
    } else {
        drop(e);
        return distinct_sim(n, config);
    };
    let (comm, s) = cuda_multimem_tests::team_on(&devices, config, MulticastPolicy::Never);
    (e, comm, s)
}

/// A team of `n` on devices of their own: the real ones when the driver has `n`, else a
/// simulated machine of `n` (for the tests that assert the plain norm's own forms).
fn team_distinct(
    n: usize,
    config: CommConfig,
) -> (cuda_multimem_tests::Env, Communicator, Vec<Stream>) {
    let e = env();
    if e.driver.devices().len() >= n {
        let devices = e.driver.devices()[..n].to_vec();
        let (comm, s) = cuda_multimem_tests::team_on(&devices, config, MulticastPolicy::Never);
        return (e, comm, s);
    }
    drop(e);
    distinct_sim(n, config)
}

fn distinct_sim(
    n: usize,
    config: CommConfig,
) -> (cuda_multimem_tests::Env, Communicator, Vec<Stream>) {
    let e = sim(SimConfig::new(n, 13000));
    let devices = e.driver.devices()[..n].to_vec();
    let (comm, s) = cuda_multimem_tests::team_on(&devices, config, MulticastPolicy::Never);
    (e, comm, s)
}

/// `n` ranks on one device: the real GPU under test-hw (every rank of a one-GPU machine shares
/// it: `placed`), else one simulated device.
fn shared_team(n: usize) -> (cuda_multimem_tests::Env, Communicator, Vec<Stream>) {
    let e = env();
    let e = if e.driver.is_simulated() {
        drop(e);
        sim(SimConfig::new(1, 13000))
    } else {
        e
    };
    let devices = placed(&e, n);
    let (comm, s) =
        cuda_multimem_tests::team_on(&devices, CommConfig::default(), MulticastPolicy::Never);
    (e, comm, s)
}

fn forced(algorithm: Option<Algorithm>) -> CommConfig {
    CommConfig {
        algorithm,
        ..Default::default()
    }
}

/// One call's data: every rank's x, the replicated residual and weight.
struct Case<T> {
    xs: Vec<Vec<T>>,
    r: Vec<T>,
    gamma: Vec<T>,
    tokens: usize,
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
            tokens,
            hidden,
        }
    }
}

/// One rank's device buffers.
struct Bufs<T: Element> {
    x: DeviceBuffer<T>,
    res: DeviceBuffer<T>,
    w: DeviceBuffer<T>,
    out: DeviceBuffer<T>,
    q: DeviceBuffer<F8E4M3>,
    sc: DeviceBuffer<f32>,
    sc_u: DeviceBuffer<u32>,
    unq: DeviceBuffer<T>,
}

impl<T: Element> Bufs<T> {
    fn new(comm: &Communicator, rank: usize, c: &Case<T>, scaling: Fp8Scaling) -> Bufs<T> {
        let d = comm.device(rank).unwrap();
        let len = c.tokens * c.hidden;
        let sl = scaling.scales_len(c.tokens, c.hidden).max(1);
        // scales filled with a pattern, so a scale the kernel does not write is seen
        let junk_f = vec![f32::from_bits(0x7f80_0001); sl];
        let junk_u = vec![0xdead_beef_u32; sl];
        Bufs {
            x: DeviceBuffer::from_host(d, &c.xs[rank]).unwrap(),
            res: DeviceBuffer::from_host(d, &c.r).unwrap(),
            w: DeviceBuffer::from_host(d, &c.gamma).unwrap(),
            out: DeviceBuffer::zeroed(d, len).unwrap(),
            q: DeviceBuffer::from_host(d, &vec![F8E4M3::from_bits(0x55); len]).unwrap(),
            sc: DeviceBuffer::from_host(d, &junk_f).unwrap(),
            sc_u: DeviceBuffer::from_host(d, &junk_u).unwrap(),
            unq: DeviceBuffer::zeroed(d, len).unwrap(),
        }
    }

    /// The FP8 output spec of `scaling` on these buffers (scales of exactly the expected length).
    fn spec(&mut self, scaling: Fp8Scaling, len: usize, unq: bool) -> Fp8Out<'_, T> {
        // SAFETY: sub-ranges of this rank's live buffers, used by the call only.
        let (sc, su) = unsafe {
            (
                Dst::<f32>::from_raw(self.sc.device_ptr(), len),
                Dst::<u32>::from_raw(self.sc_u.device_ptr(), len),
            )
        };
        let o = match scaling {
            Fp8Scaling::Static => Fp8Out::static_scale(&mut self.q, STATIC),
            Fp8Scaling::PerToken => Fp8Out::per_token(&mut self.q, sc),
            Fp8Scaling::PerGroup => Fp8Out::per_group(&mut self.q, sc),
            Fp8Scaling::PerGroupUe8m0 => Fp8Out::per_group_ue8m0(&mut self.q, su),
        };
        if unq {
            o.with_unquantised(&mut self.unq)
        } else {
            o
        }
    }
}

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn same_q(a: F8E4M3, b: F8E4M3) -> bool {
    a.to_bits() == b.to_bits() || (a.to_bits() & 0x7f == 0x7f && b.to_bits() & 0x7f == 0x7f)
}

/// Check one rank's FP8 results against the host quantisation of the plain norm's `out`.
#[allow(clippy::too_many_arguments)]
fn verify<T: Element>(
    what: &str,
    c: &Case<T>,
    scaling: Fp8Scaling,
    plain_res: &[T],
    plain_out: &[T],
    b: &Bufs<T>,
    unq: bool,
    tolerance_check: bool,
) {
    let res = b.res.to_vec().unwrap();
    assert!(
        res.iter()
            .zip(plain_res)
            .all(|(a, b)| same_f32(a.to_f32(), b.to_f32())),
        "{what}: residual_out differs from the plain norm's"
    );
    if tolerance_check {
        let xs: Vec<&[T]> = c.xs.iter().map(|v| v.as_slice()).collect();
        let (wr, wo) = add_rms_norm_reference(&xs, &c.r, &c.gamma, c.hidden, EPS);
        if let Some(i) = (0..wr.len()).find(|&i| !same_f32(res[i].to_f32(), wr[i].to_f32())) {
            panic!(
                "{what}: residual_out[{i}] = {:?}, reference {:?}",
                res[i], wr[i]
            );
        }
        if let Some(i) = (0..wo.len()).find(|&i| {
            !same_f32(plain_out[i].to_f32(), wo[i].to_f32())
                && !rms_norm_within_tolerance(plain_out[i], wo[i])
        }) {
            panic!(
                "{what}: out[{i}] = {:?}, reference {:?}",
                plain_out[i], wo[i]
            );
        }
    }
    if unq {
        let u = b.unq.to_vec().unwrap();
        if let Some(i) = (0..u.len()).find(|&i| !same_f32(u[i].to_f32(), plain_out[i].to_f32())) {
            panic!(
                "{what}: unquantised[{i}] = {:?}, the plain norm's {:?}",
                u[i], plain_out[i]
            );
        }
    }
    let (wq, ws) = fp8_quantise(plain_out, c.hidden, scaling, STATIC);
    let q = b.q.to_vec().unwrap();
    if let Some(i) = (0..q.len()).find(|&i| !same_q(q[i], wq[i])) {
        panic!(
            "{what}: q[{i}] (row {}) = {:#04x}, host quantisation {:#04x} (y = {:?})",
            i / c.hidden,
            q[i].to_bits(),
            wq[i].to_bits(),
            plain_out[i]
        );
    }
    match scaling {
        Fp8Scaling::Static => {}
        Fp8Scaling::PerToken | Fp8Scaling::PerGroup => {
            let got = b.sc.to_vec().unwrap();
            if let Some(i) = (0..ws.len()).find(|&i| !same_f32(got[i], ws[i])) {
                panic!("{what}: scales[{i}] = {:?}, host {:?}", got[i], ws[i]);
            }
        }
        Fp8Scaling::PerGroupUe8m0 => {
            let got = b.sc_u.to_vec().unwrap();
            let want = ue8m0_pack(&ws, c.tokens, c.hidden / FP8_GROUP);
            // the words of the alignment's tokens are not written
            let stride = c.tokens.next_multiple_of(4);
            if let Some(i) = (0..want.len()).find(|&i| i % stride < c.tokens && got[i] != want[i]) {
                panic!(
                    "{what}: packs[{i}] = {:#010x}, host {:#010x}",
                    got[i], want[i]
                );
            }
        }
    }
}

/// Run the plain fused norm and the FP8 one of `scaling` on `c` over every rank of `comm`
/// (`fused`; else the local norms of each rank's own x), verify every rank; the FP8 call's
/// choice.
#[allow(clippy::too_many_arguments)]
fn run_case<T: Element>(
    comm: &Communicator,
    s: &[Stream],
    c: &Case<T>,
    scaling: Fp8Scaling,
    unq: bool,
    fused: bool,
    what: &str,
) -> Choice {
    let n = s.len();
    let len = scaling.scales_len(c.tokens, c.hidden);
    let mut plain: Vec<Bufs<T>> = (0..n).map(|r| Bufs::new(comm, r, c, scaling)).collect();
    let mut fp8: Vec<Bufs<T>> = (0..n).map(|r| Bufs::new(comm, r, c, scaling)).collect();
    for r in 0..n {
        let h = comm.rank(r).unwrap();
        let p = &mut plain[r];
        if fused {
            h.all_reduce_add_rms_norm(&p.x, &mut p.res, &p.w, &mut p.out, c.hidden, EPS, &s[r])
                .unwrap();
        } else {
            h.add_rms_norm(&p.x, &mut p.res, &p.w, &mut p.out, c.hidden, EPS, &s[r])
                .unwrap();
        }
    }
    let mut choice = None;
    for r in 0..n {
        let h = comm.rank(r).unwrap();
        let b = &mut fp8[r];
        let (x, w) = (
            &b.x as *const DeviceBuffer<T>,
            &b.w as *const DeviceBuffer<T>,
        );
        // SAFETY: x and w are read-only fields of `b`, disjoint from the fields the spec
        // borrows mutably (the borrow checker cannot split a method's borrow of `b`).
        let (x, w) = unsafe { (&*x, &*w) };
        let res = &mut b.res as *mut DeviceBuffer<T>;
        // SAFETY: as above: residual is not part of the spec.
        let res = unsafe { &mut *res };
        let spec = b.spec(scaling, len, unq);
        if fused {
            choice = Some(
                h.all_reduce_add_rms_norm_fp8(x, res, w, spec, c.hidden, EPS, &s[r])
                    .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}")),
            );
        } else {
            h.add_rms_norm_fp8(x, res, w, spec, c.hidden, EPS, &s[r])
                .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        }
    }
    sync_all(s);
    comm.check().unwrap();
    let q0 = fp8[0].q.to_vec().unwrap();
    for r in 0..n {
        let pr = plain[r].res.to_vec().unwrap();
        let po = plain[r].out.to_vec().unwrap();
        verify(
            &format!("{what}, rank {r}"),
            c,
            scaling,
            &pr,
            &po,
            &fp8[r],
            unq,
            fused && r == 0,
        );
        if fused {
            let q = fp8[r].q.to_vec().unwrap();
            assert!(
                q.iter().zip(&q0).all(|(a, b)| same_q(*a, *b)),
                "{what}: rank {r}'s e4m3 rows differ from rank 0's"
            );
        }
    }
    choice.unwrap_or_else(|| {
        comm.add_rms_norm_choice(T::DTYPE, c.tokens, c.hidden)
            .unwrap()
    })
}

/// Every scaling, with and without the unquantised rows, on `comm`.
fn every_scaling<T: Element>(
    comm: &Communicator,
    s: &[Stream],
    tokens: usize,
    hidden: usize,
    seed: u64,
    what: &str,
) {
    let c = Case::<T>::new(s.len(), tokens, hidden, seed);
    for scaling in Fp8Scaling::ALL {
        if scaling.grouped() && hidden % FP8_GROUP != 0 {
            continue;
        }
        for unq in [false, true] {
            let what = format!(
                "{what}, {tokens} x {hidden} {:?}, {scaling:?}, unquantised {unq}",
                T::DTYPE
            );
            let ch = run_case(comm, s, &c, scaling, unq, true, &what);
            assert!(
                matches!(
                    ch.algorithm,
                    Algorithm::NormOneShot
                        | Algorithm::NormOneShotLl
                        | Algorithm::NormOneShotSplit
                        | Algorithm::NormOneShotLlSplit
                ),
                "{what}: ran {:?}",
                ch.algorithm
            );
            let asked = comm
                .add_rms_norm_fp8_choice(T::DTYPE, tokens, hidden, scaling)
                .unwrap();
            assert_eq!(asked, ch, "{what}: the choice differs from what ran");
        }
    }
}

#[test]
fn fp8_outputs_are_the_host_quantisation_of_the_plain_norm_for_teams_of_2_to_8() {
    for (n, tokens, hidden) in [
        (2usize, 3usize, 1024usize),
        (3, 1, 256),
        (4, 5, 384),
        (8, 2, 128),
    ] {
        let (_e, comm, s) = team(n, CommConfig::default());
        let what = format!("{n} ranks");
        every_scaling::<bf16>(&comm, &s, tokens, hidden, 11 + n as u64, &what);
    }
}

#[test]
fn fp8_outputs_of_every_type_in_both_one_shot_forms() {
    for alg in [None, Some(Algorithm::OneShot), Some(Algorithm::OneShotLl)] {
        let (_e, comm, s) = team(2, forced(alg));
        let what = format!("2 ranks, {alg:?}");
        every_scaling::<f32>(&comm, &s, 4, 256, 3, &what);
        every_scaling::<f16>(&comm, &s, 4, 256, 4, &what);
        every_scaling::<bf16>(&comm, &s, 2, 8192, 5, &what);
        // element units: rows not a whole number of 16-byte vectors
        every_scaling::<bf16>(&comm, &s, 3, 100, 6, &what);
    }
}

/// Where the plain norm runs the two-shot (teams above 3, above the one-shot limit), the FP8
/// call runs the barrier one-shot (in several launches when the staging is smaller than the
/// call: the scales of every launch's rows land at their rows); where it runs a split form, the
/// FP8 call runs the same split form.
#[test]
fn fp8_calls_run_the_one_shot_where_the_plain_norm_runs_two_shot_and_split_where_it_splits() {
    {
        let (_e, comm, s) = team_distinct(
            4,
            CommConfig {
                one_shot_max_bytes: Some(4096),
                norm_ll_max_bytes: 0,
                stage_bytes: Some(64 << 10),
                ..Default::default()
            },
        );
        let (t, h) = (40, 512);
        assert_eq!(
            comm.add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, t, h)
                .unwrap()
                .algorithm,
            Algorithm::NormTwoShot
        );
        let c = Case::<bf16>::new(4, t, h, 9);
        for scaling in Fp8Scaling::ALL {
            let ch = run_case(&comm, &s, &c, scaling, true, true, &format!("{scaling:?}"));
            assert_eq!(ch.algorithm, Algorithm::NormOneShot);
        }
    }
    // a split row (8192 bf16 = 16 KiB, 2 tokens) runs split, in both one-shot forms
    for (alg, want) in [
        (Algorithm::OneShot, Algorithm::NormOneShotSplit),
        (Algorithm::OneShotLl, Algorithm::NormOneShotLlSplit),
    ] {
        let (_e, comm, _s) = team_distinct(2, forced(Some(alg)));
        assert_eq!(
            comm.add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, 2, 8192)
                .unwrap()
                .algorithm,
            want
        );
        for scaling in Fp8Scaling::ALL {
            let plain = comm
                .add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, 2, 8192)
                .unwrap();
            let ch = comm
                .add_rms_norm_fp8_choice(cuda_multimem_collectives::DType::Bf16, 2, 8192, scaling)
                .unwrap();
            assert_eq!(ch, plain, "{alg:?}, {scaling:?}");
        }
    }
}

/// The split FP8 entries (`OneShotLlSplit`, `OneShotSplit`: a row cut over a cluster of 8
/// blocks, the amax of the row or of the groups at the slices' edges exchanged over the
/// cluster) at 2 to 8 ranks, every scaling with and without the unquantised rows: the host
/// quantisation of the plain (split) norm bit for bit. The shapes cut groups of 128 across
/// slices (hidden 2176 bf16: slices of 640 bytes, 2.5 groups, the last slice empty; 1152 f32:
/// slices of 640 bytes, 1.25 groups, the last 128 bytes), and the clean 8192 of the issue's
/// target (1 and 16 tokens), each asserted to run the split form.
#[test]
fn fp8_split_forms_are_the_host_quantisation_of_the_plain_split_norm() {
    for (alg, want) in [
        (Algorithm::OneShotLl, Algorithm::NormOneShotLlSplit),
        (Algorithm::OneShot, Algorithm::NormOneShotSplit),
    ] {
        for n in [2usize, 3, 5, 8] {
            let (e, comm, s) = team(n, forced(Some(alg)));
            let what = format!("{n} ranks, {alg:?}");
            // ranks sharing a GPU (test-hw on fewer than n GPUs) share its clusters: there the
            // planner may not split, and whatever runs is checked the same way
            let own_devices = e.driver.is_simulated() || e.driver.devices().len() >= n;
            let shapes: &[(usize, usize)] = if n == 2 {
                &[(1, 8192), (16, 8192), (3, 2176)]
            } else {
                &[(2, 2176), (1, 8192)]
            };
            for &(t, h) in shapes {
                let plain = comm
                    .add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, t, h)
                    .unwrap();
                if own_devices {
                    assert_eq!(plain.algorithm, want, "{what}: {t} x {h} does not split");
                }
                every_scaling::<bf16>(&comm, &s, t, h, 21 + n as u64, &what);
            }
            if n <= 3 {
                every_scaling::<f32>(&comm, &s, 2, 1152, 31 + n as u64, &what);
                every_scaling::<f16>(&comm, &s, 2, 2048, 41 + n as u64, &what);
                let ch = comm
                    .add_rms_norm_fp8_choice(
                        cuda_multimem_collectives::DType::F32,
                        2,
                        1152,
                        Fp8Scaling::PerGroup,
                    )
                    .unwrap();
                if own_devices {
                    assert_eq!(ch.algorithm, want, "{what}: 2 x 1152 f32");
                }
            }
        }
    }
}

/// Hostile rows in the split forms, placed where a group of 128 straddles two slices (hidden
/// 2176 bf16: group 2 is elements 256..384, slice 0 ends at element 320): a NaN, an infinity
/// from the weight and the row's largest value only in the second slice's part of the group
/// must reach the scale the first slice writes and the values the first slice quantises.
#[test]
fn hostile_rows_across_split_slices_give_the_documented_fp8_results() {
    for alg in [Algorithm::OneShotLl, Algorithm::OneShot] {
        let (_e, comm, s) = team(2, forced(Some(alg)));
        let (t, h) = (4usize, 2176usize);
        let mut c = Case::<bf16>::new(2, t, h, 15);
        // row 0: zeros; row 1: a NaN in slice 1's part of group 2; row 2: a spike there;
        // row 3: a spike in slice 0's part of group 2
        for v in c.xs.iter_mut() {
            v[..h].iter_mut().for_each(|x| *x = bf16::from_f32(0.0));
        }
        c.r[..h].iter_mut().for_each(|x| *x = bf16::from_f32(0.0));
        c.xs[1][h + 330] = bf16::NAN;
        c.xs[0][2 * h + 333] = bf16::from_f32(3e4);
        c.xs[0][3 * h + 300] = bf16::from_f32(3e4);
        let ch = comm
            .add_rms_norm_fp8_choice(
                cuda_multimem_collectives::DType::Bf16,
                t,
                h,
                Fp8Scaling::PerGroup,
            )
            .unwrap();
        assert!(
            matches!(
                ch.algorithm,
                Algorithm::NormOneShotSplit | Algorithm::NormOneShotLlSplit
            ),
            "{alg:?}: ran {:?}",
            ch.algorithm
        );
        fused_in_every_scaling(&comm, &s, &c, true, &format!("split hostile rows, {alg:?}"));
        // a weight that overflows in slice 1's part of group 2: y = ±inf there
        let mut c = Case::<bf16>::new(2, 2, h, 18);
        c.gamma[330] = bf16::MAX;
        c.gamma[331] = bf16::MAX;
        let what = format!("split overflowing weight, {alg:?}");
        fused_in_every_scaling(&comm, &s, &c, false, &what);
    }
}

#[test]
fn ranks_sharing_one_device_run_every_fp8_variant() {
    for n in [2usize, 3, 5] {
        let (_e, comm, s) = shared_team(n);
        every_scaling::<bf16>(
            &comm,
            &s,
            4,
            1024,
            40 + n as u64,
            &format!("{n} ranks on one device"),
        );
    }
}

#[test]
fn the_local_fp8_norm_is_the_host_quantisation_of_the_local_norm() {
    let (_e, comm, s) = team(2, CommConfig::default());
    for (t, h) in [(3usize, 1024usize), (70, 256), (2, 8192), (5, 100)] {
        let c = Case::<bf16>::new(2, t, h, t as u64 * 31 + h as u64);
        for scaling in Fp8Scaling::ALL {
            if scaling.grouped() && h % FP8_GROUP != 0 {
                continue;
            }
            for unq in [false, true] {
                run_case(
                    &comm,
                    &s,
                    &c,
                    scaling,
                    unq,
                    false,
                    &format!("local {t} x {h} {scaling:?} {unq}"),
                );
            }
        }
    }
    let c = Case::<f32>::new(2, 3, 512, 77);
    for scaling in Fp8Scaling::ALL {
        run_case(
            &comm,
            &s,
            &c,
            scaling,
            true,
            false,
            &format!("local f32 {scaling:?}"),
        );
    }
}

/// All-zero rows (scale 1, every element 0), a NaN in a row (its scale and every element NaN
/// for the dynamic scalings; only that element for the static one), a weight that overflows
/// bf16 (±∞ in y: saturated to ±448 statically, NaN scales dynamically), and values far beyond
/// 448 · scale (saturated): the host quantisation of the plain norm's output.
#[test]
fn hostile_rows_give_the_documented_fp8_results() {
    let (_e, comm, s) = team(2, CommConfig::default());
    let (t, h) = (4usize, 256usize);
    let mut c = Case::<bf16>::new(2, t, h, 5);
    // row 0: zeros; row 1: a NaN; row 2: large values
    for v in c.xs.iter_mut() {
        v[..h].iter_mut().for_each(|x| *x = bf16::from_f32(0.0));
    }
    c.r[..h].iter_mut().for_each(|x| *x = bf16::from_f32(0.0));
    c.xs[0][h + 7] = bf16::NAN;
    c.xs[1][h + 9] = bf16::NAN;
    for v in c.xs.iter_mut() {
        v[2 * h..3 * h]
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(x.to_f32() * 3e4));
    }
    for scaling in Fp8Scaling::ALL {
        for fused in [true, false] {
            run_case(
                &comm,
                &s,
                &c,
                scaling,
                true,
                fused,
                &format!("hostile rows, {scaling:?}, fused {fused}"),
            );
        }
    }
    // the zero row's scales are 1 and its values 0
    let mut b = Bufs::new(&comm, 0, &c, Fp8Scaling::PerToken);
    let h0 = comm.rank(0).unwrap();
    let spec_len = Fp8Scaling::PerToken.scales_len(t, h);
    let (x, w) = (
        &b.x as *const DeviceBuffer<bf16>,
        &b.w as *const DeviceBuffer<bf16>,
    );
    let res = &mut b.res as *mut DeviceBuffer<bf16>;
    // SAFETY: fields the spec does not borrow.
    let (x, w, res) = unsafe { (&*x, &*w, &mut *res) };
    h0.add_rms_norm_fp8(
        x,
        res,
        w,
        b.spec(Fp8Scaling::PerToken, spec_len, false),
        h,
        EPS,
        &s[0],
    )
    .unwrap();
    s[0].synchronize().unwrap();
    let sc = b.sc.to_vec().unwrap();
    assert_eq!(sc[0], 1.0);
    assert!(sc[1].is_nan());
    let q = b.q.to_vec().unwrap();
    assert!(q[..h].iter().all(|v| v.to_bits() & 0x7f == 0));
    assert!(q[h..2 * h].iter().all(|v| v.to_bits() & 0x7f == 0x7f));
    // a weight that overflows: y = ±inf
    let mut c = Case::<bf16>::new(2, 2, 128, 8);
    c.gamma[3] = bf16::MAX;
    c.gamma[4] = bf16::MAX;
    fused_in_every_scaling(&comm, &s, &c, false, "overflowing weight");
}

/// The fused FP8 call on `c` in every scaling over `comm` ([`run_case`]; the unquantised rows
/// when `unq`).
fn fused_in_every_scaling<T: Element>(
    comm: &Communicator,
    s: &[Stream],
    c: &Case<T>,
    unq: bool,
    what: &str,
) {
    for scaling in Fp8Scaling::ALL {
        run_case(
            comm,
            s,
            c,
            scaling,
            unq,
            true,
            &format!("{what}, {scaling:?}"),
        );
    }
}

#[test]
fn a_captured_graph_replays_the_fp8_norm() {
    for alg in [Algorithm::OneShot, Algorithm::OneShotLl] {
        let (_e, comm, s) = team(2, forced(Some(alg)));
        let (t, h) = (6usize, 512usize);
        for scaling in [Fp8Scaling::PerToken, Fp8Scaling::PerGroupUe8m0] {
            let len = scaling.scales_len(t, h);
            let c0 = Case::<bf16>::new(2, t, h, 1);
            let mut plain: Vec<Bufs<bf16>> =
                (0..2).map(|r| Bufs::new(&comm, r, &c0, scaling)).collect();
            let mut fp8: Vec<Bufs<bf16>> =
                (0..2).map(|r| Bufs::new(&comm, r, &c0, scaling)).collect();
            let mut execs = Vec::new();
            for r in 0..2 {
                let st = s[r].as_stream_ref();
                st.begin_capture(CaptureMode::Global).unwrap();
                let b = &mut fp8[r];
                let (x, w) = (
                    &b.x as *const DeviceBuffer<bf16>,
                    &b.w as *const DeviceBuffer<bf16>,
                );
                let res = &mut b.res as *mut DeviceBuffer<bf16>;
                // SAFETY: fields the spec does not borrow.
                let (x, w, res) = unsafe { (&*x, &*w, &mut *res) };
                comm.rank(r)
                    .unwrap()
                    .all_reduce_add_rms_norm_fp8(
                        x,
                        res,
                        w,
                        b.spec(scaling, len, true),
                        h,
                        EPS,
                        &s[r],
                    )
                    .unwrap();
                let g = st.end_capture().unwrap();
                // SAFETY: the buffers, team and streams outlive `execs` (dropped below, after
                // the streams are synchronised).
                execs.push(unsafe { g.instantiate() }.unwrap());
            }
            for replay in 0..3u64 {
                let c = Case::<bf16>::new(2, t, h, 100 + replay);
                for r in 0..2 {
                    for b in [&mut plain[r], &mut fp8[r]] {
                        b.x.copy_from_host(0, &c.xs[r]).unwrap();
                        b.res.copy_from_host(0, &c.r).unwrap();
                        b.w.copy_from_host(0, &c.gamma).unwrap();
                    }
                }
                for r in 0..2 {
                    let p = &mut plain[r];
                    comm.rank(r)
                        .unwrap()
                        .all_reduce_add_rms_norm(&p.x, &mut p.res, &p.w, &mut p.out, h, EPS, &s[r])
                        .unwrap();
                }
                for (x, st) in execs.iter().zip(&s) {
                    x.launch(st).unwrap();
                }
                sync_all(&s);
                comm.check().unwrap();
                for r in 0..2 {
                    let pr = plain[r].res.to_vec().unwrap();
                    let po = plain[r].out.to_vec().unwrap();
                    verify(
                        &format!("{alg}, {scaling:?}, replay {replay}, rank {r}"),
                        &c,
                        scaling,
                        &pr,
                        &po,
                        &fp8[r],
                        true,
                        false,
                    );
                }
            }
            sync_all(&s);
            drop(execs);
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
fn bad_fp8_arguments_are_refused_naming_the_argument() {
    let (_e, comm, s) = team(2, CommConfig::default());
    let h0 = comm.rank(0).unwrap();
    let d = comm.device(0).unwrap();
    let (t, h) = (4usize, 256usize);
    let x = DeviceBuffer::<bf16>::zeroed(d, t * h).unwrap();
    let mut res = DeviceBuffer::<bf16>::zeroed(d, t * h).unwrap();
    let g = DeviceBuffer::<bf16>::zeroed(d, h).unwrap();
    let mut q = DeviceBuffer::<F8E4M3>::zeroed(d, t * h).unwrap();
    let mut qs = DeviceBuffer::<F8E4M3>::zeroed(d, t * h - 1).unwrap();
    let mut sc = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let mut su = DeviceBuffer::<u32>::zeroed(d, 64).unwrap();
    let mut unq_short = DeviceBuffer::<bf16>::zeroed(d, t * h - 2).unwrap();
    let f = |e: Result<Choice, Error>| invalid_arg(e.unwrap_err());
    // static scales: zero, negative, NaN, infinite
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert_eq!(
            f(h0.all_reduce_add_rms_norm_fp8(
                &x,
                &mut res,
                &g,
                Fp8Out::static_scale(&mut q, bad),
                h,
                EPS,
                &s[0]
            )),
            "scale"
        );
        assert_eq!(
            invalid_arg(
                h0.add_rms_norm_fp8(
                    &x,
                    &mut res,
                    &g,
                    Fp8Out::static_scale(&mut q, bad),
                    h,
                    EPS,
                    &s[0]
                )
                .unwrap_err()
            ),
            "scale"
        );
    }
    // scales of the wrong length, for every dynamic scaling
    let sub =
        |b: &mut DeviceBuffer<f32>, n: usize| unsafe { Dst::<f32>::from_raw(b.device_ptr(), n) };
    let subu =
        |b: &mut DeviceBuffer<u32>, n: usize| unsafe { Dst::<u32>::from_raw(b.device_ptr(), n) };
    for n in [t - 1, t + 1] {
        assert_eq!(
            f(h0.all_reduce_add_rms_norm_fp8(
                &x,
                &mut res,
                &g,
                Fp8Out::per_token(&mut q, sub(&mut sc, n)),
                h,
                EPS,
                &s[0]
            )),
            "scales"
        );
    }
    for n in [t * 2 - 1, t * 2 + 1, t] {
        assert_eq!(
            f(h0.all_reduce_add_rms_norm_fp8(
                &x,
                &mut res,
                &g,
                Fp8Out::per_group(&mut q, sub(&mut sc, n)),
                h,
                EPS,
                &s[0]
            )),
            "scales"
        );
    }
    // packs: ceil(2 / 4) = 1 × align(4, 4) = 4 words
    for n in [3, 5, 8] {
        assert_eq!(
            f(h0.all_reduce_add_rms_norm_fp8(
                &x,
                &mut res,
                &g,
                Fp8Out::per_group_ue8m0(&mut q, subu(&mut su, n)),
                h,
                EPS,
                &s[0]
            )),
            "scales"
        );
    }
    // hidden not a multiple of the group (x of 4 × 256 = 8 rows of 128... use 5 rows of 200)
    let x2 = DeviceBuffer::<bf16>::zeroed(d, 5 * 200).unwrap();
    let mut r2 = DeviceBuffer::<bf16>::zeroed(d, 5 * 200).unwrap();
    let g2 = DeviceBuffer::<bf16>::zeroed(d, 200).unwrap();
    let mut q2 = DeviceBuffer::<F8E4M3>::zeroed(d, 5 * 200).unwrap();
    assert_eq!(
        f(h0.all_reduce_add_rms_norm_fp8(
            &x2,
            &mut r2,
            &g2,
            Fp8Out::per_group(&mut q2, sub(&mut sc, 5)),
            200,
            EPS,
            &s[0]
        )),
        "hidden"
    );
    // the e4m3 rows and the unquantised rows of the wrong length
    assert_eq!(
        f(h0.all_reduce_add_rms_norm_fp8(
            &x,
            &mut res,
            &g,
            Fp8Out::static_scale(&mut qs, 1.0),
            h,
            EPS,
            &s[0]
        )),
        "out"
    );
    assert_eq!(
        f(h0.all_reduce_add_rms_norm_fp8(
            &x,
            &mut res,
            &g,
            Fp8Out::static_scale(&mut q, 1.0).with_unquantised(&mut unq_short),
            h,
            EPS,
            &s[0]
        )),
        "unquantised"
    );
    // overlaps: the scales inside the residual, the unquantised rows over the residual
    let rp = res.device_ptr();
    // SAFETY: never written: the call is refused before any launch.
    let inside = unsafe { Dst::<f32>::from_raw(rp, t) };
    assert_eq!(
        f(h0.all_reduce_add_rms_norm_fp8(
            &x,
            &mut res,
            &g,
            Fp8Out::per_token(&mut q, inside),
            h,
            EPS,
            &s[0]
        )),
        "scales"
    );
    // SAFETY: as above.
    let over = unsafe { Dst::<bf16>::from_raw(rp, t * h) };
    assert_eq!(
        f(h0.all_reduce_add_rms_norm_fp8(
            &x,
            &mut res,
            &g,
            Fp8Out::static_scale(&mut q, 1.0).with_unquantised(over),
            h,
            EPS,
            &s[0]
        )),
        "unquantised"
    );
    // a 2-byte aligned x (element-aligned for bf16, not 4-byte)
    let big = DeviceBuffer::<bf16>::zeroed(d, t * h + 1).unwrap();
    // SAFETY: inside `big`, read only.
    let odd =
        unsafe { cuda_multimem_collectives::Src::<bf16>::from_raw(big.device_ptr() + 2, t * h) };
    assert_eq!(
        f(h0.all_reduce_add_rms_norm_fp8(
            odd,
            &mut res,
            &g,
            Fp8Out::static_scale(&mut q, 1.0),
            h,
            EPS,
            &s[0]
        )),
        "x"
    );
    // nothing was launched: the team is usable and a good call on both ranks runs (the
    // unquantised rows being x itself)
    let c = Case::<bf16>::new(2, t, h, 12);
    let mut bufs: Vec<Bufs<bf16>> = (0..2)
        .map(|r| Bufs::new(&comm, r, &c, Fp8Scaling::PerToken))
        .collect();
    for r in 0..2 {
        let b = &mut bufs[r];
        // SAFETY: x is read, then written with the unquantised rows (the same range: allowed);
        // nothing else uses it meanwhile.
        let xs =
            unsafe { cuda_multimem_collectives::Src::<bf16>::from_raw(b.x.device_ptr(), t * h) };
        let xd = unsafe { Dst::<bf16>::from_raw(b.x.device_ptr(), t * h) };
        comm.rank(r)
            .unwrap()
            .all_reduce_add_rms_norm_fp8(
                xs,
                &mut b.res,
                &b.w,
                Fp8Out::per_token(&mut b.q, &mut b.sc).with_unquantised(xd),
                h,
                EPS,
                &s[r],
            )
            .unwrap();
    }
    sync_all(&s);
    comm.check().unwrap();
}

/// Ranks that ask for different FP8 scalings (or one the plain norm) are reported, not mixed.
#[test]
fn ranks_that_disagree_on_the_fp8_output_are_reported() {
    let (_e, comm, s) = team(2, forced(Some(Algorithm::OneShot)));
    let (t, h) = (2usize, 256usize);
    let mut bufs: Vec<Bufs<bf16>> = (0..2)
        .map(|r| Bufs::new(&comm, r, &Case::new(2, t, h, 3), Fp8Scaling::PerToken))
        .collect();
    for r in 0..2 {
        let b = &mut bufs[r];
        let (x, w) = (
            &b.x as *const DeviceBuffer<bf16>,
            &b.w as *const DeviceBuffer<bf16>,
        );
        let res = &mut b.res as *mut DeviceBuffer<bf16>;
        // SAFETY: fields the spec does not borrow.
        let (x, w, res) = unsafe { (&*x, &*w, &mut *res) };
        let scaling = if r == 0 {
            Fp8Scaling::PerToken
        } else {
            Fp8Scaling::Static
        };
        let len = scaling.scales_len(t, h);
        comm.rank(r)
            .unwrap()
            .all_reduce_add_rms_norm_fp8(x, res, w, b.spec(scaling, len, false), h, EPS, &s[r])
            .unwrap();
    }
    sync_all(&s);
    assert!(
        matches!(comm.check(), Err(Error::RanksDisagree { .. })),
        "expected a disagreement"
    );
}

/// A team of one: the fused FP8 call is the local FP8 kernel (`Algorithm::Local`).
#[test]
fn a_team_of_one_runs_the_local_fp8_kernel() {
    let (_e, comm, s) = team_distinct(1, CommConfig::default());
    let c = Case::<bf16>::new(1, 3, 256, 21);
    for scaling in Fp8Scaling::ALL {
        let ch = run_case(
            &comm,
            &s,
            &c,
            scaling,
            true,
            true,
            &format!("alone, {scaling:?}"),
        );
        assert_eq!(ch.algorithm, Algorithm::Local);
    }
}

/// Rank `r`'s standalone quantisation of `x` with `scaling` into `b` (q and its scales).
fn quantize_on<T: Element>(
    comm: &Communicator,
    r: usize,
    x: &DeviceBuffer<T>,
    b: &mut Bufs<T>,
    scaling: Fp8Scaling,
    (tokens, hidden): (usize, usize),
    s: &Stream,
) -> Result<(), Error> {
    let sl = scaling.scales_len(tokens, hidden);
    comm.rank(r)
        .unwrap()
        .quantize_fp8(x, b.spec(scaling, sl, false), hidden, s)
}

/// Check the e4m3 rows and scales of `b` against the host quantisation of `rows`.
fn verify_quant<T: Element>(
    what: &str,
    rows: &[T],
    hidden: usize,
    scaling: Fp8Scaling,
    b: &Bufs<T>,
) {
    let tokens = rows.len() / hidden;
    let (wq, ws) = fp8_quantise(rows, hidden, scaling, STATIC);
    let q = b.q.to_vec().unwrap();
    if let Some(i) = (0..q.len()).find(|&i| !same_q(q[i], wq[i])) {
        panic!(
            "{what}: q[{i}] (row {}) = {:#04x}, host quantisation {:#04x} (x = {:?})",
            i / hidden,
            q[i].to_bits(),
            wq[i].to_bits(),
            rows[i]
        );
    }
    match scaling {
        Fp8Scaling::Static => {}
        Fp8Scaling::PerToken | Fp8Scaling::PerGroup => {
            let got = b.sc.to_vec().unwrap();
            if let Some(i) = (0..ws.len()).find(|&i| !same_f32(got[i], ws[i])) {
                panic!("{what}: scales[{i}] = {:?}, host {:?}", got[i], ws[i]);
            }
        }
        Fp8Scaling::PerGroupUe8m0 => {
            let got = b.sc_u.to_vec().unwrap();
            let want = ue8m0_pack(&ws, tokens, hidden / FP8_GROUP);
            let stride = tokens.next_multiple_of(4);
            if let Some(i) = (0..want.len()).find(|&i| i % stride < tokens && got[i] != want[i]) {
                panic!(
                    "{what}: packs[{i}] = {:#010x}, host {:#010x}",
                    got[i], want[i]
                );
            }
        }
    }
}

/// The standalone quantisation on every rank of a team of 2 (its own rows each), every scaling,
/// vector rows and element rows (hidden 100), bf16, f16 and f32; the rows include hostile ones
/// (all zero, a NaN, ±∞, far beyond 448 · scale): bit for bit the host quantisation.
#[test]
fn the_standalone_quantisation_is_the_host_quantisation_of_its_rows() {
    fn case<T: Element>(comm: &Communicator, s: &[Stream], t: usize, h: usize, hostile: bool) {
        for scaling in Fp8Scaling::ALL {
            if scaling.grouped() && h % FP8_GROUP != 0 {
                continue;
            }
            let c = Case::<T>::new(2, t, h, (t * 131 + h) as u64);
            let mut rows: Vec<Vec<T>> = c.xs.clone();
            if hostile && t >= 4 {
                for v in &mut rows {
                    v[..h].iter_mut().for_each(|e| *e = T::from_f32(0.0));
                    v[h + 3] = T::from_f32(f32::NAN);
                    v[2 * h + 1] = T::from_f32(f32::INFINITY);
                    v[3 * h + 2] = T::from_f32(3.0e4);
                }
            }
            let mut bufs: Vec<Bufs<T>> = (0..2).map(|r| Bufs::new(comm, r, &c, scaling)).collect();
            let xs: Vec<DeviceBuffer<T>> = (0..2)
                .map(|r| DeviceBuffer::from_host(comm.device(r).unwrap(), &rows[r]).unwrap())
                .collect();
            for r in 0..2 {
                quantize_on(comm, r, &xs[r], &mut bufs[r], scaling, (t, h), &s[r]).unwrap();
            }
            sync_all(s);
            comm.check().unwrap();
            for r in 0..2 {
                let what = format!("quantize_fp8 {} {t} x {h} {scaling:?} rank {r}", T::DTYPE);
                verify_quant(&what, &rows[r], h, scaling, &bufs[r]);
            }
        }
    }
    let (_e, comm, s) = team(2, CommConfig::default());
    case::<bf16>(&comm, &s, 5, 1024, true);
    case::<bf16>(&comm, &s, 70, 256, false);
    case::<bf16>(&comm, &s, 4, 100, true);
    case::<bf16>(&comm, &s, 2, 8192, false);
    case::<f16>(&comm, &s, 4, 512, true);
    case::<f32>(&comm, &s, 4, 384, true);
    case::<f32>(&comm, &s, 3, 100, false);
}

#[test]
fn bad_quantisation_arguments_are_refused_naming_the_argument() {
    let (_e, comm, s) = team(2, CommConfig::default());
    let h0 = comm.rank(0).unwrap();
    let d = comm.device(0).unwrap();
    let (t, h) = (4usize, 256usize);
    let x = DeviceBuffer::<bf16>::zeroed(d, t * h).unwrap();
    let mut q = DeviceBuffer::<F8E4M3>::zeroed(d, t * h).unwrap();
    let mut qs = DeviceBuffer::<F8E4M3>::zeroed(d, t * h - 1).unwrap();
    let sc = DeviceBuffer::<f32>::zeroed(d, 64).unwrap();
    let mut unq = DeviceBuffer::<bf16>::zeroed(d, t * h).unwrap();
    let f = |e: Result<(), Error>| invalid_arg(e.unwrap_err());
    // SAFETY: prefixes of live buffers of device 0, used by the calls only.
    let scales = |n: usize| unsafe { Dst::<f32>::from_raw(sc.device_ptr(), n) };
    assert_eq!(
        f(h0.quantize_fp8(
            &x,
            Fp8Out::per_token(&mut q, scales(t)).with_unquantised(&mut unq),
            h,
            &s[0]
        )),
        "out"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::per_token(&mut q, scales(t + 1)), h, &s[0])),
        "scales"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::per_token(&mut qs, scales(t)), h, &s[0])),
        "out"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::static_scale(&mut q, 0.0), h, &s[0])),
        "scale"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::static_scale(&mut q, f32::NAN), h, &s[0])),
        "scale"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::per_group(&mut q, scales(t * 4)), 64, &s[0])),
        "hidden"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::static_scale(&mut q, 1.0), 300, &s[0])),
        "x"
    );
    assert_eq!(
        f(h0.quantize_fp8(&x, Fp8Out::static_scale(&mut q, 1.0), 0, &s[0])),
        "hidden"
    );
    // nothing was launched: q still zero
    sync_all(&s);
    assert!(q.to_vec().unwrap().iter().all(|v| v.to_bits() == 0));
}
