//! Reduce-scatter, all-gather and broadcast: results equal the host references for every type
//! and operator, in place and out of place, on symmetric buffers (aligned and at odd offsets)
//! and on the caller's own memory; calls of every collective interleaved with allreduce, back
//! to back with random per-device delays, on teams of 2 to 8 with staging slots small enough
//! for many rounds; graph replays; ranks that disagree (size, collective, root) and a peer that
//! never calls are reported, and bad arguments are refused before any launch.

use std::time::Duration;

use cuda_multimem::{CaptureMode, DeviceBuffer, Error, Stream};
use cuda_multimem_collectives::testing::{all_gather_reference, broadcast_reference, random_input};
use cuda_multimem_collectives::{
    bf16, f16, Algorithm, Choice, CommConfig, Communicator, Dst, MulticastPolicy, ReduceOp, Src,
    SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{self as table, Call, Mem, Params, Pending, Queued};
use cuda_multimem_tests::{env, sim, sim_delayed, skip, Env, Rng};

mod bits;
mod copy_engine;
mod correctness;
mod protocol;

trait Elem: table::Elem {}
impl<T: table::Elem> Elem for T {}

/// Queue `call` of `count` elements per chunk on every rank (random inputs from `rng`),
/// operands in `mem`: the table's runner.
fn queue<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    call: Call,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Queued<T> {
    table::queue(comm, s, call, count, mem, in_place, rng)
}

fn streams(comm: &Communicator) -> Vec<Stream> {
    (0..comm.size())
        .map(|r| Stream::new(comm.device(r).unwrap()).unwrap())
        .collect()
}

fn sync(s: &[Stream]) {
    for st in s {
        st.synchronize().unwrap();
    }
}

/// Queue, wait, check; what the last rank's call ran.
fn once<T: Elem>(
    comm: &Communicator,
    s: &[Stream],
    call: Call,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Choice {
    *table::once::<T>(comm, s, call, count, mem, in_place, rng)
        .choices
        .last()
        .unwrap()
}

/// A team of the first two devices of the chosen driver (real GPUs or the simulator).
fn team(e: &Env, config: CommConfig) -> Option<Communicator> {
    let devices = e.driver.devices();
    if devices.len() < 2 {
        skip(
            "gather",
            format!("needs 2 devices, the machine has {}", devices.len()),
        );
        return None;
    }
    Some(cuda_multimem_tests::team_on(&devices[..2], config, MulticastPolicy::Never).0)
}

/// Every case of `kinds` at `sizes`, every type, every operand kind, in place and not; each
/// must run `expect`.
fn sweep(comm: &Communicator, kinds: &[Call], sizes: &[usize], expect: Algorithm) {
    let s = streams(comm);
    let mut seed = Rng::new(0x9e37_79b9_7f4a_7c15);
    for &kind in kinds {
        for &count in sizes {
            for mem in [Mem::SYM, Mem::SYM_ODD, Mem::OWN] {
                for in_place in [false, true] {
                    let c = [
                        once::<f32>(comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<f16>(comm, &s, kind, count, mem, in_place, &mut seed),
                        once::<bf16>(comm, &s, kind, count, mem, in_place, &mut seed),
                    ];
                    for c in c {
                        assert_eq!(c.algorithm, expect, "{kind:?} of {count}, {mem:?}");
                    }
                }
            }
        }
    }
}

/// No low-latency forms: every small call runs the staged kernel.
fn staged_only() -> CommConfig {
    CommConfig {
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        ..Default::default()
    }
}

/// The same sweep with the low-latency forms (the default at these sizes: at most 32 KiB of
/// whole buffer; odd counts and 2-byte aligned 16-bit operands included) and without them.
fn sweep_both(kinds: &[Call]) {
    let e = env();
    for (config, expect) in [
        (CommConfig::default(), Algorithm::PushLl),
        (staged_only(), Algorithm::PushStaged),
    ] {
        let Some(comm) = team(&e, config) else {
            return;
        };
        sweep(&comm, kinds, &[1, 7, 1000, 4099], expect);
    }
}

/// A simulated team of `n` with random delays (up to 300 µs, from `seed`) before every launch
/// and phase: low-latency up to 2 KiB (allreduce and the others), direct above 4 KiB, slots of
/// 4 KiB shared by 3 blocks: multi-round staged calls.
fn delayed_team(n: usize, seed: u64) -> (Env, Communicator) {
    delayed_team_ce(n, seed, usize::MAX)
}

/// [`delayed_team`] whose reduce-scatters and all-gathers of at least `ce_min` bytes go through
/// the copy engines where their operands allow.
fn delayed_team_ce(n: usize, seed: u64, ce_min: usize) -> (Env, Communicator) {
    let e = sim_delayed(SimConfig::new(n, 13000), Duration::from_micros(300), seed);
    let devices = e.driver.devices();
    let comm = cuda_multimem_tests::team_on(
        &devices,
        CommConfig {
            ll_max_bytes: 2048,
            gather_ll_max_bytes: 2048,
            broadcast_ll_max_bytes: 2048,
            one_shot_max_bytes: Some(4096),
            stage_bytes: Some(4096),
            max_blocks: 3,
            timeout: cuda_multimem_tests::TEAM_TIMEOUT,
            gather_ce_min_bytes: ce_min,
            broadcast_ce_min_bytes: ce_min,
            ..Default::default()
        },
        MulticastPolicy::Never,
    )
    .0;
    (e, comm)
}

/// Queue `calls` calls of every collective and allreduce, of random kinds, sizes (`counts`),
/// types and operand kinds on `comm`, then wait and check them all against the host
/// references: what each call ran, in order.
fn back_to_back(comm: &Communicator, seed: u64, calls: usize, counts: &[usize]) -> Vec<Algorithm> {
    let n = comm.size();
    let s = streams(comm);
    let mut state = seed * 7919;
    let mut rnd = |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    let mut pending: Vec<Box<dyn Pending>> = Vec::new();
    let mut ran = Vec::new();
    let mut data = Rng::new(seed + 100);
    for _ in 0..calls {
        let op = ReduceOp::ALL[rnd(3) as usize];
        let kind = match rnd(4) {
            0 => Call::reduce_scatter(op),
            1 => Call::all_gather(),
            2 => Call::broadcast(rnd(n as u64) as usize),
            _ => Call::all_reduce(op),
        };
        let count = counts[rnd(counts.len() as u64) as usize];
        let mem = [Mem::SYM, Mem::SYM_ODD, Mem::OWN][rnd(3) as usize];
        let in_place = rnd(2) == 0;
        let (p, a): (Box<dyn Pending>, Algorithm) = match rnd(3) {
            0 => {
                let p = queue::<f32>(comm, &s, kind, count, mem, in_place, &mut data);
                let a = p.choices.last().unwrap().algorithm;
                (Box::new(p), a)
            }
            1 => {
                let p = queue::<f16>(comm, &s, kind, count, mem, in_place, &mut data);
                let a = p.choices.last().unwrap().algorithm;
                (Box::new(p), a)
            }
            _ => {
                let p = queue::<bf16>(comm, &s, kind, count, mem, in_place, &mut data);
                let a = p.choices.last().unwrap().algorithm;
                (Box::new(p), a)
            }
        };
        pending.push(p);
        ran.push(a);
    }
    sync(&s);
    comm.check().unwrap();
    for p in &pending {
        p.check();
    }
    ran
}

/// The copy-engine all-gather and broadcast at every size (their thresholds 0, no low-latency
/// forms; 4 KiB staging slots for the calls that keep their kernels: many rounds).
fn ce_config() -> CommConfig {
    CommConfig {
        gather_ce_min_bytes: 0,
        broadcast_ce_min_bytes: 0,
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        stage_bytes: Some(4096),
        max_blocks: 4,
        ..Default::default()
    }
}
