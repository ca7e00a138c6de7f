//! A team of two MPI processes on the simulator: `mpirun -n 2` starts this test binary's
//! `mpi_rank` twice; each process simulates a two-GPU machine of its own and drives one device,
//! memory handles travel as fabric-handle bytes through `MpiBootstrap`, and every rank checks
//! the allreduce against the host reference. Needs the `mpi` feature and `mpirun` on the PATH.

use std::time::Duration;

use cuda_multimem::Stream;
use cuda_multimem_collectives::testing::{random_bytes, reference_bytes};
use cuda_multimem_collectives::{CommConfig, Communicator, DType, MpiBootstrap, ReduceOp};

const CHILD: &str = "CMM_MPI_CHILD";

fn input(call: u64, rank: usize, dtype: DType, count: usize) -> Vec<u8> {
    random_bytes(dtype, count, &mut (call * 7919 + rank as u64 + 1))
}

#[test]
#[ignore = "started by mpirun from two_mpi_ranks_allreduce_on_the_simulator"]
fn mpi_rank() {
    if std::env::var_os(CHILD).is_none() {
        eprintln!("SKIPPED: mpi_rank: only runs under mpirun, started by the parent test");
        return;
    }
    let universe = mpi::initialize().expect("MPI initialises once");
    let boot = MpiBootstrap::new(universe.world());
    use cuda_multimem_collectives::Bootstrap as _;
    let (rank, n) = (boot.rank(), boot.size());
    // an empty contribution (Open MPI reads an empty slice's address, 1, as MPI_IN_PLACE)
    let empty = boot
        .all_gather(&[])
        .expect("an exchange of empty contributions");
    assert!(
        empty.len() == n && empty.iter().all(Vec::is_empty),
        "{empty:?}"
    );
    cuda_multimem_collectives::sim::install();
    let driver =
        cuda_multimem_sim::simulated_driver(cuda_multimem_sim::SimConfig::new(n, 13000)).unwrap();
    let device = driver.device(rank).unwrap();
    let comm = Communicator::builder_with_bootstrap(&device, Box::new(boot))
        .config(CommConfig {
            one_shot_max_bytes: Some(16 << 10),
            timeout: Duration::from_secs(10),
            ..Default::default()
        })
        .build()
        .unwrap();
    let mut buf = comm.alloc::<u8>(1 << 20).unwrap();
    let stream = Stream::new(&device).unwrap();
    for (c, (count, dtype, op)) in [
        (777usize, DType::F32, ReduceOp::Sum),
        (50_001, DType::Bf16, ReduceOp::Max),
    ]
    .into_iter()
    .enumerate()
    {
        let len = count * dtype.size();
        buf.write(rank, 0, &input(c as u64, rank, dtype, count))
            .unwrap();
        comm.rank(rank)
            .unwrap()
            .all_reduce_dyn_in_place(dtype, buf.slice_mut(..len).unwrap(), op, &stream)
            .unwrap();
        stream.synchronize().unwrap();
        comm.check().unwrap();
        let inputs: Vec<Vec<u8>> = (0..n).map(|r| input(c as u64, r, dtype, count)).collect();
        let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference_bytes(dtype, op, &refs);
        let mut got = vec![0u8; len];
        buf.read(rank, 0, &mut got).unwrap();
        assert!(
            got == want,
            "rank {rank}, call {c}: result differs from the reference"
        );
    }
    println!("MPI-RANK-OK {rank}");
}

#[test]
fn two_mpi_ranks_allreduce_on_the_simulator() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("mpirun")
        .args(["-n", "2", "--oversubscribe"])
        .arg(&exe)
        .args([
            "--exact",
            "mpi_rank",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => panic!("mpirun could not start ({e}); install openmpi-bin"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mpirun failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("MPI-RANK-OK 0") && stdout.contains("MPI-RANK-OK 1"),
        "{stdout}"
    );
}
