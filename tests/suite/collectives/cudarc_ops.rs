//! Operands and streams of other libraries through the one mechanism every collective takes
//! (`IntoSrc`, `IntoDst`, `IntoStream`): what an operand keeps alive for a call — cudarc's
//! guard, an engine's own — is held until the call has queued all its work, for every
//! collective of the table, the `_dyn` forms and the local norm (on the simulator, with guards
//! of our own: cudarc cannot run there). And the caller's own memory as cudarc holds it:
//! `CudaSlice`s and views on cudarc streams through every collective (`all_reduce_cudarc` too:
//! every dtype and op, in place and out of place, one-shot and staged), against the host
//! reference, and the refusals of cudarc operands that cannot be used. cudarc talks to the real
//! driver only, so those run in `test-hw` and are skipped, saying so, on the simulator.

use std::sync::Mutex;

use cuda_multimem::{DeviceBuffer, Error};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, random_bytes, random_input, reference, reference_bytes,
};
use cuda_multimem_collectives::{
    bf16, f16, CommConfig, Communicator, DType, Dst, Element, MulticastPolicy, Operands, ReduceOp,
    Src,
};
use cuda_multimem_sim::Simulator;
use cuda_multimem_tests::collectives::{calls, Mem, Queued};
use cuda_multimem_tests::{env, sim_team, skip, Rng};
use cudarc::driver::{CudaContext, CudaStream, DeviceRepr as CudarcRepr, ValidAsZeroBits};

// ---- what an operand keeps alive, on the simulator ----

/// The simulator's count of the calls that queue work on a stream.
fn queued(sim: &Simulator) -> u64 {
    [
        "cuLaunchKernel",
        "cuMemcpyDtoDAsync",
        "cuMemcpyBatchAsync",
        "cuMemsetD8Async",
    ]
    .iter()
    .map(|s| sim.calls(s))
    .sum()
}

/// A guard an operand holds for a call (`Src::hold` / `Dst::hold`): when dropped, it notes
/// its argument and how much work had been queued by then.
struct Probe<'a> {
    sim: &'a Simulator,
    name: &'static str,
    seen: &'a Mutex<Vec<(&'static str, u64)>>,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        let at = queued(self.sim);
        self.seen.lock().unwrap().push((self.name, at));
    }
}

/// Run `call` (one rank's call, its operands holding probes made by the function it is given)
/// and check that every one of the `operands` probes was dropped by the time the call
/// returned, and only once the call had queued all its work.
fn holds_until_queued(
    sim: &Simulator,
    what: &str,
    operands: usize,
    call: impl for<'p> FnOnce(&'p dyn Fn(&'static str) -> Probe<'p>),
) {
    let seen = Mutex::new(Vec::new());
    let before = queued(sim);
    call(&|name| Probe {
        sim,
        name,
        seen: &seen,
    });
    let after = queued(sim);
    let seen = seen.into_inner().unwrap();
    assert!(after > before, "{what}: the call queued no work");
    assert_eq!(
        seen.len(),
        operands,
        "{what}: every operand's guard is dropped when the call returns: {seen:?}"
    );
    for (name, at) in seen {
        assert_eq!(
            at,
            after,
            "{what}: {name}'s guard was dropped before the call had queued all its work ({} of {} calls queued)",
            at - before,
            after - before
        );
    }
}

#[test]
fn every_collective_holds_what_its_operands_keep_until_its_work_is_queued() {
    let (e, comm, streams) = sim_team(2, CommConfig::default());
    let sim = e.sim.as_ref().expect("a simulated team");
    let mut rng = Rng::new(41);
    for call in calls(2) {
        let coll = call.at::<f32>();
        let sides = (coll.sides)(1000, &call.params).len();
        for mem in Mem::KINDS {
            for in_place in [false, true] {
                let mut q = Queued::<f32>::new(&comm, coll, 1000, call.params, mem, in_place);
                q.fill(&mut rng);
                let operands = sides + if in_place { 1 } else { 2 };
                for (r, st) in streams.iter().enumerate() {
                    let what = format!("{}, rank {r}", q.what());
                    holds_until_queued(sim, &what, operands, |probe| {
                        q.call_holding(&comm, r, st, probe)
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                    });
                }
                for st in &streams {
                    st.synchronize().unwrap();
                }
                comm.check().unwrap();
                q.check();
            }
        }
    }
}

#[test]
fn the_dyn_forms_and_the_local_norm_hold_what_their_operands_keep_until_their_work_is_queued() {
    let (e, comm, streams) = sim_team(2, CommConfig::default());
    let sim = e.sim.as_ref().expect("a simulated team");
    let devices: Vec<_> = (0..2).map(|r| comm.device(r).unwrap().clone()).collect();
    let mut seed = 43;
    let count = 1000;
    let bytes: Vec<Vec<u8>> = (0..2)
        .map(|_| random_bytes(DType::Bf16, count, &mut seed))
        .collect();
    let refs: Vec<&[u8]> = bytes.iter().map(|v| &v[..]).collect();
    let want = reference_bytes(DType::Bf16, ReduceOp::Sum, &refs);
    let ins: Vec<DeviceBuffer<u8>> = (0..2)
        .map(|r| DeviceBuffer::from_host(&devices[r], &bytes[r]).unwrap())
        .collect();
    let mut outs: Vec<DeviceBuffer<u8>> = (0..2)
        .map(|r| DeviceBuffer::zeroed(&devices[r], 2 * count).unwrap())
        .collect();
    let mut bufs: Vec<DeviceBuffer<u8>> = (0..2)
        .map(|r| DeviceBuffer::from_host(&devices[r], &bytes[r]).unwrap())
        .collect();
    for r in 0..2 {
        let h = comm.rank(r).unwrap();
        let (i, o, b) = (&ins[r], &mut outs[r], &mut bufs[r]);
        holds_until_queued(sim, &format!("all_reduce_dyn, rank {r}"), 2, |probe| {
            let (i, o) = (
                Src::from(i).hold(probe("input")),
                Dst::from(o).hold(probe("output")),
            );
            h.all_reduce_dyn(DType::Bf16, i, o, ReduceOp::Sum, &streams[r])
                .unwrap();
        });
        holds_until_queued(
            sim,
            &format!("all_reduce_dyn_in_place, rank {r}"),
            1,
            |probe| {
                let b = Dst::from(b).hold(probe("buf"));
                h.all_reduce_dyn_in_place(DType::Bf16, b, ReduceOp::Sum, &streams[r])
                    .unwrap();
            },
        );
    }
    for st in &streams {
        st.synchronize().unwrap();
    }
    comm.check().unwrap();
    for r in 0..2 {
        assert_eq!(outs[r].to_vec().unwrap(), want, "all_reduce_dyn, rank {r}");
        assert_eq!(
            bufs[r].to_vec().unwrap(),
            want,
            "all_reduce_dyn_in_place, rank {r}"
        );
    }
    // the local norm, on rank 0 only
    let hidden = 128;
    let x: Vec<bf16> = random_input(4 * hidden, &mut seed);
    let resid: Vec<bf16> = random_input(4 * hidden, &mut seed);
    let gamma: Vec<bf16> = random_input(hidden, &mut seed);
    let (want_res, want_out) = add_rms_norm_reference(&[&x], &resid, &gamma, hidden, 1e-6);
    let xd = DeviceBuffer::from_host(&devices[0], &x).unwrap();
    let mut rd = DeviceBuffer::from_host(&devices[0], &resid).unwrap();
    let wd = DeviceBuffer::from_host(&devices[0], &gamma).unwrap();
    let mut od = DeviceBuffer::<bf16>::zeroed(&devices[0], 4 * hidden).unwrap();
    let h = comm.rank(0).unwrap();
    holds_until_queued(sim, "add_rms_norm", 4, |probe| {
        h.add_rms_norm(
            Src::from(&xd).hold(probe("x")),
            Dst::from(&mut rd).hold(probe("residual")),
            Src::from(&wd).hold(probe("weight")),
            Dst::from(&mut od).hold(probe("out")),
            hidden,
            1e-6,
            &streams[0],
        )
        .unwrap();
    });
    streams[0].synchronize().unwrap();
    assert_eq!(rd.to_vec().unwrap(), want_res);
    let out = od.to_vec().unwrap();
    assert!(
        out.iter()
            .zip(&want_out)
            .all(|(&g, &w)| cuda_multimem_collectives::testing::rms_norm_within_tolerance(g, w)),
        "add_rms_norm's out"
    );
}

// ---- cudarc on the GPUs ----

/// Two GPUs that reach each other on the real driver, or a printed skip.
fn two_gpus(test: &str) -> Option<(cuda_multimem_tests::Env, Vec<cuda_multimem::Device>)> {
    let e = env();
    if e.sim.is_some() || e.driver.is_simulated() {
        skip(
            test,
            "cudarc talks to the real driver only; test-hw runs this on the GPUs",
        );
        return None;
    }
    let devices = e.driver.devices();
    if devices.len() < 2 || !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        skip(test, "needs two GPUs that reach each other");
        return None;
    }
    let two = devices[..2].to_vec();
    Some((e, two))
}

fn every_op<T>(comm: &Communicator, streams: &[std::sync::Arc<cudarc::driver::CudaStream>])
where
    T: Element + Default + CudarcRepr + ValidAsZeroBits,
{
    let n = comm.size();
    let mut seed = 77;
    for op in ReduceOp::ALL {
        // 10 001 elements: one-shot; 3 M + 5: one-shot for 16-bit types (6 MB), staged through
        // the scratch for f32 (12 MB, above the 8 MiB one-shot limit of two ranks)
        for count in [10_001usize, 3_000_005] {
            for in_place in [false, true] {
                let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, &mut seed)).collect();
                let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
                let want = reference(op, &refs);
                let mut outs = Vec::new();
                for (r, s) in streams.iter().enumerate() {
                    let h = comm.rank(r).unwrap();
                    let mut input = s.clone_htod(&inputs[r]).unwrap();
                    if in_place {
                        let c = h.all_reduce_cudarc_in_place(&mut input, op, s).unwrap();
                        let want_chunks = comm
                            .choice(T::DTYPE, op, count, Operands::Local)
                            .unwrap()
                            .staged_chunks;
                        assert_eq!(c.staged_chunks, want_chunks, "{c}");
                        outs.push(input);
                    } else {
                        let mut out = s.alloc_zeros::<T>(count).unwrap();
                        h.all_reduce_cudarc(&input, &mut out, op, s).unwrap();
                        outs.push(out);
                    }
                }
                for s in streams {
                    s.synchronize().unwrap();
                }
                comm.check().unwrap();
                for (r, (s, o)) in streams.iter().zip(&outs).enumerate() {
                    let got = s.clone_dtoh(o).unwrap();
                    let bad = got
                        .iter()
                        .zip(&want)
                        .position(|(g, w)| g.to_f32().to_bits() != w.to_f32().to_bits());
                    assert_eq!(
                        bad,
                        None,
                        "rank {r}, {} {op}, {count} elements, in place {in_place}",
                        T::DTYPE
                    );
                }
            }
        }
    }
}

#[test]
fn cudarc_slices_allreduce_to_the_host_reference_for_every_dtype_and_op() {
    let Some((_e, devices)) = two_gpus("cudarc_slices") else {
        return;
    };
    let comm = cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never).0;
    let streams: Vec<_> = (0..2)
        .map(|r| CudaContext::new(r).unwrap().new_stream().unwrap())
        .collect();
    every_op::<f32>(&comm, &streams);
    every_op::<f16>(&comm, &streams);
    every_op::<bf16>(&comm, &streams);
}

#[test]
fn a_cudarc_stream_of_another_device_is_refused() {
    let Some((_e, devices)) = two_gpus("cudarc_stream_device") else {
        return;
    };
    let comm = cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never).0;
    let s1 = CudaContext::new(1).unwrap().new_stream().unwrap();
    let mut x = s1.alloc_zeros::<f32>(64).unwrap();
    let r = comm
        .rank(0)
        .unwrap()
        .all_reduce_cudarc_in_place(&mut x, ReduceOp::Sum, &s1);
    assert!(
        matches!(r, Err(Error::InvalidArgument { arg: "stream", .. })),
        "{r:?}"
    );
    // the same through the generic method
    let r = comm.rank(0).unwrap().all_gather_in_place(&mut x, &s1);
    assert!(
        matches!(r, Err(Error::InvalidArgument { arg: "stream", .. })),
        "{r:?}"
    );
}

fn cu<T>(r: Result<T, cudarc::driver::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("cudarc: {e:?}"))
}

/// Every rank's `data` on its stream.
fn upload<T: CudarcRepr>(
    streams: &[std::sync::Arc<CudaStream>],
    data: &[Vec<T>],
) -> Vec<cudarc::driver::CudaSlice<T>> {
    streams
        .iter()
        .zip(data)
        .map(|(s, d)| cu(s.clone_htod(d)))
        .collect()
}

/// Every rank's slice, once every stream is idle and the team checked.
fn download<T: CudarcRepr + Default + Clone>(
    comm: &Communicator,
    streams: &[std::sync::Arc<CudaStream>],
    xs: &[cudarc::driver::CudaSlice<T>],
) -> Vec<Vec<T>> {
    for s in streams {
        cu(s.synchronize());
    }
    comm.check().unwrap();
    streams
        .iter()
        .zip(xs)
        .map(|(s, x)| cu(s.clone_dtoh(x)))
        .collect()
}

fn same<T: Element>(what: &str, got: &[Vec<T>], want: &[T]) {
    for (r, g) in got.iter().enumerate() {
        let bad = g
            .iter()
            .zip(want)
            .position(|(a, b)| a.to_f32().to_bits() != b.to_f32().to_bits());
        assert_eq!(bad, None, "{what}: rank {r}");
    }
}

#[test]
fn cudarc_slices_and_views_run_every_collective_to_the_host_reference() {
    let Some((_e, devices)) = two_gpus("cudarc_every_collective") else {
        return;
    };
    let comm = cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never).0;
    let st: Vec<_> = (0..2)
        .map(|r| cu(CudaContext::new(r).unwrap().new_stream()))
        .collect();
    let (n, c) = (2usize, 4099usize);
    let mut seed = 51;
    let mut inputs =
        |len| -> Vec<Vec<bf16>> { (0..n).map(|_| random_input(len, &mut seed)).collect() };
    let h = |r: usize| comm.rank(r).unwrap();

    // reduce-scatter: a slice in, a view out; in place on a slice
    let big = inputs(n * c);
    let refs: Vec<&[bf16]> = big.iter().map(|v| &v[..]).collect();
    let want = cuda_multimem_collectives::testing::reduce_scatter_reference(ReduceOp::Max, &refs);
    let bx = upload(&st, &big);
    let mut out = upload(&st, &vec![vec![bf16::ZERO; c + 3]; n]);
    for r in 0..n {
        h(r).reduce_scatter(&bx[r], out[r].slice_mut(3..3 + c), ReduceOp::Max, &st[r])
            .unwrap();
    }
    let got = download(&comm, &st, &out);
    for r in 0..n {
        same("reduce_scatter", &[got[r][3..].to_vec()], &want[r]);
    }
    let mut bi = upload(&st, &big);
    for r in 0..n {
        h(r).reduce_scatter_in_place(&mut bi[r], ReduceOp::Max, &st[r])
            .unwrap();
    }
    let got = download(&comm, &st, &bi);
    for r in 0..n {
        same(
            "reduce_scatter_in_place",
            &[got[r][r * c..(r + 1) * c].to_vec()],
            &want[r],
        );
    }

    // all-gather: a view in (by value), a slice out; in place on a view of a longer slice
    let parts = inputs(c);
    let all: Vec<bf16> = parts.concat();
    let px = upload(&st, &parts);
    let mut g = upload(&st, &vec![vec![bf16::ZERO; n * c]; n]);
    for r in 0..n {
        h(r).all_gather(px[r].slice(..), &mut g[r], &st[r]).unwrap();
    }
    same("all_gather", &download(&comm, &st, &g), &all);
    let placed: Vec<Vec<bf16>> = (0..n)
        .map(|r| {
            let mut v = vec![bf16::ZERO; n * c + 8];
            v[r * c..(r + 1) * c].copy_from_slice(&parts[r]);
            v
        })
        .collect();
    let mut gi = upload(&st, &placed);
    for r in 0..n {
        h(r).all_gather_in_place(gi[r].slice_mut(..n * c), &st[r])
            .unwrap();
    }
    let got: Vec<Vec<bf16>> = download(&comm, &st, &gi)
        .into_iter()
        .map(|v| v[..n * c].to_vec())
        .collect();
    same("all_gather_in_place", &got, &all);

    // broadcast from the last rank, out of place (a &CudaView in) and in place
    let x = inputs(c);
    let xs = upload(&st, &x);
    let mut ys = upload(&st, &vec![vec![bf16::ZERO; c]; n]);
    for r in 0..n {
        let v = xs[r].slice(..);
        h(r).broadcast(&v, &mut ys[r], n - 1, &st[r]).unwrap();
    }
    same("broadcast", &download(&comm, &st, &ys), &x[n - 1]);
    let mut xi = upload(&st, &x);
    for r in 0..n {
        h(r).broadcast_in_place(&mut xi[r], 0, &st[r]).unwrap();
    }
    same("broadcast_in_place", &download(&comm, &st, &xi), &x[0]);

    // allreduce out of place on a &CudaViewMut input, in place on a &mut CudaViewMut
    let x = inputs(c);
    let refs: Vec<&[bf16]> = x.iter().map(|v| &v[..]).collect();
    let sum = reference(ReduceOp::Sum, &refs);
    let mut xs = upload(&st, &x);
    let mut ys = upload(&st, &vec![vec![bf16::ZERO; c]; n]);
    for r in 0..n {
        let v = xs[r].slice_mut(..);
        h(r).all_reduce(&v, &mut ys[r], ReduceOp::Sum, &st[r])
            .unwrap();
    }
    same("all_reduce", &download(&comm, &st, &ys), &sum);
    for r in 0..n {
        let mut v = xs[r].slice_mut(..);
        h(r).all_reduce_in_place(&mut v, ReduceOp::Sum, &st[r])
            .unwrap();
    }
    same("all_reduce_in_place", &download(&comm, &st, &xs), &sum);

    // the fused norm and the local norm
    let hidden = 256;
    let x = inputs(8 * hidden);
    let resid: Vec<bf16> = random_input(8 * hidden, &mut 52);
    let gamma: Vec<bf16> = random_input(hidden, &mut 53);
    let refs: Vec<&[bf16]> = x.iter().map(|v| &v[..]).collect();
    let (want_res, want_out) = add_rms_norm_reference(&refs, &resid, &gamma, hidden, 1e-6);
    let xs = upload(&st, &x);
    let mut rs = upload(&st, &vec![resid.clone(); n]);
    let ws = upload(&st, &vec![gamma.clone(); n]);
    let mut os = upload(&st, &vec![vec![bf16::ZERO; 8 * hidden]; n]);
    for r in 0..n {
        h(r).all_reduce_add_rms_norm(&xs[r], &mut rs[r], &ws[r], &mut os[r], hidden, 1e-6, &st[r])
            .unwrap();
    }
    same(
        "all_reduce_add_rms_norm residual",
        &download(&comm, &st, &rs),
        &want_res,
    );
    let norm_ok = |got: Vec<Vec<bf16>>, want: &[bf16]| {
        got.iter().all(|g| {
            g.iter()
                .zip(want)
                .all(|(&a, &b)| cuda_multimem_collectives::testing::rms_norm_within_tolerance(a, b))
        })
    };
    assert!(
        norm_ok(download(&comm, &st, &os), &want_out),
        "all_reduce_add_rms_norm out"
    );
    let (want_res, want_out) = add_rms_norm_reference(&[&x[0]], &resid, &gamma, hidden, 1e-6);
    let mut rs = upload(&st, &vec![resid.clone(); n]);
    h(0).add_rms_norm(&xs[0], &mut rs[0], &ws[0], &mut os[0], hidden, 1e-6, &st[0])
        .unwrap();
    same(
        "add_rms_norm residual",
        &download(&comm, &st, &rs)[..1],
        &want_res,
    );
    assert!(
        norm_ok(download(&comm, &st, &os)[..1].to_vec(), &want_out),
        "add_rms_norm out"
    );

    // a run-time element type on byte slices, out of place and in place
    let bytes: Vec<Vec<u8>> = (0..n)
        .map(|_| random_bytes(DType::F16, c, &mut seed))
        .collect();
    let refs: Vec<&[u8]> = bytes.iter().map(|v| &v[..]).collect();
    let want = reference_bytes(DType::F16, ReduceOp::Min, &refs);
    let bs = upload(&st, &bytes);
    let mut os = upload(&st, &vec![vec![0u8; 2 * c]; n]);
    for r in 0..n {
        h(r).all_reduce_dyn(DType::F16, &bs[r], &mut os[r], ReduceOp::Min, &st[r])
            .unwrap();
    }
    assert_eq!(
        download(&comm, &st, &os),
        vec![want.clone(); n],
        "all_reduce_dyn"
    );
    let mut bi = upload(&st, &bytes);
    for r in 0..n {
        h(r).all_reduce_dyn_in_place(DType::F16, &mut bi[r], ReduceOp::Min, &st[r])
            .unwrap();
    }
    assert_eq!(
        download(&comm, &st, &bi),
        vec![want; n],
        "all_reduce_dyn_in_place"
    );
}

#[test]
fn a_cudarc_operand_with_a_stream_that_is_not_cudarcs_is_refused_naming_it() {
    let Some((_e, devices)) = two_gpus("cudarc_operand_our_stream") else {
        return;
    };
    let (comm, ours) =
        cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never);
    let s0 = cu(CudaContext::new(0).unwrap().new_stream());
    let x = cu(s0.clone_htod(&[1.0f32; 64]));
    let mut y = DeviceBuffer::<f32>::zeroed(&devices[0], 64).unwrap();
    let r = comm
        .rank(0)
        .unwrap()
        .all_reduce(&x, &mut y, ReduceOp::Sum, &ours[0]);
    match r {
        Err(Error::InvalidArgument {
            arg: "input",
            reason,
        }) => {
            assert!(reason.contains("not a cudarc stream"), "{reason}")
        }
        other => panic!("expected the input refused, got {other:?}"),
    }
}

#[test]
fn an_operand_made_for_another_streams_call_is_refused_naming_it() {
    use cuda_multimem_collectives::IntoStream;
    let Some((_e, devices)) = two_gpus("cudarc_operand_other_stream") else {
        return;
    };
    let comm = cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never).0;
    let ctx = CudaContext::new(0).unwrap();
    let (a, b) = (cu(ctx.new_stream()), cu(ctx.new_stream()));
    let mut x = cu(a.clone_htod(&[1.0f32; 64]));
    let h = comm.rank(0).unwrap();
    let on_a = (&a).into_stream(h.device()).unwrap();
    let buf = Dst::from_cudarc(&mut x, &on_a, "buf").unwrap();
    let r = h.all_reduce_in_place(buf, ReduceOp::Sum, &b);
    match r {
        Err(Error::InvalidArgument { arg: "buf", reason }) => {
            assert!(reason.contains("made for a call on stream"), "{reason}")
        }
        other => panic!("expected the buffer refused, got {other:?}"),
    }
}

#[test]
fn a_collective_on_one_cudarc_stream_waits_for_a_write_on_another() {
    let Some((_e, devices)) = two_gpus("cudarc_event_tracking") else {
        return;
    };
    let comm = cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never).0;
    // 64 Mi elements written on stream `w`, reduced on stream `c` at once: cudarc's tracking
    // (the operand's pointer taken against `c`) makes `c` wait for the write.
    let count = 64 << 20;
    let ctxs: Vec<_> = (0..2).map(|r| CudaContext::new(r).unwrap()).collect();
    let w: Vec<_> = ctxs.iter().map(|c| cu(c.new_stream())).collect();
    let cs: Vec<_> = ctxs.iter().map(|c| cu(c.new_stream())).collect();
    let mut xs: Vec<_> = w.iter().map(|s| cu(s.alloc_zeros::<f32>(count))).collect();
    for s in &w {
        cu(s.synchronize());
    }
    let host: Vec<Vec<f32>> = (0..2).map(|r| vec![(r + 1) as f32; count]).collect();
    for r in 0..2 {
        cu(w[r].memcpy_htod(&host[r], &mut xs[r]));
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(&mut xs[r], ReduceOp::Sum, &cs[r])
            .unwrap();
    }
    let got = download(&comm, &cs, &xs);
    for (r, g) in got.iter().enumerate() {
        assert!(
            g.iter().all(|&v| v == 3.0),
            "rank {r}: the allreduce read before the write"
        );
    }
}

#[test]
fn a_captured_collective_on_cudarc_slices_replays() {
    let Some((_e, devices)) = two_gpus("cudarc_graph") else {
        return;
    };
    let comm = cuda_multimem_tests::team_on(&devices, Default::default(), MulticastPolicy::Never).0;
    let ctxs: Vec<_> = (0..2).map(|r| CudaContext::new(r).unwrap()).collect();
    let st: Vec<_> = ctxs.iter().map(|c| cu(c.new_stream())).collect();
    let count = 10_001;
    let x: Vec<Vec<f32>> = (0..2).map(|r| vec![(r + 1) as f32; count]).collect();
    let mut xs = upload(&st, &x);
    // eager first (what the call sets up, outside the capture)
    for r in 0..2 {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(&mut xs[r], ReduceOp::Sum, &st[r])
            .unwrap();
    }
    same("eager", &download(&comm, &st, &xs), &vec![3.0f32; count]);
    let mut graphs = Vec::new();
    for r in 0..2 {
        // A capture cannot wait on events recorded outside it: tracking off while capturing.
        // SAFETY: the stream is idle (downloaded above) and the capture uses it alone.
        unsafe { ctxs[r].disable_event_tracking() };
        cu(st[r].begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        ));
        let queued = comm
            .rank(r)
            .unwrap()
            .all_reduce_in_place(&mut xs[r], ReduceOp::Sum, &st[r]);
        let g = cu(st[r].end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0)));
        // SAFETY: no slice was made while tracking was off.
        unsafe { ctxs[r].enable_event_tracking() };
        queued.unwrap();
        graphs.push(g.expect("a graph"));
    }
    for _ in 0..2 {
        for g in &graphs {
            cu(g.launch());
        }
    }
    // 3 -> 6 -> 12
    same(
        "replayed twice",
        &download(&comm, &st, &xs),
        &vec![12.0f32; count],
    );
}
