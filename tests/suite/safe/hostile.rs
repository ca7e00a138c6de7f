//! Hostile use of the safe layer's public API (`cuda-multimem`): VMM, managed memory, multicast
//! objects, logical endpoints, teams, streams, events, graphs and modules with bad arguments
//! must give an error value naming the argument, never a panic, a hang or memory corruption.
//!
//! Everything runs on an explicit simulator (`sim(...)`): several cases create multicast objects,
//! which real GPU machines forbid, and the others check the simulator's call counts.

use std::os::fd::AsFd;

use cuda_multimem::endpoint::{EndpointSpec, LogicalEndpoint};
use cuda_multimem::managed::{self, ManagedBuffer, PrefetchPolicy};
use cuda_multimem::multicast::{policy_from, MulticastObject, MulticastSpec, NVLS_ENABLE_ENV};
use cuda_multimem::team::{Backend, Team};
use cuda_multimem::vmm::{
    HandleTypes, Location, PhysicalAllocation, Reservation, Rounding, VmmBuffer,
};
use cuda_multimem::{CaptureMode, Error, Stream};
use cuda_multimem_sim::SimConfig;
use cuda_multimem_tests::{fail_each_call, sim};

use crate::safe::multicast::leftovers;

const MIB: usize = 1 << 20;

/// The argument an `InvalidArgument` names, or a panic saying what came instead.
fn invalid_arg<T: std::fmt::Debug>(r: Result<T, Error>) -> (&'static str, String) {
    match r {
        Err(Error::InvalidArgument { arg, reason }) => (arg, reason),
        other => panic!("expected Error::InvalidArgument, got {other:?}"),
    }
}

#[test]
fn an_endpoint_size_near_usize_max_is_an_error_naming_the_size_not_a_panic() {
    let e = sim(SimConfig::new(2, 13030));
    let s = e.sim.as_ref().unwrap();
    let d0 = e.driver.device(0).unwrap();
    for size in [usize::MAX, usize::MAX - 4096, (usize::MAX >> 1) + 3] {
        for spec in [
            EndpointSpec::unicast(&d0, size),
            EndpointSpec::multicast(2, size),
        ] {
            let (arg, why) = invalid_arg(spec.validate(&e.driver));
            assert_eq!(arg, "spec.size", "{size}: {why}");
            let (arg, _) = invalid_arg(LogicalEndpoint::create(&e.driver, &spec));
            assert_eq!(arg, "spec.size");
        }
    }
    assert_eq!(s.calls("cuLogicalEndpointIdReserve"), 0);
    assert_eq!(s.calls("cuLogicalEndpointCreate"), 0);
}

#[test]
fn a_team_size_near_usize_max_is_an_error_naming_the_size_not_a_panic() {
    for (version, backend) in [
        (13010, Backend::MulticastObject),
        (13030, Backend::LogicalEndpoint),
    ] {
        let e = sim(SimConfig::new(2, version));
        let s = e.sim.as_ref().unwrap();
        let dev = e.driver.devices();
        for size in [usize::MAX, usize::MAX - 4096] {
            let r = Team::builder(&dev).size(size).backend(backend).build();
            let (arg, why) = invalid_arg(r);
            assert_eq!(arg, "size", "{version} {size}: {why}");
        }
        assert_eq!(s.calls("cuMulticastCreate"), 0);
        assert_eq!(s.calls("cuLogicalEndpointCreate"), 0);
        assert!(leftovers(s).values().all(|&v| v == 0), "{:?}", leftovers(s));
    }
}

#[test]
fn growing_a_vmm_buffer_blames_new_size() {
    let e = sim(SimConfig::new(2, 13000));
    let d = &e.driver;
    let exact = PhysicalAllocation::builder(d, Location::Device(0)).rounding(Rounding::Exact);
    let g = exact.spec().granularity(d, Default::default()).unwrap();
    let mut b = VmmBuffer::new(exact, g, &[]).unwrap();
    let was = (b.device_ptr(), b.size());
    // Exact rounding: the growth is not a granularity multiple.
    let (arg, why) = invalid_arg(b.grow(g + g / 2));
    assert_eq!(arg, "new_size", "{why}");
    // The growth overflows when rounded.
    let (arg, why) = invalid_arg(b.grow(usize::MAX));
    assert_eq!(arg, "new_size", "{why}");
    let mut b2 =
        VmmBuffer::new(PhysicalAllocation::builder(d, Location::Device(0)), g, &[]).unwrap();
    let (arg, why) = invalid_arg(b2.grow(usize::MAX));
    assert_eq!(arg, "new_size", "{why}");
    assert_eq!((b.device_ptr(), b.size()), was, "unchanged");
}

#[test]
fn mapping_a_multicast_object_at_an_offset_near_usize_max_is_an_error_not_a_panic() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let o = MulticastObject::new(d, &MulticastSpec::new(2, 2 * MIB)).unwrap();
    for dev in d.devices() {
        o.add_device(&dev).unwrap();
    }
    let g = o.granularity();
    let r = Reservation::builder(d, o.size())
        .alignment(g)
        .reserve()
        .unwrap();
    let far = usize::MAX - (usize::MAX % g);
    let (arg, why) = invalid_arg(o.map(&r, far, 0, o.size(), &d.devices()));
    assert!(arg == "reservation_offset" || arg == "size", "{arg}: {why}");
}

#[test]
fn nccl_nvls_enable_values_nccl_reads_as_zero_refuse_multicast() {
    // NCCL reads its integer parameters with strtoll(value, NULL, 0): a value without digits,
    // or whose number is 0 in C's notation, switches NVLS off there; the guard must agree.
    let with = |v: &'static str| move |q: &str| (q == NVLS_ENABLE_ENV).then(|| v.to_string());
    for off in [
        "0", " 0 ", "00", "0x0", "0X00", "-0", "+0", "false", "off", "no", "0abc", "08",
    ] {
        let e = policy_from(with(off)).expect_err(off);
        assert!(e.contains(NVLS_ENABLE_ENV), "{off}: {e}");
    }
    for on in ["1", "2", "0x1", "010", "-1", "", "7 "] {
        assert!(policy_from(with(on)).is_ok(), "{on:?}");
    }
}

#[test]
fn an_imported_allocation_claimed_too_large_to_reserve_is_an_error_naming_the_size() {
    let e = sim(SimConfig::new(2, 13000));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let a = PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(HandleTypes {
            posix_fd: true,
            fabric: true,
        })
        .create(2 * MIB)
        .unwrap();
    let g = a.granularity();
    let fd = a.export_posix_fd().unwrap();
    let fabric = a.export_fabric().unwrap();
    let before = leftovers(s);
    for claim in [1usize << 50, usize::MAX - (usize::MAX % g)] {
        let (arg, why) = invalid_arg(PhysicalAllocation::import_posix_fd(d, fd.as_fd(), claim));
        assert_eq!(arg, "size", "{claim}: {why}");
        let (arg, why) = invalid_arg(PhysicalAllocation::import_fabric(
            d,
            fabric.as_bytes(),
            claim,
        ));
        assert_eq!(arg, "size", "{claim}: {why}");
    }
    assert_eq!(leftovers(s), before, "the imported handles were released");
    // The true size still imports.
    let back = PhysicalAllocation::import_posix_fd(d, fd.as_fd(), 2 * MIB).unwrap();
    assert_eq!(back.size(), 2 * MIB);
}

#[test]
fn a_failure_at_any_step_of_importing_a_multicast_object_leaks_nothing() {
    let e = sim(SimConfig::new(2, 13010));
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes {
        posix_fd: true,
        fabric: true,
    });
    let o = MulticastObject::new(d, &spec).unwrap();
    let fd = o.export_posix_fd().unwrap();
    let fabric = o.export_fabric().unwrap();
    let by_fd = || MulticastObject::import_posix_fd(d, fd.as_fd(), o.spec());
    let by_fabric = || MulticastObject::import_fabric(d, fabric.as_bytes(), o.spec());
    drop((by_fd().unwrap(), by_fabric().unwrap())); // resolve every entry point first
    let n = fail_each_call(s, by_fd, |b| assert!(b.is_imported()));
    assert!(n >= 3, "granularity, import, properties: {n}");
    let n = fail_each_call(s, by_fabric, |b| assert!(b.is_imported()));
    assert!(n >= 3, "granularity, import, properties: {n}");
}

#[test]
fn a_failure_at_any_step_of_importing_a_logical_endpoint_leaks_nothing() {
    let mut cfg = SimConfig::new(2, 13030);
    cfg.endpoint_ready_polls = 0;
    let e = sim(cfg);
    let s = e.sim.as_ref().unwrap();
    let d = &e.driver;
    for spec in [
        EndpointSpec::multicast(2, 2 * MIB).fabric_handle(true),
        EndpointSpec::unicast(&d.device(1).unwrap(), 2 * MIB).fabric_handle(true),
    ] {
        let ep = LogicalEndpoint::create(d, &spec).unwrap();
        let h = ep.export_fabric().unwrap();
        let import = || LogicalEndpoint::import_fabric(d, &h, &spec);
        drop(import().unwrap()); // resolve every entry point first
        let n = fail_each_call(s, import, |i| assert!(i.is_imported()));
        assert!(n >= 3, "limits, reserve, import: {n}");
    }
}

#[test]
fn batch_range_operations_on_cuda_12_name_the_missing_batch_function() {
    for version in [12000, 12080] {
        let e = sim(SimConfig::new(2, version));
        let sim = e.sim.as_ref().unwrap();
        let d = e.driver.device(0).unwrap();
        let s = Stream::new(&d).unwrap();
        let buf = ManagedBuffer::new(&d, 4 * MIB).unwrap();
        let rs = [
            buf.subrange(0, 2 * MIB).unwrap(),
            buf.subrange(2 * MIB, 2 * MIB).unwrap(),
        ];
        let dev = [managed::Location::Device(1)];
        let missing = |r: Result<(), Error>| match r {
            Err(Error::Unsupported {
                symbol,
                needed: 13000,
                driver,
                ..
            }) if driver == version => symbol,
            other => panic!("{version}: expected Unsupported, got {other:?}"),
        };
        assert_eq!(
            missing(managed::prefetch_many_with(
                &rs,
                &dev,
                &s,
                PrefetchPolicy::Batch
            )),
            "cuMemPrefetchBatchAsync"
        );
        assert_eq!(
            missing(managed::discard_many(&rs, &s)),
            "cuMemDiscardBatchAsync"
        );
        assert_eq!(
            missing(managed::discard_and_prefetch_many(&rs, &dev, &s)),
            "cuMemDiscardAndPrefetchBatchAsync"
        );
        // Auto never picks the batch a driver lacks, even for ranges it would batch on 13.0.
        managed::prefetch_many(&rs, &dev, &s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(sim.calls("cuMemPrefetchAsync"), 2, "{version}");
    }
}

/// What the `hostile_log` kernel of the next test recorded, in the order it ran.
static GRAPH_LOG: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

#[test]
fn one_executable_graph_launched_from_many_threads_replays_whole_each_time() {
    // The driver's graph objects are not thread-safe, yet GraphExec is Sync: launches of one
    // executable graph from several threads must be serialised by it, each replay whole.
    let e = sim(SimConfig::new(2, 13000));
    cuda_multimem_sim::register_kernel("hostile_log", |a| {
        GRAPH_LOG.lock().unwrap().push(a.u64(0)?);
        Ok(())
    });
    let d = e.driver.device(0).unwrap();
    let ptx = ".version 8.0\n.target sm_90\n.address_size 64\n\
               .visible .entry hostile_log(.param .u64 v)\n{\n\tret;\n}\n";
    let f = cuda_multimem::Module::load_ptx(&d, ptx)
        .unwrap()
        .function("hostile_log")
        .unwrap();
    let s = Stream::new(&d).unwrap();
    let r = s.as_stream_ref();
    r.begin_capture(CaptureMode::Global).unwrap();
    for step in 0..3u64 {
        // SAFETY: one .u64 parameter; the kernel touches no device memory.
        unsafe { f.launch_u64(&cuda_multimem::LaunchConfig::linear(1, 1), &s, &[step]) }.unwrap();
    }
    // SAFETY: the module, function and stream the capture used outlive `exec` (declared first).
    let exec = unsafe { r.end_capture().unwrap().instantiate() }.unwrap();
    GRAPH_LOG.lock().unwrap().clear();
    let (threads, launches) = (4, 300);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                for _ in 0..launches {
                    exec.launch(&s).unwrap();
                }
            });
        }
    });
    s.synchronize().unwrap();
    let log = std::mem::take(&mut *GRAPH_LOG.lock().unwrap());
    assert_eq!(log.len(), 3 * threads * launches);
    for (i, replay) in log.chunks(3).enumerate() {
        assert_eq!(replay, [0, 1, 2], "replay {i} was interleaved with another");
    }
}
