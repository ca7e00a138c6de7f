//! What a team needs when several of its ranks share one device: the simulator does it as a GPU
//! would. In one process: one allocation mapped several times into the device's context (one
//! mapping per rank) is one memory; a device is not its own peer, and needs no peer access to
//! its own memory; streams of one device run spin-waiting kernels at once (see also
//! `coresidency.rs`). Across processes: a POSIX-fd handle exported by one process and imported
//! by another for the same device maps the same memory.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_multimem::vmm::{Access, HandleTypes, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Error, LaunchConfig, Module, Stream};
use cuda_multimem_sim::{register_kernel, SimConfig, Simulator};
use cuda_multimem_sys::CUresult;

/// How long a test waits for something that should happen at once.
const PATIENCE: Duration = Duration::from_secs(120);

#[test]
fn one_allocation_mapped_for_several_ranks_of_one_device_is_one_memory() {
    let driver = cuda_multimem_sim::simulated_driver(SimConfig::new(1, 13030)).unwrap();
    let alloc = PhysicalAllocation::builder(&driver, Location::Device(0))
        .create(2 << 20)
        .unwrap();
    let rw = [(Location::Device(0), Access::ReadWrite)];
    // three ranks on device 0, each with its own mapping of the same memory
    let views: Vec<Mapping> = (0..3)
        .map(|_| Mapping::map_whole(&alloc, &rw).unwrap())
        .collect();
    let ptrs: Vec<_> = views.iter().map(|m| m.device_ptr()).collect();
    assert!(ptrs[0] != ptrs[1] && ptrs[1] != ptrs[2] && ptrs[0] != ptrs[2]);
    views[0].write(4096, &[7u32, 8, 9]).unwrap();
    for v in &views[1..] {
        let mut back = [0u32; 3];
        v.read(4096, &mut back).unwrap();
        assert_eq!(back, [7, 8, 9]);
    }
    // a device-to-device copy from one rank's view into another's lands in the one memory
    let s = Stream::new(&driver.device(0).unwrap()).unwrap();
    // SAFETY: both ranges lie inside live mappings that outlive the synchronisation below.
    unsafe {
        s.as_stream_ref()
            .copy_dtod_async(ptrs[2] + 8192, ptrs[1] + 4096, 12)
    }
    .unwrap();
    s.synchronize().unwrap();
    let mut back = [0u32; 3];
    views[0].read(8192, &mut back).unwrap();
    assert_eq!(back, [7, 8, 9]);
    assert_eq!(
        views[1].access(Location::Device(0)).unwrap(),
        Access::ReadWrite
    );
}

#[test]
fn a_device_is_not_its_own_peer_and_reaches_its_memory_without_peer_access() {
    let driver = cuda_multimem_sim::simulated_driver(SimConfig::new(2, 13030)).unwrap();
    let (d0, d1) = (driver.device(0).unwrap(), driver.device(1).unwrap());
    // as a GPU answers: cuDeviceCanAccessPeer(d, d) is 0
    assert!(!d0.can_access_peer(&d0).unwrap());
    assert!(d0.can_access_peer(&d1).unwrap());
    match d0.enable_peer_access(&d0) {
        Err(Error::InvalidArgument { arg: "peer", .. }) => {}
        other => panic!("expected the safe layer to refuse, got {other:?}"),
    }
    // the driver call itself: the current context is no peer of itself
    d0.bind().unwrap();
    let mut ctx = std::ptr::null_mut();
    let sys = driver.sys();
    // SAFETY: one context handle written through a valid pointer.
    assert_eq!(
        unsafe { sys.cuCtxGetCurrent().unwrap()(&mut ctx) },
        CUresult::CUDA_SUCCESS
    );
    // SAFETY: a live context handle; flags 0.
    assert_eq!(
        unsafe { sys.cuCtxEnablePeerAccess().unwrap()(ctx, 0) },
        CUresult::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
    );
    // what ranks of one device use instead: access descriptors for the device itself
    let alloc = PhysicalAllocation::builder(&driver, Location::Device(0))
        .create(2 << 20)
        .unwrap();
    let m = Mapping::map_whole(&alloc, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
    m.write(0, &[1u64]).unwrap();
    let mut back = [0u64];
    m.read(0, &mut back).unwrap();
    assert_eq!(back, [1]);
}

#[test]
fn streams_of_one_device_run_spin_waiting_kernels_of_several_ranks_at_once() {
    let sim = Simulator::start(SimConfig::new(1, 13030)).unwrap();
    let driver = cuda_multimem_sim::driver_over(&sim).unwrap();
    let d = driver.device(0).unwrap();
    let ptx = ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry rod_meet(.param .u64 team)\n{\n    ret;\n}\n";
    let f = Module::load_ptx(&d, ptx)
        .unwrap()
        .function("rod_meet")
        .unwrap();
    // each rank waits for every rank (team size from the parameter) to be present at once
    let (present, met) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    {
        let (present, met) = (present.clone(), met.clone());
        register_kernel("rod_meet", move |a| {
            let team = a.u64(0)? as u32;
            present.fetch_add(1, Ordering::SeqCst);
            let start = Instant::now();
            while present.load(Ordering::SeqCst) < team && met.load(Ordering::SeqCst) == 0 {
                if start.elapsed() > PATIENCE {
                    return Err(cuda_multimem_sim::KernelError::Failed(
                        "the ranks never met".into(),
                    ));
                }
                std::thread::yield_now();
            }
            met.store(1, Ordering::SeqCst);
            Ok(())
        });
    }
    let ranks = 8u32;
    // each rank's share of the device by the kernel's occupancy
    let per_sm = f.max_active_blocks_per_multiprocessor(512, 0).unwrap();
    let share = per_sm * d.multiprocessor_count().unwrap() as u32 / ranks;
    assert!(share >= 1);
    let streams: Vec<Stream> = (0..ranks).map(|_| Stream::new(&d).unwrap()).collect();
    for s in &streams {
        // SAFETY: the kernel takes one .u64 and touches no device memory.
        unsafe { f.launch_u64(&LaunchConfig::linear(share, 512), s, &[ranks as u64]) }.unwrap();
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    assert_eq!(met.load(Ordering::SeqCst), 1);
    assert_eq!(sim.residency_waits(), 0);
}

/// The child's side of the cross-process test: import the parent's fd for device 0, check the
/// parent's bytes, write an answer.
const CHILD_FD: &str = "CMM_SIM_TEST_ONE_DEVICE_FD";

#[test]
fn a_posix_fd_handle_shares_memory_between_processes_on_one_device() {
    const SIZE: usize = 2 << 20;
    if let Ok(fd) = std::env::var(CHILD_FD) {
        let raw: i32 = fd.parse().unwrap();
        let driver = cuda_multimem_sim::simulated_driver(SimConfig::new(1, 13030)).unwrap();
        // SAFETY: the parent left this descriptor open across exec for this process.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let alloc = PhysicalAllocation::import_posix_fd(&driver, fd, SIZE).unwrap();
        let m = Mapping::map_whole(&alloc, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
        let mut seen = [0u32; 4];
        m.read(0, &mut seen).unwrap();
        assert_eq!(seen, [11, 22, 33, 44], "the parent's bytes");
        m.write(64, &[55u32, 66]).unwrap();
        return;
    }
    let driver = cuda_multimem_sim::simulated_driver(SimConfig::new(1, 13030)).unwrap();
    let alloc = PhysicalAllocation::builder(&driver, Location::Device(0))
        .handle_types(HandleTypes::POSIX_FD)
        .create(SIZE)
        .unwrap();
    let m = Mapping::map_whole(&alloc, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
    m.write(0, &[11u32, 22, 33, 44]).unwrap();
    let exported = alloc.export_posix_fd().unwrap();
    // a descriptor without close-on-exec, for the child to inherit
    // SAFETY: dup of a descriptor we own; the new one is closed below.
    let inherited = unsafe { libc::dup(exported.as_raw_fd()) };
    assert!(inherited >= 0);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_posix_fd_handle_shares_memory_between_processes_on_one_device",
            "--test-threads=1",
        ])
        .env(CHILD_FD, inherited.to_string())
        .spawn()
        .unwrap();
    // SAFETY: our duplicate; the child has its own copy now.
    unsafe { libc::close(inherited) };
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > PATIENCE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the importing process did not finish within {PATIENCE:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(status.success(), "the importing process failed: {status}");
    let mut answer = [0u32; 2];
    m.read(64, &mut answer).unwrap();
    assert_eq!(
        answer,
        [55, 66],
        "the child's bytes, through this process's mapping"
    );
}
