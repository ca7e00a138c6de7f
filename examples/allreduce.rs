//! The README's main job: allreduce across every GPU of the machine, checked against a host
//! reference, with the communicator choosing the path and algorithm per call.
//!
//! Uses the real GPUs when the machine has two or more that reach each other; otherwise (saying
//! so) a simulated NVLink machine of 8 GPUs where multicast is allowed, so the multimem path
//! runs for the sizes where it pays off. Prints what each call ran; exits non-zero if any result
//! differs from the reference.
//!
//! `--ranks N` runs a team of N ranks (default: one per GPU); with more ranks than GPUs they are
//! placed round-robin, several on one GPU (`CommunicatorBuilder::allow_shared_devices`), and it
//! says so — one GPU then runs the real kernels of a team of N.
//!
//! `cargo run --release --example allreduce [-- --ranks N]`
//! (`CUDA_MULTIMEM_DRIVER=sim:devices=N,version=V` picks a simulated machine).

use std::process::ExitCode;

use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{random_input, reference};
use cuda_multimem_collectives::{bf16, Choice, Communicator, Element, Path, ReduceOp};
use cuda_multimem_examples::{pick_driver, Res};

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

/// Where the operands live.
#[derive(Clone, Copy, PartialEq)]
enum Operands {
    /// A symmetric buffer, in place.
    Symmetric,
    /// The caller's own device memory (`DeviceBuffer`), out of place.
    Own,
}

/// Whether `got` matches `want`: exactly, or — for sums on the multimem path, which the switch
/// adds in its own order — within the rounding of `n` additions.
fn matches<T: Element>(got: &[T], want: &[T], inputs: &[Vec<T>], exact: bool) -> Option<usize> {
    let eps = match T::DTYPE {
        cuda_multimem_collectives::DType::F32 => f32::EPSILON,
        cuda_multimem_collectives::DType::F16 => 1.0 / 1024.0,
        cuda_multimem_collectives::DType::Bf16 => 1.0 / 128.0,
        _ => 0.0,
    };
    (0..want.len()).find(|&i| {
        let (g, w) = (got[i].to_f32(), want[i].to_f32());
        if exact {
            got[i].to_bits64() != want[i].to_bits64()
        } else {
            let mag: f32 = inputs.iter().map(|x| x[i].to_f32().abs()).sum();
            (g - w).abs() > eps * mag.max(1.0) * inputs.len() as f32
        }
    })
}

fn case<T: Element + Default>(
    comm: &Communicator,
    streams: &[Stream],
    count: usize,
    op: ReduceOp,
    operands: Operands,
    seed: &mut u64,
) -> Res<(Choice, bool)> {
    let n = comm.size();
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
    let want = reference(op, &refs);
    let mut results = Vec::new();
    let mut choice = None;
    match operands {
        Operands::Symmetric => {
            let mut buf = comm.alloc::<T>(count)?;
            for (rank, s) in streams.iter().enumerate() {
                buf.write(rank, 0, &inputs[rank])?;
                choice = Some(comm.rank(rank)?.all_reduce_in_place(&mut buf, op, s)?);
            }
            for s in streams {
                s.synchronize()?;
            }
            comm.check()?;
            for rank in 0..n {
                results.push(buf.to_vec(rank)?);
            }
        }
        Operands::Own => {
            let mut outs = Vec::new();
            for (rank, s) in streams.iter().enumerate() {
                let input = DeviceBuffer::from_host(s.device(), &inputs[rank])?;
                let mut output = DeviceBuffer::<T>::zeroed(s.device(), count)?;
                choice = Some(comm.rank(rank)?.all_reduce(&input, &mut output, op, s)?);
                outs.push((input, output));
            }
            for s in streams {
                s.synchronize()?;
            }
            comm.check()?;
            for (_, o) in &outs {
                results.push(o.to_vec()?);
            }
        }
    }
    let choice = choice.ok_or("no rank ran")?;
    let exact = !(choice.path == Path::Multimem && op == ReduceOp::Sum);
    let mut ok = true;
    for (rank, got) in results.iter().enumerate() {
        if let Some(i) = matches(got, &want, &inputs, exact) {
            println!(
                "  rank {rank}: element {i} is {:?}, the reference {:?}",
                got[i], want[i]
            );
            ok = false;
        }
    }
    Ok((choice, ok))
}

/// `--ranks N`, if given.
fn ranks_arg() -> Res<Option<usize>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => Ok(None),
        [flag, n] if flag == "--ranks" => match n.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => Err(format!("--ranks {n}: expected a number of ranks, at least 1").into()),
        },
        _ => Err(format!("unexpected arguments {args:?}; usage: allreduce [--ranks N]").into()),
    }
}

fn run() -> Res<bool> {
    let ranks = ranks_arg()?;
    // with --ranks, one GPU is enough: its ranks share it
    let (driver, what) = pick_driver(if ranks.is_some() { 1 } else { 2 }, 8)?;
    println!("running on {what}");
    let gpus = driver.devices();
    let n = ranks.unwrap_or(gpus.len());
    // rank r on GPU r mod G
    let devices: Vec<_> = (0..n).map(|r| gpus[r % gpus.len()].clone()).collect();
    if n > gpus.len() {
        println!(
            "{n} ranks on {} GPU(s): placed round-robin, up to {} ranks share a GPU (timings of such a team say nothing about {n} GPUs)",
            gpus.len(),
            n.div_ceil(gpus.len())
        );
    }
    let comm = Communicator::builder(&devices)
        .allow_shared_devices(n > gpus.len())
        .build()?;
    match comm.multimem_unavailable_reason() {
        None => println!("multimem path: on (NVLink multicast)"),
        Some(why) => println!("multimem path: off ({why})"),
    }
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    println!("a team of {n} ranks");
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut all_ok = true;
    println!(
        "{:>10} {:>5} {:>4} {:>10}  {:<44} result",
        "elements", "type", "op", "operands", "ran"
    );
    type Case = (usize, &'static str, ReduceOp, Operands);
    let cases: [Case; 7] = [
        (1000, "f32", ReduceOp::Sum, Operands::Symmetric),
        (100_003, "bf16", ReduceOp::Sum, Operands::Symmetric),
        (100_003, "bf16", ReduceOp::Max, Operands::Own),
        (1 << 20, "bf16", ReduceOp::Sum, Operands::Symmetric),
        (1 << 20, "f16", ReduceOp::Min, Operands::Symmetric),
        (6 << 20, "bf16", ReduceOp::Sum, Operands::Own),
        (12 << 20, "bf16", ReduceOp::Sum, Operands::Symmetric),
    ];
    for (count, ty, op, operands) in cases {
        let (choice, ok) = match ty {
            "f32" => case::<f32>(&comm, &streams, count, op, operands, &mut seed)?,
            "f16" => case::<half::f16>(&comm, &streams, count, op, operands, &mut seed)?,
            _ => case::<bf16>(&comm, &streams, count, op, operands, &mut seed)?,
        };
        println!(
            "{count:>10} {ty:>5} {:>4} {:>10}  {:<44} {}",
            op.name(),
            if operands == Operands::Own {
                "own"
            } else {
                "symmetric"
            },
            choice.to_string(),
            if ok {
                "matches the host reference"
            } else {
                "WRONG"
            }
        );
        all_ok &= ok;
    }
    println!(
        "{}",
        if all_ok {
            "all results match the host reference"
        } else {
            "some results differ from the host reference"
        }
    );
    Ok(all_ok)
}
