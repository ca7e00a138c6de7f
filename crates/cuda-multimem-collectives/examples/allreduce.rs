//! The README's main job: an allreduce over two GPUs, checked against a host reference.
//!
//! Uses the GPUs when the machine has two that reach each other (peer-to-peer over NVLink),
//! otherwise a simulated two-GPU NVLink system, and says which. Prints the path and algorithm of
//! each size, and exits non-zero if any result differs from the host reference.
//!
//! `cargo run --release --example allreduce` (`CUDA_MULTIMEM_DRIVER=sim` forces the simulator).

use std::process::ExitCode;

use cuda_multimem::{Driver, Stream};
use cuda_multimem_collectives::{random_input, reference, Communicator, DType, Op};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The real driver with two peer-capable GPUs, else a simulated two-GPU NVLink machine.
fn pick_driver() -> Res<(Driver, String)> {
    if std::env::var(cuda_multimem::DRIVER_ENV).is_ok_and(|v| v.starts_with("sim")) {
        return Ok((
            cuda_multimem_sim::driver_from_env()?,
            "simulated (CUDA_MULTIMEM_DRIVER)".into(),
        ));
    }
    match Driver::load() {
        Ok(d) if d.device_count() >= 2 => {
            let devs = d.devices();
            if devs[0].can_access_peer(&devs[1]).unwrap_or(false) {
                let name = devs[0].name().unwrap_or_default();
                let what = format!("2 x {name} (real GPUs, driver {})", d.version());
                return Ok((d, what));
            }
            println!("note: the GPUs cannot access each other; using the simulator");
        }
        Ok(d) => println!(
            "note: the real driver has {} GPU(s), two are needed; using the simulator",
            d.device_count()
        ),
        Err(e) => println!("note: no usable CUDA driver ({e}); using the simulator"),
    }
    let d = cuda_multimem_sim::simulated_driver(cuda_multimem_sim::SimConfig::new(2, 13000))?;
    Ok((d, "a simulated two-GPU NVLink system".into()))
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<bool> {
    let (driver, what) = pick_driver()?;
    println!("running on {what}");
    let devices = &driver.devices()[..2];
    let multicast_allowed = std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0")
        && std::env::var("CUDA_MULTIMEM_DISABLE_MULTICAST").as_deref() != Ok("1");
    // The multimem path (MultimemAllReduce) needs multicast, and pays off only for teams larger
    // than 3: with two GPUs the peer-to-peer path is the right one either way.
    println!(
        "path: peer-to-peer ({})",
        if !multicast_allowed {
            "multicast is disabled here"
        } else if !cuda_multimem_collectives::multimem_pays_off(devices.len()) {
            "multimem pays off only for teams larger than 3"
        } else {
            "multimem not chosen"
        }
    );
    let comm = Communicator::new(devices)?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let buf = comm.alloc(24 << 20)?;
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut all_ok = true;
    for (count, dtype, op) in [
        (1000usize, DType::F32, Op::Sum),
        (100_003, DType::Bf16, Op::Sum),
        (2_000_000, DType::F16, Op::Max),
        // above the one-shot limit: the write-only two-shot in rounds
        (12_000_000, DType::Bf16, Op::Sum),
    ] {
        let inputs: Vec<Vec<u8>> = (0..2)
            .map(|_| random_input(dtype, count, &mut seed))
            .collect();
        for (r, d) in inputs.iter().enumerate() {
            buf.copy_from_host(r, d)?;
        }
        let mut choice = None;
        for (r, s) in streams.iter().enumerate() {
            choice = Some(comm.all_reduce(r, &buf, 0, &buf, 0, count, dtype, op, s)?);
        }
        for s in &streams {
            s.synchronize()?;
        }
        comm.check()?;
        let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
        let want = reference(dtype, op, &refs);
        let mut ok = true;
        for r in 0..2 {
            let mut got = vec![0u8; want.len()];
            buf.copy_to_host(r, &mut got)?;
            ok &= got == want;
        }
        let c = choice.ok_or("no call")?;
        println!(
            "{count:>9} x {:<4} {:<3}: {} {} ({} blocks x {} threads): {}",
            dtype.name(),
            op.name(),
            c.path,
            c.algorithm,
            c.blocks,
            c.threads,
            if ok {
                "matches the host reference"
            } else {
                "MISMATCH"
            }
        );
        all_ok &= ok;
    }
    Ok(all_ok)
}
