//! Hostile input to building a team: bootstrap timeouts, sizes and entries; the hierarchical
//! communicator's builder, layout and scratch; zero-sized buffers; cross-domain steps that
//! miscount their rail.

use super::*;

// ---- bootstrap ----

/// `Instant::now() + Duration::MAX` overflows: a timeout no deadline can hold must be refused
/// naming it, not panic inside the rendezvous.
#[test]
fn a_bootstrap_timeout_no_deadline_can_hold_is_refused_naming_it() {
    let path = rendezvous("boot-max");
    for rank in [0, 1] {
        assert_eq!(
            arg_of(UnixBootstrap::new(&path, rank, 2, Duration::MAX)),
            "timeout",
            "rank {rank}"
        );
    }
}

/// The rendezvous sends the team size as 32 bits, and rank 0 waits for `size - 1` peers: a size
/// past 32 bits must be refused naming it, and a huge one that fits must time out, not size
/// anything by it up front (a table of 2^32 peers is an abort, not an error).
#[test]
fn a_bootstrap_team_size_past_what_a_rendezvous_holds_is_an_error_not_an_abort() {
    let path = rendezvous("boot-size");
    assert_eq!(
        arg_of(UnixBootstrap::new(
            &path,
            0,
            usize::MAX,
            Duration::from_millis(20)
        )),
        "size"
    );
    assert_eq!(
        arg_of(UnixBootstrap::new(
            &path,
            1,
            1 << 40,
            Duration::from_millis(20)
        )),
        "size"
    );
    match UnixBootstrap::new(&path, 0, u32::MAX as usize, Duration::from_millis(50)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
}

/// A rank 0 that relays an exchange whose entry announces a length near `u64::MAX`: the peer
/// must answer an `Error::Peer`, not overflow its bounds arithmetic.
#[test]
fn an_exchange_entry_announcing_an_absurd_length_is_a_peer_error() {
    let path = rendezvous("boot-len");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let fake_root = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 12];
        s.read_exact(&mut hello).unwrap();
        // rank 1's entry: its length, then its bytes
        let mut len = [0u8; 8];
        s.read_exact(&mut len).unwrap();
        let mut data = vec![0u8; u64::from_le_bytes(len) as usize];
        s.read_exact(&mut data).unwrap();
        // the relayed exchange: 8 bytes, one entry header announcing u64::MAX - 3 bytes
        let packed = (u64::MAX - 3).to_le_bytes();
        s.write_all(&(packed.len() as u64).to_le_bytes()).unwrap();
        s.write_all(&packed).unwrap();
        // keep the connection until the peer is done
        let _ = s.read(&mut [0u8; 1]);
    });
    let b = UnixBootstrap::new(&path, 1, 2, Duration::from_secs(30)).unwrap();
    match b.all_gather(b"hello") {
        Err(Error::Peer { rank: 0, .. }) => {}
        other => panic!("expected a peer error naming rank 0, got {other:?}"),
    }
    drop(b);
    fake_root.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

// ---- the hierarchical communicator ----

/// A team of 2 ranks (threads over one simulator, a Unix-socket bootstrap) whose rank r has
/// domain id `domain_of(r)`; each rank builds with `config`, `nccl_timeout` and the host test
/// double for the cross-domain step, then runs `body` on what the build gave.
fn hier_pair<R: Send + 'static>(
    tag: &str,
    domain_of: fn(usize) -> u64,
    config: CommConfig,
    nccl_timeout: Duration,
    body: fn(usize, cuda_multimem::Result<HierCommunicator>, &Stream) -> R,
) -> Vec<R> {
    hier_pair_with(
        tag,
        domain_of,
        config,
        nccl_timeout,
        HierBuilder::cross_domain_test_double,
        body,
    )
}

/// [`hier_pair`] with the builder's last step (the cross-domain step) given by `cross`.
fn hier_pair_with<R: Send + 'static>(
    tag: &str,
    domain_of: fn(usize) -> u64,
    config: CommConfig,
    nccl_timeout: Duration,
    cross: fn(HierBuilder) -> HierBuilder,
    body: fn(usize, cuda_multimem::Result<HierCommunicator>, &Stream) -> R,
) -> Vec<R> {
    let n = 2;
    let e = sim(SimConfig::new(n, 13000));
    let path = rendezvous(tag);
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let (driver, path, config) = (e.driver.clone(), path.clone(), config.clone());
            std::thread::spawn(move || {
                let device = driver.device(rank).unwrap();
                let boot = UnixBootstrap::new(&path, rank, n, Duration::from_secs(30)).unwrap();
                let b = HierCommunicator::builder(&device, Box::new(boot))
                    .domain_id(domain_of(rank))
                    .multicast(MulticastPolicy::Never)
                    .config(config)
                    .nccl_timeout(nccl_timeout);
                let built = cross(b).build();
                let s = Stream::new(&device).unwrap();
                body(rank, built, &s)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn short_config() -> CommConfig {
    CommConfig {
        timeout: cuda_multimem_tests::TEAM_TIMEOUT,
        one_shot_max_bytes: Some(16 << 10),
        stage_bytes: Some(16 << 10),
        scratch_bytes: 64 << 10,
        ..Default::default()
    }
}

/// Out of place, the hierarchical allreduce copies the input into the output and reduces the
/// output: an input shorter than the output must be refused (naming the output), not leave the
/// output's tail holding whatever it held, reduced as if it were data.
#[test]
fn a_hierarchical_allreduce_refuses_an_input_shorter_than_its_output() {
    let r = hier_pair(
        "ar-short",
        |_| 7,
        short_config(),
        Duration::from_secs(60),
        {
            |rank, built, s| {
                let hier = built.unwrap();
                assert_eq!(hier.layout().domain_count(), 1);
                let d = hier.device();
                let input = DeviceBuffer::from_host(d, &[rank as f32 + 1.0; 8]).unwrap();
                let mut output = DeviceBuffer::from_host(d, &[100.0f32; 16]).unwrap();
                let got = hier.all_reduce(&input, &mut output, ReduceOp::Sum, s);
                s.synchronize().unwrap();
                (arg_of(got), output.to_vec().unwrap())
            }
        },
    );
    for (rank, (arg, out)) in r.into_iter().enumerate() {
        assert_eq!(arg, "output", "rank {rank}");
        assert!(
            out.iter().all(|&v| v == 100.0),
            "rank {rank}: the refused call wrote its output: {out:?}"
        );
    }
}

/// Domains of one GPU have no domain communicator: the builder must still refuse an invalid
/// configuration (naming the field), as it does for larger domains, and a NCCL timeout that no
/// deadline can hold.
#[test]
fn a_hierarchical_builder_refuses_invalid_settings_whatever_the_layout() {
    let zero_timeout = CommConfig {
        timeout: Duration::ZERO,
        ..short_config()
    };
    let r = hier_pair(
        "cfg-one-gpu",
        |rank| rank as u64,
        zero_timeout,
        Duration::from_secs(60),
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(r, ["config.timeout"; 2]);
    let r = hier_pair(
        "nccl-timeout",
        |rank| rank as u64,
        short_config(),
        Duration::MAX,
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(r, ["nccl_timeout"; 2]);
}

/// The layout's accessors take indices: out of range they answer nothing, they do not panic.
#[test]
fn layout_accessors_out_of_range_answer_empty_not_panic() {
    let l = HierLayout::from_keys(1, &[0, 0, 1, 1]).unwrap();
    assert_eq!(l.domain_members(1), &[2, 3]);
    assert_eq!(l.rail_members(1), vec![1, 3]);
    assert!(l.domain_members(2).is_empty());
    assert!(l.domain_members(usize::MAX).is_empty());
    assert!(l.rail_members(2).is_empty());
    assert!(l.rail_members(usize::MAX).is_empty());
    // a rank in no domain, and no ranks at all, are errors naming the rank
    assert_eq!(arg_of(HierLayout::from_keys(4, &[0, 0, 1, 1])), "rank");
    assert_eq!(arg_of(HierLayout::from_keys(0, &[])), "rank");
}

/// One rank more than the largest team (`MAX_RANKS`, one NVL72 domain) is refused naming the
/// argument that carries the size, before anything is exchanged or allocated: a device list
/// (here 73 ranks sharing 3 simulated devices), a bootstrap of 73 ranks, and a hierarchical
/// layout whose domains have 73 ranks. `MAX_RANKS` itself builds.
#[test]
fn a_team_of_one_rank_more_than_the_largest_is_refused_naming_the_argument() {
    /// A bootstrap of `MAX_RANKS + 1` ranks that must never be asked to exchange.
    struct TooMany;
    impl Bootstrap for TooMany {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            MAX_RANKS + 1
        }
        fn all_gather(&self, _: &[u8]) -> cuda_multimem::Result<Vec<Vec<u8>>> {
            panic!("a team of {} ranks exchanged", MAX_RANKS + 1)
        }
    }
    let e = sim(SimConfig::new(3, 13000));
    let d = e.driver.devices();
    let many: Vec<_> = (0..=MAX_RANKS).map(|r| d[r % 3].clone()).collect();
    let simulator = e.sim.as_ref().unwrap();
    let before = simulator.live_resources();
    let err = Communicator::builder(&many)
        .allow_shared_devices(true)
        .build()
        .unwrap_err();
    match &err {
        Error::InvalidArgument { arg, reason } => {
            assert_eq!(*arg, "devices");
            assert!(reason.contains(&format!("1 to {MAX_RANKS}")), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let r = Communicator::builder_with_bootstrap(&d[0], Box::new(TooMany)).build();
    assert_eq!(arg_of(r), "bootstrap");
    assert_eq!(
        simulator.live_resources(),
        before,
        "a refused build left something"
    );
    let keys = vec![5u64; MAX_RANKS + 1];
    assert_eq!(arg_of(HierLayout::from_keys(0, &keys)), "domains");
    assert!(HierLayout::from_keys(0, &keys[..MAX_RANKS]).is_ok());
    // the largest team of one device per rank builds (its calls: collectives::table)
    drop((many, d, e));
    let e = sim(SimConfig::new(MAX_RANKS, 13000));
    let small = CommConfig {
        ll_max_bytes: 4 << 10,
        gather_ll_max_bytes: 8 << 10,
        broadcast_ll_max_bytes: 4 << 10,
        norm_ll_max_bytes: 4 << 10,
        one_shot_max_bytes: Some(16 << 10),
        stage_bytes: Some(16 << 10),
        scratch_bytes: 0,
        ..CommConfig::default()
    };
    let comm = Communicator::builder(&e.driver.devices())
        .config(small)
        .build()
        .unwrap();
    assert_eq!(comm.size(), MAX_RANKS);
}

/// A zero-sized element type is a valid `DeviceRepr` (no padding, every bit pattern valid): a
/// symmetric buffer of it has no bytes, which must be refused naming the length, like 0.
#[test]
fn a_symmetric_buffer_of_a_zero_sized_type_is_refused_naming_the_length() {
    #[derive(Clone, Copy)]
    struct Nothing;
    // SAFETY: a zero-sized type: no bytes, no padding, no invariants.
    unsafe impl cuda_multimem::DeviceRepr for Nothing {}
    let (e, comm, _s) = team(2, CommConfig::default());
    let sim = e.sim.as_ref().unwrap();
    let before = sim.live_resources();
    assert_eq!(arg_of(comm.alloc::<Nothing>(16)), "len");
    assert_eq!(
        sim.live_resources(),
        before,
        "the refused allocation left something"
    );
    // the team is unaffected
    comm.alloc::<f32>(16).unwrap();
}

/// `reserve_scratch` takes a byte count: one whose power-of-two rounding overflows must be
/// refused naming it.
#[test]
fn a_hierarchical_scratch_reservation_past_usize_is_refused_naming_it() {
    let r = hier_pair(
        "scratch-max",
        |_| 3,
        short_config(),
        Duration::from_secs(60),
        |_, built, _| {
            let hier = built.unwrap();
            let huge = arg_of(hier.reserve_scratch(usize::MAX));
            let past = arg_of(hier.reserve_scratch((1 << 63) + 1));
            // a sane one still works afterwards
            hier.reserve_scratch(4096).unwrap();
            (huge, past)
        },
    );
    assert_eq!(r, [("bytes", "bytes"); 2]);
}

// ---- hierarchical: a cross-domain step that miscounts its rail ----

/// A cross-domain step whose idea of the rail is off by `skew` (rank and size), never called.
struct Miscounted {
    rank: usize,
    size: usize,
}

impl CrossDomain for Miscounted {
    fn name(&self) -> String {
        "miscounted".into()
    }
    fn rail_rank(&self) -> usize {
        self.rank
    }
    fn rail_size(&self) -> usize {
        self.size
    }
    fn graph_capturable(&self) -> bool {
        false
    }
    unsafe fn all_reduce(
        &self,
        _: DType,
        _: ReduceOp,
        _: u64,
        _: u64,
        _: usize,
        _: &cuda_multimem::StreamRef<'_>,
    ) -> cuda_multimem::Result<()> {
        panic!("a miscounted cross-domain step was called")
    }
    unsafe fn reduce_scatter(
        &self,
        _: DType,
        _: ReduceOp,
        _: u64,
        _: u64,
        _: usize,
        _: &cuda_multimem::StreamRef<'_>,
    ) -> cuda_multimem::Result<()> {
        panic!("a miscounted cross-domain step was called")
    }
    unsafe fn all_gather(
        &self,
        _: DType,
        _: u64,
        _: u64,
        _: usize,
        _: &cuda_multimem::StreamRef<'_>,
    ) -> cuda_multimem::Result<()> {
        panic!("a miscounted cross-domain step was called")
    }
    fn check(&self) -> cuda_multimem::Result<()> {
        Ok(())
    }
}

/// The hierarchy sizes its calls to the cross-domain step by the rail (M chunks of its scratch,
/// chunk r of the caller's buffer), and the step's contract is in its own rail size and rank: a
/// step (a safe factory's product) whose rank or size differs from the rail's would read and
/// write past those ranges. The builder must refuse it, naming it.
#[test]
fn a_cross_domain_step_that_miscounts_its_rail_is_refused_at_build() {
    let bigger = hier_pair_with(
        "cross-size",
        |rank| rank as u64,
        short_config(),
        Duration::from_secs(60),
        |b| {
            b.cross_domain_with(|rail| {
                Ok(Box::new(Miscounted {
                    rank: rail.rank,
                    size: rail.size + 1,
                }) as _)
            })
        },
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(bigger, ["cross_domain"; 2]);
    let swapped = hier_pair_with(
        "cross-rank",
        |rank| rank as u64,
        short_config(),
        Duration::from_secs(60),
        |b| {
            b.cross_domain_with(|rail| {
                Ok(Box::new(Miscounted {
                    rank: rail.size - 1 - rail.rank,
                    size: rail.size,
                }) as _)
            })
        },
        |_, built, _| arg_of(built.map(drop)),
    );
    assert_eq!(swapped, ["cross_domain"; 2]);
}
