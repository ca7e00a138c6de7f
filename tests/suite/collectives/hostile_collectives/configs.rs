//! Configurations at the edges of what `validate` accepts, and the reports of what a call
//! would run: every collective still gives its host reference.

use super::*;

// ---- the communicator's reports ----

/// `Communicator::choice` reports `staged_chunks` as a u32 (0 means "no copies"): a count whose
/// chunks through the scratch do not fit must be refused naming it, not truncated to a report
/// that says the operands are used in place.
#[test]
fn a_choice_whose_chunk_count_does_not_fit_its_report_is_refused() {
    let (_e, comm, _s) = team(
        2,
        CommConfig {
            // the smallest scratch: three 4 KiB regions
            scratch_bytes: 1,
            ..Default::default()
        },
    );
    // 2^45 bytes in 4 KiB chunks: 2^33 chunks, 0 as a u32
    let count = 1usize << 43;
    assert_eq!(
        arg_of(comm.choice(DType::F32, ReduceOp::Sum, count, Operands::Local)),
        "count"
    );
    // a count that fits is reported with its chunks (16 MiB, above the 8 MiB one-shot limit)
    let c = comm
        .choice(DType::F32, ReduceOp::Sum, 1 << 22, Operands::Local)
        .unwrap();
    assert_eq!(c.staged_chunks, 4096);
}

// ---- configurations at the edges of what `validate` accepts ----

/// Every collective of the table at `count` elements per rank (every operator, the first and
/// the last rank as a broadcast's root, the fused norm in 3 rows of `count` up to 400: a row
/// fits a 4 KiB staging slot twice), on symmetric buffers and on the caller's own memory, in
/// place and out of place, each compared with its host reference.
fn every_collective<T: table::Elem>(comm: &Communicator, s: &[Stream], count: usize, what: &str) {
    let n = comm.size();
    let mut rng = Rng::new(17 + count as u64);
    for c in table::table::<T>() {
        for mut params in table::params_for(&c, n) {
            let elems = if c.name == "all_reduce_add_rms_norm" {
                params.hidden = count.min(400);
                3 * params.hidden
            } else {
                count
            };
            for mem in Mem::KINDS {
                for in_place in [false, true] {
                    let mut q = Queued::new(comm, c, elems, params, mem, in_place);
                    q.fill(&mut rng);
                    q.call_all(comm, s);
                    sync(s);
                    comm.check()
                        .unwrap_or_else(|e| panic!("{what}: {}: {e}", q.what()));
                    q.verify().unwrap_or_else(|m| panic!("{what}: {m}"));
                }
            }
        }
    }
}

/// Configurations `validate` accepts at the edges of every field, thresholds inverted or
/// turned off: every collective still equals its host reference (no panic, no hang, no wrong
/// bits), on a team of 3 (chunks that do not divide evenly) at counts from 1 to beyond the
/// smallest staging slot.
#[test]
fn configurations_at_the_edges_of_validity_still_give_the_reference() {
    let base = CommConfig {
        timeout: cuda_multimem_tests::TEAM_TIMEOUT,
        ..Default::default()
    };
    let configs = [
        (
            "everything smallest, low-latency and one-shot off",
            CommConfig {
                threads: 64,
                push_threads: 64,
                max_blocks: 1,
                stage_bytes: Some(4096),
                one_shot_max_bytes: Some(0),
                ll_max_bytes: 0,
                gather_ll_max_bytes: 0,
                broadcast_ll_max_bytes: 0,
                norm_ll_max_bytes: 0,
                scratch_bytes: 1,
                multimem_capacity: 0,
                ..base.clone()
            },
        ),
        (
            "copy engines from 0 bytes, inverted ce thresholds",
            CommConfig {
                ll_max_bytes: 0,
                one_shot_max_bytes: Some(0),
                ce_min_bytes: 0,
                ce_max_bytes: 64 << 10,
                gather_ce_min_bytes: 0,
                broadcast_ce_min_bytes: 0,
                gather_ll_max_bytes: 0,
                broadcast_ll_max_bytes: 0,
                stage_bytes: Some(4096),
                ..base.clone()
            },
        ),
        (
            "everything largest per launch, low-latency limits above the one-shot limit",
            CommConfig {
                threads: 1024,
                push_threads: 1024,
                max_blocks: MAX_BLOCKS as u32,
                one_shot_max_bytes: Some(4096),
                stage_bytes: Some(4096),
                ll_max_bytes: 1 << 20,
                norm_ll_max_bytes: 1 << 20,
                gather_ll_max_bytes: 1 << 20,
                broadcast_ll_max_bytes: 1 << 20,
                ..base.clone()
            },
        ),
        (
            "one-shot forced, the smallest staging",
            CommConfig {
                algorithm: Some(Algorithm::OneShot),
                stage_bytes: Some(4096),
                one_shot_max_bytes: Some(0),
                ..base.clone()
            },
        ),
    ];
    for (what, config) in configs {
        config.validate().unwrap();
        let forced = config.algorithm.is_some();
        let (_e, comm, s) = team(3, config);
        for count in [1, 7, 1000, 5000] {
            if forced && count * 4 > 4096 {
                // a forced one-shot on symmetric buffers larger than its staging is refused
                let mut big = comm.alloc::<f32>(count).unwrap();
                let r = comm.rank(0).unwrap();
                assert_eq!(
                    arg_of(r.all_reduce_in_place(&mut big, ReduceOp::Sum, &s[0])),
                    "count"
                );
                continue;
            }
            every_collective::<f32>(&comm, &s, count, what);
        }
        every_collective::<bf16>(&comm, &s, 999, what);
    }
}
