//! The multicast guard (the site's variables, the thread override, fresh processes), the
//! capability report, objects across processes, per-device binds and teams larger than the
//! machine.

use super::*;

#[test]
fn the_guard_refuses_multicast_before_any_driver_call() {
    // Runs on the real driver too: the refusal comes before anything is created.
    let e = env();
    let _off = disable_multicast_on_this_thread();
    let before = e.sim.as_ref().map(|s| {
        (
            s.calls("cuMulticastCreate"),
            s.calls("cuMulticastGetGranularity"),
        )
    });
    let err = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap_err();
    assert!(matches!(err, Error::Disabled { .. }), "{err}");
    assert!(multicast_allowed().is_err() && multicast_allowed_for(&e.driver).is_err());
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes::FABRIC);
    let imp = MulticastObject::import_fabric(&e.driver, &[0; 64], &spec).unwrap_err();
    assert!(matches!(imp, Error::Disabled { .. }), "{imp}");
    if let Some(s) = &e.sim {
        assert_eq!(
            Some((
                s.calls("cuMulticastCreate"),
                s.calls("cuMulticastGetGranularity")
            )),
            before
        );
    }
}

#[test]
fn the_guard_holds_on_the_real_driver_when_the_site_sets_the_variables() {
    let e = env();
    if e.driver.is_simulated() {
        // The variables are for real GPUs; on the simulator check the same decision through the
        // pure policy function instead.
        assert!(policy_from(|k| (k == NVLS_ENABLE_ENV).then(|| "0".into())).is_err());
        return;
    }
    match multicast_allowed() {
        Err(reason) => {
            let err = MulticastObject::new(&e.driver, &MulticastSpec::new(2, 2 * MIB)).unwrap_err();
            assert!(matches!(err, Error::Disabled { .. }), "{err}");
            assert!(err.to_string().contains(&reason), "{err}");
        }
        Ok(()) => skip(
            "the_guard_holds_on_the_real_driver_when_the_site_sets_the_variables",
            "neither NCCL_NVLS_ENABLE=0 nor CUDA_MULTIMEM_DISABLE_MULTICAST=1 is set here, and this test never creates a multicast object on real GPUs",
        ),
    }
}

#[test]
fn the_policy_reads_both_variables_and_fails_safe() {
    let with = |k: &'static str, v: &'static str| move |q: &str| (q == k).then(|| v.to_string());
    assert!(policy_from(|_| None).is_ok());
    let e = policy_from(with(NVLS_ENABLE_ENV, "0")).unwrap_err();
    assert!(e.contains(NVLS_ENABLE_ENV), "{e}");
    assert!(policy_from(with(NVLS_ENABLE_ENV, " 0 ")).is_err());
    assert!(policy_from(with(NVLS_ENABLE_ENV, "1")).is_ok());
    assert!(policy_from(with(NVLS_ENABLE_ENV, "2")).is_ok());
    let e = policy_from(with(DISABLE_MULTICAST_ENV, "1")).unwrap_err();
    assert!(e.contains(DISABLE_MULTICAST_ENV), "{e}");
    assert!(policy_from(with(DISABLE_MULTICAST_ENV, "yes")).is_err());
    assert!(
        policy_from(with(DISABLE_MULTICAST_ENV, "garbage")).is_err(),
        "fails safe"
    );
    assert!(policy_from(with(DISABLE_MULTICAST_ENV, "0")).is_ok());
    assert!(policy_from(with(DISABLE_MULTICAST_ENV, "")).is_ok());
    let e = policy_from(with(TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV, "1")).unwrap_err();
    assert!(e.contains(TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV), "{e}");
    let e = policy_from(with(NVSHMEM_DISABLE_NVLS_ENV, "1")).unwrap_err();
    assert!(e.contains(NVSHMEM_DISABLE_NVLS_ENV), "{e}");
}

/// Child mode of the next test: the environment it was started with must give this answer.
const CHILD_EXPECT: &str = "CUDA_MULTIMEM_GUARD_CHILD_EXPECT";

#[test]
fn the_environment_variables_disable_multicast_in_a_fresh_process() {
    if let Ok(expect) = std::env::var(CHILD_EXPECT) {
        let got = multicast_allowed();
        match expect.as_str() {
            "allowed" => assert_eq!(got, Ok(())),
            var => {
                let reason = got.unwrap_err();
                assert!(reason.contains(var), "{reason}");
            }
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let name =
        "safe::multicast::guard::the_environment_variables_disable_multicast_in_a_fresh_process";
    for (vars, expect) in [
        (vec![(NVLS_ENABLE_ENV, "0")], NVLS_ENABLE_ENV),
        (vec![(DISABLE_MULTICAST_ENV, "1")], DISABLE_MULTICAST_ENV),
        (
            vec![(NVLS_ENABLE_ENV, "1"), (DISABLE_MULTICAST_ENV, "0")],
            "allowed",
        ),
    ] {
        let out = std::process::Command::new(&exe)
            .args(["--exact", name, "--test-threads=1"])
            .env_remove(NVLS_ENABLE_ENV)
            .env_remove(DISABLE_MULTICAST_ENV)
            .env_remove(TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV)
            .env_remove(NVSHMEM_DISABLE_NVLS_ENV)
            .envs(vars.iter().copied())
            .env(CHILD_EXPECT, expect)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child with {vars:?}: {text}");
        assert!(text.contains("1 passed"), "the child ran the check: {text}");
    }
}

#[test]
fn the_simulator_is_exempt_from_the_variables_but_not_from_the_thread_override() {
    let e = sim(SimConfig::new(2, 13010));
    assert!(multicast_allowed_for(&e.driver).is_ok());
    let off = disable_multicast_on_this_thread();
    assert!(multicast_allowed_for(&e.driver).is_err());
    drop(off);
    assert!(multicast_allowed_for(&e.driver).is_ok());
    // Other threads are not affected by this thread's override.
    let _off = disable_multicast_on_this_thread();
    let d = e.driver.clone();
    std::thread::spawn(move || assert!(multicast_allowed_for(&d).is_ok()))
        .join()
        .unwrap();
}

#[test]
fn the_capability_report_matches_the_driver_version() {
    let e = env();
    let d0 = e.driver.device(0).unwrap();
    let mc = d0.supports_multicast().unwrap();
    if e.driver.version() < 12010 {
        assert!(!mc, "no multicast attribute before 12.1");
    }
    let le = d0.logical_endpoint_multicast().unwrap();
    assert_eq!(le.is_some(), e.driver.version() >= 13030, "{le:?}");
}

/// Child mode of the next tests: `fd:<descriptor>` or `fabric:<hex bytes>` of the exported object.
const CHILD_FD: &str = "CUDA_MULTIMEM_MC_CHILD_HANDLE";

/// The importing process: add device 1, bind its memory, map, then follow the parent's script.
fn multicast_child(handle: &str) {
    use std::io::{BufRead, Write};
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(HandleTypes::POSIX_FD);
    let o = match handle.split_once(':') {
        Some(("fd", n)) => {
            // SAFETY: the parent passed this descriptor to us, open and not close-on-exec.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(n.parse().unwrap()) };
            MulticastObject::import_posix_fd(d, fd, &spec).unwrap()
        }
        Some(("fabric", hex)) => {
            let bytes: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            let spec = spec.handle_types(HandleTypes::FABRIC);
            MulticastObject::import_fabric(d, &bytes, &spec).unwrap()
        }
        _ => panic!("bad child handle {handle}"),
    };
    let dev1 = d.device(1).unwrap();
    o.add_device(&dev1).unwrap();
    let mem = PhysicalAllocation::builder(d, Location::Device(1))
        .handle_types(HandleTypes::POSIX_FD)
        .create(2 * MIB)
        .unwrap();
    let own = Mapping::map_whole(&mem, &[(Location::Device(1), Access::ReadWrite)]).unwrap();
    let b = o.bind_mem(&dev1, 0, &mem, 0, 2 * MIB).unwrap();
    let map = o.map_whole(std::slice::from_ref(&dev1)).unwrap();
    let mut lines = std::io::stdin().lock().lines();
    let say = |s: &str| {
        println!("@@{s}");
        std::io::stdout().flush().unwrap();
    };
    say("BOUND");
    assert_eq!(lines.next().unwrap().unwrap(), "CHECK");
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, own.device_ptr()).unwrap();
    say(if back == random(4096, 77) {
        "SAW-OK"
    } else {
        "SAW-BAD"
    });
    htod(d, map.device_ptr() + 8192, &random(4096, 78)).unwrap();
    say("STORED");
    assert_eq!(lines.next().unwrap().unwrap(), "DONE");
    drop((map, b, o, own, mem));
}

#[test]
fn a_multicast_object_exported_as_a_posix_fd_works_in_another_process() {
    if let Ok(h) = std::env::var(CHILD_FD) {
        return multicast_child(&h);
    }
    across_processes(false);
}

#[test]
fn a_multicast_object_exported_as_a_fabric_handle_works_in_another_process() {
    if let Ok(h) = std::env::var(CHILD_FD) {
        return multicast_child(&h);
    }
    across_processes(true);
}

/// The exporting process: create, export, add device 0, start the importer, bind, map; each
/// side's store through its own multicast mapping reaches the other's memory.
fn across_processes(fabric: bool) {
    use std::io::{BufRead, BufReader, Write};
    use std::os::fd::AsRawFd;
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    let ht = HandleTypes {
        posix_fd: true,
        fabric,
    };
    let spec = MulticastSpec::new(2, 2 * MIB).handle_types(ht);
    let o = MulticastObject::new(d, &spec).unwrap();
    let exported = o.export_posix_fd().unwrap();
    // A copy without close-on-exec for the child.
    // SAFETY: dup of a descriptor we own; the new one is closed below.
    let inherited = unsafe { libc::dup(exported.as_raw_fd()) };
    assert!(inherited >= 0);
    let (name, handle) = if fabric {
        let h = o.export_fabric().unwrap();
        let hex: String = h.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        (
            "a_multicast_object_exported_as_a_fabric_handle_works_in_another_process",
            format!("fabric:{hex}"),
        )
    } else {
        (
            "a_multicast_object_exported_as_a_posix_fd_works_in_another_process",
            format!("fd:{inherited}"),
        )
    };
    let dev0 = d.device(0).unwrap();
    o.add_device(&dev0).unwrap();
    let mut child = cuda_multimem_tests::child_test(&format!("safe::multicast::guard::{name}"))
        .env(CHILD_FD, handle)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // SAFETY: our copy; the child has its own.
    unsafe { libc::close(inherited) };
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap()).lines();
    // libtest prints "test <name> ... " before the child's own lines: look for the marker.
    let mut expect = |what: &str| loop {
        let l = from_child.next().expect("child output").unwrap();
        if let Some(i) = l.find("@@") {
            let got = l[i + 2..].trim().to_string();
            if got.starts_with("SAW-") || got == what {
                return got;
            }
        }
    };
    let mem = PhysicalAllocation::builder(d, Location::Device(0))
        .handle_types(ht)
        .create(2 * MIB)
        .unwrap();
    let own = Mapping::map_whole(&mem, &[(Location::Device(0), Access::ReadWrite)]).unwrap();
    // Waits (the driver's blocking, simulated by polling the shared table) for the child's device.
    let b = o.bind_mem(&dev0, 0, &mem, 0, 2 * MIB).unwrap();
    let map = o.map_whole(std::slice::from_ref(&dev0)).unwrap();
    assert_eq!(expect("BOUND"), "BOUND");
    let data = random(4096, 77);
    htod(d, map.device_ptr(), &data).unwrap();
    let mut back = vec![0u8; 4096];
    dtoh(d, &mut back, own.device_ptr()).unwrap();
    assert!(back == data, "the parent's own memory");
    writeln!(to_child, "CHECK").unwrap();
    assert_eq!(
        expect("SAW-OK"),
        "SAW-OK",
        "the child's memory got the parent's store"
    );
    assert_eq!(expect("STORED"), "STORED");
    dtoh(d, &mut back, own.device_ptr() + 8192).unwrap();
    assert!(
        back == random(4096, 78),
        "the child's store reached the parent's memory"
    );
    writeln!(to_child, "DONE").unwrap();
    drop(to_child);
    assert!(child.wait().unwrap().success());
    drop((map, b, o, own, mem, exported));
    assert_eq!(leftovers(e.sim.as_ref().unwrap()), Default::default());
}

#[test]
fn host_numa_memory_binds_for_its_nearest_device_only_with_the_per_device_bind() {
    for v in [13000, 13010] {
        let e = sim(SimConfig::new(2, v));
        let d = &e.driver;
        let o = full_object(d, 2, 2 * MIB);
        let numa = d
            .device(0)
            .unwrap()
            .host_numa_id()
            .unwrap()
            .expect("node 0");
        let host = PhysicalAllocation::builder(d, Location::HostNuma(numa))
            .create(2 * MIB)
            .unwrap();
        let r = o.bind_mem(&d.device(0).unwrap(), 0, &host, 0, 2 * MIB);
        if v >= 13010 {
            let b = r.unwrap();
            assert_eq!(b.device(), 0);
        } else {
            let err = r.unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument { arg: "memory", .. }),
                "{err}"
            );
        }
    }
}

#[test]
fn a_team_may_be_larger_than_this_machine_but_binds_wait_for_every_member() {
    let e = sim(SimConfig::new(2, 13010));
    let d = &e.driver;
    // 4 members: two here, two in another process or node.
    let o = MulticastObject::new(d, &MulticastSpec::new(4, 2 * MIB)).unwrap();
    o.add_device(&d.device(0).unwrap()).unwrap();
    o.add_device(&d.device(1).unwrap()).unwrap();
    let mem = member_memory(d, 1, 2 * MIB, HandleTypes::NONE);
    let err = o
        .bind_mem(&d.device(0).unwrap(), 0, mem[0].allocation(), 0, 2 * MIB)
        .unwrap_err();
    assert!(err.to_string().contains("2 of 4"), "{err}");
    let none = MulticastObject::new(d, &MulticastSpec::new(0, 2 * MIB)).unwrap_err();
    assert!(
        matches!(
            none,
            Error::InvalidArgument {
                arg: "spec.devices",
                ..
            }
        ),
        "{none}"
    );
}
