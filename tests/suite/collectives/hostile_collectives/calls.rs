//! Hostile calls: a team that broke refuses every call, operands of another team, rank or
//! device, extreme counts in the queries, streams, threads calling one rank, forced forms.

use super::*;

// ---- a team that broke refuses every call ----

/// After a timeout, every collective of the table (both operand kinds, in place or not) and
/// every allocation is refused as `Unusable` before any launch; `check` keeps reporting (the
/// rank that timed out its own timeout, the team `Unusable`).
#[test]
fn after_a_timeout_every_collective_and_the_norm_are_refused_without_a_launch() {
    let (e, comm, s) = team(
        2,
        CommConfig {
            timeout: Duration::from_millis(50),
            first_call_timeout: Some(Duration::from_millis(50)),
            gather_ll_max_bytes: 0,
            ..Default::default()
        },
    );
    let sim = e.sim.as_ref().unwrap();
    // every case's operands, allocated while the team is healthy
    let mut cases = every_case::<f32>(&comm, 64, 16);
    let a = comm.alloc::<f32>(64).unwrap();
    let mut b = comm.alloc::<f32>(128).unwrap();
    // rank 0 all-gathers alone: its barrier times out
    let h0 = comm.rank(0).unwrap();
    h0.all_gather(&a, &mut b, &s[0]).unwrap();
    sync(&s);
    assert!(matches!(comm.check(), Err(Error::Timeout { .. })));
    assert!(matches!(comm.check(), Err(Error::Unusable { .. })));
    assert!(matches!(h0.check(), Err(Error::Timeout { .. })));
    assert!(matches!(
        comm.rank(1).unwrap().check(),
        Err(Error::Unusable { .. })
    ));
    let before = sim.calls("cuLaunchKernel");
    for (rank, st) in s.iter().enumerate() {
        for q in cases.iter_mut() {
            let r = q.call(&comm, rank, st);
            assert!(
                matches!(r, Err(Error::Unusable { .. })),
                "{}, rank {rank}: {r:?}",
                q.what()
            );
        }
        let x = comm.alloc::<f32>(1);
        assert!(matches!(x, Err(Error::Unusable { .. })), "alloc");
    }
    assert_eq!(
        sim.calls("cuLaunchKernel"),
        before,
        "a refused call launched"
    );
}

/// Every collective of the table at `count` (the norm in rows of `hidden`) with its first
/// parameters, on both operand kinds, in place and not: allocated and filled, not called.
fn every_case<T: table::Elem>(comm: &Communicator, count: usize, hidden: usize) -> Vec<Queued<T>> {
    let mut rng = Rng::new(count as u64 + 1);
    let mut cases = Vec::new();
    for c in table::table::<T>() {
        let mut params = table::params_for(&c, comm.size())[0];
        params.hidden = hidden;
        for mem in Mem::KINDS {
            for in_place in [false, true] {
                let mut q = Queued::new(comm, c, count, params, mem, in_place);
                q.fill(&mut rng);
                cases.push(q);
            }
        }
    }
    cases
}

/// Every collective of the table refuses a stream of another device and (out of place and in
/// place) operands of another communicator, naming the argument, before any launch; the team
/// stays healthy and runs every case afterwards.
#[test]
fn every_collective_refuses_a_foreign_stream_or_buffer_naming_it_before_any_launch() {
    let (e, comm, s) = team(2, CommConfig::default());
    let other = cuda_multimem_tests::team_on(
        &e.driver.devices(),
        CommConfig::default(),
        MulticastPolicy::Never,
    )
    .0;
    let sim = e.sim.as_ref().unwrap();
    let mut cases = every_case::<f32>(&comm, 64, 16);
    let mut foreign = every_case::<f32>(&other, 64, 16);
    let before = sim.calls("cuLaunchKernel");
    for q in cases.iter_mut() {
        assert_eq!(arg_of(q.call(&comm, 0, &s[1])), "stream", "{}", q.what());
    }
    for q in foreign.iter_mut().filter(|q| q.mem == Mem::SYM) {
        // the first operand the call checks: the input (the norm's x), in place the buffer;
        // the norm's in-place form passes x and out as raw views of the caller's memory, so
        // its residual is the first of another communicator
        let want = match (q.coll.name, q.in_place) {
            ("all_reduce_add_rms_norm", false) => "x",
            ("all_reduce_add_rms_norm", true) => "residual",
            (_, false) => "input",
            (_, true) => "buf",
        };
        assert_eq!(arg_of(q.call(&comm, 0, &s[0])), want, "{}", q.what());
    }
    assert_eq!(
        sim.calls("cuLaunchKernel"),
        before,
        "a refused call launched"
    );
    sync(&s);
    comm.check().unwrap();
    for q in cases.iter_mut() {
        q.call_all(&comm, &s);
        sync(&s);
        comm.check().unwrap();
        q.check();
    }
}

// ---- operands that belong elsewhere ----

/// Reduce-scatter, all-gather, broadcast and the fused norm take the allreduce's operand
/// checks: a buffer of another communicator, a view of another rank's part
/// (`SymmetricBuffer::parts_mut`) and a stream of another device are refused naming the
/// argument, before any launch; the right rank's part is accepted.
#[test]
fn operands_of_another_team_rank_or_device_are_refused_by_every_collective() {
    let (e, comm, s) = team(2, CommConfig::default());
    let other = cuda_multimem_tests::team_on(
        &e.driver.devices(),
        CommConfig::default(),
        MulticastPolicy::Never,
    )
    .0;
    let sim = e.sim.as_ref().unwrap();
    let foreign = other.alloc::<f32>(128).unwrap();
    let mut foreign_out = other.alloc::<f32>(128).unwrap();
    let a = comm.alloc::<f32>(64).unwrap();
    let mut b = comm.alloc::<f32>(128).unwrap();
    let h0 = comm.rank(0).unwrap();
    let st = &s[0];
    let before = sim.calls("cuLaunchKernel");
    // another communicator's buffers
    let mut part = comm.alloc::<f32>(64).unwrap();
    assert_eq!(
        arg_of(h0.reduce_scatter(&foreign, &mut part, ReduceOp::Sum, st)),
        "input"
    );
    assert_eq!(
        arg_of(h0.reduce_scatter(&b, foreign_out.slice_mut(..64).unwrap(), ReduceOp::Sum, st)),
        "output"
    );
    assert_eq!(
        arg_of(h0.all_gather(foreign.slice(..64).unwrap(), &mut b, st)),
        "input"
    );
    assert_eq!(arg_of(h0.all_gather(&a, &mut foreign_out, st)), "output");
    assert_eq!(
        arg_of(h0.broadcast(
            foreign.slice(..64).unwrap(),
            b.slice_mut(..64).unwrap(),
            1,
            st
        )),
        "input"
    );
    // in place, the one operand is `buf` (not an `input` or `output` the call does not have)
    assert_eq!(
        arg_of(h0.broadcast_in_place(&mut foreign_out, 1, st)),
        "buf"
    );
    assert_eq!(arg_of(h0.all_gather_in_place(&mut foreign_out, st)), "buf");
    assert_eq!(
        arg_of(h0.reduce_scatter_in_place(&mut foreign_out, ReduceOp::Min, st)),
        "buf"
    );
    // a view of rank 1's part in rank 0's call
    {
        let mut parts = b.parts_mut();
        let (p0, p1) = parts.split_at_mut(1);
        let (p0, p1) = (&mut p0[0], &mut p1[0]);
        assert_eq!((p0.rank(), p1.rank()), (0, 1));
        assert_eq!(arg_of(h0.all_gather_in_place(p1.as_mut_slice(), st)), "buf");
        assert_eq!(
            arg_of(h0.broadcast(&a, p1.slice_mut(..64).unwrap(), 0, st)),
            "output"
        );
        let v = p1.as_mut_slice();
        assert_eq!(
            arg_of(h0.reduce_scatter(&v, p0.slice_mut(..64).unwrap(), ReduceOp::Sum, st)),
            "input"
        );
    }
    // a stream of device 1 for rank 0
    assert_eq!(arg_of(h0.all_gather(&a, &mut b, &s[1])), "stream");
    assert_eq!(
        arg_of(h0.reduce_scatter(&b, &mut part, ReduceOp::Max, &s[1])),
        "stream"
    );
    assert_eq!(arg_of(h0.broadcast_in_place(&mut b, 0, &s[1])), "stream");
    // the norm: another communicator's x, residual, weight, out
    let d0 = comm.device(0).unwrap();
    let x = DeviceBuffer::<f32>::zeroed(d0, 128).unwrap();
    let mut res = DeviceBuffer::<f32>::zeroed(d0, 128).unwrap();
    let g = DeviceBuffer::<f32>::zeroed(d0, 64).unwrap();
    let mut out = DeviceBuffer::<f32>::zeroed(d0, 128).unwrap();
    let norm = |r: cuda_multimem::Result<cuda_multimem_collectives::Choice>| arg_of(r);
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(&foreign, &mut res, &g, &mut out, 64, 1e-6, st)),
        "x"
    );
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(&x, &mut foreign_out, &g, &mut out, 64, 1e-6, st)),
        "residual"
    );
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(
            &x,
            &mut res,
            foreign.slice(..64).unwrap(),
            &mut out,
            64,
            1e-6,
            st
        )),
        "weight"
    );
    assert_eq!(
        norm(h0.all_reduce_add_rms_norm(&x, &mut res, &g, &mut foreign_out, 64, 1e-6, st)),
        "out"
    );
    {
        let mut parts = b.parts_mut();
        let p1 = &mut parts[1];
        assert_eq!(
            norm(h0.all_reduce_add_rms_norm(&x, &mut res, &g, p1.as_mut_slice(), 64, 1e-6, st)),
            "out"
        );
    }
    // the unfused baseline: another device's memory and stream
    let d1 = comm.device(1).unwrap();
    let x1 = DeviceBuffer::<f32>::zeroed(d1, 128).unwrap();
    assert_eq!(
        arg_of(h0.add_rms_norm(&x1, &mut res, &g, &mut out, 64, 1e-6, st)),
        "x"
    );
    assert_eq!(
        arg_of(h0.add_rms_norm(&x, &mut res, &g, &mut out, 64, 1e-6, &s[1])),
        "stream"
    );
    assert_eq!(
        sim.calls("cuLaunchKernel"),
        before,
        "a refused call launched"
    );
    // nothing ran: the team is healthy, and each rank's own part serves its calls
    sync(&s);
    comm.check().unwrap();
    {
        let mut parts = b.parts_mut();
        for (r, p) in parts.iter_mut().enumerate() {
            p.write(64 * r, &[r as f32 + 1.0; 64]).unwrap();
            comm.rank(r)
                .unwrap()
                .all_gather_in_place(p.as_mut_slice(), &s[r])
                .unwrap();
        }
    }
    sync(&s);
    comm.check().unwrap();
    let want: Vec<f32> = (0..128).map(|i| (i / 64) as f32 + 1.0).collect();
    for r in 0..2 {
        assert_eq!(b.to_vec(r).unwrap(), want, "rank {r}");
    }
}

/// The queries that report what a call would run take any count: an overflowing byte size is
/// an error naming the count or the row, extremes that fit are answered, nothing panics.
#[test]
fn choice_queries_at_extreme_counts_answer_or_name_the_argument() {
    let (_e, comm, _s) = team(3, CommConfig::default());
    for dtype in DType::ALL {
        for operands in [Operands::Symmetric, Operands::Local] {
            assert_eq!(
                arg_of(comm.choice(dtype, ReduceOp::Sum, usize::MAX, operands)),
                "count"
            );
            // the largest count whose bytes fit: an answer or a refusal of the count
            let big = usize::MAX / dtype.size();
            match comm.choice(dtype, ReduceOp::Max, big, operands) {
                Ok(c) => assert_eq!(operands, Operands::Symmetric, "{c:?}"),
                Err(e) => assert_eq!(arg_of::<()>(Err(e)), "count"),
            }
            comm.choice(dtype, ReduceOp::Min, 0, operands).unwrap();
        }
        assert_eq!(arg_of(comm.add_rms_norm_choice(dtype, 1, 0)), "hidden");
        assert_eq!(
            arg_of(comm.add_rms_norm_choice(dtype, 1, usize::MAX)),
            "hidden"
        );
        for tokens in [0, 1, usize::MAX / 2, usize::MAX] {
            let c = comm.add_rms_norm_choice(dtype, tokens, 1).unwrap();
            assert!(c.blocks >= 1 && c.threads >= 64, "{tokens} tokens: {c:?}");
        }
    }
}

/// Any stream per call: a call on a second stream while the first still has this rank's work
/// is taken and ordered after it on the GPU (one wait on the rank's event) — and a previous
/// stream, destroyed meanwhile, is never queried (its handle may be dangling: the order comes
/// from the rank's own event, recorded behind its last call).
#[test]
fn a_second_stream_waits_for_the_first_and_a_destroyed_one_is_never_touched() {
    let (e, comm, s) = team(2, CommConfig::default());
    let sim = e.sim.as_ref().unwrap();
    let d0 = e.driver.device(0).unwrap();
    let mut buf = comm.alloc::<f32>(1024).unwrap();
    let a = Stream::new(&d0).unwrap();
    let r0 = comm.rank(0).unwrap();
    let r1 = comm.rank(1).unwrap();
    // rank 0 alone: its kernel waits for rank 1's data
    r0.all_reduce_in_place(&mut buf, ReduceOp::Sum, &a).unwrap();
    let b = Stream::new(&d0).unwrap();
    // taken at once, and ordered after the call on `a` by a wait on the rank's event
    let waits = sim.calls("cuStreamWaitEvent");
    r0.all_reduce_in_place(&mut buf, ReduceOp::Sum, &b).unwrap();
    assert_eq!(
        sim.calls("cuStreamWaitEvent"),
        waits + 1,
        "one wait on the GPU"
    );
    r1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap();
    r1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap();
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    s[1].synchronize().unwrap();
    comm.check().unwrap();
    // a stream destroyed after its call is never touched again: the next call on another
    // stream waits for the rank's own event, not for it
    drop(a);
    let queries = sim.calls("cuStreamQuery");
    let c = Stream::new(&d0).unwrap();
    r0.all_reduce_in_place(&mut buf, ReduceOp::Sum, &c).unwrap();
    r1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
        .unwrap();
    assert_eq!(
        sim.calls("cuStreamQuery"),
        queries,
        "a previous stream's handle was queried"
    );
    c.synchronize().unwrap();
    b.synchronize().unwrap();
    s[1].synchronize().unwrap();
    comm.check().unwrap();
}

/// Two threads calling the same rank at once, on its one stream: each call (here staged
/// through the scratch, several copies and launches) must reach the stream whole, never
/// interleaved with the other thread's. Every call is the same in-place sum, so whatever the
/// order, 2K calls per rank leave N^(2K-1) times the sum of the inputs, exactly.
#[test]
fn two_threads_calling_one_rank_queue_whole_calls() {
    let (e, comm, s) = team(
        2,
        CommConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 0,
            scratch_bytes: 48 << 10,
            timeout: cuda_multimem_tests::TEAM_TIMEOUT,
            ..CommConfig::default()
        },
    );
    let (n, len, k) = (2usize, 16 << 10, 3u32);
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| (0..len).map(|i| ((i * 7 + r * 3) % 4) as f32).collect())
        .collect();
    let bufs: Vec<DeviceBuffer<f32>> = (0..n)
        .map(|r| DeviceBuffer::from_host(&e.driver.device(r).unwrap(), &inputs[r]).unwrap())
        .collect();
    std::thread::scope(|scope| {
        for r in 0..n {
            for _ in 0..2 {
                let (comm, s, p) = (&comm, &s, bufs[r].device_ptr());
                scope.spawn(move || {
                    let h = comm.rank(r).unwrap();
                    for _ in 0..k {
                        // SAFETY: the buffer lives until after the streams are synchronised
                        // below; the calls on it are ordered by the one stream.
                        let c = h
                            .all_reduce_in_place(
                                unsafe { cuda_multimem_collectives::Dst::<f32>::from_raw(p, len) },
                                ReduceOp::Sum,
                                &s[r],
                            )
                            .unwrap();
                        assert!(c.staged_chunks > 1, "{c:?}");
                    }
                });
            }
        }
    });
    sync(&s);
    comm.check().unwrap();
    let scale = (n as f32).powi(2 * k as i32 - 1);
    let want: Vec<f32> = (0..len)
        .map(|i| scale * inputs.iter().map(|x| x[i]).sum::<f32>())
        .collect();
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(b.to_vec().unwrap(), want, "rank {r}");
    }
}

/// One-shot forced, the caller's own memory, chunks of the scratch larger than the one-shot's
/// staging: refused naming the count before anything reaches the stream (the chunk's form is
/// decided before its copy into the scratch).
#[test]
fn a_forced_form_that_cannot_take_a_staged_chunk_is_refused_before_any_copy() {
    let (e, comm, s) = team(
        2,
        CommConfig {
            algorithm: Some(Algorithm::OneShot),
            one_shot_max_bytes: Some(4 << 10),
            stage_bytes: Some(4 << 10),
            ll_max_bytes: 0,
            scratch_bytes: 3 << 20,
            ..CommConfig::default()
        },
    );
    let sim = e.sim.as_ref().unwrap();
    let d0 = e.driver.device(0).unwrap();
    let mut own = DeviceBuffer::<f32>::zeroed(&d0, 256 << 10).unwrap();
    let (copies, launches) = (sim.calls("cuMemcpyDtoDAsync"), sim.calls("cuLaunchKernel"));
    let r = comm
        .rank(0)
        .unwrap()
        .all_reduce_in_place(&mut own, ReduceOp::Sum, &s[0]);
    assert_eq!(arg_of(r), "count");
    assert_eq!(
        sim.calls("cuMemcpyDtoDAsync"),
        copies,
        "a copy reached the stream"
    );
    assert_eq!(sim.calls("cuLaunchKernel"), launches);
}
