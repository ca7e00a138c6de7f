//! Shareable handles: fabric handles and POSIX fds, in this process and in a child process;
//! peer access descriptors; host NUMA allocations.

use super::*;

#[test]
fn fabric_handles_round_trip_and_garbage_is_rejected() {
    let e = env();
    let d = &e.driver;
    if !d.device(0).unwrap().supports_fabric_handle().unwrap() {
        return skip(
            "fabric_handles_round_trip_and_garbage_is_rejected",
            "device 0 has no fabric handle support",
        );
    }
    let g = gran(d);
    let a = match PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(HandleTypes::FABRIC)
        .create(g)
    {
        Ok(a) => a,
        Err(Error::Driver { code, .. })
            if code == CUresult::CUDA_ERROR_NOT_PERMITTED
                || code == CUresult::CUDA_ERROR_NOT_SUPPORTED =>
        {
            return skip(
                "fabric_handles_round_trip_and_garbage_is_rejected",
                format!("cuMemCreate with a fabric handle type: {code} (no IMEX channel?)"),
            );
        }
        Err(e) => panic!("{e}"),
    };
    let h = a.export_fabric().unwrap();
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    let data = random(g, 11);
    m.write(0, &data).unwrap();
    let b = PhysicalAllocation::import_fabric(d, h.as_bytes(), g).unwrap();
    let m2 = Mapping::map_whole(&b, &rw0()).unwrap();
    let mut back = vec![0u8; g];
    m2.read(0, &mut back).unwrap();
    assert!(back == data);
    // Truncated, too long, garbage, and a claimed size larger than the allocation.
    assert!(matches!(
        PhysicalAllocation::import_fabric(d, &h.as_bytes()[..63], g),
        Err(Error::InvalidArgument { arg: "bytes", .. })
    ));
    assert!(matches!(
        PhysicalAllocation::import_fabric(d, &[0u8; 65], g),
        Err(Error::InvalidArgument { arg: "bytes", .. })
    ));
    let mut garbage = *h.as_bytes();
    garbage[20] ^= 0x5a;
    assert!(PhysicalAllocation::import_fabric(d, &garbage, g).is_err());
    assert!(PhysicalAllocation::import_fabric(d, &random(64, 12), g).is_err());
    assert!(matches!(
        PhysicalAllocation::import_fabric(d, h.as_bytes(), 0),
        Err(Error::InvalidArgument { arg: "size", .. })
    ));
    let too_big = PhysicalAllocation::import_fabric(d, h.as_bytes(), 2 * g);
    assert!(
        matches!(too_big, Err(Error::InvalidArgument { arg: "size", .. })),
        "{too_big:?}"
    );
    assert_eq!(FabricHandle::from_bytes(h.as_bytes()).unwrap(), h);
    // Once every owner of the allocation is gone, its fabric handle imports no more.
    drop((m2, b, m, a));
    let stale = PhysicalAllocation::import_fabric(d, h.as_bytes(), g);
    assert!(stale.is_err(), "a released allocation imported: {stale:?}");
}

#[test]
fn posix_fd_import_rejects_fds_that_are_not_allocations_and_oversized_claims() {
    let e = env();
    let d = &e.driver;
    if !d.device(0).unwrap().supports_posix_fd_handle().unwrap() {
        return skip(
            "posix_fd_import_rejects_fds_that_are_not_allocations_and_oversized_claims",
            "no POSIX-fd handle support",
        );
    }
    let g = gran(d);
    let f = std::fs::File::open("/proc/self/status").unwrap();
    let r = PhysicalAllocation::import_posix_fd(d, std::os::fd::AsFd::as_fd(&f), g);
    assert!(r.is_err(), "a regular file imported: {r:?}");
    let a = PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(HandleTypes::POSIX_FD)
        .create(g)
        .unwrap();
    let fd = a.export_posix_fd().unwrap();
    let too_big = PhysicalAllocation::import_posix_fd(d, std::os::fd::AsFd::as_fd(&fd), 2 * g);
    assert!(
        matches!(too_big, Err(Error::InvalidArgument { arg: "size", .. })),
        "{too_big:?}"
    );
    let ok = PhysicalAllocation::import_posix_fd(d, std::os::fd::AsFd::as_fd(&fd), g).unwrap();
    assert_eq!(ok.spec().location, Location::Device(0));
    assert!(ok.spec().handle_types.posix_fd);
    if let Some(s) = &e.sim {
        drop((ok, a, fd));
        assert!(s.live_resources().keys().all(|k| !k.starts_with("vmm")));
    }
}

#[test]
fn peer_reads_through_its_own_access_descriptor() {
    let e = env();
    let d = &e.driver;
    if d.device_count() < 2 {
        return skip(
            "peer_reads_through_its_own_access_descriptor",
            "needs 2 devices",
        );
    }
    let (d0, d1) = (d.device(0).unwrap(), d.device(1).unwrap());
    if !d1.can_access_peer(&d0).unwrap() {
        return skip(
            "peer_reads_through_its_own_access_descriptor",
            "device 1 cannot access device 0",
        );
    }
    let g = gran(d);
    let a = PhysicalAllocation::builder(d, Location::Device(0))
        .create(g)
        .unwrap();
    let m0 = Mapping::map_whole(&a, &rw0()).unwrap();
    let m1 = Mapping::map_whole(&a, &[(Location::Device(1), Access::ReadOnly)]).unwrap();
    assert_eq!(m1.access(Location::Device(1)).unwrap(), Access::ReadOnly);
    assert_eq!(m1.access(Location::Device(0)).unwrap(), Access::None);
    let data = random(g, 13);
    m0.write(0, &data).unwrap();
    // Read through device 1's mapping, with device 1's context current.
    d1.bind().unwrap();
    let f = d.sys().cuMemcpyDtoH().unwrap();
    let mut back = vec![0u8; g];
    // SAFETY: `back` holds g bytes; the mapping is live and readable by device 1.
    let r = unsafe { f(back.as_mut_ptr().cast(), m1.device_ptr(), g) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    assert!(back == data);
}

#[test]
fn host_numa_allocations_work_where_the_driver_has_host_numa_vmm() {
    let e = env();
    let d = &e.driver;
    let ok_host = d
        .device(0)
        .unwrap()
        .attribute_opt(cuda_multimem::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        .unwrap()
        .unwrap_or(0)
        != 0;
    let r = PhysicalAllocation::builder(d, Location::HostNuma(0)).create(2 * MIB);
    if !ok_host {
        assert!(r.is_err(), "host-NUMA VMM unsupported but created");
        return skip(
            "host_numa_allocations_work_where_the_driver_has_host_numa_vmm",
            "no host-NUMA VMM on this driver",
        );
    }
    let a = r.unwrap();
    let m = Mapping::map_whole(&a, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
    let data = random(a.size(), 14);
    m.write(0, &data).unwrap();
    let mut back = vec![0u8; a.size()];
    m.read(0, &mut back).unwrap();
    assert!(back == data);
    assert!(matches!(
        PhysicalAllocation::builder(d, Location::HostNuma(0))
            .handle_types(HandleTypes::POSIX_FD)
            .create(2 * MIB),
        Err(Error::InvalidArgument {
            arg: "handle_types",
            ..
        })
    ));
    assert!(PhysicalAllocation::builder(d, Location::HostNuma(1 << 20))
        .create(2 * MIB)
        .is_err());
    let _ = Arc::strong_count(&a);
}

/// Environment variable that makes [`shareable_handle_child_process`] the child half of the
/// two-process tests: the number of the inherited socket.
const CHILD_SOCKET_ENV: &str = "CUDA_MULTIMEM_TEST_VMM_CHILD_SOCKET";

/// Send `data`, and `fd` if given, over a Unix socket (SCM_RIGHTS).
fn send_msg(sock: std::os::fd::RawFd, fd: Option<std::os::fd::RawFd>, data: &[u8]) {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has room for one header with one int (CMSG_SPACE above).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut libc::c_int, fd);
        }
    }
    // SAFETY: msg points at live buffers.
    let n = unsafe { libc::sendmsg(sock, &msg, 0) };
    assert_eq!(
        n,
        data.len() as isize,
        "sendmsg: {}",
        std::io::Error::last_os_error()
    );
}

/// Receive up to `buf.len()` bytes and an fd, if one came (SCM_RIGHTS).
fn recv_msg(sock: std::os::fd::RawFd, buf: &mut [u8]) -> (usize, Option<std::os::fd::OwnedFd>) {
    use std::os::fd::FromRawFd;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the buffers are live; the kernel writes at most their sizes.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n > 0, "recvmsg: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel filled the control buffer; the header is checked before the fd is read.
    let fd = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (!c.is_null() && (*c).cmsg_type == libc::SCM_RIGHTS).then(|| {
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
            std::os::fd::OwnedFd::from_raw_fd(fd)
        })
    };
    (n as usize, fd)
}

/// How the parent hands an allocation to the child.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Share {
    /// A POSIX fd, passed with SCM_RIGHTS.
    PosixFd,
    /// The 64 bytes of a fabric handle, in the message.
    Fabric,
}

/// The parent half of the two-process tests: allocate with the handle type, write random data,
/// hand the handle to a child (this test binary, running [`shareable_handle_child_process`]),
/// and check that the child saw the data and that its writes (the complement) are visible here.
fn share_with_a_child_process(name: &str, share: Share) {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let e = env();
    let d = &e.driver;
    let dev = d.device(0).unwrap();
    let (supported, types) = match share {
        Share::PosixFd => (
            dev.supports_posix_fd_handle().unwrap(),
            HandleTypes::POSIX_FD,
        ),
        Share::Fabric => (dev.supports_fabric_handle().unwrap(), HandleTypes::FABRIC),
    };
    if !supported {
        return skip(name, format!("device 0 does not support {share:?} handles"));
    }
    let size = 2 * gran(d);
    let a = match PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(types)
        .create(size)
    {
        Ok(a) => a,
        Err(Error::Driver { code, .. })
            if share == Share::Fabric && code == CUresult::CUDA_ERROR_NOT_PERMITTED =>
        {
            return skip(
                name,
                "cuMemCreate with a fabric handle type is not permitted here (no IMEX channel)",
            );
        }
        Err(e) => panic!("{e}"),
    };
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    let seed = 0x5eed_u64 + share as u64;
    m.write(0, &random(size, seed)).unwrap();
    let mut msg = [0u8; 80];
    msg[..8].copy_from_slice(&(size as u64).to_le_bytes());
    msg[8..16].copy_from_slice(&seed.to_le_bytes());
    let fd = match share {
        Share::PosixFd => Some(a.export_posix_fd().unwrap()),
        Share::Fabric => {
            msg[16..].copy_from_slice(a.export_fabric().unwrap().as_bytes());
            None
        }
    };

    let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let child_fd = theirs.as_raw_fd();
    let mut cmd =
        cuda_multimem_tests::child_test("safe::vmm::sharing::shareable_handle_child_process");
    cmd.env(CHILD_SOCKET_ENV, child_fd.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // SAFETY: between fork and exec only async-signal-safe fcntl calls run; they touch the
    // child's copy of the socket fd, so it survives exec there (and nowhere else).
    unsafe {
        cmd.pre_exec(move || {
            let f = libc::fcntl(child_fd, libc::F_GETFD);
            if f < 0 || libc::fcntl(child_fd, libc::F_SETFD, f & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    send_msg(mine.as_raw_fd(), fd.as_ref().map(|f| f.as_raw_fd()), &msg);
    drop(fd); // the child holds its own copy now
    let mut reply = Vec::new();
    (&mine).read_to_end(&mut reply).unwrap();
    let out = child.wait_with_output().unwrap();
    let log = format!(
        "child stdout:\n{}\nchild stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "child failed ({}):\n{log}",
        out.status
    );
    assert_eq!(reply, b"ok", "child reply; {log}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child test did not run: {log}"
    );
    // The child wrote the complement of what it read.
    let expected: Vec<u8> = random(size, seed).iter().map(|b| !b).collect();
    let mut back = vec![0u8; size];
    m.read(0, &mut back).unwrap();
    assert!(
        back == expected,
        "the child's writes are not visible to the parent"
    );
}

#[test]
fn a_posix_fd_shares_an_allocation_with_another_process() {
    share_with_a_child_process(
        "a_posix_fd_shares_an_allocation_with_another_process",
        Share::PosixFd,
    );
}

#[test]
fn a_fabric_handle_shares_an_allocation_with_another_process() {
    share_with_a_child_process(
        "a_fabric_handle_shares_an_allocation_with_another_process",
        Share::Fabric,
    );
}

/// The child half of the two-process tests: receives the handle (an fd, or fabric bytes),
/// imports and maps it, checks the parent's data, writes its complement, replies "ok".
#[test]
#[ignore = "child process of the two-process sharing tests; runs only when spawned by them"]
fn shareable_handle_child_process() {
    use std::io::Write;
    use std::os::fd::{AsFd, FromRawFd};
    let Some(sock) = std::env::var(CHILD_SOCKET_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return skip(
            "shareable_handle_child_process",
            "the child half of the two-process sharing tests; runs only when spawned by them",
        );
    };
    // SAFETY: the parent passed us this socket fd, inherited, owned by nobody else here.
    let mut sock = unsafe { std::os::unix::net::UnixStream::from_raw_fd(sock) };
    let mut msg = [0u8; 80];
    let (n, fd) = recv_msg(std::os::fd::AsRawFd::as_raw_fd(&sock), &mut msg);
    assert_eq!(n, 80);
    let size = u64::from_le_bytes(msg[..8].try_into().unwrap()) as usize;
    let seed = u64::from_le_bytes(msg[8..16].try_into().unwrap());
    let e = env();
    let d = &e.driver;
    let a = match fd {
        Some(fd) => PhysicalAllocation::import_posix_fd(d, fd.as_fd(), size).unwrap(),
        None => PhysicalAllocation::import_fabric(d, &msg[16..], size).unwrap(),
    };
    let m = Mapping::map_whole(&a, &rw0()).unwrap();
    let mut got = vec![0u8; size];
    m.read(0, &mut got).unwrap();
    assert!(
        got == random(size, seed),
        "the child does not see the parent's data"
    );
    let flipped: Vec<u8> = got.iter().map(|b| !b).collect();
    m.write(0, &flipped).unwrap();
    // Make sure the writes landed before telling the parent.
    let mut again = vec![0u8; size];
    m.read(0, &mut again).unwrap();
    assert!(again == flipped);
    drop((m, a));
    sock.write_all(b"ok").unwrap();
}
