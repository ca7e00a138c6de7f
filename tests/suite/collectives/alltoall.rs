//! All-to-all (`all_to_all`, `all_to_all_in_place`, `all_to_all_v` with counts on the host,
//! `all_to_all_v_dev` with counts on the device) against a host reference: teams of 2 to 8
//! ranks (on the simulator each its own device; on a real driver placed round-robin on its GPUs,
//! several ranks sharing one where it has fewer), both forms (low-latency, direct into a
//! symmetric output or through the scratch), symmetric buffers and the caller's own memory,
//! element types of 1, 2, 4 and 8 bytes, random and zero counts, in place; graph replay with
//! new counts read on the device; hostile counts on the host (errors naming the argument) and on
//! the device (the error word, nothing written outside the buffers); ranks sharing one simulated
//! device.

use cuda_multimem::{CaptureMode, Device, DeviceBuffer, DeviceRepr, Stream};
use cuda_multimem_collectives::kernels::MAX_RANKS;
use cuda_multimem_collectives::{
    Algorithm, Choice, CommConfig, Communicator, MulticastPolicy, Operands, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{
    collectives_unsupported, env, invalid_arg_of, placed, sim, skip, sync_all, team_on, Rng,
};

/// The team sizes run.
const SIZES: [usize; 4] = [2, 3, 5, 8];

/// Configurations reaching both forms: the defaults (low-latency for small calls), the
/// low-latency form with few threads per block (parts split over several blocks), and no
/// low-latency form (direct, or through a small scratch; few threads: several blocks).
fn configs() -> [CommConfig; 3] {
    [
        CommConfig::default(),
        CommConfig {
            threads: 64,
            ..CommConfig::default()
        },
        CommConfig {
            gather_ll_max_bytes: 0,
            // regions of 8 MiB: the real driver's largest own or in-place outputs (8 ranks of
            // 100000 8-byte elements: 6.4 MB)
            scratch_bytes: 24 << 20,
            push_threads: 64,
            ..CommConfig::default()
        },
    ]
}

/// Whether configuration `ci` of [`configs`] runs the low-latency form of small calls.
fn is_ll(ci: usize) -> bool {
    ci < 2
}

/// Run `f` on teams of every size in [`SIZES`]: on the simulator each rank its own simulated
/// device; on a real driver the ranks placed on its GPUs (sharing them where it has fewer).
fn for_teams(test: &str, f: impl Fn(&[Device], usize)) {
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip(test, why);
    }
    if e.driver.is_simulated() {
        // one simulated machine at a time: a machine of n devices per team
        drop(e);
        for n in SIZES {
            let s = sim(SimConfig::new(n, 13050));
            f(&s.driver.devices(), n);
        }
    } else {
        for n in SIZES {
            f(&placed(&e, n), n);
        }
    }
}

/// One buffer per rank: a symmetric buffer, or the caller's own memory.
enum Bufs<T: DeviceRepr> {
    Sym(SymmetricBuffer<T>),
    Own(Vec<DeviceBuffer<T>>),
}

impl<T: DeviceRepr + Default> Bufs<T> {
    fn new(comm: &Communicator, sym: bool, len: usize) -> Self {
        if sym {
            Bufs::Sym(comm.alloc(len).unwrap())
        } else {
            Bufs::Own(
                (0..comm.size())
                    .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), len).unwrap())
                    .collect(),
            )
        }
    }

    fn write(&mut self, r: usize, data: &[T]) {
        match self {
            Bufs::Sym(b) => b.write(r, 0, data).unwrap(),
            Bufs::Own(v) => v[r].copy_from_host(0, data).unwrap(),
        }
    }

    fn read(&self, r: usize, len: usize) -> Vec<T> {
        let mut out = vec![T::default(); len];
        match self {
            Bufs::Sym(b) => b.read(r, 0, &mut out).unwrap(),
            Bufs::Own(v) => v[r].copy_to_host(0, &mut out).unwrap(),
        }
        out
    }
}

/// Random values of `T` (its bytes drawn from `rng`).
fn random<T: DeviceRepr + Default>(rng: &mut Rng, len: usize) -> Vec<T> {
    let mut v = vec![T::default(); len];
    // SAFETY: DeviceRepr types take any bit pattern; the slice covers exactly v's bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(&v[..]))
    };
    rng.fill(bytes);
    v
}

/// The host reference of an all-to-all with counts: rank k's output is `before[k]` with, for
/// every sender r, `sc[r][k]` elements of `input[r]` from `so[r][k]` at `ro[k][r]`.
#[allow(clippy::type_complexity)]
fn reference<T: Copy>(
    input: &[Vec<T>],
    before: &[Vec<T>],
    sc: &[Vec<usize>],
    so: &[Vec<usize>],
    ro: &[Vec<usize>],
) -> Vec<Vec<T>> {
    let n = input.len();
    let mut out = before.to_vec();
    for k in 0..n {
        for r in 0..n {
            let c = sc[r][k];
            out[k][ro[k][r]..ro[k][r] + c].copy_from_slice(&input[r][so[r][k]..so[r][k] + c]);
        }
    }
    out
}

/// Equal parts of `part` elements on every rank, out of place or in place: every output equals
/// the reference; the form is what the plan reports.
fn equal_case<T: DeviceRepr + Default + PartialEq + std::fmt::Debug>(
    comm: &Communicator,
    s: &[Stream],
    part: usize,
    sym: bool,
    in_place: bool,
    rng: &mut Rng,
) -> Choice {
    let n = comm.size();
    let len = n * part;
    let input: Vec<Vec<T>> = (0..n).map(|_| random(rng, len)).collect();
    let mut a = Bufs::<T>::new(comm, sym, len);
    let mut b = Bufs::<T>::new(comm, sym, len);
    for r in 0..n {
        a.write(r, &input[r]);
    }
    let mut choice = None;
    for r in 0..n {
        let h = comm.rank(r).unwrap();
        let c = match (&mut a, &mut b, in_place) {
            (Bufs::Sym(x), _, true) => h.all_to_all_in_place(x.slice_mut(..len).unwrap(), &s[r]),
            (Bufs::Own(x), _, true) => h.all_to_all_in_place(&mut x[r], &s[r]),
            (Bufs::Sym(x), Bufs::Sym(y), false) => {
                h.all_to_all(x.slice(..len).unwrap(), y.slice_mut(..len).unwrap(), &s[r])
            }
            (Bufs::Own(x), Bufs::Own(y), false) => h.all_to_all(&x[r], &mut y[r], &s[r]),
            _ => unreachable!(),
        };
        let c = c.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        choice.get_or_insert(c);
    }
    sync_all(s);
    comm.check().unwrap();
    // what the communicator says such a call runs is what it ran
    let bytes = len * std::mem::size_of::<T>();
    let ops = if sym {
        Operands::Symmetric
    } else {
        Operands::Local
    };
    assert_eq!(
        comm.all_to_all_choice(bytes, bytes, false, ops, in_place)
            .unwrap(),
        choice.unwrap()
    );
    let out = if in_place { &a } else { &b };
    for k in 0..n {
        let got = out.read(k, len);
        for r in 0..n {
            assert_eq!(
                got[r * part..(r + 1) * part],
                input[r][k * part..(k + 1) * part],
                "{n} ranks, part {part} of {} bytes, sym {sym}, in place {in_place}: rank {k}'s part from {r}",
                std::mem::size_of::<T>()
            );
        }
    }
    choice.unwrap()
}

#[test]
fn all_to_all_of_equal_parts_equals_the_host_reference() {
    for_teams("collectives::alltoall::equal_parts", |devices, n| {
        for (ci, config) in configs().into_iter().enumerate() {
            let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(n as u64 * 10 + ci as u64);
            let parts: &[usize] = if devices[0].driver().is_simulated() {
                &[1, 7, 300]
            } else {
                &[1, 7, 300, 4099, 100_000]
            };
            for &part in parts {
                for sym in [true, false] {
                    for in_place in [false, true] {
                        let c = equal_case::<u8>(&comm, &s, part, sym, in_place, &mut rng);
                        let want = if is_ll(ci) {
                            Algorithm::AllToAllLl
                        } else {
                            Algorithm::AllToAllDirect
                        };
                        assert_eq!(c.algorithm, want, "{n} ranks, part {part}");
                        assert_eq!(
                            c.staged_chunks,
                            (!is_ll(ci) && (!sym || in_place)) as u32,
                            "{c}"
                        );
                        equal_case::<u16>(&comm, &s, part, sym, in_place, &mut rng);
                        equal_case::<i32>(&comm, &s, part + 1, sym, in_place, &mut rng);
                        equal_case::<u64>(&comm, &s, part, sym, in_place, &mut rng);
                    }
                }
            }
        }
    });
}

/// Random per-peer counts (a third of them zero), offsets with gaps: one call with counts on
/// the host; the output outside the received parts keeps what it held.
fn host_counts_case<T: DeviceRepr + Default + PartialEq + std::fmt::Debug>(
    comm: &Communicator,
    s: &[Stream],
    max: usize,
    sym: bool,
    rng: &mut Rng,
) -> Choice {
    let n = comm.size();
    let draw = |rng: &mut Rng| {
        let x = rng.next_u64() as usize % (max + 1);
        if rng.next_u64().is_multiple_of(3) {
            0
        } else {
            x
        }
    };
    let sc: Vec<Vec<usize>> = (0..n)
        .map(|_| (0..n).map(|_| draw(rng)).collect())
        .collect();
    // send offsets: parts in reverse rank order with a gap of 1; receive offsets: in rank order
    // with a gap of 2
    let mut so = vec![vec![0; n]; n];
    let mut ro = vec![vec![0; n]; n];
    for r in 0..n {
        let mut at = 1;
        for k in (0..n).rev() {
            so[r][k] = at;
            at += sc[r][k] + 1;
        }
        let mut at = 2;
        for src in 0..n {
            ro[r][src] = at;
            at += sc[src][r] + 2;
        }
    }
    let (il, ol) = (n * (max + 1) + 1, n * (max + 2) + 2);
    let input: Vec<Vec<T>> = (0..n).map(|_| random(rng, il)).collect();
    let before: Vec<Vec<T>> = (0..n).map(|_| random(rng, ol)).collect();
    let mut a = Bufs::<T>::new(comm, sym, il);
    let mut b = Bufs::<T>::new(comm, sym, ol);
    for r in 0..n {
        a.write(r, &input[r]);
        b.write(r, &before[r]);
    }
    let mut choice = None;
    for r in 0..n {
        let rc: Vec<usize> = (0..n).map(|src| sc[src][r]).collect();
        let h = comm.rank(r).unwrap();
        let c = match (&a, &mut b) {
            (Bufs::Sym(x), Bufs::Sym(y)) => {
                h.all_to_all_v(x, y, &sc[r], &so[r], &rc, &ro[r], &s[r])
            }
            (Bufs::Own(x), Bufs::Own(y)) => {
                h.all_to_all_v(&x[r], &mut y[r], &sc[r], &so[r], &rc, &ro[r], &s[r])
            }
            _ => unreachable!(),
        }
        .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        choice.get_or_insert(c);
    }
    sync_all(s);
    comm.check().unwrap();
    let es = std::mem::size_of::<T>();
    let ops = if sym {
        Operands::Symmetric
    } else {
        Operands::Local
    };
    assert_eq!(
        comm.all_to_all_choice(il * es, ol * es, true, ops, false)
            .unwrap(),
        choice.unwrap()
    );
    let want = reference(&input, &before, &sc, &so, &ro);
    for k in 0..n {
        assert_eq!(
            b.read(k, ol),
            want[k],
            "{n} ranks, max {max}, sym {sym}: rank {k}"
        );
    }
    choice.unwrap()
}

#[test]
fn all_to_all_v_with_host_counts_equals_the_host_reference() {
    for_teams("collectives::alltoall::host_counts", |devices, n| {
        for (ci, config) in configs().into_iter().enumerate() {
            let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(100 + n as u64 * 10 + ci as u64);
            let maxes: &[usize] = if devices[0].driver().is_simulated() {
                &[0, 5, 200]
            } else {
                &[0, 5, 200, 30_000]
            };
            for &max in maxes {
                for sym in [true, false] {
                    let c = host_counts_case::<u8>(&comm, &s, max, sym, &mut rng);
                    assert_eq!(c.algorithm == Algorithm::AllToAllLl, is_ll(ci), "{c}");
                    host_counts_case::<u16>(&comm, &s, max, sym, &mut rng);
                    host_counts_case::<u64>(&comm, &s, max, sym, &mut rng);
                }
            }
        }
    });
}

/// Elements after a device-count case's output (symmetric outputs are a view of the first
/// `ol`): never written.
const GUARD: usize = 64;

/// Counts on the device: per rank its send counts (`u64[n]`), the input packed in rank order;
/// the receive counts and offsets the kernel writes, and the packed output.
struct DevCase<T: DeviceRepr> {
    input: Bufs<T>,
    output: Bufs<T>,
    send: Vec<DeviceBuffer<u64>>,
    rcnt: Vec<DeviceBuffer<u64>>,
    roff: Vec<DeviceBuffer<u64>>,
    il: usize,
    ol: usize,
    /// What the last `fill` wrote.
    sc: Vec<Vec<usize>>,
    data: Vec<Vec<T>>,
    before: Vec<Vec<T>>,
}

impl<T: DeviceRepr + Default + PartialEq + std::fmt::Debug> DevCase<T> {
    fn new(comm: &Communicator, sym: bool, max: usize) -> Self {
        let n = comm.size();
        let dev = |r: usize| comm.device(r).unwrap();
        let (il, ol) = (n * max, n * max + 3);
        DevCase {
            input: Bufs::new(comm, sym, il.max(1)),
            output: Bufs::new(comm, sym, ol + GUARD),
            send: (0..n)
                .map(|r| DeviceBuffer::zeroed(dev(r), n).unwrap())
                .collect(),
            rcnt: (0..n)
                .map(|r| DeviceBuffer::zeroed(dev(r), n).unwrap())
                .collect(),
            roff: (0..n)
                .map(|r| DeviceBuffer::zeroed(dev(r), n).unwrap())
                .collect(),
            il,
            ol,
            sc: Vec::new(),
            data: Vec::new(),
            before: Vec::new(),
        }
    }

    /// New random counts (at most `max` per peer, some zero; `skew`: everything to rank 0) and
    /// data.
    fn fill(&mut self, rng: &mut Rng, max: usize, skew: bool) {
        let n = self.send.len();
        self.sc = (0..n)
            .map(|_| {
                (0..n)
                    .map(|k| match (skew, k) {
                        (true, 0) => max,
                        (true, _) => 0,
                        _ if rng.next_u64().is_multiple_of(4) => 0,
                        _ => rng.next_u64() as usize % (max + 1),
                    })
                    .collect()
            })
            .collect();
        self.data = (0..n).map(|_| random(rng, self.il.max(1))).collect();
        self.before = (0..n).map(|_| random(rng, self.ol + GUARD)).collect();
        for r in 0..n {
            let c: Vec<u64> = self.sc[r].iter().map(|&x| x as u64).collect();
            self.send[r].copy_from_host(0, &c).unwrap();
            self.rcnt[r].copy_from_host(0, &vec![u64::MAX; n]).unwrap();
            self.input.write(r, &self.data[r]);
            self.output.write(r, &self.before[r]);
        }
    }

    fn call(&mut self, comm: &Communicator, r: usize, s: &Stream) -> Choice {
        self.try_call(comm, r, s)
            .unwrap_or_else(|e| panic!("rank {r}: {e}"))
    }

    fn try_call(
        &mut self,
        comm: &Communicator,
        r: usize,
        s: &Stream,
    ) -> cuda_multimem::Result<Choice> {
        let h = comm.rank(r).unwrap();
        match (&self.input, &mut self.output) {
            (Bufs::Sym(x), Bufs::Sym(y)) => h.all_to_all_v_dev(
                x,
                y.slice_mut(..self.ol).unwrap(),
                &self.send[r],
                &mut self.rcnt[r],
                &mut self.roff[r],
                s,
            ),
            (Bufs::Own(x), Bufs::Own(y)) => h.all_to_all_v_dev(
                &x[r],
                &mut y[r],
                &self.send[r],
                &mut self.rcnt[r],
                &mut self.roff[r],
                s,
            ),
            _ => unreachable!(),
        }
    }

    fn verify(&self, what: &str) {
        let n = self.send.len();
        let so: Vec<Vec<usize>> = (0..n)
            .map(|r| {
                (0..n)
                    .scan(0, |at, k| {
                        let o = *at;
                        *at += self.sc[r][k];
                        Some(o)
                    })
                    .collect()
            })
            .collect();
        let ro: Vec<Vec<usize>> = (0..n)
            .map(|k| {
                (0..n)
                    .scan(0, |at, r| {
                        let o = *at;
                        *at += self.sc[r][k];
                        Some(o)
                    })
                    .collect()
            })
            .collect();
        let want = reference(&self.data, &self.before, &self.sc, &so, &ro);
        for k in 0..n {
            let mut c = vec![0u64; n];
            let mut o = vec![0u64; n];
            self.rcnt[k].copy_to_host(0, &mut c).unwrap();
            self.roff[k].copy_to_host(0, &mut o).unwrap();
            let wc: Vec<u64> = (0..n).map(|r| self.sc[r][k] as u64).collect();
            let wo: Vec<u64> = ro[k].iter().map(|&x| x as u64).collect();
            assert_eq!(c, wc, "{what}: rank {k}'s receive counts");
            assert_eq!(o, wo, "{what}: rank {k}'s receive offsets");
            assert_eq!(
                self.output.read(k, self.ol + GUARD),
                want[k],
                "{what}: rank {k}'s output"
            );
        }
    }
}

#[test]
fn all_to_all_v_with_device_counts_equals_the_host_reference() {
    for_teams("collectives::alltoall::device_counts", |devices, n| {
        for (ci, config) in configs().into_iter().enumerate() {
            let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(200 + n as u64 * 10 + ci as u64);
            for max in [0usize, 3, 150] {
                for sym in [true, false] {
                    for skew in [false, true] {
                        let mut case = DevCase::<u16>::new(&comm, sym, max);
                        case.fill(&mut rng, max, skew);
                        let mut c = None;
                        for r in 0..n {
                            c.get_or_insert(case.call(&comm, r, &s[r]));
                        }
                        sync_all(&s);
                        comm.check().unwrap();
                        let c = c.unwrap();
                        assert_eq!(c.algorithm == Algorithm::AllToAllLl, is_ll(ci), "{c}");
                        case.verify(&format!(
                            "{n} ranks, max {max}, sym {sym}, skew {skew}: {c}"
                        ));
                    }
                }
            }
        }
    });
}

#[test]
fn a_captured_all_to_all_v_replays_with_new_counts_read_on_the_device() {
    for_teams("collectives::alltoall::graph", |devices, n| {
        for (ci, config) in configs().into_iter().enumerate() {
            let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(300 + n as u64 + ci as u64);
            let max = 40;
            let mut case = DevCase::<u32>::new(&comm, ci != 1, max);
            case.fill(&mut rng, max, false);
            let mut execs = Vec::new();
            for r in 0..n {
                let sr = s[r].as_stream_ref();
                sr.begin_capture(CaptureMode::ThreadLocal).unwrap();
                case.call(&comm, r, &s[r]);
                let graph = sr.end_capture().unwrap();
                // SAFETY: the team, the case's buffers and the streams outlive `execs`.
                execs.push(unsafe { graph.instantiate() }.unwrap());
            }
            for replay in 0..3 {
                case.fill(&mut rng, max, replay == 1);
                for r in 0..n {
                    execs[r].launch(&s[r]).unwrap();
                }
                sync_all(&s);
                comm.check().unwrap();
                case.verify(&format!("{n} ranks, replay {replay}"));
            }
            drop(execs);
        }
    });
}

#[test]
fn hostile_counts_on_the_host_are_errors_naming_the_argument() {
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip("collectives::alltoall::hostile_host", why);
    }
    let (comm, s) = team_on(
        &placed(&e, 2),
        CommConfig::default(),
        MulticastPolicy::Never,
    );
    let h = comm.rank(0).unwrap();
    let x: SymmetricBuffer<u16> = comm.alloc(10).unwrap();
    let mut y: SymmetricBuffer<u16> = comm.alloc(10).unwrap();
    let ok = [5usize, 5];
    let at = [0usize, 5];
    for (sc, so, rc, ro, arg) in [
        (&[5usize][..], &at[..], &ok[..], &at[..], "send_counts"),
        (
            &ok[..],
            &at[..],
            &ok[..],
            &[0usize, 5, 0][..],
            "recv_offsets",
        ),
        (&[11, 0][..], &at[..], &ok[..], &at[..], "send_counts"),
        (&ok[..], &[0, 6][..], &ok[..], &at[..], "send_offsets"),
        (&ok[..], &at[..], &[6, 5][..], &[0, 4][..], "recv_offsets"),
        (
            &ok[..],
            &at[..],
            &[5, 5][..],
            &[0, usize::MAX][..],
            "recv_offsets",
        ),
        (&ok[..], &at[..], &[5, 5][..], &[0, 3][..], "recv_offsets"),
    ] {
        assert_eq!(
            invalid_arg_of(h.all_to_all_v(&x, &mut y, sc, so, rc, ro, &s[0])),
            arg,
            "{sc:?} {so:?} {rc:?} {ro:?}"
        );
    }
    // equal parts: the input a whole number of parts, the output as long
    let mut z: SymmetricBuffer<u16> = comm.alloc(11).unwrap();
    assert_eq!(invalid_arg_of(h.all_to_all(&z, &mut y, &s[0])), "input");
    assert_eq!(
        invalid_arg_of(h.all_to_all(&x, z.slice_mut(..8).unwrap(), &s[0])),
        "output"
    );
    assert_eq!(invalid_arg_of(h.all_to_all_in_place(&mut z, &s[0])), "buf");
    // device tables of the wrong length, overlapping each other
    let d = comm.device(0).unwrap();
    let short = DeviceBuffer::<u64>::zeroed(d, 1).unwrap();
    let mut rc = DeviceBuffer::<u64>::zeroed(d, 2).unwrap();
    let mut ro = DeviceBuffer::<u64>::zeroed(d, 2).unwrap();
    assert_eq!(
        invalid_arg_of(h.all_to_all_v_dev(&x, &mut y, &short, &mut rc, &mut ro, &s[0])),
        "send_counts"
    );
    let sc2 = DeviceBuffer::<u64>::zeroed(d, 2).unwrap();
    let mut short_out = DeviceBuffer::<u64>::zeroed(d, 1).unwrap();
    assert_eq!(
        invalid_arg_of(h.all_to_all_v_dev(&x, &mut y, &sc2, &mut short_out, &mut ro, &s[0])),
        "recv_counts"
    );
    assert_eq!(
        invalid_arg_of(h.all_to_all_v_dev(&x, &mut y, &sc2, &mut rc, &mut short_out, &s[0])),
        "recv_offsets"
    );
    // nothing was queued: the team is healthy
    sync_all(&s);
    comm.check().unwrap();
}

/// Counts only the device sees, out of range: a part past the end of the sender's input, and
/// parts past the end of the receiver's output. The error word reports them (the next check:
/// an error naming the counts), the parts they concern are not written (their receive count
/// reads 0) and nothing is written outside the buffers; after `recover` the team runs again.
#[test]
fn counts_out_of_range_on_the_device_are_reported_and_nothing_is_written_outside() {
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip("collectives::alltoall::hostile_device", why);
    }
    let n = 3;
    let e = if e.driver.is_simulated() {
        drop(e);
        sim(SimConfig::new(n, 13050))
    } else {
        e
    };
    let devices = placed(&e, n);
    for (ci, config) in configs().into_iter().enumerate() {
        let (comm, s) = team_on(&devices, config, MulticastPolicy::Never);
        let mut rng = Rng::new(400 + ci as u64);
        let max = 8;
        for (case_no, bad) in [(0usize, 0usize), (1, 1)] {
            let mut case = DevCase::<u8>::new(&comm, true, max);
            case.fill(&mut rng, max, false);
            let (il, ol) = (case.il, case.ol);
            let mut counts = case.sc.clone();
            match bad {
                // rank 0 sends rank 1 one element more than its input holds
                0 => counts[0][1] = il + 1,
                // rank 1 sends rank 0 its whole input, every other rank max: past rank 0's output
                _ => {
                    counts[1] = vec![0; n];
                    counts[1][0] = il;
                    counts[0][0] = max;
                    for r in 2..n {
                        counts[r][0] = max;
                    }
                }
            }
            for r in 0..n {
                let c: Vec<u64> = counts[r].iter().map(|&x| x as u64).collect();
                case.send[r].copy_from_host(0, &c).unwrap();
            }
            for r in 0..n {
                case.try_call(&comm, r, &s[r]).unwrap();
            }
            sync_all(&s);
            // the ranks the bad counts do not concern finished their calls whole (a bounds
            // error ends no wait early): no error, and their outputs as the reference
            let receiver = if bad == 0 { 1 } else { 0 };
            for k in (0..n).filter(|&k| k != receiver && !(bad == 0 && k == 0)) {
                comm.rank(k)
                    .unwrap()
                    .check()
                    .unwrap_or_else(|e| panic!("case {case_no}: rank {k}: {e}"));
                let mut want = case.before[k].clone();
                let mut at = 0;
                for r in 0..n {
                    let c = counts[r][k];
                    // the input packed over the valid counts (as the kernel skips the others)
                    let so = counts[r][..k]
                        .iter()
                        .fold(0, |p, &x| if p + x <= il { p + x } else { p });
                    want[at..at + c].copy_from_slice(&case.data[r][so..so + c]);
                    at += c;
                }
                assert_eq!(
                    case.output.read(k, ol + GUARD),
                    want,
                    "case {case_no}: rank {k}'s output"
                );
            }
            let err = comm.check().expect_err("counts out of range are reported");
            assert!(
                matches!(
                    err,
                    cuda_multimem::Error::InvalidArgument { arg: "counts", .. }
                ),
                "case {case_no}: {err}"
            );
            // the guard after every output is what it was
            for k in 0..n {
                let got = case.output.read(k, ol + GUARD);
                assert_eq!(
                    got[ol..],
                    case.before[k][ol..],
                    "case {case_no}: rank {k}'s guard"
                );
            }
            let mut c = vec![0u64; n];
            case.rcnt[receiver].copy_to_host(0, &mut c).unwrap();
            let sender = if bad == 0 { 0 } else { 1 };
            assert_eq!(
                c[sender], 0,
                "case {case_no}: the part out of range was not received"
            );
            comm.recover().unwrap();
            // and the team runs again
            case.fill(&mut rng, max, false);
            for r in 0..n {
                case.call(&comm, r, &s[r]);
            }
            sync_all(&s);
            comm.check().unwrap();
            case.verify(&format!("after recovering from case {case_no}"));
        }
    }
}

/// Ranks sharing one simulated device (every rank's blocks resident at once: nothing waits
/// for resident slots), both forms, equal parts and device counts.
#[test]
fn all_to_all_on_one_simulated_device_shared_by_2_to_8_ranks() {
    for n in [2usize, 4, 8] {
        let e = sim(SimConfig::new(1, 13050));
        let devices = placed(&e, n);
        for (ci, config) in configs().into_iter().enumerate() {
            let (comm, s) = team_on(&devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(500 + n as u64 + ci as u64);
            for sym in [true, false] {
                equal_case::<u32>(&comm, &s, 33, sym, false, &mut rng);
                equal_case::<u8>(&comm, &s, 5, sym, true, &mut rng);
                let mut case = DevCase::<u16>::new(&comm, sym, 20);
                case.fill(&mut rng, 20, false);
                for r in 0..n {
                    case.call(&comm, r, &s[r]);
                }
                sync_all(&s);
                comm.check().unwrap();
                case.verify(&format!("{n} ranks on one device"));
            }
        }
        assert_eq!(e.sim.as_ref().unwrap().residency_waits(), 0, "{n} ranks");
    }
}

/// Teams of 16 and of `MAX_RANKS` (one NVL72 domain) on the simulator, small parts: equal parts,
/// host counts and device counts (the count matrix every block holds, the pushes and polls of
/// thread t for peers t, t + ntid, ...), in both forms.
#[test]
fn all_to_all_on_simulated_teams_of_16_and_max_ranks_equals_the_host_reference() {
    for n in [16usize, MAX_RANKS] {
        let e = sim(SimConfig::new(n, 13050));
        let devices = e.driver.devices();
        // every rank's staging and low-latency areas are 2 × N slots: small ones
        let small = CommConfig {
            ll_max_bytes: 4 << 10,
            gather_ll_max_bytes: 8 << 10,
            broadcast_ll_max_bytes: 4 << 10,
            norm_ll_max_bytes: 4 << 10,
            one_shot_max_bytes: Some(16 << 10),
            stage_bytes: Some(16 << 10),
            scratch_bytes: 3 << 20,
            max_blocks: 2,
            ..CommConfig::default()
        };
        let forms = [
            (small.clone(), Algorithm::AllToAllLl),
            (
                CommConfig {
                    gather_ll_max_bytes: 0,
                    push_threads: 64,
                    ..small
                },
                Algorithm::AllToAllDirect,
            ),
        ];
        for (ci, (config, want)) in forms.into_iter().enumerate() {
            let (comm, s) = team_on(&devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(700 + n as u64 + ci as u64);
            let c = equal_case::<u32>(&comm, &s, 3, true, false, &mut rng);
            assert_eq!(c.algorithm, want, "{n} ranks: {c}");
            equal_case::<u8>(&comm, &s, 5, false, true, &mut rng);
            let c = host_counts_case::<u16>(&comm, &s, 9, true, &mut rng);
            assert_eq!(c.algorithm, want, "{n} ranks: {c}");
            let mut case = DevCase::<u16>::new(&comm, false, 6);
            case.fill(&mut rng, 6, true);
            for r in 0..n {
                case.call(&comm, r, &s[r]);
            }
            sync_all(&s);
            comm.check().unwrap();
            case.verify(&format!("{n} ranks, device counts, {want:?}"));
        }
    }
}

/// A rank that never calls: every rank that did ends its waits at the timeout (both forms),
/// and `check` reports it.
#[test]
fn a_peer_that_never_arrives_is_a_timeout_on_every_calling_rank() {
    let short = std::time::Duration::from_millis(300);
    for direct in [false, true] {
        let e = sim(SimConfig::new(3, 13050));
        let (comm, s) = team_on(
            &e.driver.devices(),
            CommConfig {
                timeout: short,
                first_call_timeout: Some(short),
                gather_ll_max_bytes: if direct { 0 } else { 2 << 20 },
                ..CommConfig::default()
            },
            MulticastPolicy::Never,
        );
        let x = comm.alloc::<u8>(3 * 64).unwrap();
        let mut y = comm.alloc::<u8>(3 * 64).unwrap();
        for r in 0..2 {
            let c = comm.rank(r).unwrap().all_to_all(&x, &mut y, &s[r]).unwrap();
            assert_eq!(c.algorithm == Algorithm::AllToAllDirect, direct, "{c}");
        }
        for st in s.iter().take(2) {
            st.synchronize().unwrap();
        }
        for r in 0..2 {
            match comm.rank(r).unwrap().check() {
                Err(cuda_multimem::Error::Timeout { .. })
                | Err(cuda_multimem::Error::Unusable { .. }) => {}
                other => panic!("direct {direct}, rank {r}: expected a timeout, got {other:?}"),
            }
        }
    }
}

/// Counts given on the host reach the kernel through the fill kernel's parameters: a captured
/// graph holds them by value (the replays move the same parts of new data).
#[test]
fn a_captured_all_to_all_v_with_host_counts_replays_them() {
    for_teams("collectives::alltoall::graph_host", |devices, n| {
        for (ci, config) in configs().into_iter().enumerate() {
            let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
            let mut rng = Rng::new(600 + n as u64 + ci as u64);
            let sc: Vec<Vec<usize>> = (0..n)
                .map(|r| (0..n).map(|k| (r * 7 + k * 3) % 11).collect())
                .collect();
            let so: Vec<Vec<usize>> = (0..n)
                .map(|r| (0..n).map(|k| k * 11 + r % 2).collect())
                .collect();
            let ro: Vec<Vec<usize>> = (0..n).map(|_| (0..n).map(|j| j * 12).collect()).collect();
            let rc: Vec<Vec<usize>> = (0..n).map(|k| (0..n).map(|r| sc[r][k]).collect()).collect();
            let len = n * 12;
            let x: SymmetricBuffer<u16> = comm.alloc(len).unwrap();
            let mut y: SymmetricBuffer<u16> = comm.alloc(len).unwrap();
            let mut execs = Vec::new();
            for r in 0..n {
                let sr = s[r].as_stream_ref();
                sr.begin_capture(CaptureMode::ThreadLocal).unwrap();
                comm.rank(r)
                    .unwrap()
                    .all_to_all_v(&x, &mut y, &sc[r], &so[r], &rc[r], &ro[r], &s[r])
                    .unwrap();
                let graph = sr.end_capture().unwrap();
                // SAFETY: the team, the buffers and the streams outlive `execs`.
                execs.push(unsafe { graph.instantiate() }.unwrap());
            }
            for replay in 0..3 {
                let input: Vec<Vec<u16>> = (0..n).map(|_| random(&mut rng, len)).collect();
                let before: Vec<Vec<u16>> = (0..n).map(|_| random(&mut rng, len)).collect();
                for r in 0..n {
                    x.write(r, 0, &input[r]).unwrap();
                    y.write(r, 0, &before[r]).unwrap();
                }
                for r in 0..n {
                    execs[r].launch(&s[r]).unwrap();
                }
                sync_all(&s);
                comm.check().unwrap();
                let want = reference(&input, &before, &sc, &so, &ro);
                for k in 0..n {
                    assert_eq!(
                        y.to_vec(k).unwrap(),
                        want[k],
                        "{n} ranks, replay {replay}: rank {k}"
                    );
                }
            }
            drop(execs);
        }
    });
}

/// A team of one: its own part only (any size, low-latency kernel); device counts written.
#[test]
fn a_team_of_one_moves_its_own_part() {
    let e = sim(SimConfig::new(1, 13050));
    let (comm, s) = team_on(
        &e.driver.devices(),
        CommConfig::default(),
        MulticastPolicy::Never,
    );
    let mut rng = Rng::new(7);
    for part in [1usize, 5000] {
        for sym in [true, false] {
            for in_place in [false, true] {
                let c = equal_case::<u8>(&comm, &s, part, sym, in_place, &mut rng);
                assert_eq!(c.algorithm, Algorithm::AllToAllLl, "{c}");
            }
        }
    }
    let mut case = DevCase::<u32>::new(&comm, false, 9);
    case.fill(&mut rng, 9, false);
    case.call(&comm, 0, &s[0]);
    sync_all(&s);
    comm.check().unwrap();
    case.verify("a team of one");
}

/// The caller's own output above the low-latency limit goes through a scratch region: one that
/// does not fit is refused before launch, naming the output.
#[test]
fn an_own_output_larger_than_a_scratch_region_is_refused_naming_the_output() {
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip("collectives::alltoall::scratch_limit", why);
    }
    let config = CommConfig {
        gather_ll_max_bytes: 0,
        scratch_bytes: 3 << 20,
        ..CommConfig::default()
    };
    let (comm, s) = team_on(&placed(&e, 2), config, MulticastPolicy::Never);
    let d = comm.device(0).unwrap();
    let x = DeviceBuffer::<u8>::zeroed(d, 2 << 20).unwrap();
    let mut y = DeviceBuffer::<u8>::zeroed(d, 2 << 20).unwrap();
    assert_eq!(
        invalid_arg_of(comm.rank(0).unwrap().all_to_all(&x, &mut y, &s[0])),
        "output"
    );
    let mut z = comm.alloc::<u8>(2 << 20).unwrap();
    assert_eq!(
        invalid_arg_of(comm.rank(0).unwrap().all_to_all_in_place(&mut z, &s[0])),
        "output"
    );
    sync_all(&s);
    comm.check().unwrap();
}
