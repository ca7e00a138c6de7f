//! Hostile use of the surfaces a user meets before any collective: the simulator's options
//! (`SimConfig::parse`, `SimConfig::validate`, `Simulator::start`), the loader (`load_from`,
//! `availability`, `raw`), driver selection through `CUDA_MULTIMEM_DRIVER` (in child processes:
//! the environment is process-wide) and the cudarc operands of the collectives. Every bad input
//! must be an error naming the option or argument — never a panic, a hang, a value silently
//! wrapped into range, or a silent fall back to the simulator.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use cuda_multimem::{DeviceBuffer, Driver, Error, DRIVER_ENV};
use cuda_multimem_sim::{ConfigError, SimConfig, Simulator, StartError};
use cuda_multimem_sys::{CUresult, LoadError, LIBRARY_ENV, SYMBOLS};
use cuda_multimem_tests::{env, sim, skip};

/// The option an `InvalidValue` names, or a panic saying what came instead.
fn invalid_key<T: std::fmt::Debug>(input: &str, r: Result<T, ConfigError>) -> String {
    let e = r.expect_err(input);
    match &e {
        ConfigError::InvalidValue { key, .. } => {
            assert!(e.to_string().contains(&format!("`{key}`")), "{input}: {e}");
            key.clone()
        }
        other => panic!("{input}: expected ConfigError::InvalidValue, got {other:?}"),
    }
}

#[test]
fn sim_option_values_beyond_their_fields_are_errors_naming_the_option_not_wrapped_into_range() {
    for (input, key) in [
        // 2^32 + 12000 is not version 12000, 2^32 - 1 is not "no NUMA" (-1), 2^32 + 1 is not 1
        ("version=4294979296", "version"),
        ("numa=4294967295", "numa"),
        ("numa_nodes=4294967297", "numa_nodes"),
        // 2^44 MiB is not 0 bytes, i64::MAX MiB is not 2^64 - 1 MiB
        ("memory_mib=17592186044416", "memory_mib"),
        ("memory_mib=9223372036854775807", "memory_mib"),
        // -2^63 is not the power of two 2^63, nor is -4096 a granularity
        ("granularity=-9223372036854775808", "granularity"),
        ("granularity=-4096", "granularity"),
        // a host NUMA id is -1 or a node; a node count is not negative, and its error names it
        ("numa=-5", "numa"),
        ("numa_nodes=-3", "numa_nodes"),
        ("numa_nodes=-3,numa=-1", "numa_nodes"),
    ] {
        assert_eq!(invalid_key(input, SimConfig::parse(input)), key, "{input}");
        match cuda_multimem_sim::driver_from_selection(&format!("sim:{input}")) {
            Err(Error::Config(msg)) => {
                assert!(msg.contains(&format!("`{key}`")), "{input}: {msg}")
            }
            other => panic!("{input}: expected a configuration error, got {other:?}"),
        }
    }
    // The largest values that do fit still parse.
    let c = SimConfig::parse("memory_mib=17592186044415,numa=-1,numa_nodes=0").unwrap();
    assert_eq!(c.devices[0].memory, 17592186044415 << 20);
}

#[test]
fn a_repeated_sim_option_takes_its_last_value_the_device_count_too() {
    let c = SimConfig::parse("version=12000,version=13030").unwrap();
    assert_eq!(c.version, 13030);
    // `sim:$BASE,devices=4` must override the base's count, as it overrides any other option.
    let c = SimConfig::parse("devices=2,version=12080,devices=4").unwrap();
    assert_eq!((c.devices.len(), c.version), (4, 12080));
    let c = SimConfig::parse("devices=4,cliques=2,devices=2").unwrap();
    let cliques: Vec<_> = c.devices.iter().map(|d| d.clique).collect();
    assert_eq!(cliques, [0, 0]);
    let key = invalid_key("", SimConfig::parse("devices=4,devices=0"));
    assert_eq!(key, "devices");
}

#[test]
fn odd_sim_option_strings_never_panic_and_each_error_names_its_option() {
    let long_key = "k".repeat(100_000);
    let long = format!("{long_key}=1");
    for (input, names) in [
        ("", None),
        (",, ,", None),
        (" devices = 3 ,, version = 12080 ", None),
        ("=", Some("``")),
        ("=2", Some("``")),
        ("devices=", Some("`devices`")),
        ("devices=-1", Some("`devices`")),
        ("devices=99999999999999999999999", Some("`devices`")),
        ("devices=100000", Some("`devices`")),
        ("devices=２", Some("`devices`")),
        ("devices=2\0", Some("`devices`")),
        ("version=", Some("`version`")),
        ("version=-1", Some("`version`")),
        ("version=0", Some("`version`")),
        ("version=99999", Some("`version`")),
        ("version=-9223372036854775809", Some("`version`")),
        ("vmm=", Some("`vmm`")),
        ("cliques=-1", Some("`cliques`")),
        ("granularity=0", Some("`granularity`")),
        ("memory_mib=0", Some("`memory_mib`")),
        ("ready_polls=x", Some("`ready_polls`")),
        ("ünïcødé=1", Some("`ünïcødé`")),
        ("version==13000", Some("`version`")),
        ("a=b=c", Some("`a`")),
        ("devices", Some("`devices`")),
        (long.as_str(), Some(long_key.as_str())),
    ] {
        let r = std::panic::catch_unwind(|| SimConfig::parse(input))
            .unwrap_or_else(|_| panic!("SimConfig::parse({input:?}) panicked"));
        match (r, names) {
            (Ok(c), None) => assert!(c.validate().is_ok(), "{input:?}"),
            (Err(e), Some(n)) => assert!(e.to_string().contains(n), "{input:?}: {e}"),
            (r, _) => panic!("{input:?}: {r:?}"),
        }
    }
}

#[test]
fn a_machine_of_no_or_100000_devices_or_a_bad_version_or_numa_does_not_start() {
    let key = |c: SimConfig| match Simulator::start(c) {
        Err(StartError::Config(ConfigError::InvalidValue { key, .. })) => key,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    for n in [0, 73, 100_000] {
        assert_eq!(key(SimConfig::new(n, 13030)), "devices", "{n} devices");
    }
    for v in [0, -1, 99_999, 12_005, 11_080, i32::MIN, i32::MAX] {
        assert_eq!(key(SimConfig::new(2, v)), "version", "version {v}");
    }
    let mut c = SimConfig::new(2, 13030);
    c.devices[1].host_numa_id = -7;
    assert_eq!(key(c), "numa");
    let mut c = SimConfig::new(2, 13030).with_all(|d| d.host_numa_id = -1);
    c.host_numa_nodes = -1;
    assert_eq!(key(c), "numa_nodes");
    match cuda_multimem_sim::simulated_driver(SimConfig::new(0, 13030)) {
        Err(Error::Config(msg)) => assert!(msg.contains("`devices`"), "{msg}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn an_allocation_near_usize_max_is_out_of_memory_not_an_internal_failure() {
    let e = sim(SimConfig::new(2, 13030));
    let dev = e.driver.device(0).unwrap();
    // Something already allocated: the simulator's used + requested must not overflow.
    let _held = DeviceBuffer::<u8>::zeroed(&dev, 4096).unwrap();
    for len in [usize::MAX, usize::MAX - 4095] {
        match DeviceBuffer::<u8>::zeroed(&dev, len) {
            Err(Error::Driver { call, code }) => {
                assert!(call.starts_with("cuMemAlloc"), "{call}");
                assert_eq!(code, CUresult::CUDA_ERROR_OUT_OF_MEMORY, "{len} bytes");
            }
            other => panic!("{len} bytes: expected out of memory, got {other:?}"),
        }
    }
}

#[test]
fn a_symbol_or_abi_the_headers_lack_is_an_error_naming_it_without_asking_the_driver() {
    let e = sim(SimConfig::new(2, 13030));
    let s = e.sim.as_ref().unwrap();
    let d = e.driver.sys();
    let asked = s.proc_address_requests();
    for (name, abi) in [
        ("cuNoSuchFunction", 12000),
        ("cuInit", 12345),
        ("", 2000),
        ("cuInit\0", 2000),
    ] {
        match d.availability(name, abi) {
            Err(err @ LoadError::NotInHeaders { .. }) => {
                let msg = err.to_string();
                assert!(
                    msg.contains(&format!("`{name}`")) && msg.contains(&abi.to_string()),
                    "{msg}"
                );
            }
            other => panic!("{name}@{abi}: expected NotInHeaders, got {other:?}"),
        }
    }
    assert_eq!(s.proc_address_requests(), asked, "the driver was asked");
    for index in [SYMBOLS.len(), SYMBOLS.len() + 1, usize::MAX] {
        match d.raw(index) {
            Err(err @ LoadError::NotInHeaders { .. }) => {
                assert!(err.to_string().contains(&index.to_string()), "{err}")
            }
            other => panic!("row {index}: expected NotInHeaders, got {other:?}"),
        }
    }
    assert_eq!(s.proc_address_requests(), asked, "the driver was asked");
    assert!(d.availability("cuInit", 2000).is_ok());
}

#[test]
fn paths_that_are_not_shared_libraries_are_errors_naming_the_path() {
    let text = std::env::temp_dir().join(format!("cmm-hostile-{}.so", std::process::id()));
    std::fs::write(&text, "not an ELF file\n").unwrap();
    let text_path = text.display().to_string();
    for path in ["/", "/dev/null", text_path.as_str(), "lib\0cuda.so.1"] {
        match cuda_multimem_sys::Driver::load_from(path) {
            Err(LoadError::LibraryNotFound { tried }) => {
                assert_eq!(tried.len(), 1, "{tried:?}");
                assert_eq!(tried[0].0, path);
                assert!(!tried[0].1.is_empty(), "{tried:?}");
            }
            other => panic!("{path:?}: expected LibraryNotFound, got {other:?}"),
        }
    }
    let _ = std::fs::remove_file(&text);
}

/// Marks the child process in which a test reads `CUDA_MULTIMEM_DRIVER`/`CUDA_MULTIMEM_LIBCUDA`.
const CHILD: &str = "CMM_TEST_HOSTILE_SIM_CHILD";

/// Run `test` in a child process of this test binary with `vars` set (`None`: removed) and
/// `CHILD` set to `case`; it must pass.
fn in_child(test: &str, case: &str, vars: &[(&str, Option<&OsStr>)]) {
    let mut cmd = cuda_multimem_tests::child_test(test);
    cmd.env(CHILD, case);
    for (k, v) in vars {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cuda_multimem_tests::assert_child_passes(cmd, &format!("{test} [{case}] in a child process"));
}

fn config_error(who: &str, r: Result<Driver, Error>, needles: &[&str]) {
    match r {
        Err(Error::Config(msg)) => {
            for n in needles {
                assert!(msg.contains(n), "{who}: `{n}` missing from: {msg}");
            }
        }
        other => panic!("{who}: expected Error::Config, got {other:?}"),
    }
}

fn library_not_found(who: &str, r: Result<Driver, Error>, path: &str) {
    match r {
        Err(Error::Load(LoadError::LibraryNotFound { tried })) => {
            assert_eq!(tried.len(), 1, "{who}: {tried:?}");
            assert_eq!(tried[0].0, path, "{who}");
        }
        Err(Error::Load(e @ LoadError::NotADriver { .. })) => {
            assert!(e.to_string().contains(path), "{who}: {e}")
        }
        other => panic!("{who}: expected the library at {path} to fail, got {other:?}"),
    }
}

#[test]
fn garbage_in_the_driver_variables_is_an_error_naming_them_and_never_the_simulator() {
    let test = "sim::hostile::garbage_in_the_driver_variables_is_an_error_naming_them_and_never_the_simulator";
    let Some(case) = std::env::var_os(CHILD) else {
        let bytes = OsStr::from_bytes(b"sim:devices=\xff\xfe");
        let os = |s: &'static str| Some(OsStr::new(s));
        in_child(test, "not-utf8", &[(DRIVER_ENV, Some(bytes))]);
        in_child(test, "sim", &[(DRIVER_ENV, os("sim:devices=2"))]);
        in_child(test, "bogus", &[(DRIVER_ENV, os("cüda\u{1F600}"))]);
        in_child(
            test,
            "sim-bad",
            &[(DRIVER_ENV, os("sim:version=4294979296"))],
        );
        for (case, driver) in [("cuda", os("cuda")), ("unset", None)] {
            for lib in ["/nonexistent/libcuda.so.1", "/dev/null", "libm.so.6"] {
                let c = format!("{case}:{lib}");
                in_child(test, &c, &[(DRIVER_ENV, driver), (LIBRARY_ENV, os(lib))]);
            }
        }
        return;
    };
    let case = case.to_str().unwrap();
    let lib = || case.split_once(':').unwrap().1;
    let sim_hint = "cuda_multimem_sim::driver_from_env()";
    match case {
        "not-utf8" => {
            config_error("Driver", Driver::from_env(), &[DRIVER_ENV, "UTF-8"]);
            let r = cuda_multimem_sim::driver_from_env();
            config_error("sim", r, &[DRIVER_ENV, "UTF-8"]);
        }
        "sim" => config_error("Driver", Driver::from_env(), &[DRIVER_ENV, sim_hint]),
        "bogus" => {
            let want = [DRIVER_ENV, "cüda\u{1F600}", "expected"];
            config_error("Driver", Driver::from_env(), &want);
            config_error("sim", cuda_multimem_sim::driver_from_env(), &want);
        }
        "sim-bad" => {
            config_error("Driver", Driver::from_env(), &[sim_hint]);
            let r = cuda_multimem_sim::driver_from_env();
            config_error("sim", r, &[DRIVER_ENV, "`version`", "4294979296"]);
        }
        c if c.starts_with("cuda:") || c.starts_with("unset:") => {
            library_not_found("Driver", Driver::from_env(), lib());
            library_not_found("sim", cuda_multimem_sim::driver_from_env(), lib());
            library_not_found("load", Driver::load(), lib());
        }
        c => panic!("unknown case {c}"),
    }
}

/// cudarc talks to the real driver only: these run under test-hw and skip on the simulator.
fn two_real_gpus(test: &str) -> Option<Vec<cuda_multimem::Device>> {
    let e = env();
    if e.sim.is_some() || e.driver.is_simulated() {
        skip(
            test,
            "cudarc talks to the real driver only; test-hw runs this on the GPUs",
        );
        return None;
    }
    let devices = e.driver.devices();
    if devices.len() < 2 || !devices[0].can_access_peer(&devices[1]).unwrap_or(false) {
        skip(test, "needs two GPUs that reach each other");
        return None;
    }
    Some(devices)
}

#[test]
fn cudarc_slices_of_another_device_are_refused_naming_the_operand() {
    use cuda_multimem_collectives::{Communicator, MulticastPolicy, ReduceOp};
    use cudarc::driver::CudaContext;
    let Some(devices) = two_real_gpus("cudarc_slice_device") else {
        return;
    };
    let comm = Communicator::builder(&devices[..2])
        .multicast(MulticastPolicy::Never)
        .build()
        .unwrap();
    let s0 = CudaContext::new(0).unwrap().new_stream().unwrap();
    let s1 = CudaContext::new(1).unwrap().new_stream().unwrap();
    let mine_in = s0.clone_htod(&vec![1.0f32; 64]).unwrap();
    let mut mine_out = s0.alloc_zeros::<f32>(64).unwrap();
    let mut theirs = s1.clone_htod(&vec![7.0f32; 64]).unwrap();
    let h = comm.rank(0).unwrap();
    let arg = |r: cuda_multimem::Result<_>| match r {
        Err(Error::InvalidArgument { arg, reason }) => {
            assert!(reason.contains("device 1"), "{reason}");
            arg
        }
        other => panic!("expected an invalid argument, got {other:?}"),
    };
    assert_eq!(
        arg(h.all_reduce_cudarc(&theirs, &mut mine_out, ReduceOp::Sum, &s0)),
        "input"
    );
    assert_eq!(
        arg(h.all_reduce_cudarc(&mine_in, &mut theirs, ReduceOp::Sum, &s0)),
        "output"
    );
    assert_eq!(
        arg(h.all_reduce_cudarc_in_place(&mut theirs, ReduceOp::Sum, &s0)),
        "buf"
    );
    // A view of another device's slice is refused as well.
    let view = theirs.slice(8..16);
    assert_eq!(
        arg(h.all_reduce_cudarc(&view, &mut mine_out, ReduceOp::Sum, &s0)),
        "input"
    );
    // Nothing ran: the other device's data is untouched, ours too.
    assert_eq!(s1.clone_dtoh(&theirs).unwrap(), [7.0f32; 64]);
    assert_eq!(s0.clone_dtoh(&mine_in).unwrap(), [1.0f32; 64]);
    assert_eq!(s0.clone_dtoh(&mine_out).unwrap(), [0.0f32; 64]);
}

/// `SimConfig::new` with an absurd device count describes a machine `start` refuses, instead
/// of building a description per device asked for (capacity overflow, or out of memory).
#[test]
fn a_sim_config_of_usize_max_devices_is_refused_not_an_abort() {
    for n in [73, 100_000, usize::MAX] {
        let c = cuda_multimem_sim::SimConfig::new(n, 13000);
        assert!(
            matches!(
                c.validate(),
                Err(cuda_multimem_sim::ConfigError::InvalidValue { ref key, .. }) if key == "devices"
            ),
            "{n} devices"
        );
    }
}

/// A failure plan whose code is `CUDA_SUCCESS` is no failure: the call does its work (armed,
/// it skipped the work and reported success, so the buffer's address was never written).
#[test]
fn a_failure_plan_of_cuda_success_leaves_calls_doing_their_work() {
    let e = sim(SimConfig::new(1, 13000));
    let s = e.sim.as_ref().unwrap();
    let d = e.driver.device(0).unwrap();
    s.inject_failure(cuda_multimem_sim::FailurePlan {
        call: Some("cuMemAlloc".into()),
        skip: 0,
        code: CUresult::CUDA_SUCCESS,
    });
    let b = DeviceBuffer::<u32>::from_host(&d, &[1, 2, 3, 4]).unwrap();
    assert_ne!(b.device_ptr(), 0);
    assert_eq!(b.to_vec().unwrap(), [1, 2, 3, 4]);
    assert_eq!(s.clear_failure(), None, "nothing was failed");
}
