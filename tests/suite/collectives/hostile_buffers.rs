//! Hostile use of symmetric buffers, their views, operands, the fused norm's arguments, the
//! configuration and the host references: every misuse gives an error value naming the
//! argument (or a documented panic), before any launch, and what is accepted computes the
//! reference.

use std::ops::Bound;
use std::time::Duration;

use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, broadcast_reference, reduce_scatter_reference, reference,
};
use cuda_multimem_collectives::{
    bf16, f16, Algorithm, CommConfig, Communicator, DType, Dst, Element, MulticastPolicy, Operands,
    ReduceOp, Src,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::collectives::{self as table, Mem, Queued};
use cuda_multimem_tests::{sim, Env, Rng};

use cuda_multimem_tests::{invalid_arg_of as arg_of, sim_team as team, sync_all as sync};

fn launches(e: &Env) -> u64 {
    e.sim.as_ref().unwrap().calls("cuLaunchKernel")
}

// ---- views and parts ----

#[test]
/// `parts_mut` is for one thread per rank: each part goes to its thread, writes, runs its
/// rank's call on its own view and reads back.
fn parts_mut_serve_one_thread_per_rank() {
    let (_e, comm, s) = team(2, CommConfig::default());
    let mut buf = comm.alloc::<f32>(64).unwrap();
    std::thread::scope(|sc| {
        for (mut p, st) in buf.parts_mut().into_iter().zip(&s) {
            let comm = &comm;
            sc.spawn(move || {
                let r = p.rank();
                p.write(0, &[r as f32 + 1.0; 64]).unwrap();
                comm.rank(r)
                    .unwrap()
                    .all_reduce_in_place(p.as_mut_slice(), ReduceOp::Sum, st)
                    .unwrap();
                st.synchronize().unwrap();
                let mut got = [0f32; 64];
                p.read(0, &mut got).unwrap();
                assert_eq!(got, [3.0; 64]);
            });
        }
    });
    comm.check().unwrap();
}

#[test]
/// Empty views (at the start, in the middle, at the very end of a buffer) and null raw pointers
/// of no bytes pass every collective and both norms without a launch; an empty call still
/// checks its root; the team stays in step for a real call after them.
fn zero_length_operands_pass_every_collective_without_a_launch() {
    let (e, comm, s) = team(2, CommConfig::default());
    let mut a = comm.alloc::<f32>(64).unwrap();
    let mut b = comm.alloc::<f32>(128).unwrap();
    let before = launches(&e);
    for (r, st) in s.iter().enumerate() {
        let h = comm.rank(r).unwrap();
        h.all_reduce(
            a.slice(64..).unwrap(),
            b.slice_mut(128..).unwrap(),
            ReduceOp::Sum,
            st,
        )
        .unwrap();
        h.all_reduce_in_place(a.slice_mut(3..3).unwrap(), ReduceOp::Sum, st)
            .unwrap();
        h.reduce_scatter(
            a.slice(..0).unwrap(),
            b.slice_mut(5..5).unwrap(),
            ReduceOp::Max,
            st,
        )
        .unwrap();
        h.all_gather(a.slice(..0).unwrap(), b.slice_mut(..0).unwrap(), st)
            .unwrap();
        h.all_gather_in_place(b.slice_mut(..0).unwrap(), st)
            .unwrap();
        h.reduce_scatter_in_place(b.slice_mut(..0).unwrap(), ReduceOp::Min, st)
            .unwrap();
        h.broadcast(a.slice(..0).unwrap(), b.slice_mut(..0).unwrap(), 1, st)
            .unwrap();
        h.broadcast_in_place(b.slice_mut(..0).unwrap(), 0, st)
            .unwrap();
        assert_eq!(
            arg_of(h.broadcast_in_place(b.slice_mut(..0).unwrap(), 2, st)),
            "root"
        );
        // null pointers of no bytes
        unsafe {
            h.all_reduce(
                Src::<f32>::from_raw(0, 0),
                Dst::<f32>::from_raw(0, 0),
                ReduceOp::Sum,
                st,
            )
            .unwrap();
            h.all_gather(Src::<f32>::from_raw(0, 0), Dst::<f32>::from_raw(0, 0), st)
                .unwrap();
        }
        let g = comm.alloc::<f32>(16).unwrap();
        h.all_reduce_add_rms_norm(
            a.slice(..0).unwrap(),
            b.slice_mut(..0).unwrap(),
            &g,
            unsafe { Dst::<f32>::from_raw(0, 0) },
            16,
            1e-6,
            st,
        )
        .unwrap();
        h.add_rms_norm(
            a.slice(..0).unwrap(),
            b.slice_mut(..0).unwrap(),
            &g,
            unsafe { Dst::<f32>::from_raw(0, 0) },
            16,
            1e-6,
            st,
        )
        .unwrap();
    }
    assert_eq!(launches(&e), before);
    sync(&s);
    comm.check().unwrap();
    // a real call afterwards
    for r in 0..2 {
        a.write(r, 0, &[r as f32 + 1.0; 64]).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(&mut a, ReduceOp::Sum, st)
            .unwrap();
    }
    sync(&s);
    comm.check().unwrap();
    assert_eq!(a.to_vec(1).unwrap(), vec![3.0; 64]);
}

/// Every collective of the table at no elements — every parameter, both operand kinds, in
/// place and not — launches nothing; the team stays in step for a real call of each after
/// them.
#[test]
fn every_collective_of_no_elements_launches_nothing_and_the_team_stays_in_step() {
    let (e, comm, s) = team(2, CommConfig::default());
    let mut rng = Rng::new(3);
    let before = launches(&e);
    let mut empty = Vec::new();
    for c in table::table::<f32>() {
        for params in table::params_for(&c, 2) {
            for mem in Mem::KINDS {
                for in_place in [false, true] {
                    let mut q = Queued::new(&comm, c, 0, params, mem, in_place);
                    q.fill(&mut rng);
                    q.call_all(&comm, &s);
                    empty.push(q);
                }
            }
        }
    }
    assert_eq!(launches(&e), before);
    sync(&s);
    comm.check().unwrap();
    for q in &empty {
        q.check();
    }
    for call in table::calls(2) {
        table::once::<f32>(&comm, &s, call, 64, Mem::SYM, false, &mut rng);
    }
}

#[test]
/// Views of views add their offsets; every bound kind (excluded start, inclusive end, past
/// the end, `Excluded(usize::MAX)`) is checked against the inner view; a collective on a view
/// of a view of a split touches exactly its range.
fn views_of_views_compose_offsets_and_refuse_bad_bounds() {
    let (_e, comm, s) = team(2, CommConfig::default());
    let mut buf = comm.alloc::<f32>(100).unwrap();
    for r in 0..2 {
        buf.write(r, 0, &(0..100).map(|i| i as f32).collect::<Vec<_>>())
            .unwrap();
    }
    {
        let v = buf.slice(10..90).unwrap();
        let w = v.slice(5..).unwrap();
        assert_eq!((w.offset(), w.len()), (15, 75));
        let x = w.slice((Bound::Excluded(2), Bound::Included(4))).unwrap();
        assert_eq!((x.offset(), x.len()), (18, 2));
        assert_eq!(
            arg_of(w.slice((Bound::Excluded(usize::MAX), Bound::Unbounded))),
            "range"
        );
        assert_eq!(arg_of(w.slice(76..)), "range");
        assert_eq!(arg_of(w.slice(..=75)), "range");
    }
    for (r, st) in s.iter().enumerate() {
        let mut v = buf.slice_mut(10..90).unwrap();
        let (_, mut hi) = v.slice_mut(5..).unwrap().split_at_mut(3).unwrap();
        let mut x = hi.slice_mut(2..4).unwrap();
        assert_eq!((x.offset(), x.len()), (20, 2));
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(&mut x, ReduceOp::Sum, st)
            .unwrap();
    }
    sync(&s);
    comm.check().unwrap();
    let got = buf.to_vec(0).unwrap();
    for (i, g) in got.iter().enumerate() {
        let want = if (20..22).contains(&i) {
            2.0 * i as f32
        } else {
            i as f32
        };
        assert_eq!(*g, want, "{i}");
    }
}

#[test]
/// A `DeviceBuffer` of the same ordinal from another `Driver` value is another device to the
/// team: refused naming the operand, saying so, before any launch.
fn device_memory_of_another_driver_value_is_refused_naming_the_operand() {
    let (e, comm, s) = team(2, CommConfig::default());
    let other = cuda_multimem_sim::driver_over(e.sim.as_ref().unwrap()).unwrap();
    let d0 = other.device(0).unwrap();
    let foreign = DeviceBuffer::<f32>::zeroed(&d0, 64).unwrap();
    let mut foreign_out = DeviceBuffer::<f32>::zeroed(&d0, 64).unwrap();
    let mut buf = comm.alloc::<f32>(64).unwrap();
    let h = comm.rank(0).unwrap();
    let before = launches(&e);
    let err = h.all_reduce(&foreign, &mut buf, ReduceOp::Sum, &s[0]);
    assert!(
        format!("{err:?}").contains("another Driver value"),
        "{err:?}"
    );
    assert_eq!(arg_of(err), "input");
    assert_eq!(
        arg_of(h.all_reduce_in_place(&mut foreign_out, ReduceOp::Sum, &s[0])),
        "buf"
    );
    assert_eq!(
        arg_of(h.broadcast(&buf, &mut foreign_out, 0, &s[0])),
        "output"
    );
    assert_eq!(launches(&e), before);
}

#[test]
/// The fused norm at hidden 1, 3, 7 and 33 (rows of odd element counts, not whole 4-byte
/// words for 16-bit types) and eps 0 equals its reference for every dtype.
fn the_norm_at_tiny_and_odd_hidden_equals_the_reference_for_every_dtype() {
    fn one<T: Element + Default + Copy>(comm: &Communicator, s: &[Stream]) {
        for hidden in [1usize, 3, 7, 33] {
            let tokens = 3;
            let len = tokens * hidden;
            let x = comm.alloc::<T>(len).unwrap();
            let mut res = comm.alloc::<T>(len).unwrap();
            let g = comm.alloc::<T>(hidden).unwrap();
            let mut out = comm.alloc::<T>(len).unwrap();
            let mut seed = 5 + hidden as u64;
            let xs: Vec<Vec<T>> = (0..2)
                .map(|_| cuda_multimem_collectives::testing::random_input(len, &mut seed))
                .collect();
            let r0: Vec<T> = cuda_multimem_collectives::testing::random_input(len, &mut seed);
            let gamma: Vec<T> = cuda_multimem_collectives::testing::random_input(hidden, &mut seed);
            for (r, xr) in xs.iter().enumerate() {
                x.write(r, 0, xr).unwrap();
                res.write(r, 0, &r0).unwrap();
                g.write(r, 0, &gamma).unwrap();
            }
            for (r, st) in s.iter().enumerate() {
                comm.rank(r)
                    .unwrap()
                    .all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, hidden, 0.0, st)
                    .unwrap();
            }
            sync(s);
            comm.check().unwrap();
            let refs: Vec<&[T]> = xs.iter().map(|v| v.as_slice()).collect();
            let (wr, wo) = add_rms_norm_reference(&refs, &r0, &gamma, hidden, 0.0);
            for r in 0..2 {
                assert_eq!(res.to_vec(r).unwrap(), wr, "{} hidden {hidden}", T::DTYPE);
                let o = out.to_vec(r).unwrap();
                for (a, b) in o.iter().zip(&wo) {
                    assert!(
                        cuda_multimem_collectives::testing::rms_norm_within_tolerance(*a, *b),
                        "{} hidden {hidden}: {a:?} {b:?}",
                        T::DTYPE
                    );
                }
            }
        }
    }
    let (_e, comm, s) = team(2, CommConfig::default());
    one::<f32>(&comm, &s);
    one::<f16>(&comm, &s);
    one::<bf16>(&comm, &s);
}

#[test]
/// Norm arguments in combinations not covered elsewhere: a weight too long, hidden past the
/// buffer or not dividing it, eps -inf, hidden usize::MAX, a residual over the weight, a byte
/// length that overflows, a null weight with bytes: each refused naming it, before any launch.
fn norm_arguments_are_refused_naming_each_before_any_launch() {
    let (e, comm, s) = team(2, CommConfig::default());
    let h = comm.rank(0).unwrap();
    let x = comm.alloc::<bf16>(64).unwrap();
    let mut res = comm.alloc::<bf16>(64).unwrap();
    let g = comm.alloc::<bf16>(32).unwrap();
    let mut out = comm.alloc::<bf16>(64).unwrap();
    let before = launches(&e);
    // weight too long
    assert_eq!(
        arg_of(h.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, 16, 1e-6, &s[0])),
        "weight"
    );
    // hidden larger than the buffer
    assert_eq!(
        arg_of(h.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, 128, 1e-6, &s[0])),
        "x"
    );
    // hidden not dividing the length
    assert_eq!(
        arg_of(h.all_reduce_add_rms_norm(
            &x,
            &mut res,
            g.slice(..24).unwrap(),
            &mut out,
            24,
            1e-6,
            &s[0]
        )),
        "x"
    );
    assert_eq!(
        arg_of(h.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, 32, f32::NEG_INFINITY, &s[0])),
        "eps"
    );
    assert_eq!(
        arg_of(h.all_reduce_add_rms_norm(&x, &mut res, &g, &mut out, usize::MAX, 0.0, &s[0])),
        "hidden"
    );
    // residual is weight (overlap)
    unsafe {
        let p = g.device_ptr(0).unwrap();
        assert_eq!(
            arg_of(h.all_reduce_add_rms_norm(
                &x,
                Dst::<bf16>::from_raw(p, 64),
                &g,
                &mut out,
                32,
                0.0,
                &s[0]
            )),
            "residual"
        );
        // tokens*hidden overflowing bytes
        assert_eq!(
            arg_of(h.all_reduce_add_rms_norm(
                Src::<bf16>::from_raw(p, usize::MAX / 2 + 1),
                Dst::<bf16>::from_raw(p, usize::MAX / 2 + 1),
                Src::<bf16>::from_raw(p, 1),
                Dst::<bf16>::from_raw(p, usize::MAX / 2 + 1),
                1,
                0.0,
                &s[0]
            )),
            "x"
        );
        // null pointers with bytes
        assert_eq!(
            arg_of(h.all_reduce_add_rms_norm(
                &x,
                &mut res,
                Src::<bf16>::from_raw(0, 32),
                &mut out,
                32,
                0.0,
                &s[0]
            )),
            "weight"
        );
    }
    assert_eq!(launches(&e), before);
}

#[test]
/// Fields at 0, just past their limits, or an algorithm of another collective: refused by
/// `build` naming `config.<field>`.
fn configurations_past_each_limit_are_refused_naming_the_field() {
    let e = sim(SimConfig::new(2, 13000));
    let devices = e.driver.devices();
    let d = CommConfig::default;
    for (config, field) in [
        (CommConfig { threads: 0, ..d() }, "config.threads"),
        (CommConfig { threads: 65, ..d() }, "config.threads"),
        (
            CommConfig {
                threads: 1056,
                ..d()
            },
            "config.threads",
        ),
        (
            CommConfig {
                push_threads: 0,
                ..d()
            },
            "config.push_threads",
        ),
        (
            CommConfig {
                push_threads: u32::MAX,
                ..d()
            },
            "config.push_threads",
        ),
        (
            CommConfig {
                max_blocks: 257,
                ..d()
            },
            "config.max_blocks",
        ),
        (
            CommConfig {
                timeout: Duration::ZERO,
                ..d()
            },
            "config.timeout",
        ),
        (
            CommConfig {
                stage_bytes: Some(0),
                ..d()
            },
            "config.stage_bytes",
        ),
        (
            CommConfig {
                stage_bytes: Some(4095),
                ..d()
            },
            "config.stage_bytes",
        ),
        (
            CommConfig {
                norm_ll_max_bytes: usize::MAX,
                ..d()
            },
            "config.norm_ll_max_bytes",
        ),
        (
            CommConfig {
                gather_ll_max_bytes: (16 << 20) + 1,
                ..d()
            },
            "config.gather_ll_max_bytes",
        ),
        (
            CommConfig {
                algorithm: Some(Algorithm::PushLl),
                ..d()
            },
            "config.algorithm",
        ),
    ] {
        let err = Communicator::builder(&devices)
            .config(config)
            .multicast(MulticastPolicy::Never)
            .build();
        assert_eq!(arg_of(err), field);
    }
}

#[test]
/// Launch settings that are valid but not powers of two (96 and 160 threads, 3 blocks) with
/// small staging: allreduce, all-gather and reduce-scatter on a team of 3 give the reference.
fn valid_non_power_of_two_launch_settings_give_the_reference() {
    let config = CommConfig {
        threads: 96,
        push_threads: 160,
        max_blocks: 3,
        one_shot_max_bytes: Some(4096),
        stage_bytes: Some(8192),
        ll_max_bytes: 0,
        gather_ll_max_bytes: 0,
        broadcast_ll_max_bytes: 0,
        norm_ll_max_bytes: 0,
        ..Default::default()
    };
    let (_e, comm, s) = team(3, config);
    for count in [1usize, 7, 1000, 12345] {
        let mut buf = comm.alloc::<f32>(count).unwrap();
        let mut seed = 3 + count as u64;
        let ins: Vec<Vec<f32>> = (0..3)
            .map(|_| cuda_multimem_collectives::testing::random_input(count, &mut seed))
            .collect();
        for (r, x) in ins.iter().enumerate() {
            buf.write(r, 0, x).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            comm.rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
                .unwrap();
        }
        sync(&s);
        comm.check().unwrap();
        let refs: Vec<&[f32]> = ins.iter().map(|v| v.as_slice()).collect();
        let want = reference(ReduceOp::Sum, &refs);
        for r in 0..3 {
            assert_eq!(buf.to_vec(r).unwrap(), want, "count {count} rank {r}");
        }
        // all-gather and reduce-scatter
        let mut whole = comm.alloc::<f32>(3 * count).unwrap();
        for (r, st) in s.iter().enumerate() {
            comm.rank(r)
                .unwrap()
                .all_gather(&buf, &mut whole, st)
                .unwrap();
        }
        sync(&s);
        comm.check().unwrap();
        let w3: Vec<f32> = want.iter().chain(&want).chain(&want).copied().collect();
        for r in 0..3 {
            assert_eq!(whole.to_vec(r).unwrap(), w3, "ag count {count} rank {r}");
        }
        for (r, st) in s.iter().enumerate() {
            comm.rank(r)
                .unwrap()
                .reduce_scatter(&whole, &mut buf, ReduceOp::Max, st)
                .unwrap();
        }
        sync(&s);
        comm.check().unwrap();
        for r in 0..3 {
            assert_eq!(buf.to_vec(r).unwrap(), want, "rs count {count} rank {r}");
        }
    }
}

#[test]
/// `add_rms_norm_choice` at every dtype, hidden from 1 to `MAX_HIDDEN` and tokens from 0 to
/// usize::MAX answers with a launch shape (at least one block) or names `hidden`.
fn norm_choice_at_extreme_shapes_reports_a_launch_shape_or_names_hidden() {
    let (_e, comm, _s) = team(2, CommConfig::default());
    for dtype in DType::ALL {
        for hidden in [1, 2, 3, 4097, MAX_HIDDEN] {
            for tokens in [0, 1, 2, 3, 1000, usize::MAX] {
                let r = comm.add_rms_norm_choice(dtype, tokens, hidden);
                match r {
                    Ok(c) => assert!(
                        c.blocks >= 1 && c.threads >= 64 && c.threads <= 1024,
                        "{c:?}"
                    ),
                    Err(e) => assert_eq!(arg_of::<()>(Err(e)), "hidden"),
                }
            }
        }
    }
}

/// `norm::MAX_HIDDEN` (not exported).
const MAX_HIDDEN: usize = 1 << 24;

// ---- what the queries report ----

/// The split norm forms at no rows: the choice query and the call (which launches nothing)
/// reported 0 blocks (`0 × SPLIT`); every other form reports at least one.
#[test]
fn a_norm_of_no_rows_reports_at_least_one_block() {
    let (e, comm, s) = team(2, CommConfig::default());
    // rows of at least 4 KiB: the split forms' size
    for (dtype, hidden) in [(DType::F32, 1024), (DType::F32, 4097), (DType::Bf16, 2048)] {
        let c = comm.add_rms_norm_choice(dtype, 0, hidden).unwrap();
        assert!(c.blocks >= 1, "{dtype} hidden {hidden}: {c:?}");
    }
    let g = comm.alloc::<f32>(1024).unwrap();
    let mut res = comm.alloc::<f32>(1).unwrap();
    let before = launches(&e);
    for (r, st) in s.iter().enumerate() {
        let c = comm
            .rank(r)
            .unwrap()
            .all_reduce_add_rms_norm(
                g.slice(..0).unwrap(),
                res.slice_mut(..0).unwrap(),
                &g,
                // SAFETY: no bytes.
                unsafe { Dst::<f32>::from_raw(0, 0) },
                1024,
                1e-6,
                st,
            )
            .unwrap();
        assert!(c.blocks >= 1, "rank {r}: {c:?}");
        assert_eq!(c, comm.add_rms_norm_choice(DType::F32, 0, 1024).unwrap());
    }
    assert_eq!(launches(&e), before);
}

/// `Communicator::choice` reports what the call runs: the same `Choice` the call returns, on
/// symmetric buffers and on the caller's own memory, for f32 and f16 (odd f16 counts are no
/// whole 4-byte words: the low-latency form falls back to one-shot), with the default, a tiny
/// scratch and forced configurations.
#[test]
fn choice_equals_what_the_call_runs() {
    fn check<T: Element + Default + Copy>(comm: &Communicator, s: &[Stream], count: usize) {
        let what = format!("{count} x {} ({:?})", T::DTYPE, comm.config().algorithm);
        let mut buf = comm.alloc::<T>(count).unwrap();
        let mut ran = Vec::new();
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            ran.push(h.all_reduce_in_place(&mut buf, ReduceOp::Sum, st).unwrap());
        }
        sync(s);
        let q = comm.choice(T::DTYPE, ReduceOp::Sum, count, Operands::Symmetric);
        assert_eq!(q.unwrap(), ran[0], "{what}, symmetric");
        let mut own: Vec<DeviceBuffer<T>> = (0..s.len())
            .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), count).unwrap())
            .collect();
        let mut ran = Vec::new();
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            ran.push(
                h.all_reduce_in_place(&mut own[r], ReduceOp::Sum, st)
                    .unwrap(),
            );
        }
        sync(s);
        let q = comm.choice(T::DTYPE, ReduceOp::Sum, count, Operands::Local);
        assert_eq!(q.unwrap(), ran[0], "{what}, own memory");
        comm.check().unwrap();
    }
    for config in [
        CommConfig::default(),
        CommConfig {
            scratch_bytes: 1,
            ..Default::default()
        },
        CommConfig {
            algorithm: Some(Algorithm::OneShotLl),
            ..Default::default()
        },
        CommConfig {
            algorithm: Some(Algorithm::TwoShotPush),
            scratch_bytes: 1 << 20,
            ..Default::default()
        },
    ] {
        let (_e, comm, s) = team(2, config);
        for count in [1, 3, 5, 1001, 40_001, 1 << 20] {
            check::<f32>(&comm, &s, count);
            check::<f16>(&comm, &s, count);
        }
    }
}

/// A forced form the communicator cannot run at this size (one-shot above its staging, the
/// copy-engine two-shot above its landing slots): the call refuses naming `count`, and so
/// must the choice query, for both kinds of operands, rather than report it as what runs.
#[test]
fn choice_refuses_a_forced_form_the_call_refuses() {
    for config in [
        CommConfig {
            algorithm: Some(Algorithm::OneShot),
            one_shot_max_bytes: Some(4 << 10),
            stage_bytes: Some(4 << 10),
            ll_max_bytes: 0,
            ..Default::default()
        },
        CommConfig {
            algorithm: Some(Algorithm::TwoShotCe),
            ..Default::default()
        },
    ] {
        let (e, comm, s) = team(2, config);
        let what = format!("{:?}", comm.config().algorithm);
        let count = 64 << 10;
        let mut buf = comm.alloc::<f32>(count).unwrap();
        let mut own = DeviceBuffer::<f32>::zeroed(comm.device(0).unwrap(), count).unwrap();
        let h = comm.rank(0).unwrap();
        let before = launches(&e);
        assert_eq!(
            arg_of(h.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[0])),
            "count",
            "{what}"
        );
        assert_eq!(
            arg_of(h.all_reduce_in_place(&mut own, ReduceOp::Sum, &s[0])),
            "count",
            "{what}"
        );
        assert_eq!(launches(&e), before);
        for operands in [Operands::Symmetric, Operands::Local] {
            assert_eq!(
                arg_of(comm.choice(DType::F32, ReduceOp::Sum, count, operands)),
                "count",
                "{what} {operands:?}"
            );
        }
        // a size it runs is still answered
        comm.choice(DType::F32, ReduceOp::Sum, 256, Operands::Symmetric)
            .unwrap();
    }
}

// ---- the host references ----

/// The references' preconditions, documented under `# Panics`: a short input, a root past the
/// inputs, a short weight panic; what is within them (an empty team, a longer input, no rows)
/// answers.
#[test]
fn the_references_panic_only_on_their_documented_preconditions() {
    let panics = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    let (a, b) = ([1f32, 2.0, 3.0, 4.0], [1f32, 2.0]);
    assert!(panics(&|| {
        reference(ReduceOp::Sum, &[&a[..], &b[..]]);
    }));
    assert!(panics(&|| {
        reduce_scatter_reference(ReduceOp::Sum, &[&a[..], &b[..]]);
    }));
    assert!(panics(&|| {
        broadcast_reference(&[&a[..], &b[..]], 2);
    }));
    assert!(panics(&|| {
        add_rms_norm_reference(&[&a[..], &a[..]], &a, &b, 4, 0.0);
    }));
    assert!(panics(&|| {
        DType::F32.load(&[0u8; 7], 1);
    }));
    // within the preconditions
    assert!(reference::<f32>(ReduceOp::Sum, &[]).is_empty());
    assert_eq!(reference(ReduceOp::Sum, &[&b[..], &a[..]]), vec![2.0, 4.0]);
    assert_eq!(broadcast_reference(&[&a[..], &b[..]], 1), b.to_vec());
    let (res, out) = add_rms_norm_reference::<f32>(&[], &[], &[], 4, 0.0);
    assert!(res.is_empty() && out.is_empty());
    assert_eq!(DType::F32.load(&[0u8; 8], 1), 0.0);
}
