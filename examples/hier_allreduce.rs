//! The main job across NVLink domains: an allreduce whose team is cut into domains (our NVLink
//! kernels inside each) joined by NCCL, checked against the host reference on every rank.
//!
//! Two ways to start it:
//!
//! - **Under `mpirun -np N`** (build with `--features mpi`): one process per GPU, the team from
//!   `MpiBootstrap`, each rank on the GPU of its rank on its host (local rank → device); domains
//!   found per host (ranks of one host whose GPUs reach each other), or given with
//!   `--domain-size D` (ranks `d·D … d·D + D − 1` form domain d: `--domain-size 1` makes every
//!   GPU a domain of its own, e.g. two domains of one GPU on one machine); NCCL between domains.
//!   `mpirun -np 2 target/release/examples/hier_allreduce --domain-size 1`
//! - **Alone** (`cargo run --release --example hier_allreduce`): on a machine with two or more
//!   GPUs and NCCL it runs two processes, each one GPU and its own domain (the smallest
//!   hierarchy: every byte crosses through NCCL): rank 0 starts this program again as rank 1,
//!   and the two meet through a Unix socket (`UnixBootstrap`).
//!
//! NCCL is the library `CUDA_MULTIMEM_NCCL` names, else `libnccl.so.2`, else the `nvidia-nccl`
//! wheel of `python3` (torch's). Without GPUs or NCCL (on any rank) it says so and runs on the
//! simulated driver — across the MPI processes under mpirun, else four threads as two domains of
//! two GPUs — with the cross-domain step done by the library's host test double
//! (`HostCrossDomainDouble`: host copies exchanged through the team's bootstrap, i.e. with
//! `MPI_Allgatherv` under mpirun, reduced on the host in domain order), not NCCL.
//! `CUDA_MULTIMEM_DRIVER=sim` forces the simulator. The library itself never falls back to the
//! simulator; only this example does, saying so.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use cuda_multimem::{Device, DeviceBuffer, Driver, Stream};
use cuda_multimem_collectives::testing::{random_input, reference};
use cuda_multimem_collectives::{
    bf16, Bootstrap, HierBuilder, HierCommunicator, HierLayout, MulticastPolicy, Nccl, ReduceOp,
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

/// The hierarchical allreduce example (README, "Across nodes").
#[derive(Parser, Debug, Clone)]
#[command(name = "hier_allreduce")]
struct Args {
    /// Ranks per NVLink domain: consecutive ranks form a domain (the team's size must be a
    /// multiple). Default: under mpirun, domains found per host; alone, one domain per GPU
    /// (on the simulator, two domains of two).
    #[arg(long)]
    domain_size: Option<usize>,
}

impl Args {
    /// The domain id of `rank` in a team of `n`, where `--domain-size` gives one.
    fn domain_id(&self, rank: usize, n: usize) -> Res<Option<u64>> {
        match self.domain_size {
            None => Ok(None),
            Some(d) if d == 0 || !n.is_multiple_of(d) => Err(format!(
                "--domain-size {d}: the team has {n} ranks; expected a divisor of {n} (1 makes every GPU its own domain)"
            )
            .into()),
            Some(d) => Ok(Some((rank / d) as u64)),
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
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

/// One rank's calls: every size, on the caller's own memory, checked against the host
/// reference on this rank. Rank 0 prints the table; any other rank prints its own mismatches.
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
        let verdict = match bad {
            None => "matches the host reference".to_string(),
            Some(i) => format!("WRONG at {i}: {} want {}", got[i], w[i]),
        };
        if l.rank() == 0 {
            println!(
                "{:>10} {:>12} {:>12.1}  {verdict}",
                count,
                count * 2,
                took.as_secs_f64() * 1e6,
            );
        } else if bad.is_some() {
            eprintln!("rank {}: {count} elements: {verdict}", l.rank());
        }
        ok &= bad.is_none();
    }
    Ok(ok)
}

fn describe(hier: &HierCommunicator, across: &str) {
    let l = hier.layout();
    println!(
        "team of {} ranks: {} domain(s) of {} GPU(s) (domain ranks {:?}); across domains: {}",
        l.size(),
        l.domain_count(),
        l.domain_size(),
        (0..l.domain_count())
            .map(|d| l.domain_members(d).to_vec())
            .collect::<Vec<_>>(),
        match hier.cross_domain() {
            None => "none (one domain)".to_string(),
            Some(c) => format!("{}{across}", c.name()),
        }
    );
    println!(
        "{:>10} {:>12} {:>12}  result (bf16 sum, in place, one eager call each; wall time)",
        "elements", "bytes", "time(us)"
    );
}

/// The builder's settings shared by every mode: the domain (given or found), no multicast.
fn builder(device: &Device, boot: Box<dyn Bootstrap>, domain: Option<u64>) -> HierBuilder {
    let b = HierCommunicator::builder(device, boot).multicast(MulticastPolicy::Never);
    match domain {
        Some(d) => b.domain_id(d),
        None => b,
    }
}

/// One process of the two-GPU run.
fn real_rank(
    driver: &Driver,
    (rank, args): (usize, &Args),
    path: &Path,
    nccl: Arc<Nccl>,
) -> Res<bool> {
    let device = driver.device(rank)?;
    let domain = args.domain_id(rank, 2)?.unwrap_or(rank as u64);
    let boot = UnixBootstrap::new(path, rank, 2, Duration::from_secs(60))?;
    let hier = builder(&device, Box::new(boot), Some(domain))
        .nccl(nccl)
        .build()?;
    if rank == 0 {
        describe(&hier, "");
    }
    calls(&hier, &device)
}

/// The two-process run on real GPUs: rank 0 here, rank 1 in a child (with the same arguments).
fn real(driver: &Driver, nccl: Arc<Nccl>, args: &Args) -> Res<bool> {
    // refuse a bad --domain-size here, before the child starts
    args.domain_id(0, 2)?;
    println!(
        "running on 2 x {} (real GPUs, driver {}), one process per GPU; NCCL {} from {}",
        driver.device(0)?.name()?,
        driver.version(),
        nccl.version_string(),
        nccl.path()
    );
    let path = std::env::temp_dir().join(format!("cmm-hier-example-{}", std::process::id()));
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .env(RANK_ENV, "1")
        .env(PATH_ENV, &path)
        .env(cuda_multimem_collectives::nccl::NCCL_ENV, nccl.path())
        .spawn()?;
    let mine = real_rank(driver, (0, args), &path, nccl);
    let theirs = child.wait()?;
    let ok = mine?;
    if !theirs.success() {
        return Err(format!("rank 1 failed ({theirs})").into());
    }
    Ok(ok)
}

/// The simulated run: 4 threads as 2 domains of 2 GPUs (or as `--domain-size` says), the host
/// test double across.
fn simulated_run(driver: Driver, why: &str, args: &Args) -> Res<bool> {
    let n = 4;
    args.domain_id(0, n)?;
    println!(
        "running on the SIMULATED driver ({why}): {n} threads, one simulated GPU each; the cross-domain step is the host test double, not NCCL"
    );
    let path: PathBuf =
        std::env::temp_dir().join(format!("cmm-hier-example-sim-{}", std::process::id()));
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (driver, path, args) = (driver.clone(), path.clone(), args.clone());
            std::thread::spawn(move || -> Result<bool, String> {
                let go = || -> Res<bool> {
                    let device = driver.device(rank)?;
                    let domain = args.domain_id(rank, n)?.unwrap_or((rank / 2) as u64);
                    let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(60))?;
                    let hier = builder(&device, Box::new(boot), Some(domain))
                        .cross_domain_test_double()
                        .build()?;
                    if rank == 0 {
                        describe(&hier, "");
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

/// The number of processes an MPI launcher started, from the variables it sets (Open MPI,
/// MPICH/Hydra and Slurm's PMI), without initialising MPI.
fn mpi_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

fn run(args: &Args) -> Res<bool> {
    if let (Ok(rank), Ok(path)) = (std::env::var(RANK_ENV), std::env::var(PATH_ENV)) {
        // The child: rank 1 of the two-process run.
        let rank = rank
            .parse()
            .map_err(|e| format!("{RANK_ENV}={rank}: {e}"))?;
        let nccl = locate_nccl()?;
        return real_rank(&Driver::load()?, (rank, args), Path::new(&path), nccl);
    }
    if let Some(n) = mpi_world_size().filter(|&n| n > 1) {
        return under_mpirun(n, args);
    }
    let forced_sim = forced_sim();
    let why = match forced_sim {
        Some(why) => why,
        None => match Driver::load() {
            Ok(d) if d.device_count() >= 2 => match locate_nccl() {
                Ok(nccl) => return report(real(&d, nccl, args)?),
                Err(e) => format!("no NCCL: {e}"),
            },
            Ok(d) => format!(
                "the real driver has {} GPU(s), 2 are needed",
                d.device_count()
            ),
            Err(e) => format!("no usable CUDA driver: {e}"),
        },
    };
    report(simulated_run(simulated(4, 13030)?, &why, args)?)
}

/// Why the simulator is selected, where `CUDA_MULTIMEM_DRIVER` selects it.
fn forced_sim() -> Option<String> {
    std::env::var(cuda_multimem::DRIVER_ENV)
        .is_ok_and(|v| v.trim().starts_with("sim"))
        .then(|| format!("{} selects it", cuda_multimem::DRIVER_ENV))
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

#[cfg(not(feature = "mpi"))]
fn under_mpirun(n: usize, _: &Args) -> Res<bool> {
    Err(format!(
        "started by an MPI launcher with {n} processes, but built without MPI: build with `--features mpi` (cargo build --release -p cuda-multimem-examples --features mpi --example hier_allreduce)"
    )
    .into())
}

#[cfg(feature = "mpi")]
fn under_mpirun(_: usize, args: &Args) -> Res<bool> {
    use mpi::traits::{Communicator as _, CommunicatorCollectives as _};
    let universe = mpi::initialize().ok_or("MPI was initialised already")?;
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    // A bad argument is the same on every rank: rank 0 says it (before any rank exits: mpirun
    // ends the job at the first non-zero exit), every rank fails.
    if let Err(e) = args.domain_id(rank, n) {
        if rank == 0 {
            eprintln!("hier_allreduce: {e}");
        }
        world.barrier();
        return Ok(false);
    }
    match mpi_team::run(&world, args) {
        Ok(ok) => Ok(ok),
        Err(e) => {
            // Another rank may be waiting in a collective call: end the whole job.
            eprintln!("hier_allreduce: rank {rank}: {e}");
            world.abort(2)
        }
    }
}

/// The team under mpirun: one process per GPU, the team from `MpiBootstrap`.
#[cfg(feature = "mpi")]
mod mpi_team {
    use super::*;
    use cuda_multimem_collectives::MpiBootstrap;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::{Communicator as _, CommunicatorCollectives as _};

    /// What this rank can run on: real GPUs and NCCL, or why not.
    enum Verdict {
        Real(Driver, Arc<Nccl>),
        Sim(String),
    }

    fn verdict(local: usize) -> Verdict {
        if let Some(why) = forced_sim() {
            return Verdict::Sim(why);
        }
        match Driver::load() {
            Ok(d) if d.device_count() > local => match locate_nccl() {
                Ok(nccl) => Verdict::Real(d, nccl),
                Err(e) => Verdict::Sim(format!("no NCCL: {e}")),
            },
            Ok(d) => Verdict::Sim(format!(
                "local rank {local} needs GPU {local}; the real driver has {}",
                d.device_count()
            )),
            Err(e) => Verdict::Sim(format!("no usable CUDA driver: {e}")),
        }
    }

    pub(super) fn run(world: &SimpleCommunicator, args: &Args) -> Res<bool> {
        let (rank, n) = (world.rank() as usize, world.size() as usize);
        let domain = args.domain_id(rank, n)?;
        // The ranks of this host: local rank -> device.
        let host = world.split_shared(world.rank());
        let (local, local_n) = (host.rank() as usize, host.size() as usize);
        // Every rank must take the same road: real GPUs only where every rank can.
        let agree = MpiBootstrap::new(world.duplicate());
        let mine = verdict(local);
        let why_not = match &mine {
            Verdict::Real(..) => String::new(),
            Verdict::Sim(why) => why.clone(),
        };
        let all = agree.all_gather(why_not.as_bytes())?;
        let sim_why = all
            .iter()
            .enumerate()
            .find(|(_, w)| !w.is_empty())
            .map(|(r, w)| format!("rank {r}: {}", String::from_utf8_lossy(w)));
        let boot = Box::new(MpiBootstrap::new(world.duplicate()));
        let (device, hier, across) = match (mine, sim_why) {
            (Verdict::Real(driver, nccl), None) => {
                let device = driver.device(local)?;
                if rank == 0 {
                    println!(
                        "under mpirun: {n} processes, one GPU each (local rank -> device; {} here), real GPUs, driver {}; NCCL {} from {}",
                        device.name()?,
                        driver.version(),
                        nccl.version_string(),
                        nccl.path()
                    );
                }
                let hier = builder(&device, boot, domain).nccl(nccl).build()?;
                (device, hier, "")
            }
            (_, why) => {
                let why = why.unwrap_or_default();
                if rank == 0 {
                    println!(
                        "under mpirun: {n} processes on the SIMULATED driver ({why}); each simulates this host's {local_n} GPU(s) and drives the one of its local rank"
                    );
                }
                let driver = simulated(local_n, 13030)?;
                let device = driver.device(local)?;
                let hier = builder(&device, boot, domain)
                    .cross_domain_test_double()
                    .build()?;
                (
                    device,
                    hier,
                    " (host copies exchanged with MPI_Allgatherv), not NCCL",
                )
            }
        };
        if rank == 0 {
            describe(&hier, across);
        }
        let ok = calls(&hier, &device)?;
        drop(hier);
        // Every rank checked its own result; the job passes only if all did.
        let oks = agree.all_gather(&[u8::from(ok)])?;
        let wrong: Vec<usize> = (0..n).filter(|&r| oks[r] != [1]).collect();
        if rank == 0 {
            if wrong.is_empty() {
                println!("all results match the host reference on all {n} ranks");
            } else {
                println!("some results differ from the host reference on rank(s) {wrong:?}");
            }
        }
        // rank 0 has said it before any rank exits (mpirun ends the job at a non-zero exit)
        world.barrier();
        Ok(wrong.is_empty())
    }
}
