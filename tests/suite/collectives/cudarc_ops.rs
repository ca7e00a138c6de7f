//! The caller's own memory as cudarc holds it: `CudaSlice`s on cudarc streams, allreduced
//! through `RankHandle::all_reduce_cudarc` — every dtype and op, in place and out of place, below
//! and above the one-shot limit (staged), against the host reference. cudarc talks to the real
//! driver only, so this runs in `test-hw` and is skipped, saying so, on the simulator.

use cuda_multimem_collectives::{
    bf16, f16, random_input, reference, Communicator, Element, MulticastPolicy, Operands, ReduceOp,
};
use cuda_multimem_tests::{env, skip};
use cudarc::driver::{CudaContext, DeviceRepr as CudarcRepr, ValidAsZeroBits};

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
    let e = env();
    if e.sim.is_some() || e.driver.is_simulated() {
        return skip(
            "cudarc_slices",
            "cudarc talks to the real driver only; test-hw runs this on the GPUs",
        );
    }
    let devices = e.driver.devices();
    if devices.len() < 2 || !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        return skip("cudarc_slices", "needs two GPUs that reach each other");
    }
    let comm =
        cuda_multimem_tests::team_on(&devices[..2], Default::default(), MulticastPolicy::Never).0;
    let streams: Vec<_> = (0..2)
        .map(|r| CudaContext::new(r).unwrap().new_stream().unwrap())
        .collect();
    every_op::<f32>(&comm, &streams);
    every_op::<f16>(&comm, &streams);
    every_op::<bf16>(&comm, &streams);
}

#[test]
fn a_cudarc_stream_of_another_device_is_refused() {
    let e = env();
    if e.sim.is_some() || e.driver.is_simulated() {
        return skip(
            "cudarc_stream_device",
            "cudarc talks to the real driver only; test-hw runs this on the GPUs",
        );
    }
    let devices = e.driver.devices();
    if devices.len() < 2 || !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        return skip(
            "cudarc_stream_device",
            "needs two GPUs that reach each other",
        );
    }
    let comm =
        cuda_multimem_tests::team_on(&devices[..2], Default::default(), MulticastPolicy::Never).0;
    let s1 = CudaContext::new(1).unwrap().new_stream().unwrap();
    let mut x = s1.alloc_zeros::<f32>(64).unwrap();
    let r = comm
        .rank(0)
        .unwrap()
        .all_reduce_cudarc_in_place(&mut x, ReduceOp::Sum, &s1);
    assert!(
        matches!(
            r,
            Err(cuda_multimem::Error::InvalidArgument { arg: "stream", .. })
        ),
        "{r:?}"
    );
}
