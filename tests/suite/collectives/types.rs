//! The reductions of every numeric type beyond f32, f16 and bf16 (f64, i32, u32, i64, u64, i8,
//! u8, FP8 e4m3 and e5m2): every operator, allreduce and reduce-scatter, every operand kind, in
//! place and not, bit for bit equal to the host reference — on 2 ranks of the chosen driver
//! and on simulated teams of 3 and 8; every forced allreduce form; the `_dyn` forms with
//! crafted extremes (wrapping sums and products, signed against unsigned min and max, FP8
//! saturation and NaN); the fused norm refusing them.

use super::*;
use cuda_multimem_collectives::float8::{F8E4M3, F8E5M2};
use cuda_multimem_collectives::Path;
use cuda_multimem_tests::collectives::{calls, once};
use cuda_multimem_tests::team_on;

/// Runs `$f::<T>(args)` for every type the reductions take beyond f32, f16 and bf16.
macro_rules! for_each_new_type {
    ($f:ident ( $($arg:expr),* $(,)? )) => {{
        $f::<f64>($($arg),*);
        $f::<i32>($($arg),*);
        $f::<u32>($($arg),*);
        $f::<i64>($($arg),*);
        $f::<u64>($($arg),*);
        $f::<i8>($($arg),*);
        $f::<u8>($($arg),*);
        $f::<F8E4M3>($($arg),*);
        $f::<F8E5M2>($($arg),*);
    }};
}

/// Two ranks on the chosen driver's devices: the first two where they are peers, else two ranks
/// sharing the first device (a machine of one GPU runs the real kernels so), or a printed skip.
fn two(test: &str) -> Option<(Env, Vec<Device>)> {
    cuda_multimem_collectives::sim::install();
    let e = env();
    if let Some(why) = cuda_multimem_tests::collectives_unsupported(&e.driver) {
        skip(test, why);
        return None;
    }
    let two = cuda_multimem_tests::placed(&e, 2);
    Some((e, two))
}

/// Every reducing call of the table (allreduce and reduce-scatter, every operator) at
/// `counts`, every operand kind of `mems`, in place and not, against the host reference (bit
/// for bit: `Compare::Exact` compares the elements' bits).
fn reductions<T: Elem>(devices: &[Device], config: CommConfig, counts: &[usize], mems: &[Mem]) {
    let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
    let mut rng = Rng::new(17 + T::DTYPE.size() as u64);
    for call in calls(devices.len())
        .into_iter()
        .filter(|c| c.at::<T>().reduces)
    {
        for &count in counts {
            for &mem in mems {
                for in_place in [false, true] {
                    once::<T>(&comm, &s, call, count, mem, in_place, &mut rng);
                }
            }
        }
    }
}

#[test]
fn every_new_type_reduces_bit_exactly_on_two_ranks() {
    let Some((_e, devices)) = two("collectives::types::every_new_type_two_ranks") else {
        return;
    };
    // 7: scalars only; 1000: vectors and a tail
    for_each_new_type!(reductions(
        &devices,
        CommConfig::default(),
        &[7, 1000],
        &Mem::ALL
    ));
}

#[test]
fn every_new_type_reduces_bit_exactly_on_simulated_teams_of_3_and_8() {
    {
        let e = ar_sim(3);
        let devices = e.driver.devices();
        for_each_new_type!(reductions(
            &devices,
            CommConfig::default(),
            &[7, 1000],
            &Mem::ALL
        ));
    }
    let e = ar_sim(8);
    let devices = e.driver.devices();
    for_each_new_type!(reductions(
        &devices,
        CommConfig::default(),
        &[515],
        &[Mem::SYM]
    ));
}

/// Every allreduce form forced, for every new type, on symmetric and own memory (the forms
/// that cannot run a case fall back as documented; the result is the reference all the same).
fn forced<T: Elem>(devices: &[Device]) {
    for alg in [
        Algorithm::OneShot,
        Algorithm::OneShotLl,
        Algorithm::TwoShot,
        Algorithm::TwoShotPush,
        Algorithm::TwoShotCe,
    ] {
        // landing slots large enough for the copy-engine two-shot's parts
        let config = CommConfig {
            algorithm: Some(alg),
            ce_max_bytes: 64 << 10,
            ..Default::default()
        };
        let (comm, s) = team_on(devices, config, MulticastPolicy::Never);
        let mut rng = Rng::new(5);
        for op in ReduceOp::ALL {
            for mem in Mem::KINDS {
                once::<T>(&comm, &s, Call::all_reduce(op), 2052, mem, false, &mut rng);
            }
        }
    }
}

#[test]
fn every_forced_allreduce_form_reduces_every_new_type() {
    let Some((_e, devices)) = two("collectives::types::every_forced_form") else {
        return;
    };
    for_each_new_type!(forced(&devices));
}

/// Element bits of `dtype` as bytes.
fn bytes_of(dtype: DType, v: &[u64]) -> Vec<u8> {
    let mut out = Vec::new();
    for &b in v {
        dtype.store_bits(&mut out, b);
    }
    out
}

/// Whether two results of `dtype` agree bit for bit (a NaN of an FP8 type agrees with any NaN:
/// a GPU's NaN sign is not specified).
fn same(dtype: DType, got: &[u8], want: &[u8]) -> Option<String> {
    (0..want.len() / dtype.size()).find_map(|i| {
        let (g, w) = (dtype.load_bits(got, i), dtype.load_bits(want, i));
        let nan = |b: u64| dtype.acc(b).to_f32().is_nan();
        let ok = g == w || (matches!(dtype, DType::F8E4M3 | DType::F8E5M2) && nan(g) && nan(w));
        (!ok).then(|| format!("element {i}: got {g:#x} want {w:#x}"))
    })
}

/// Crafted inputs of rank 0 and rank 1 per type: the extremes.
fn extremes(dtype: DType) -> [Vec<u64>; 2] {
    match dtype {
        DType::I8 => [
            vec![0x7f, 0x80, 0xff, 0x01, 0x80, 0x7f],
            vec![0x01, 0x80, 0x7f, 0xff, 0x7f, 0x7f],
        ],
        DType::U8 => [
            vec![0xff, 0x80, 0x00, 0x01, 0xff, 0x10],
            vec![0x01, 0x80, 0xff, 0xff, 0xff, 0x10],
        ],
        DType::I32 => [
            vec![
                0x7fff_ffff,
                0x8000_0000,
                0xffff_ffff,
                1,
                0x8000_0000,
                0x1_0000,
            ],
            vec![
                1,
                0x8000_0000,
                0x7fff_ffff,
                0xffff_ffff,
                0x7fff_ffff,
                0x1_0000,
            ],
        ],
        DType::U32 => [
            vec![0xffff_ffff, 0x8000_0000, 0, 1, 0xffff_ffff, 0x1_0000],
            vec![
                1,
                0x8000_0000,
                0xffff_ffff,
                0xffff_ffff,
                0xffff_ffff,
                0x1_0000,
            ],
        ],
        DType::I64 | DType::U64 => [
            vec![i64::MAX as u64, 1 << 63, u64::MAX, 1, 1 << 63, 1 << 32],
            vec![
                1,
                1 << 63,
                i64::MAX as u64,
                u64::MAX,
                i64::MAX as u64,
                1 << 32,
            ],
        ],
        DType::F64 => [
            vec![
                1e308f64.to_bits(),
                f64::NAN.to_bits(),
                (-0.0f64).to_bits(),
                0.1f64.to_bits(),
                f64::MIN_POSITIVE.to_bits(),
                1.0f64.to_bits(),
            ],
            vec![
                1e308f64.to_bits(),
                2.0f64.to_bits(),
                0.0f64.to_bits(),
                0.2f64.to_bits(),
                (-f64::MIN_POSITIVE).to_bits(),
                (1.0f64 + f64::EPSILON).to_bits(),
            ],
        ],
        // FP8: the largest finite value twice (saturates), a NaN, -0 and +0, a subnormal,
        // an infinity of e5m2 (0x7c; e4m3 has none: 0x7e is 448), the largest negative
        _ => [
            vec![0x7e, 0x7f, 0x80, 0x01, 0x7c, 0xfe],
            vec![0x7e, 0x38, 0x00, 0x01, 0x38, 0xfe],
        ],
    }
}

#[test]
fn the_dyn_forms_wrap_saturate_and_order_the_extremes_as_the_reference() {
    let Some((_e, devices)) = two("collectives::types::dyn_extremes") else {
        return;
    };
    let (comm, s) = team_on(&devices, CommConfig::default(), MulticastPolicy::Never);
    let inp = comm.alloc::<u8>(256).unwrap();
    let mut out = comm.alloc::<u8>(256).unwrap();
    for dtype in DType::REDUCED
        .into_iter()
        .filter(|d| !DType::ALL.contains(d))
    {
        let inputs: Vec<Vec<u8>> = extremes(dtype).iter().map(|v| bytes_of(dtype, v)).collect();
        let len = inputs[0].len();
        for op in ReduceOp::ALL {
            let want = reference_bytes(dtype, op, &refs(&inputs));
            for (r, x) in inputs.iter().enumerate() {
                inp.write(r, 0, x).unwrap();
            }
            for (r, st) in s.iter().enumerate() {
                comm.rank(r)
                    .unwrap()
                    .all_reduce_dyn(
                        dtype,
                        inp.slice(..len).unwrap(),
                        out.slice_mut(..len).unwrap(),
                        op,
                        st,
                    )
                    .unwrap();
            }
            sync(&s);
            comm.check().unwrap();
            for r in 0..2 {
                let mut got = vec![0u8; len];
                out.read(r, 0, &mut got).unwrap();
                assert_eq!(same(dtype, &got, &want), None, "{dtype} {op} rank {r}");
            }
        }
    }
}

#[test]
fn the_reference_wraps_integers_saturates_fp8_and_orders_signed_and_unsigned() {
    let r = |d: DType, op, a: u64, b: u64| d.reduce_bits(op, [a, b]);
    // wrapping sums and products in the type's width
    assert_eq!(r(DType::I8, ReduceOp::Sum, 0x7f, 1), 0x80);
    assert_eq!(r(DType::U8, ReduceOp::Sum, 0xff, 1), 0);
    assert_eq!(r(DType::U8, ReduceOp::Prod, 0x10, 0x10), 0);
    assert_eq!(r(DType::I32, ReduceOp::Sum, 0x7fff_ffff, 1), 0x8000_0000);
    assert_eq!(r(DType::U64, ReduceOp::Sum, u64::MAX, 2), 1);
    assert_eq!(r(DType::I64, ReduceOp::Prod, 1 << 62, 4), 0);
    // min and max: signed against unsigned
    assert_eq!(r(DType::I8, ReduceOp::Min, 0x80, 0x7f), 0x80);
    assert_eq!(r(DType::U8, ReduceOp::Min, 0x80, 0x7f), 0x7f);
    assert_eq!(r(DType::I32, ReduceOp::Max, 0xffff_ffff, 1), 1);
    assert_eq!(r(DType::U32, ReduceOp::Max, 0xffff_ffff, 1), 0xffff_ffff);
    assert_eq!(r(DType::I64, ReduceOp::Min, 1 << 63, 0), 1 << 63);
    assert_eq!(r(DType::U64, ReduceOp::Min, 1 << 63, 0), 0);
    // average: the wrapped sum divided, toward zero
    assert_eq!(r(DType::I8, ReduceOp::Avg, 0x7f, 0x7f), 0xff); // (127 + 127) wraps to -2: -1
    assert_eq!(
        r(DType::I32, ReduceOp::Avg, (-3i32) as u32 as u64, 0),
        (-1i32) as u32 as u64
    );
    assert_eq!(r(DType::U8, ReduceOp::Avg, 0xff, 0x03), 0x01); // 258 wraps to 2: 1
                                                               // FP8: saturation to the finite range, NaN, infinity
    assert_eq!(r(DType::F8E4M3, ReduceOp::Sum, 0x7e, 0x7e), 0x7e); // 448 + 448 -> 448
    assert_eq!(r(DType::F8E4M3, ReduceOp::Sum, 0xfe, 0xfe), 0xfe);
    assert_eq!(r(DType::F8E5M2, ReduceOp::Sum, 0x7b, 0x7b), 0x7b); // 57344 twice -> 57344
    assert_eq!(r(DType::F8E5M2, ReduceOp::Sum, 0x7c, 0x38), 0x7b); // inf + 1 -> 57344
    assert_eq!(r(DType::F8E4M3, ReduceOp::Sum, 0x7f, 0x38), 0x7f); // NaN
    assert_eq!(r(DType::F8E4M3, ReduceOp::Min, 0x7f, 0x38), 0x38); // min drops the NaN
    assert_eq!(r(DType::F8E4M3, ReduceOp::Sum, 0x38, 0x38), 0x40); // 1 + 1 = 2
                                                                   // e4m3: 1 + 1/16 is halfway between 1 and 1.125: to even (1)
    assert_eq!(r(DType::F8E4M3, ReduceOp::Sum, 0x38, 0x18), 0x38);
    // f64 in rank order, in f64
    let s = r(
        DType::F64,
        ReduceOp::Sum,
        0.1f64.to_bits(),
        0.2f64.to_bits(),
    );
    assert_eq!(f64::from_bits(s), 0.1 + 0.2);
    // typed and byte references agree for the wide types
    let mut st = 9;
    let a: Vec<i64> = random_input(64, &mut st);
    let b: Vec<i64> = random_input(64, &mut st);
    let t = reference(ReduceOp::Sum, &[&a, &b]);
    let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let rb = reference_bytes(DType::I64, ReduceOp::Sum, &[&bytes(&a), &bytes(&b)]);
    assert_eq!(bytes(&t), rb);
    assert!(
        a.iter().zip(&b).any(|(x, y)| x.checked_add(*y).is_none()),
        "no overflow drawn"
    );
}

#[test]
fn the_fused_norm_refuses_every_other_type_naming_dtype() {
    let Some((_e, devices)) = two("collectives::types::norm_refuses") else {
        return;
    };
    let (comm, s) = team_on(&devices, CommConfig::default(), MulticastPolicy::Never);
    let x = comm.alloc::<i32>(64).unwrap();
    let mut res = comm.alloc::<i32>(64).unwrap();
    let w = comm.alloc::<i32>(64).unwrap();
    let mut o = comm.alloc::<i32>(64).unwrap();
    let e = comm
        .rank(0)
        .unwrap()
        .all_reduce_add_rms_norm(&x, &mut res, &w, &mut o, 64, 1e-6, &s[0])
        .unwrap_err();
    let m = e.to_string();
    assert!(m.contains("dtype") && m.contains("i32"), "{m}");
    comm.check().unwrap();
}

/// On a simulated machine with multicast, the planner never picks multimem for a type it has no
/// multimem kernel for — whatever the policy — and the choice reports the peer-to-peer form
/// that runs (8-byte types never the low-latency one); a real call reports the same and equals
/// the reference.
#[test]
fn multimem_and_the_low_latency_forms_are_never_chosen_for_types_without_them() {
    cuda_multimem_collectives::sim::install();
    let e = sim(SimConfig::new(
        8,
        cuda_multimem_tests::sim_version().max(13030),
    ));
    let devices = e.driver.devices();
    let comm = Communicator::builder(&devices)
        .multicast(MulticastPolicy::Always)
        .build()
        .unwrap();
    assert!(
        comm.multimem_active(),
        "{:?}",
        comm.multimem_unavailable_reason()
    );
    for dtype in DType::REDUCED {
        for op in ReduceOp::ALL {
            let c = comm
                .choice(dtype, op, 1 << 18, Operands::Symmetric)
                .unwrap();
            let mm = cuda_multimem_collectives::multimem_supports(dtype, op);
            assert_eq!(c.path == Path::Multimem, mm, "{dtype} {op}: {c}");
            assert!(!mm || DType::ALL.contains(&dtype), "{dtype} {op}");
            let small = comm.choice(dtype, op, 64, Operands::Symmetric).unwrap();
            if dtype.size() == 8 {
                assert_ne!(
                    small.algorithm,
                    Algorithm::OneShotLl,
                    "{dtype} {op}: {small}"
                );
            }
        }
    }
    // a real call of i32 sums reports the peer-to-peer path and wraps as the reference
    let s = streams(&comm);
    let count = 100_000;
    let mut buf = comm.alloc::<i32>(count).unwrap();
    let mut seed = 31;
    let inputs: Vec<Vec<i32>> = (0..8).map(|_| random_input(count, &mut seed)).collect();
    for (r, x) in inputs.iter().enumerate() {
        buf.write(r, 0, x).unwrap();
    }
    let want = reference(ReduceOp::Sum, &refs(&inputs));
    let mut choices = Vec::new();
    for (r, st) in s.iter().enumerate() {
        choices.push(
            comm.rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
                .unwrap(),
        );
    }
    sync(&s);
    comm.check().unwrap();
    let c = comm
        .choice(DType::I32, ReduceOp::Sum, count, Operands::Symmetric)
        .unwrap();
    for (r, got) in choices.iter().enumerate() {
        assert_eq!(*got, c, "rank {r}");
        assert_eq!(got.path, Path::PeerToPeer, "rank {r}");
        assert_eq!(
            first_mismatch(&buf.to_vec(r).unwrap(), &want),
            None,
            "rank {r}"
        );
    }
}
