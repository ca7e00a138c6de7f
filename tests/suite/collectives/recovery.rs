//! Failures an engine can live with: a timeout or a disagreement is reported by the next call
//! of every rank (through the ranks' error mirrors: no `check()` and no driver call needed),
//! disagreeing sizes of every form are a disagreement (not a timeout), and
//! `Communicator::recover` makes the team usable again, its next results equal to the host
//! reference. The teams are placed on the devices of the driver `CUDA_MULTIMEM_DRIVER` selects
//! (ranks sharing a GPU where it has fewer), so `cargo xtask test-hw` runs the real kernels.

use std::time::Duration;

use cuda_multimem::{Device, Error, Stream};
use cuda_multimem_collectives::testing::reference;
use cuda_multimem_collectives::{
    CommConfig, Communicator, MulticastPolicy, RankHandle, ReduceOp, SymmetricBuffer,
};
use cuda_multimem_tests::{collectives_unsupported, env, placed, skip, sync_all, team_on, Env};

/// The devices of the environment for a team of `n`, unless the collectives cannot run there.
fn team_devices(e: &Env, n: usize, test: &str) -> Option<Vec<Device>> {
    if let Some(why) = collectives_unsupported(&e.driver) {
        skip(test, why);
        return None;
    }
    Some(placed(e, n))
}

/// What the next call of a rank returned after a failure: its own report (`own`: a timeout or
/// a disagreement) or, where another rank of this process reported first, `Unusable` naming it.
/// Either must carry `needle`.
fn reported(r: usize, got: cuda_multimem::Result<()>, own: fn(&Error) -> bool, needle: &str) {
    match got {
        Err(e) if own(&e) => assert!(e.to_string().contains(needle), "rank {r}: {e}"),
        Err(Error::Unusable { cause }) => assert!(cause.contains(needle), "rank {r}: {cause}"),
        other => panic!("rank {r}: expected the failure to be reported, got {other:?}"),
    }
}

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. })
}

fn is_disagreement(e: &Error) -> bool {
    matches!(e, Error::RanksDisagree { .. })
}

/// An allreduce of `count` f32 (small integers: every order of the sums is exact) on every rank
/// of `comm` in `buf`, compared with the host reference.
fn allreduce_matches(
    comm: &Communicator,
    s: &[Stream],
    buf: &mut SymmetricBuffer<f32>,
    count: usize,
    seed: usize,
) {
    let n = comm.size();
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|r| {
            (0..count)
                .map(|i| ((i * 7 + r * 13 + seed) % 31) as f32)
                .collect()
        })
        .collect();
    for (r, x) in inputs.iter().enumerate() {
        buf.write(r, 0, x).unwrap();
    }
    for (r, st) in s.iter().enumerate() {
        comm.rank(r)
            .unwrap()
            .all_reduce_in_place(buf.slice_mut(..count).unwrap(), ReduceOp::Sum, st)
            .unwrap_or_else(|e| panic!("rank {r}, after the recovery: {e}"));
    }
    sync_all(s);
    comm.check().unwrap();
    let refs: Vec<&[f32]> = inputs.iter().map(|x| x.as_slice()).collect();
    let want = reference(ReduceOp::Sum, &refs);
    for r in 0..n {
        let mut got = vec![0f32; count];
        buf.read(r, 0, &mut got).unwrap();
        assert_eq!(got, want, "rank {r}: {count} elements after the recovery");
    }
}

/// Rank 2 of 3 never calls: the next call of each rank that did reports the timeout, naming
/// rank 2, without `check()` (the kernels mirrored their error words to the host), and so does a
/// later call of the rank that never came (the team is unusable). `recover` then makes the team
/// usable: the next allreduce of every rank equals the host reference. Both the low-latency
/// and a barrier form, and twice in a row (a recovered team fails and recovers again).
#[test]
fn a_dead_peer_is_reported_by_the_next_call_of_every_rank_and_recover_makes_the_team_usable() {
    let e = env();
    let n = 3;
    let Some(devices) = team_devices(&e, n, "collectives::recovery::dead_peer") else {
        return;
    };
    let short = Duration::from_millis(300);
    for ll in [true, false] {
        let (comm, s) = team_on(
            &devices,
            CommConfig {
                timeout: short,
                first_call_timeout: Some(short),
                ll_max_bytes: if ll { 64 << 10 } else { 0 },
                ..CommConfig::default()
            },
            MulticastPolicy::Never,
        );
        let mut buf = comm.alloc::<f32>(4096).unwrap();
        for round in 0..2 {
            for r in 0..n - 1 {
                comm.rank(r)
                    .unwrap()
                    .all_reduce_in_place(buf.slice_mut(..256).unwrap(), ReduceOp::Sum, &s[r])
                    .unwrap();
            }
            sync_all(&s[..n - 1]);
            // the next call of each rank, the first rank to look changing each round
            for k in 0..n - 1 {
                let r = (k + round) % (n - 1);
                let got = comm
                    .rank(r)
                    .unwrap()
                    .all_reduce_in_place(buf.slice_mut(..256).unwrap(), ReduceOp::Sum, &s[r])
                    .map(|_| ());
                reported(r, got, is_timeout, "rank 2 did not arrive");
            }
            let late = comm
                .rank(n - 1)
                .unwrap()
                .all_reduce_in_place(buf.slice_mut(..256).unwrap(), ReduceOp::Sum, &s[n - 1])
                .map(|_| ());
            reported(n - 1, late, is_timeout, "did not arrive");
            comm.recover().unwrap();
            allreduce_matches(&comm, &s, &mut buf, 1000, round);
        }
    }
}

type Step = fn(&RankHandle<'_>, &mut SymmetricBuffer<f32>, &mut SymmetricBuffer<f32>, &Stream);

/// The disagreements of every family: a rank calling `first`, the others `others`.
fn disagreements() -> Vec<(&'static str, Step, Step)> {
    use ReduceOp::Sum;
    vec![
        (
            "low-latency allreduce of 64 / 128 elements",
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..64).unwrap(), Sum, s)
                    .unwrap();
            },
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..128).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
        (
            "two-shot allreduce of 2^16 / 2^16 + 4 elements",
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..1 << 16).unwrap(), Sum, s)
                    .unwrap();
            },
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..(1 << 16) + 4).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
        (
            "low-latency allreduce / two-shot allreduce",
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..64).unwrap(), Sum, s)
                    .unwrap();
            },
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..1 << 16).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
        (
            "low-latency all-gather of 3 x 96 / 3 x 192 elements",
            |h, b, _, s| {
                h.all_gather_in_place(b.slice_mut(..96 * 3).unwrap(), s)
                    .unwrap();
            },
            |h, b, _, s| {
                h.all_gather_in_place(b.slice_mut(..192 * 3).unwrap(), s)
                    .unwrap();
            },
        ),
        (
            "low-latency all-to-all of 3 x 32 / 3 x 64 elements",
            |h, x, y, s| {
                h.all_to_all(x.slice(..96).unwrap(), y.slice_mut(..96).unwrap(), s)
                    .unwrap();
            },
            |h, x, y, s| {
                h.all_to_all(x.slice(..192).unwrap(), y.slice_mut(..192).unwrap(), s)
                    .unwrap();
            },
        ),
        (
            "direct all-to-all of 3 x 2^16 / 3 x 2^16 + 3 elements",
            |h, x, y, s| {
                let m = 3 << 16;
                h.all_to_all(x.slice(..m).unwrap(), y.slice_mut(..m).unwrap(), s)
                    .unwrap();
            },
            |h, x, y, s| {
                let m = (3 << 16) + 3;
                h.all_to_all(x.slice(..m).unwrap(), y.slice_mut(..m).unwrap(), s)
                    .unwrap();
            },
        ),
        (
            "low-latency all-to-all / direct all-to-all",
            |h, x, y, s| {
                h.all_to_all(x.slice(..96).unwrap(), y.slice_mut(..96).unwrap(), s)
                    .unwrap();
            },
            |h, x, y, s| {
                let m = 3 << 16;
                h.all_to_all(x.slice(..m).unwrap(), y.slice_mut(..m).unwrap(), s)
                    .unwrap();
            },
        ),
        (
            "direct all-to-all / two-shot allreduce",
            |h, x, y, s| {
                let m = 3 << 16;
                h.all_to_all(x.slice(..m).unwrap(), y.slice_mut(..m).unwrap(), s)
                    .unwrap();
            },
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..1 << 16).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
        (
            "low-latency all-to-all / low-latency allreduce",
            |h, x, y, s| {
                h.all_to_all(x.slice(..96).unwrap(), y.slice_mut(..96).unwrap(), s)
                    .unwrap();
            },
            |h, b, _, s| {
                h.all_reduce_in_place(b.slice_mut(..64).unwrap(), Sum, s)
                    .unwrap();
            },
        ),
    ]
}

/// Ranks that disagree — on sizes within a form, sizes that choose different forms, and
/// different collectives, the all-to-all's included — are reported as `RanksDisagree` by the
/// next call of every rank, with the suite's generous timeout (a timeout would be a failure
/// here), and the team recovers: its next allreduce equals the host reference.
#[test]
fn disagreements_are_reported_by_the_next_call_of_every_rank_and_the_team_recovers() {
    let e = env();
    let n = 3;
    let Some(devices) = team_devices(&e, n, "collectives::recovery::disagreements") else {
        return;
    };
    let (comm, s) = team_on(
        &devices,
        CommConfig {
            one_shot_max_bytes: Some(8 << 10),
            ll_max_bytes: 4 << 10,
            gather_ll_max_bytes: 64 << 10,
            broadcast_ll_max_bytes: 64 << 10,
            // the all-to-all's direct form into a symmetric output, no copy engines
            gather_ce_min_bytes: usize::MAX,
            broadcast_ce_min_bytes: usize::MAX,
            ..CommConfig::default()
        },
        MulticastPolicy::Never,
    );
    let len = (3 << 16) + 3;
    let mut x = comm.alloc::<f32>(len).unwrap();
    let mut y = comm.alloc::<f32>(len).unwrap();
    for (i, (what, first, others)) in disagreements().into_iter().enumerate() {
        for (r, st) in s.iter().enumerate() {
            let h = comm.rank(r).unwrap();
            if r == 0 {
                first(&h, &mut x, &mut y, st);
            } else {
                others(&h, &mut x, &mut y, st);
            }
        }
        sync_all(&s);
        // the next call of every rank, the first to look changing with the case
        for k in 0..n {
            let r = (k + i) % n;
            let got = comm
                .rank(r)
                .unwrap()
                .all_reduce_in_place(x.slice_mut(..64).unwrap(), ReduceOp::Sum, &s[r])
                .map(|_| ());
            reported(r, got, is_disagreement, "differs");
        }
        assert!(
            matches!(comm.check(), Err(Error::Unusable { .. })),
            "{what}: check after the report"
        );
        comm.recover()
            .unwrap_or_else(|e| panic!("{what}: recover: {e}"));
        allreduce_matches(&comm, &s, &mut x, 700, i);
    }
}

/// The first call's bound: the longer of the timeout and the default first-call bound where the
/// configuration leaves it, else what it says (a team over a bootstrap: at least the
/// bootstrap's own timeout, `collectives::allreduce::processes`).
#[test]
fn the_first_call_waits_as_configured_or_by_default_the_longer_bound() {
    let e = env();
    let Some(devices) = team_devices(&e, 2, "collectives::recovery::first_call") else {
        return;
    };
    for (config, want) in [
        (
            CommConfig {
                timeout: Duration::from_secs(5),
                ..CommConfig::default()
            },
            CommConfig::FIRST_CALL_TIMEOUT,
        ),
        (
            CommConfig {
                timeout: Duration::from_secs(200),
                ..CommConfig::default()
            },
            Duration::from_secs(200),
        ),
        (
            CommConfig {
                timeout: Duration::from_secs(1),
                first_call_timeout: Some(Duration::from_secs(30)),
                ..CommConfig::default()
            },
            Duration::from_secs(30),
        ),
    ] {
        let (comm, _) = team_on(&devices, config, MulticastPolicy::Never);
        assert_eq!(comm.first_call_timeout(), want);
    }
}
