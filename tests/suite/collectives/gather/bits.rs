//! All-gather and broadcast of element types they only move (any `DeviceRepr` type: integers,
//! FP8, f64, structs of odd size): every rank's result equals the host reference bit for bit,
//! in place and not, on symmetric buffers (whole and at an odd element offset) and on the
//! caller's own memory, in every form (low-latency, staged, direct, copy engines), on teams of
//! their own devices and on ranks sharing one device; the calls run as words of the element's
//! carrier type (`DType::carrier`) and report the same choices as a type of that size.

use std::collections::BTreeSet;
use std::fmt::Debug;

use cuda_multimem::{Device, DeviceBuffer, DeviceRepr, Stream};
use cuda_multimem_collectives::{
    float8::{F8E4M3, F8E5M2},
    Algorithm, CommConfig, Communicator, DType, Dst, MulticastPolicy, Src, SymmetricBuffer,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{
    collectives_unsupported, env, placed, sim, skip, sync_all, team_on, Rng,
};

/// A token record of 4 bytes aligned to 2 (moved as 16-bit words).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Token {
    id: u16,
    flag: u8,
    kind: u8,
}
// SAFETY: repr(C) of integers with no padding (2 + 1 + 1 bytes, alignment 2): every bit
// pattern is a valid value.
unsafe impl DeviceRepr for Token {}

/// A 3-byte record (odd size: moved as bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Rgb {
    r: u8,
    g: u8,
    b: u8,
}
// SAFETY: repr(C) of three bytes: no padding, every bit pattern valid.
unsafe impl DeviceRepr for Rgb {}

/// What the tests need of an element: bits only.
trait Bits: DeviceRepr + Default + PartialEq + Debug {}
impl<T: DeviceRepr + Default + PartialEq + Debug> Bits for T {}

fn bytes_of<T: Bits>(v: &[T]) -> &[u8] {
    // SAFETY: DeviceRepr types have no padding: every byte is initialised.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn random<T: Bits>(rng: &mut Rng, len: usize) -> Vec<T> {
    let mut v = vec![T::default(); len];
    // SAFETY: DeviceRepr: every bit pattern is a valid T (the types here are integers, FP8 and
    // records of integers).
    let b = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(&v[..]))
    };
    rng.fill(b);
    v
}

/// Which memory a case's operands are.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mem {
    /// Whole symmetric buffers.
    Sym,
    /// Symmetric views from element 1 (not aligned to 16 bytes, nor to 4 for small types).
    SymOdd,
    /// The caller's own `DeviceBuffer`s.
    Own,
}

enum Buf<T: Bits> {
    Sym(SymmetricBuffer<T>),
    Own(Vec<DeviceBuffer<T>>),
}

impl<T: Bits> Buf<T> {
    fn new(comm: &Communicator, own: bool, len: usize) -> Self {
        if own {
            Buf::Own(
                (0..comm.size())
                    .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), len).unwrap())
                    .collect(),
            )
        } else {
            Buf::Sym(comm.alloc::<T>(len).unwrap())
        }
    }
    fn write(&mut self, r: usize, at: usize, data: &[T]) {
        match self {
            Buf::Sym(b) => b.write(r, at, data).unwrap(),
            Buf::Own(b) => b[r].copy_from_host(at, data).unwrap(),
        }
    }
    fn read(&self, r: usize, at: usize, len: usize) -> Vec<T> {
        let mut v = vec![T::default(); len];
        match self {
            Buf::Sym(b) => b.read(r, at, &mut v).unwrap(),
            Buf::Own(b) => b[r].copy_to_host(at, &mut v).unwrap(),
        }
        v
    }
    fn src(&self, r: usize, at: usize, len: usize) -> Src<'_, T> {
        match self {
            Buf::Sym(b) => b.slice(at..at + len).unwrap().into(),
            Buf::Own(b) => (&b[r]).into(),
        }
    }
    fn dst(&mut self, r: usize, at: usize, len: usize) -> Dst<'_, T> {
        match self {
            Buf::Sym(b) => b.slice_mut(at..at + len).unwrap().into(),
            Buf::Own(b) => (&mut b[r]).into(),
        }
    }
}

/// One case: all-gather (`root` None) or broadcast from `root`, `count` elements per rank's
/// input; checks every rank's whole buffer against the reference. Returns the algorithms the
/// ranks reported.
#[allow(clippy::too_many_arguments)]
fn case<T: Bits>(
    comm: &Communicator,
    s: &[Stream],
    root: Option<usize>,
    count: usize,
    mem: Mem,
    in_place: bool,
    rng: &mut Rng,
) -> Vec<Algorithm> {
    let n = comm.size();
    let at = usize::from(mem == Mem::SymOdd);
    let own = mem == Mem::Own;
    let out_len = if root.is_some() { count } else { n * count };
    let inputs: Vec<Vec<T>> = (0..n).map(|_| random::<T>(rng, count)).collect();
    // outputs start as random garbage: a result that is not written shows
    let junk: Vec<Vec<T>> = (0..n).map(|_| random::<T>(rng, out_len)).collect();
    let mut out = Buf::<T>::new(comm, own, at + out_len);
    let mut inp = (!in_place).then(|| Buf::<T>::new(comm, own, at + count));
    for r in 0..n {
        out.write(r, at, &junk[r]);
        match (&mut inp, root) {
            (Some(i), _) => i.write(r, at, &inputs[r]),
            (None, None) => out.write(r, at + r * count, &inputs[r]),
            (None, Some(_)) => out.write(r, at, &inputs[r]),
        }
    }
    let mut algs = Vec::new();
    for r in 0..n {
        let h = comm.rank(r).unwrap();
        let what = format!(
            "{} of {count} {} on {n} ranks, {mem:?}, in place {in_place}",
            root.map_or("all-gather".to_string(), |k| format!("broadcast from {k}")),
            std::any::type_name::<T>()
        );
        let c = match (&inp, root) {
            (Some(i), None) => h.all_gather(i.src(r, at, count), out.dst(r, at, out_len), &s[r]),
            (None, None) => h.all_gather_in_place(out.dst(r, at, out_len), &s[r]),
            (Some(i), Some(k)) => {
                h.broadcast(i.src(r, at, count), out.dst(r, at, out_len), k, &s[r])
            }
            (None, Some(k)) => h.broadcast_in_place(out.dst(r, at, out_len), k, &s[r]),
        }
        .unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        algs.push(c.algorithm);
    }
    sync_all(s);
    comm.check().unwrap();
    let want: Vec<T> = match root {
        None => inputs.iter().flatten().copied().collect(),
        Some(k) => inputs[k].clone(),
    };
    for r in 0..n {
        let got = out.read(r, at, out_len);
        if bytes_of(&got) != bytes_of(&want) {
            let i = got
                .iter()
                .zip(&want)
                .position(|(g, w)| {
                    bytes_of(std::slice::from_ref(g)) != bytes_of(std::slice::from_ref(w))
                })
                .unwrap();
            panic!(
                "{}: {} of {count} {} on {n} ranks, {mem:?}, in place {in_place}: rank {r} element {i}: got {:?} want {:?}",
                algs[r],
                root.map_or("all-gather".to_string(), |k| format!("broadcast from {k}")),
                std::any::type_name::<T>(),
                got[i],
                want[i]
            );
        }
    }
    algs
}

/// Small limits so that small buffers reach every form.
fn config(ll: bool) -> CommConfig {
    CommConfig {
        gather_ll_max_bytes: if ll { 64 << 10 } else { 0 },
        broadcast_ll_max_bytes: if ll { 32 << 10 } else { 0 },
        one_shot_max_bytes: Some(4 << 10),
        gather_ce_min_bytes: 128 << 10,
        broadcast_ce_min_bytes: 128 << 10,
        stage_bytes: Some(64 << 10),
        ..CommConfig::default()
    }
}

/// Every case of `T` on the team of `devices`, at `counts`; the algorithms seen.
fn sweep<T: Bits>(devices: &[Device], counts: &[usize], seed: u64) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut rng = Rng::new(seed);
    for ll in [true, false] {
        let (comm, s) = team_on(devices, config(ll), MulticastPolicy::Never);
        let n = comm.size();
        for root in [None, Some(0), Some(n - 1)] {
            for &count in counts {
                for mem in [Mem::Sym, Mem::SymOdd, Mem::Own] {
                    for in_place in [false, true] {
                        for a in case::<T>(&comm, &s, root, count, mem, in_place, &mut rng) {
                            seen.insert(a.to_string());
                        }
                    }
                }
            }
        }
    }
    seen
}

/// Every type the tests move, with its carrier.
macro_rules! for_each_bits {
    ($f:ident ( $($arg:expr),* $(,)? )) => {{
        let mut seen = BTreeSet::new();
        seen.extend($f::<i32>($($arg),*));
        seen.extend($f::<i64>($($arg),*));
        seen.extend($f::<u8>($($arg),*));
        seen.extend($f::<i8>($($arg),*));
        seen.extend($f::<F8E4M3>($($arg),*));
        seen.extend($f::<F8E5M2>($($arg),*));
        seen.extend($f::<f64>($($arg),*));
        seen.extend($f::<Token>($($arg),*));
        seen.extend($f::<Rgb>($($arg),*));
        seen
    }};
}

#[test]
fn every_device_repr_type_moves_as_its_carrier() {
    assert_eq!(DType::carrier_of::<i32>(), Some(DType::F32));
    assert_eq!(DType::carrier_of::<i64>(), Some(DType::F32));
    assert_eq!(DType::carrier_of::<f64>(), Some(DType::F32));
    assert_eq!(DType::carrier_of::<u16>(), Some(DType::F16));
    assert_eq!(DType::carrier_of::<Token>(), Some(DType::F16));
    assert_eq!(DType::carrier_of::<u8>(), Some(DType::U8));
    assert_eq!(DType::carrier_of::<F8E4M3>(), Some(DType::U8));
    assert_eq!(DType::carrier_of::<Rgb>(), Some(DType::U8));
    assert_eq!(DType::carrier_of::<[u8; 4]>(), Some(DType::U8));
    assert_eq!(DType::carrier_of::<()>(), None);
}

/// Run `body(devices, seed)` for every team size: on the simulator a fresh simulated machine
/// per team (`n` devices, or one for `shared`), on a real driver its devices (round-robin when
/// `shared`; teams larger than the machine skipped unless shared).
fn teams(
    test: &str,
    shared: bool,
    sim_sizes: &[usize],
    hw_sizes: &[usize],
    body: impl Fn(&cuda_multimem_tests::Env, &[Device], usize),
) {
    let e = env();
    if let Some(why) = collectives_unsupported(&e.driver) {
        return skip(test, why);
    }
    if !e.driver.is_simulated() {
        for &n in hw_sizes {
            if !shared && e.driver.devices().len() < n {
                continue;
            }
            let devices = if shared {
                placed(&e, n)
            } else {
                e.driver.devices().into_iter().take(n).collect()
            };
            body(&e, &devices, n);
        }
        return;
    }
    drop(e);
    for &n in sim_sizes {
        let e = sim(SimConfig::new(if shared { 1 } else { n }, 13050));
        let devices = placed(&e, n);
        body(&e, &devices, n);
    }
}

#[test]
fn every_device_repr_type_is_gathered_and_broadcast_bit_for_bit_on_own_devices() {
    teams(
        "gather::bits::own_devices",
        false,
        &[2, 5],
        &[2, 3, 4, 8],
        |e, devices, n| {
            let counts: &[usize] = if e.driver.is_simulated() {
                &[7, 2500, 17_000]
            } else {
                &[1, 7, 1000, 2500, 17_000, 300_001]
            };
            let seen = for_each_bits!(sweep(devices, counts, 40 + n as u64));
            if e.driver.is_simulated() {
                for a in ["push-ll", "push-staged", "push-direct", "copy-engine"] {
                    assert!(seen.contains(a), "{n} ranks: {a} never ran: {seen:?}");
                }
            }
        },
    );
}

#[test]
fn every_device_repr_type_is_gathered_and_broadcast_bit_for_bit_on_ranks_sharing_a_device() {
    teams(
        "gather::bits::shared",
        true,
        &[3, 8],
        &[2, 3, 5, 8],
        |e, devices, n| {
            let counts: &[usize] = if e.driver.is_simulated() {
                &[7, 2500]
            } else {
                &[1, 7, 2500, 17_000, 300_001]
            };
            let seen = for_each_bits!(sweep(devices, counts, 60 + n as u64));
            if e.driver.is_simulated() {
                for a in ["push-ll", "push-staged", "push-direct"] {
                    assert!(seen.contains(a), "{n} ranks: {a} never ran: {seen:?}");
                }
                assert_eq!(e.sim.as_ref().unwrap().residency_waits(), 0, "{n} ranks");
            }
        },
    );
}
