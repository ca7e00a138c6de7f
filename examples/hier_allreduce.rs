//! The main job across NVLink domains: an allreduce whose team is cut into domains (our NVLink
//! kernels inside each) joined by NCCL, checked against the host reference.
//!
//! On a machine with two or more GPUs and NCCL it runs two processes, each one GPU and its own
//! domain (the smallest hierarchy: every byte crosses through NCCL): rank 0 starts this program
//! again as rank 1, and the two meet through a Unix socket (`UnixBootstrap`). NCCL is the
//! library `CUDA_MULTIMEM_NCCL` names, else `libnccl.so.2`, else the `nvidia-nccl` wheel of
//! `python3` (torch's). Without GPUs or NCCL it says so and runs on the simulated driver: four
//! threads as two domains of two GPUs, the cross-domain step done by the host test double.
//!
//! `cargo run --release --example hier_allreduce` (`CUDA_MULTIMEM_DRIVER=sim` forces the
//! simulator). Across nodes, one process per GPU under `mpirun -np N`: build with the
//! collectives' `mpi` feature and pass `MpiBootstrap::new(mpi::initialize()?.world())` to
//! `HierCommunicator::builder` instead of the Unix bootstrap; domains are then found per host
//! (README, "Across nodes").

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::{Device, DeviceBuffer, Driver, Stream};
use cuda_multimem_collectives::{
    bf16, random_input, reference, HierCommunicator, HierLayout, MulticastPolicy, Nccl, ReduceOp,
    UnixBootstrap,
};
use cuda_multimem_examples::{locate_nccl, simulated, Res};

/// Set in the child process: its rank and the rendezvous socket.
const RANK_ENV: &str = "HIER_EXAMPLE_RANK";
const PATH_ENV: &str = "HIER_EXAMPLE_PATH";

/// Message sizes in elements: a few bf16, a non-multiple of the domain size, 1 MiB, 32 MiB
/// (the simulator stops at 128 KiB: it runs the kernels on the host).
const COUNTS: [usize; 4] = [7, 100_003, 1 << 19, 1 << 24];
const SIM_COUNTS: [usize; 3] = [7, 100_003, 1 << 16];

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("hier_allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Rank r's input for message `call` (every process can compute every rank's).
fn input(call: usize, rank: usize, count: usize) -> Vec<bf16> {
    let mut state =
        ((call as u64) * 7919 + rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    random_input(count, &mut state)
}

/// What the hierarchy computes: each domain's members summed in rank order (rounded to bf16),
/// then the domains' sums in domain order.
fn want(layout: &HierLayout, inputs: &[Vec<bf16>]) -> Vec<bf16> {
    let per_domain: Vec<Vec<bf16>> = (0..layout.domain_count())
        .map(|d| {
            let refs: Vec<&[bf16]> = layout
                .domain_members(d)
                .iter()
                .map(|&r| inputs[r].as_slice())
                .collect();
            reference(ReduceOp::Sum, &refs)
        })
        .collect();
    let refs: Vec<&[bf16]> = per_domain.iter().map(|v| v.as_slice()).collect();
    reference(ReduceOp::Sum, &refs)
}

/// One rank's calls: every size, on the caller's own memory, checked. Rank 0 prints.
fn calls(hier: &HierCommunicator, device: &Device) -> Res<bool> {
    let l = hier.layout().clone();
    let s = Stream::new(device)?;
    let mut ok = true;
    let counts: &[usize] = if device.driver().is_simulated() {
        &SIM_COUNTS
    } else {
        &COUNTS
    };
    for (call, &count) in counts.iter().enumerate() {
        let inputs: Vec<Vec<bf16>> = (0..l.size()).map(|r| input(call, r, count)).collect();
        let mut buf = DeviceBuffer::from_host(device, &inputs[l.rank()])?;
        let t = Instant::now();
        hier.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s)?;
        s.synchronize()?;
        let took = t.elapsed();
        hier.check()?;
        let got = buf.to_vec()?;
        let w = want(&l, &inputs);
        let bad = (0..count).find(|&i| got[i].to_bits() != w[i].to_bits());
        if l.rank() == 0 {
            println!(
                "{:>10} {:>12} {:>12.1}  {}",
                count,
                count * 2,
                took.as_secs_f64() * 1e6,
                match bad {
                    None => "matches the host reference".to_string(),
                    Some(i) => format!("WRONG at {i}: {} want {}", got[i], w[i]),
                }
            );
        }
        ok &= bad.is_none();
    }
    Ok(ok)
}

fn describe(hier: &HierCommunicator) {
    let l = hier.layout();
    println!(
        "team of {} ranks: {} domain(s) of {} GPU(s) (domain ranks {:?}); across domains: {}",
        l.size(),
        l.domain_count(),
        l.domain_size(),
        (0..l.domain_count())
            .map(|d| l.domain_members(d).to_vec())
            .collect::<Vec<_>>(),
        hier.cross_domain().map_or("none".into(), |c| c.name())
    );
    println!(
        "{:>10} {:>12} {:>12}  result (bf16 sum, in place, one eager call each; wall time)",
        "elements", "bytes", "time(us)"
    );
}

/// One process of the two-GPU run.
fn real_rank(driver: &Driver, rank: usize, path: &Path, nccl: Arc<Nccl>) -> Res<bool> {
    let device = driver.device(rank)?;
    let boot = UnixBootstrap::new(path, rank, 2, Duration::from_secs(60))?;
    let hier = HierCommunicator::builder(&device, Box::new(boot))
        .domain_id(rank as u64)
        .multicast(MulticastPolicy::Never)
        .nccl(nccl)
        .build()?;
    if rank == 0 {
        describe(&hier);
    }
    calls(&hier, &device)
}

/// The two-process run on real GPUs: rank 0 here, rank 1 in a child.
fn real(driver: &Driver, nccl: Arc<Nccl>) -> Res<bool> {
    println!(
        "running on 2 x {} (real GPUs, driver {}), one process and one domain per GPU; NCCL {} from {}",
        driver.device(0)?.name()?,
        driver.version(),
        nccl.version_string(),
        nccl.path()
    );
    let path = std::env::temp_dir().join(format!("cmm-hier-example-{}", std::process::id()));
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .env(RANK_ENV, "1")
        .env(PATH_ENV, &path)
        .env(cuda_multimem_collectives::nccl::NCCL_ENV, nccl.path())
        .spawn()?;
    let mine = real_rank(driver, 0, &path, nccl);
    let theirs = child.wait()?;
    let ok = mine?;
    if !theirs.success() {
        return Err(format!("rank 1 failed ({theirs})").into());
    }
    Ok(ok)
}

/// The simulated run: 4 threads as 2 domains of 2 GPUs, the host test double across.
fn simulated_run(driver: Driver, why: &str) -> Res<bool> {
    println!(
        "running on the SIMULATED driver ({why}): 4 threads as 2 domains of 2 GPUs; the cross-domain step is the host test double, not NCCL"
    );
    let n = 4;
    let path: PathBuf =
        std::env::temp_dir().join(format!("cmm-hier-example-sim-{}", std::process::id()));
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (driver, path) = (driver.clone(), path.clone());
            std::thread::spawn(move || -> Result<bool, String> {
                let go = || -> Res<bool> {
                    let device = driver.device(rank)?;
                    let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(60))?;
                    let hier = HierCommunicator::builder(&device, Box::new(boot))
                        .domain_id((rank / 2) as u64)
                        .multicast(MulticastPolicy::Never)
                        .cross_domain_test_double()
                        .build()?;
                    if rank == 0 {
                        describe(&hier);
                    }
                    calls(&hier, &device)
                };
                go().map_err(|e| format!("rank {rank}: {e}"))
            })
        })
        .collect();
    let mut ok = true;
    for h in hs {
        ok &= h.join().map_err(|_| "a rank panicked")??;
    }
    Ok(ok)
}

fn run() -> Res<bool> {
    if let (Ok(rank), Ok(path)) = (std::env::var(RANK_ENV), std::env::var(PATH_ENV)) {
        // The child: rank 1 of the two-process run.
        let nccl = locate_nccl()?;
        return real_rank(&Driver::load()?, rank.parse()?, Path::new(&path), nccl);
    }
    let forced_sim = std::env::var(cuda_multimem::DRIVER_ENV).is_ok_and(|v| v.starts_with("sim"));
    let why = if forced_sim {
        format!("{} selects it", cuda_multimem::DRIVER_ENV)
    } else {
        match Driver::load() {
            Ok(d) if d.device_count() >= 2 => match locate_nccl() {
                Ok(nccl) => return report(real(&d, nccl)?),
                Err(e) => format!("no NCCL: {e}"),
            },
            Ok(d) => format!(
                "the real driver has {} GPU(s), 2 are needed",
                d.device_count()
            ),
            Err(e) => format!("no usable CUDA driver: {e}"),
        }
    };
    report(simulated_run(simulated(4, 13030)?, &why)?)
}

fn report(ok: bool) -> Res<bool> {
    println!(
        "{}",
        if ok {
            "all results match the host reference"
        } else {
            "some results differ from the host reference"
        }
    );
    Ok(ok)
}
