//! The multimem path on the simulator (real GPUs here must never create multicast objects):
//! what a rank whose barrier failed may and may not do to its peers, and what the path promises
//! about the order of a sum.

use std::time::Duration;

use cuda_multimem::{Error, Stream};
use cuda_multimem_collectives::{
    reference, Algorithm, CommConfig, Communicator, MulticastPolicy, Path, ReduceOp,
};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::sim;

/// A team of 3 with the multimem path forced where rank 2 never calls. Rank 0 queues two calls
/// and runs them to the end (timed out) before rank 1, slower, queues its two. The arrival words
/// are additive: if rank 0 kept arriving after its first barrier failed, its arrivals plus rank
/// 1's own would complete rank 1's barriers without rank 2, and rank 1 would reduce without it
/// and report nothing. Every calling rank must time out instead.
#[test]
fn a_rank_whose_multimem_barrier_timed_out_completes_no_later_barrier_of_its_peers() {
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let e = sim(SimConfig::new(3, 13000));
        let devices = e.driver.devices();
        let comm = Communicator::builder(&devices)
            .multicast(MulticastPolicy::Always)
            .config(CommConfig {
                algorithm: Some(algorithm),
                max_blocks: 2,
                threads: 64,
                timeout: Duration::from_millis(200),
                ..Default::default()
            })
            .build()
            .unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let count = 4096;
        let mut buf = comm.alloc::<f32>(count).unwrap();
        for r in 0..3 {
            buf.write(r, 0, &vec![1f32; count]).unwrap();
        }
        let (h0, h1) = (comm.rank(0).unwrap(), comm.rank(1).unwrap());
        for _ in 0..2 {
            let c = h0
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[0])
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        s[0].synchronize().unwrap();
        // Rank 1 calls only now, after rank 0's two calls timed out (nobody has looked yet, so
        // the team still takes calls): its barrier must not be completed by rank 0's arrivals.
        h1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1])
            .unwrap();
        s[1].synchronize().unwrap();
        match h1.check() {
            Err(Error::Timeout { after, .. }) => {
                assert_eq!(after, Duration::from_millis(200), "{algorithm}")
            }
            other => panic!("{algorithm}: rank 1's call completed without rank 2 ({other:?})"),
        }
        match h0.check() {
            Err(Error::Timeout { .. }) => {}
            other => panic!("{algorithm}: rank 0: expected a timeout, got {other:?}"),
        }
        assert!(matches!(
            h1.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s[1]),
            Err(Error::Unusable { .. })
        ));
    }
}

/// What the multimem path guarantees for sums, on a simulated team of 3 whose switch reduces
/// in an order of its own: two-shot results are bit-identical on every rank (each part is
/// reduced once and multicast-stored) and one-shot results are close to the rank-order
/// reference, but neither is the rank-order sum bit for bit.
#[test]
fn multimem_sums_are_not_in_rank_order_and_two_shot_is_the_same_on_every_rank() {
    let e = sim(SimConfig::new(3, 13000));
    let devices = e.driver.devices();
    let count = 20_000;
    // magnitudes over several binades, so that the order of the additions shows in the bits
    let mut rng = cuda_multimem_tests::Rng::new(7);
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|_| {
            (0..count)
                .map(|_| {
                    let scale = (1u32 << (rng.next_u64() % 12)) as f32;
                    rng.f32() * scale
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(ReduceOp::Sum, &refs);
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let comm = Communicator::builder(&devices)
            .multicast(MulticastPolicy::Always)
            .config(CommConfig {
                algorithm: Some(algorithm),
                ..Default::default()
            })
            .build()
            .unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let mut buf = comm.alloc::<f32>(count).unwrap();
        for (r, x) in inputs.iter().enumerate() {
            buf.write(r, 0, x).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            let c = comm
                .rank(r)
                .unwrap()
                .all_reduce_in_place(&mut buf, ReduceOp::Sum, st)
                .unwrap();
            assert_eq!(c.path, Path::Multimem);
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        comm.check().unwrap();
        let got: Vec<Vec<f32>> = (0..3).map(|r| buf.to_vec(r).unwrap()).collect();
        for (r, g) in got.iter().enumerate() {
            if let Some(m) = cuda_multimem_tests::first_beyond_sum_tolerance(
                cuda_multimem_collectives::DType::F32,
                3,
                &bytes(g),
                &bytes(&want),
            ) {
                panic!("{algorithm}: rank {r}: {m}");
            }
            assert_ne!(
                g, &want,
                "{algorithm}: rank {r} summed in rank order, bit for bit"
            );
        }
        if algorithm == Algorithm::TwoShot {
            assert!(
                got.iter().all(|g| g == &got[0]),
                "two-shot: every rank gets the same bits"
            );
        }
    }
}
