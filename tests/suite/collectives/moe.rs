//! MoE dispatch / combine through a [`MoePlan`] against the host reference
//! (`moe_dispatch_reference`, `moe_combine_reference`, bit for bit): teams of 2, 3 and 8 ranks
//! (on the simulator each its own device; on a real driver placed round-robin on its GPUs,
//! several ranks sharing one where it has fewer), bf16 and FP8 payloads with and without
//! scales (per token, per group), k = 1, 2, 8, random and skewed routings (every token to one
//! expert, ranks receiving nothing), T = 0 and T at the maximum, f32 / bf16 expert outputs and
//! outputs; graph replay with new routings; hostile inputs on the host (errors naming the
//! argument) and on the device (ids out of range, rows past the plan's: the bounds word, the
//! rest delivered, nothing written outside: guard regions); a rank that never arrives; ranks
//! sharing one simulated device.

// `u64::is_multiple_of` needs Rust 1.87; the workspace keeps `%` for older toolchains. Ranks
// index their buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::manual_is_multiple_of, clippy::needless_range_loop)]

use cuda_multimem::{CaptureMode, Device, DeviceBuffer, DeviceRepr, Stream};
use cuda_multimem_collectives::testing::{
    moe_combine_reference, moe_dispatch_reference, random_input, MoeDispatched,
};
use cuda_multimem_collectives::{
    bf16, Algorithm, CommConfig, Communicator, DType, Dst, Element, MoePlan, MoeProtocol,
    MoeScales, MoeShape, MulticastPolicy, ReduceOp, Src,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{
    collectives_unsupported, env, invalid_arg_of, placed, sim, skip, sync_all, team_on, Rng,
};

/// Bytes of the guard before and after every buffer a call writes or reads.
const GUARD: usize = 64;

/// Run `f` on teams of `sizes`: on the simulator each rank its own simulated device; on a real
/// driver the ranks placed on its GPUs (sharing them where it has fewer).
fn for_teams(test: &str, sizes: &[usize], f: impl Fn(&[Device], usize)) {
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip(test, why);
    }
    if e.driver.is_simulated() {
        drop(e);
        for &n in sizes {
            let s = sim(SimConfig::new(n, 13050));
            f(&s.driver.devices(), n);
        }
    } else {
        for &n in sizes {
            f(&placed(&e, n), n);
        }
    }
}

/// A device buffer of `len` elements between two guards of [`GUARD`] bytes of `fill`.
struct Guarded<T: DeviceRepr> {
    buf: DeviceBuffer<u8>,
    len: usize,
    fill: u8,
    _t: std::marker::PhantomData<T>,
}

impl<T: DeviceRepr + Default + Clone> Guarded<T> {
    fn new(dev: &Device, len: usize, fill: u8) -> Self {
        let bytes = len * std::mem::size_of::<T>() + 2 * GUARD;
        let buf = DeviceBuffer::from_host(dev, &vec![fill; bytes]).unwrap();
        Guarded {
            buf,
            len,
            fill,
            _t: std::marker::PhantomData,
        }
    }

    fn write(&mut self, data: &[T]) {
        assert_eq!(data.len(), self.len);
        // SAFETY: DeviceRepr values are plain bytes.
        let b = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        self.buf.copy_from_host(GUARD, b).unwrap();
    }

    fn read(&self) -> Vec<T> {
        let mut v = vec![T::default(); self.len];
        // SAFETY: as `write`.
        let b = unsafe {
            std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(&v[..]))
        };
        self.buf.copy_to_host(GUARD, b).unwrap();
        v
    }

    /// The guards are as they were.
    fn guards_intact(&self, what: &str) {
        let all = self.buf.to_vec().unwrap();
        let end = GUARD + self.len * std::mem::size_of::<T>();
        assert!(
            all[..GUARD]
                .iter()
                .chain(&all[end..])
                .all(|&b| b == self.fill),
            "{what}: a guard changed"
        );
    }

    fn src(&self) -> Src<'static, T> {
        // SAFETY: the buffer outlives every call of the test that uses the view; `len`
        // elements from GUARD lie inside it.
        unsafe { Src::from_raw(self.buf.device_ptr() + GUARD as u64, self.len) }
    }

    fn dst(&self) -> Dst<'static, T> {
        // SAFETY: as `src`.
        unsafe { Dst::from_raw(self.buf.device_ptr() + GUARD as u64, self.len) }
    }
}

/// How tokens are routed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Routing {
    /// Distinct random experts, some slots −1.
    Random,
    /// Every token's every slot to expert 0.
    OneExpert,
    /// Only experts of rank 0 (the other ranks receive nothing).
    FirstRank,
}

/// One rank's inputs of a dispatch.
struct Inputs {
    tokens: Guarded<u8>,
    ids: Guarded<i32>,
    w: Guarded<f32>,
    scales: Guarded<f32>,
    h_tokens: Vec<u8>,
    h_ids: Vec<i32>,
    h_w: Vec<f32>,
    h_scales: Vec<f32>,
}

/// A team, its streams, a plan and every rank's inputs (T per rank).
struct Case {
    comm: Communicator,
    streams: Vec<Stream>,
    plan: MoePlan,
    inputs: Vec<Inputs>,
    t: Vec<usize>,
}

impl Case {
    fn new(comm: Communicator, streams: Vec<Stream>, shape: MoeShape, t: Vec<usize>) -> Case {
        let plan = MoePlan::new(&comm, shape.clone()).unwrap();
        let n = comm.size();
        let row = shape.hidden * shape.payload_bytes;
        let sp = shape.scales_per_token();
        let k = shape.top_k;
        let inputs = (0..n)
            .map(|r| {
                let d = comm.device(r).unwrap();
                Inputs {
                    tokens: Guarded::new(d, t[r] * row, 0xa5),
                    ids: Guarded::new(d, t[r] * k, 0x5a),
                    w: Guarded::new(d, t[r] * k, 0x3c),
                    scales: Guarded::new(d, t[r] * sp, 0xc3),
                    h_tokens: vec![],
                    h_ids: vec![],
                    h_w: vec![],
                    h_scales: vec![],
                }
            })
            .collect();
        Case {
            comm,
            streams,
            plan,
            inputs,
            t,
        }
    }

    fn shape(&self) -> &MoeShape {
        self.plan.shape()
    }

    /// The form the plan's calls report.
    fn form(&self) -> Algorithm {
        if self.shape().low_latency() {
            Algorithm::MoeLl
        } else {
            Algorithm::MoeBulk
        }
    }

    /// New random tokens, routing, weights and scales.
    fn fill(&mut self, rng: &mut Rng, routing: Routing) {
        let sh = self.plan.shape().clone();
        let (k, e, n) = (sh.top_k, sh.num_experts, self.comm.size());
        let row = sh.hidden * sh.payload_bytes;
        let sp = sh.scales_per_token();
        for r in 0..n {
            let t = self.t[r];
            let inp = &mut self.inputs[r];
            inp.h_tokens = vec![0u8; t * row];
            rng.fill(&mut inp.h_tokens);
            inp.h_ids = Vec::with_capacity(t * k);
            for _ in 0..t {
                let mut picked: Vec<i32> = Vec::new();
                for _ in 0..k {
                    let id = match routing {
                        Routing::OneExpert => 0,
                        Routing::FirstRank => (rng.next_u64() % (e / n).max(1) as u64) as i32,
                        Routing::Random => {
                            if rng.next_u64() % 6 == 0 {
                                -1
                            } else {
                                loop {
                                    let x = (rng.next_u64() % e as u64) as i32;
                                    if !picked.contains(&x) || picked.len() >= e {
                                        break x;
                                    }
                                }
                            }
                        }
                    };
                    picked.push(id);
                }
                inp.h_ids.extend(picked);
            }
            let mut seed = rng.next_u64() | 1;
            inp.h_w = random_input::<f32>(t * k, &mut seed);
            inp.h_scales = random_input::<f32>(t * sp, &mut seed);
            inp.tokens.write(&inp.h_tokens);
            inp.ids.write(&inp.h_ids);
            inp.w.write(&inp.h_w);
            inp.scales.write(&inp.h_scales);
        }
    }

    /// Rank `r`'s dispatch, as the shape asks (with or without scales).
    fn dispatch(&self, r: usize) -> cuda_multimem::Result<cuda_multimem_collectives::Choice> {
        let h = self.comm.rank(r).unwrap();
        let inp = &self.inputs[r];
        let s = &self.streams[r];
        // the tokens as elements of the payload (u16 for bf16, u8 for FP8)
        let (ptr, bytes) = (inp.tokens.buf.device_ptr() + GUARD as u64, inp.tokens.len);
        match (self.shape().payload_bytes, self.shape().scales) {
            (2, MoeScales::None) => {
                // SAFETY: inside the guarded buffer, which outlives the call.
                let x = unsafe { Src::<u16>::from_raw(ptr, bytes / 2) };
                h.moe_dispatch(&self.plan, x, inp.ids.src(), inp.w.src(), s)
            }
            (2, _) => {
                // SAFETY: as above.
                let x = unsafe { Src::<u16>::from_raw(ptr, bytes / 2) };
                h.moe_dispatch_scaled(
                    &self.plan,
                    x,
                    inp.ids.src(),
                    inp.w.src(),
                    inp.scales.src(),
                    s,
                )
            }
            (_, MoeScales::None) => {
                h.moe_dispatch(&self.plan, inp.tokens.src(), inp.ids.src(), inp.w.src(), s)
            }
            _ => h.moe_dispatch_scaled(
                &self.plan,
                inp.tokens.src(),
                inp.ids.src(),
                inp.w.src(),
                inp.scales.src(),
                s,
            ),
        }
    }

    fn reference(&self) -> Vec<MoeDispatched> {
        let toks: Vec<&[u8]> = self.inputs.iter().map(|i| &i.h_tokens[..]).collect();
        let ids: Vec<&[i32]> = self.inputs.iter().map(|i| &i.h_ids[..]).collect();
        let sc: Vec<&[f32]> = self.inputs.iter().map(|i| &i.h_scales[..]).collect();
        moe_dispatch_reference(self.shape(), self.comm.size(), &toks, &ids, &sc).unwrap()
    }

    /// Every rank's plan holds what the reference says.
    fn verify_dispatch(&self, want: &[MoeDispatched], what: &str) {
        let sh = self.shape();
        let row = sh.hidden * sh.payload_bytes;
        let sp = sh.scales_per_token();
        for r in 0..self.comm.size() {
            let l = self.plan.local_experts(r).unwrap();
            let w = &want[r];
            let counts = self.plan.expert_counts(r).unwrap().to_vec().unwrap();
            let offsets = self.plan.expert_offsets(r).unwrap().to_vec().unwrap();
            assert_eq!(&counts[..l], &w.counts[..], "{what}: rank {r}'s counts");
            assert_eq!(offsets, w.offsets, "{what}: rank {r}'s offsets");
            let total = w.offsets[l] as usize;
            let map = self.plan.dispatch_map(r).unwrap().to_vec().unwrap();
            assert_eq!(&map[..total], &w.map[..], "{what}: rank {r}'s map");
            let x = self.plan.expert_tokens(r).unwrap().to_vec().unwrap();
            assert!(
                x[..total * row] == w.tokens[..],
                "{what}: rank {r}'s expert-grouped tokens"
            );
            if sp > 0 {
                let s = self.plan.expert_scales(r).unwrap().to_vec().unwrap();
                assert_eq!(
                    s[..total * sp]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    w.scales.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what}: rank {r}'s scales"
                );
            }
        }
    }

    /// Combine random expert outputs of `Y` into outputs of `O`; every rank's output as the
    /// reference, bit for bit, and its guards intact.
    fn combine_and_verify<Y: Element + Default + Clone, O: Element + Default + Clone>(
        &self,
        want: &[MoeDispatched],
        seed: u64,
        what: &str,
    ) {
        let (y, outs) = self.combine::<Y, O>(seed);
        sync_all(&self.streams);
        self.comm.check().unwrap();
        self.verify_combine(want, &y, &outs, what);
    }

    #[allow(clippy::type_complexity)]
    fn combine<Y: Element + Default + Clone, O: Element + Default + Clone>(
        &self,
        seed: u64,
    ) -> (Vec<(Vec<Y>, Guarded<Y>)>, Vec<Guarded<O>>) {
        let sh = self.shape();
        let n = self.comm.size();
        let rows = self.plan.rows();
        let mut seed = seed | 1;
        let mut y = Vec::new();
        let mut outs = Vec::new();
        for r in 0..n {
            let d = self.comm.device(r).unwrap();
            let hy = random_input::<Y>(rows * sh.hidden, &mut seed);
            let mut g = Guarded::<Y>::new(d, rows * sh.hidden, 0x77);
            g.write(&hy);
            let o = Guarded::<O>::new(d, self.t[r] * sh.hidden, 0x99);
            let c = self
                .comm
                .rank(r)
                .unwrap()
                .moe_combine(&self.plan, g.src(), o.dst(), &self.streams[r])
                .unwrap();
            assert_eq!(c.algorithm, self.form(), "{c}");
            y.push((hy, g));
            outs.push(o);
        }
        (y, outs)
    }

    fn verify_combine<Y: Element + Default + Clone, O: Element + Default + Clone>(
        &self,
        want: &[MoeDispatched],
        y: &[(Vec<Y>, Guarded<Y>)],
        outs: &[Guarded<O>],
        what: &str,
    ) {
        let ys: Vec<&[Y]> = y.iter().map(|(h, _)| &h[..]).collect();
        let ws: Vec<&[f32]> = self.inputs.iter().map(|i| &i.h_w[..]).collect();
        let expect = moe_combine_reference::<Y, O>(self.shape(), want, &ys, &ws);
        for r in 0..self.comm.size() {
            let got = outs[r].read();
            let same = got
                .iter()
                .zip(&expect[r])
                .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
            assert!(
                same && got.len() == expect[r].len(),
                "{what}: rank {r}'s combine"
            );
            outs[r].guards_intact(&format!("{what}: rank {r}'s out"));
            y[r].1
                .guards_intact(&format!("{what}: rank {r}'s expert_out"));
        }
    }

    fn run(&self, what: &str) -> Vec<MoeDispatched> {
        for r in 0..self.comm.size() {
            let c = self.dispatch(r).unwrap();
            assert_eq!(c.algorithm, self.form(), "{c}");
        }
        sync_all(&self.streams);
        self.comm.check().unwrap_or_else(|e| panic!("{what}: {e}"));
        let want = self.reference();
        self.verify_dispatch(&want, what);
        for (r, i) in self.inputs.iter().enumerate() {
            i.tokens
                .guards_intact(&format!("{what}: rank {r}'s tokens"));
            i.ids.guards_intact(what);
            i.w.guards_intact(what);
            i.scales.guards_intact(what);
        }
        want
    }
}

fn shape(hidden: usize, payload: usize, k: usize, experts: usize, tmax: usize) -> MoeShape {
    MoeShape::new(tmax, hidden, payload, k, experts)
}

fn config() -> CommConfig {
    CommConfig {
        push_threads: 64,
        ..CommConfig::default()
    }
}

#[test]
fn moe_dispatch_and_combine_equal_the_host_reference() {
    for_teams("collectives::moe::reference", &[2, 3, 8], |devices, n| {
        let mut rng = Rng::new(900 + n as u64);
        // (payload bytes, k, scales, routing)
        let cases = [
            (2, 2, MoeScales::None, Routing::Random),
            (1, 8, MoeScales::PerToken, Routing::Random),
            (1, 1, MoeScales::PerGroup(16), Routing::OneExpert),
            (2, 2, MoeScales::PerGroup(8), Routing::FirstRank),
        ];
        for (ci, &(pb, k, sc, routing)) in cases.iter().enumerate() {
            let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
            let experts = 2 * n.max(4);
            let tmax = 5;
            let mut sh = shape(32, pb, k, experts - experts % n, tmax);
            sh.scales = sc;
            // both forms: the low-latency one (the default at these sizes) and the bulk one
            sh.protocol = [MoeProtocol::Auto, MoeProtocol::Bulk][ci % 2];
            sh.expert_out = if ci % 2 == 0 { DType::Bf16 } else { DType::F32 };
            // T: 0 on rank 0, the maximum on the last, between elsewhere
            let t: Vec<usize> = (0..n)
                .map(|r| match r {
                    0 => 0,
                    r if r == n - 1 => tmax,
                    r => 1 + r % tmax,
                })
                .collect();
            let mut case = Case::new(comm, s, sh, t);
            case.fill(&mut rng, routing);
            let what = format!(
                "{n} ranks, case {ci} ({pb}-byte payload, k {k}, {sc:?}, {routing:?}, {:?})",
                case.shape().protocol
            );
            let want = case.run(&what);
            if ci % 2 == 0 {
                case.combine_and_verify::<bf16, bf16>(&want, 7 + ci as u64, &what);
                case.combine_and_verify::<bf16, f32>(&want, 8 + ci as u64, &what);
            } else {
                case.combine_and_verify::<f32, f32>(&want, 9 + ci as u64, &what);
                case.combine_and_verify::<f32, bf16>(&want, 10 + ci as u64, &what);
            }
            // again with a new routing: nothing of the last call is taken for this one's
            case.fill(&mut rng, Routing::Random);
            let want = case.run(&format!("{what}, second call"));
            if ci % 2 == 0 {
                case.combine_and_verify::<bf16, bf16>(&want, 11, &what);
            } else {
                case.combine_and_verify::<f32, f32>(&want, 12, &what);
            }
        }
    });
}

#[test]
fn a_captured_dispatch_and_combine_replay_with_new_routings() {
    for_teams("collectives::moe::graph", &[3], |devices, n| {
        for protocol in [MoeProtocol::LowLatency, MoeProtocol::Bulk] {
            let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
            let mut rng = Rng::new(950);
            let mut sh = shape(16, 1, 2, 6, 4);
            sh.scales = MoeScales::PerToken;
            sh.expert_out = DType::F32;
            sh.protocol = protocol;
            let mut case = Case::new(comm, s, sh.clone(), vec![4, 2, 3]);
            case.fill(&mut rng, Routing::Random);
            let rows = case.plan.rows();
            let mut ys: Vec<Guarded<f32>> = (0..n)
                .map(|r| Guarded::new(case.comm.device(r).unwrap(), rows * sh.hidden, 1))
                .collect();
            let outs: Vec<Guarded<f32>> = (0..n)
                .map(|r| Guarded::new(case.comm.device(r).unwrap(), case.t[r] * sh.hidden, 2))
                .collect();
            let mut execs = Vec::new();
            for r in 0..n {
                let sr = case.streams[r].as_stream_ref();
                sr.begin_capture(CaptureMode::ThreadLocal).unwrap();
                case.dispatch(r).unwrap();
                case.comm
                    .rank(r)
                    .unwrap()
                    .moe_combine(&case.plan, ys[r].src(), outs[r].dst(), &case.streams[r])
                    .unwrap();
                let graph = sr.end_capture().unwrap();
                // SAFETY: the team, the case's buffers and the streams outlive `execs`.
                execs.push(unsafe { graph.instantiate() }.unwrap());
            }
            for replay in 0..3 {
                let routing = [Routing::Random, Routing::OneExpert, Routing::FirstRank][replay];
                case.fill(&mut rng, routing);
                let mut seed = 77 + replay as u64;
                let hy: Vec<Vec<f32>> = (0..n)
                    .map(|_| random_input::<f32>(rows * sh.hidden, &mut seed))
                    .collect();
                for r in 0..n {
                    ys[r].write(&hy[r]);
                }
                for r in 0..n {
                    execs[r].launch(&case.streams[r]).unwrap();
                }
                sync_all(&case.streams);
                case.comm.check().unwrap();
                let what = format!("replay {replay} ({routing:?}, {protocol:?})");
                let want = case.reference();
                case.verify_dispatch(&want, &what);
                let ys_h: Vec<&[f32]> = hy.iter().map(|v| &v[..]).collect();
                let ws: Vec<&[f32]> = case.inputs.iter().map(|i| &i.h_w[..]).collect();
                let expect = moe_combine_reference::<f32, f32>(&sh, &want, &ys_h, &ws);
                for r in 0..n {
                    let got: Vec<u32> = outs[r].read().iter().map(|v| v.to_bits()).collect();
                    let exp: Vec<u32> = expect[r].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, exp, "{what}: rank {r}'s combine");
                    outs[r].guards_intact(&what);
                }
            }
            drop(execs);
        }
    });
}

#[test]
fn back_to_back_dispatches_and_other_collectives_between_keep_calls_apart() {
    // Two dispatches in a row (the second's pushes must not meet rows the first is still
    // placing), then the combine of the second; an allreduce between calls shifts the team's
    // counters, so the low-latency form's regions alternate by the plan's own call sequence,
    // not by the counters. Both forms, several rounds, new routings each time.
    for_teams("collectives::moe::back_to_back", &[2, 3], |devices, n| {
        for protocol in [MoeProtocol::LowLatency, MoeProtocol::Bulk] {
            let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
            let mut rng = Rng::new(970 + n as u64);
            let mut sh = shape(32, 2, 2, 2 * n, 4);
            sh.protocol = protocol;
            let t: Vec<usize> = (0..n).map(|r| 1 + (r + 2) % 4).collect();
            let mut case = Case::new(comm, s, sh, t);
            let mut bufs: Vec<DeviceBuffer<f32>> = (0..n)
                .map(|r| DeviceBuffer::zeroed(case.comm.device(r).unwrap(), 1000).unwrap())
                .collect();
            for round in 0..4 {
                let what = format!("{n} ranks, {protocol:?}, round {round}");
                case.fill(&mut rng, Routing::Random);
                case.run(&format!("{what}, first dispatch"));
                if round % 2 == 1 {
                    for r in 0..n {
                        case.comm
                            .rank(r)
                            .unwrap()
                            .all_reduce_in_place(&mut bufs[r], ReduceOp::Sum, &case.streams[r])
                            .unwrap();
                    }
                }
                case.fill(&mut rng, Routing::Random);
                let want = case.run(&format!("{what}, second dispatch"));
                case.combine_and_verify::<bf16, bf16>(&want, 21 + round, &what);
            }
        }
    });
}

#[test]
fn hostile_arguments_on_the_host_are_errors_naming_the_argument() {
    for_teams("collectives::moe::hostile_host", &[2], |devices, _n| {
        let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
        // shapes
        let bad = |f: &dyn Fn(&mut MoeShape)| {
            let mut sh = shape(32, 2, 2, 4, 4);
            f(&mut sh);
            invalid_arg_of(MoePlan::new(&comm, sh))
        };
        assert_eq!(bad(&|s| s.hidden = 20), "hidden");
        assert_eq!(bad(&|s| s.num_experts = 5), "num_experts");
        assert_eq!(bad(&|s| s.top_k = 0), "top_k");
        assert_eq!(bad(&|s| s.max_tokens_per_rank = 0), "max_tokens_per_rank");
        assert_eq!(bad(&|s| s.scales = MoeScales::PerGroup(7)), "scales");
        assert_eq!(bad(&|s| s.placement = Some(vec![0, 1, 2, 0])), "placement");
        assert_eq!(bad(&|s| s.max_recv_rows = Some(0)), "max_recv_rows");
        assert_eq!(bad(&|s| s.expert_out = DType::U8), "expert_out");
        assert!(shape(32, 2, 2, 4, 4).symmetric_bytes(2).unwrap() > 0);
        // the plan stops at 32 ranks (one u32 destination mask per token), below the team's 72
        assert_eq!(
            invalid_arg_of(shape(32, 2, 2, 4, 4).symmetric_bytes(33)),
            "n"
        );
        let mut sh = shape(32, 2, 2, 4, 4);
        sh.scales = MoeScales::PerToken;
        let plan = MoePlan::new(&comm, sh).unwrap();
        let d = comm.device(0).unwrap();
        let h = comm.rank(0).unwrap();
        let toks = |t: usize| Guarded::<u16>::new(d, t * 32, 0);
        let f32s = |len: usize| Guarded::<f32>::new(d, len, 0);
        let i32s = |len: usize| Guarded::<i32>::new(d, len, 0);
        let (t3, i6, w6, s3) = (toks(3), i32s(6), f32s(6), f32s(3));
        // T above the maximum
        let (t5, i10, w10, s5) = (toks(5), i32s(10), f32s(10), f32s(5));
        assert_eq!(
            invalid_arg_of(h.moe_dispatch_scaled(
                &plan,
                t5.src(),
                i10.src(),
                w10.src(),
                s5.src(),
                &s[0]
            )),
            "tokens"
        );
        // mismatched k
        let (i5, w5) = (i32s(5), f32s(5));
        assert_eq!(
            invalid_arg_of(h.moe_dispatch_scaled(
                &plan,
                t3.src(),
                i5.src(),
                w6.src(),
                s3.src(),
                &s[0]
            )),
            "topk_ids"
        );
        assert_eq!(
            invalid_arg_of(h.moe_dispatch_scaled(
                &plan,
                t3.src(),
                i6.src(),
                w5.src(),
                s3.src(),
                &s[0]
            )),
            "topk_weights"
        );
        // scales: wrong length, missing
        assert_eq!(
            invalid_arg_of(h.moe_dispatch_scaled(
                &plan,
                t3.src(),
                i6.src(),
                w6.src(),
                w6.src(),
                &s[0]
            )),
            "scales"
        );
        assert_eq!(
            invalid_arg_of(h.moe_dispatch(&plan, t3.src(), i6.src(), w6.src(), &s[0])),
            "scales"
        );
        // the payload's element
        let t8 = Guarded::<u8>::new(d, 3 * 32, 0);
        assert_eq!(
            invalid_arg_of(h.moe_dispatch_scaled(
                &plan,
                t8.src(),
                i6.src(),
                w6.src(),
                s3.src(),
                &s[0]
            )),
            "tokens"
        );
        // tokens not whole rows
        let t_odd = Guarded::<u16>::new(d, 3 * 32 + 1, 0);
        assert_eq!(
            invalid_arg_of(h.moe_dispatch_scaled(
                &plan,
                t_odd.src(),
                i6.src(),
                w6.src(),
                s3.src(),
                &s[0]
            )),
            "tokens"
        );
        // combine: the outputs' length and type, out's rows
        let rows = plan.rows();
        let y = Guarded::<bf16>::new(d, rows * 32, 0);
        let y_short = Guarded::<bf16>::new(d, rows * 32 - 8, 0);
        let y_f32 = Guarded::<f32>::new(d, rows * 32, 0);
        let o = Guarded::<f32>::new(d, 3 * 32, 0);
        let o_odd = Guarded::<f32>::new(d, 3 * 32 + 4, 0);
        let o_big = Guarded::<f32>::new(d, 5 * 32, 0);
        assert_eq!(
            invalid_arg_of(h.moe_combine(&plan, y_short.src(), o.dst(), &s[0])),
            "expert_out"
        );
        assert_eq!(
            invalid_arg_of(h.moe_combine(&plan, y_f32.src(), o.dst(), &s[0])),
            "expert_out"
        );
        assert_eq!(
            invalid_arg_of(h.moe_combine(&plan, y.src(), o_odd.dst(), &s[0])),
            "out"
        );
        assert_eq!(
            invalid_arg_of(h.moe_combine(&plan, y.src(), o_big.dst(), &s[0])),
            "out"
        );
        // a plan of another communicator
        let (other, _s2) = team_on(devices, config(), MulticastPolicy::Never);
        let foreign = MoePlan::new(&other, shape(32, 2, 2, 4, 4)).unwrap();
        assert_eq!(
            invalid_arg_of(h.moe_dispatch(&foreign, t3.src(), i6.src(), w6.src(), &s[0])),
            "plan"
        );
        // nothing was queued: the team is healthy
        sync_all(&s);
        comm.check().unwrap();
    });
}

#[test]
fn ids_out_of_range_and_rows_past_the_plan_set_the_bounds_word_and_write_nothing_outside() {
    for_teams("collectives::moe::hostile_device", &[3], |devices, n| {
        let mut rng = Rng::new(960);
        for case_no in 0..2 {
            let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
            let mut sh = shape(16, 2, 2, 6, 4);
            sh.expert_out = DType::F32;
            if case_no == 1 {
                // every token to expert 0 (rank 0): 12 entries for 5 rows
                sh.max_recv_rows = Some(5);
            }
            let mut case = Case::new(comm, s, sh, vec![4; n]);
            case.fill(
                &mut rng,
                if case_no == 0 {
                    Routing::Random
                } else {
                    Routing::OneExpert
                },
            );
            let bad_rank = if case_no == 0 {
                // rank 1's ids: one too large, one negative other than -1
                let ids = &mut case.inputs[1].h_ids;
                ids[0] = 6;
                ids[3] = -7;
                let v = ids.clone();
                case.inputs[1].ids.write(&v);
                1
            } else {
                0
            };
            for r in 0..n {
                case.dispatch(r).unwrap();
            }
            sync_all(&case.streams);
            let want = case.reference();
            // the ranks the error does not concern finished their calls whole (a bounds error
            // ends no wait early): no error
            for r in (0..n).filter(|&r| r != bad_rank) {
                case.comm
                    .rank(r)
                    .unwrap()
                    .check()
                    .unwrap_or_else(|e| panic!("case {case_no}: rank {r}: {e}"));
            }
            assert_eq!(want[0].bounds, case_no == 1);
            // what was valid was delivered (the rows that fit), nothing written outside
            case.verify_dispatch(&want, &format!("case {case_no}"));
            for (r, i) in case.inputs.iter().enumerate() {
                i.tokens.guards_intact(&format!("case {case_no}: rank {r}"));
                i.ids.guards_intact(&format!("case {case_no}: rank {r}"));
            }
            // the combine of what was delivered (a slot refused adds nothing)
            let (y, outs) = case.combine::<f32, f32>(5);
            sync_all(&case.streams);
            case.verify_combine(&want, &y, &outs, &format!("case {case_no}"));
            // the bounds word of the rank concerned
            assert_eq!(
                invalid_arg_of(case.comm.rank(bad_rank).unwrap().check()),
                "counts",
                "case {case_no}: rank {bad_rank}"
            );
            // recover, build the plan again, and the team runs
            case.comm.recover().unwrap();
            let mut again = case.shape().clone();
            again.max_recv_rows = None;
            case.plan = MoePlan::new(&case.comm, again).unwrap();
            case.fill(&mut rng, Routing::Random);
            let want = case.run(&format!("after case {case_no}"));
            case.combine_and_verify::<f32, f32>(&want, 6, &format!("after case {case_no}"));
        }
    });
}

#[test]
fn nan_weights_propagate_into_their_tokens_only() {
    for_teams("collectives::moe::nan", &[2], |devices, n| {
        let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
        let mut rng = Rng::new(970);
        let mut sh = shape(16, 2, 2, 4, 3);
        sh.expert_out = DType::F32;
        let mut case = Case::new(comm, s, sh, vec![3; n]);
        case.fill(&mut rng, Routing::OneExpert);
        case.inputs[0].h_w[2] = f32::NAN; // token 1, slot 0
        let w = case.inputs[0].h_w.clone();
        case.inputs[0].w.write(&w);
        let want = case.run("nan");
        let (_, outs) = case.combine::<f32, f32>(3);
        sync_all(&case.streams);
        case.comm.check().unwrap();
        let got = outs[0].read();
        let h = 16;
        assert!(got[h..2 * h].iter().all(|v| v.is_nan()), "token 1 is NaN");
        assert!(got[..h].iter().chain(&got[2 * h..]).all(|v| !v.is_nan()));
        let _ = want;
    });
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout() {
    let e = sim(SimConfig::new(3, 13050));
    let short = std::time::Duration::from_millis(300);
    let (comm, s) = team_on(
        &e.driver.devices(),
        CommConfig {
            timeout: short,
            first_call_timeout: Some(short),
            ..config()
        },
        MulticastPolicy::Never,
    );
    let mut case = Case::new(comm, s, shape(16, 2, 1, 3, 2), vec![2; 3]);
    case.fill(&mut Rng::new(980), Routing::Random);
    for r in 0..2 {
        case.dispatch(r).unwrap();
    }
    for st in case.streams.iter().take(2) {
        st.synchronize().unwrap();
    }
    for r in 0..2 {
        match case.comm.rank(r).unwrap().check() {
            Err(cuda_multimem::Error::Timeout { .. })
            | Err(cuda_multimem::Error::Unusable { .. }) => {}
            other => panic!("rank {r}: expected a timeout, got {other:?}"),
        }
    }
}

/// Ranks sharing one simulated device (every rank's blocks resident at once).
#[test]
fn moe_on_one_simulated_device_shared_by_4_ranks() {
    let n = 4;
    let e = sim(SimConfig::new(1, 13050));
    let devices = placed(&e, n);
    let (comm, s) = team_on(&devices, config(), MulticastPolicy::Never);
    let mut sh = shape(16, 1, 2, 8, 3);
    sh.scales = MoeScales::PerToken;
    let mut case = Case::new(comm, s, sh, vec![3, 0, 2, 3]);
    case.fill(&mut Rng::new(990), Routing::Random);
    let want = case.run("4 ranks on one device");
    case.combine_and_verify::<bf16, bf16>(&want, 4, "4 ranks on one device");
    assert_eq!(e.sim.as_ref().unwrap().residency_waits(), 0);
}

/// A team of one: its tokens never leave the device, the same layout and combine.
#[test]
fn a_team_of_one_dispatches_to_its_own_experts() {
    for_teams("collectives::moe::alone", &[1], |devices, _n| {
        let (comm, s) = team_on(devices, config(), MulticastPolicy::Never);
        let mut sh = shape(16, 2, 8, 8, 4);
        sh.scales = MoeScales::PerGroup(4);
        let mut case = Case::new(comm, s, sh, vec![4]);
        case.fill(&mut Rng::new(995), Routing::Random);
        let want = case.run("a team of one");
        case.combine_and_verify::<bf16, f32>(&want, 5, "a team of one");
    });
}
