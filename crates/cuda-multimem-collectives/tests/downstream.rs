//! `docs/simulator.md`, "Testing an engine's collectives": a downstream crate's test of its
//! communication code on the simulator, as the guide shows it (`sim::install()`, then the driver
//! `CUDA_MULTIMEM_DRIVER` selects through `driver_from_env()`). Run without the variable (as
//! `cargo xtask test`'s unit run does), the test runs itself in a child process with
//! `CUDA_MULTIMEM_DRIVER=sim:devices=2`, which is what the guide tells a CI job to set.

use cuda_multimem::{DeviceBuffer, IntoStream, Stream};
use cuda_multimem_collectives::testing::reference;
use cuda_multimem_collectives::{Communicator, IntoDst, ReduceOp};

/// The engine's code under test, generic over its tensor type (a cudarc `CudaSlice` in
/// production, a `DeviceBuffer` in the test) and its stream type: every rank's `x` summed in
/// place across the team.
fn sum_across<X, S>(comm: &Communicator, xs: &mut [X], streams: &[S]) -> cuda_multimem::Result<()>
where
    for<'a> &'a mut X: IntoDst<'a, f32>,
    for<'s> &'s S: IntoStream<'s>,
{
    for (rank, (x, s)) in xs.iter_mut().zip(streams).enumerate() {
        comm.rank(rank)?.all_reduce_in_place(x, ReduceOp::Sum, s)?;
    }
    Ok(())
}

#[test]
fn the_engine_sums_across_two_simulated_gpus() {
    if std::env::var_os(cuda_multimem::DRIVER_ENV).is_none() {
        let exe = std::env::current_exe().expect("this test binary");
        let out = std::process::Command::new(exe)
            .args(["--exact", "the_engine_sums_across_two_simulated_gpus"])
            .env(cuda_multimem::DRIVER_ENV, "sim:devices=2")
            .output()
            .expect("the child test process runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "the test under {}=sim:devices=2 failed:\n{text}",
            cuda_multimem::DRIVER_ENV
        );
        return;
    }
    // --- the guide's test from here on ---
    // The kernels' host equivalents: without them a launch on the simulator fails with
    // CUDA_ERROR_NOT_FOUND.
    cuda_multimem_collectives::sim::install();
    // CUDA_MULTIMEM_DRIVER=sim:devices=2 in CI; unset, the real driver (on a GPU machine).
    let driver = cuda_multimem_sim::driver_from_env().unwrap();
    let devices = driver.devices();
    let comm = Communicator::new(&devices).unwrap();
    let streams: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
    let inputs: Vec<Vec<f32>> = (0..devices.len())
        .map(|r| {
            (0..4096)
                .map(|i| (i % 97) as f32 * (r + 1) as f32)
                .collect()
        })
        .collect();
    let mut xs: Vec<DeviceBuffer<f32>> = devices
        .iter()
        .zip(&inputs)
        .map(|(d, x)| DeviceBuffer::from_host(d, x).unwrap())
        .collect();
    sum_across(&comm, &mut xs, &streams).unwrap();
    for s in &streams {
        s.synchronize().unwrap();
    }
    comm.check().unwrap();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    let want = reference(ReduceOp::Sum, &refs);
    for x in &xs {
        assert_eq!(x.to_vec().unwrap(), want);
    }
}
