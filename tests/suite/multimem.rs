//! The multimem path on the simulator (real GPUs here must never create multicast objects):
//! what a rank whose barrier failed may and may not do to its peers.

use std::time::Duration;

use cuda_multimem::{Device, Stream};
use cuda_multimem_collectives::kernels::multimem::{MM_DATA, MM_OFF_ERR};
use cuda_multimem_collectives::kernels::ERR_TIMEOUT;
use cuda_multimem_collectives::{Algorithm, AllReduceConfig, DType, MultimemAllReduce, Op};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::sim;

/// Rank `rank`'s error word, read from its member memory (0: no error).
fn error_word(mm: &MultimemAllReduce, device: &Device, rank: usize) -> u32 {
    let at = mm.input_ptr(rank).unwrap() - MM_DATA as u64 + MM_OFF_ERR as u64;
    let mut w = [0u8; 4];
    device.bind().unwrap();
    let copy = device.driver().sys().cuMemcpyDtoH_v3020().unwrap();
    // SAFETY: four bytes of the rank's member memory, mapped for its device; `w` is live.
    let rc = unsafe { copy(w.as_mut_ptr().cast(), at, 4) };
    assert_eq!(rc, cuda_multimem_sys::CUresult::CUDA_SUCCESS);
    u32::from_le_bytes(w)
}

/// A team of 3 where rank 2 never calls. Rank 0 queues two calls and runs them to the end
/// (timed out) before rank 1, slower, queues its two. The arrival words are additive: if rank 0
/// kept arriving after its first barrier failed, its four arrivals plus rank 1's own would
/// complete both barriers of rank 1's first call (3 × 1 and 3 × 2) without rank 2, and rank 1
/// would reduce without it and report nothing. Every calling rank must time out instead.
#[test]
fn a_rank_whose_multimem_barrier_timed_out_completes_no_later_barrier_of_its_peers() {
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let e = sim(SimConfig::new(3, 13000));
        let devices = e.driver.devices();
        let mm = MultimemAllReduce::new(
            &devices,
            64 << 10,
            AllReduceConfig {
                algorithm: Some(algorithm),
                max_blocks: 2,
                threads: 64,
                timeout: Duration::from_millis(200),
                ..Default::default()
            },
        )
        .unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        let count = 4096;
        for r in 0..3 {
            let ones: Vec<u8> = (0..count).flat_map(|_| 1f32.to_le_bytes()).collect();
            mm.copy_in(r, &ones).unwrap();
        }
        for _ in 0..2 {
            mm.all_reduce(0, count, DType::F32, Op::Sum, &s[0]).unwrap();
        }
        s[0].synchronize().unwrap();
        assert_eq!(
            error_word(&mm, &devices[0], 0),
            ERR_TIMEOUT,
            "{algorithm}: rank 0"
        );
        for call in 0..2 {
            mm.all_reduce(1, count, DType::F32, Op::Sum, &s[1]).unwrap();
            s[1].synchronize().unwrap();
            assert_eq!(
                error_word(&mm, &devices[1], 1),
                ERR_TIMEOUT,
                "{algorithm}: rank 1's call {call} completed without rank 2"
            );
        }
        match mm.check() {
            Err(cuda_multimem::Error::Timeout { .. }) => {}
            other => panic!("{algorithm}: expected a timeout, got {other:?}"),
        }
    }
}

/// What the multimem path guarantees for sums, on a simulated team of 3 whose switch reduces
/// in an order of its own: two-shot results are bit-identical on every rank (each part is
/// reduced once and multicast-stored) and one-shot results are close to the rank-order
/// reference, but neither is the rank-order sum bit for bit.
#[test]
fn multimem_sums_are_not_in_rank_order_and_two_shot_is_the_same_on_every_rank() {
    use cuda_multimem_collectives::reference;
    let e = sim(SimConfig::new(3, 13000));
    let devices = e.driver.devices();
    let count = 20_000;
    // magnitudes over several binades, so that the order of the additions shows in the bits
    let mut rng = cuda_multimem_tests::Rng::new(7);
    let inputs: Vec<Vec<u8>> = (0..3)
        .map(|_| {
            (0..count)
                .flat_map(|_| {
                    let scale = (1u32 << (rng.next_u64() % 12)) as f32;
                    (rng.f32() * scale).to_le_bytes()
                })
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(DType::F32, Op::Sum, &refs);
    for algorithm in [Algorithm::OneShot, Algorithm::TwoShot] {
        let mm = MultimemAllReduce::new(
            &devices,
            count * 4,
            AllReduceConfig {
                algorithm: Some(algorithm),
                ..Default::default()
            },
        )
        .unwrap();
        let s: Vec<Stream> = devices.iter().map(|d| Stream::new(d).unwrap()).collect();
        for (r, x) in inputs.iter().enumerate() {
            mm.copy_in(r, x).unwrap();
        }
        for (r, st) in s.iter().enumerate() {
            mm.all_reduce(r, count, DType::F32, Op::Sum, st).unwrap();
        }
        for st in &s {
            st.synchronize().unwrap();
        }
        mm.check().unwrap();
        let got: Vec<Vec<u8>> = (0..3)
            .map(|r| {
                let mut g = vec![0u8; want.len()];
                mm.copy_out(r, &mut g).unwrap();
                g
            })
            .collect();
        for (r, g) in got.iter().enumerate() {
            if let Some(m) =
                cuda_multimem_tests::first_beyond_sum_tolerance(DType::F32, 3, g, &want)
            {
                panic!("{algorithm}, rank {r}: {m}");
            }
            assert_ne!(
                g, &want,
                "{algorithm}, rank {r}: the rank-order sum bit for bit"
            );
        }
        if algorithm == Algorithm::TwoShot {
            assert!(
                got.iter().all(|g| g == &got[0]),
                "two-shot results differ between ranks"
            );
        }
    }
}
