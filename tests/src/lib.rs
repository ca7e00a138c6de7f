//! The harness of the workspace suite: which driver a test runs on, honest skips, the one
//! random generator, the one place a team is built ([`team_on`]), and the collectives as a
//! table ([`collectives`]) that the suite's correctness, graph-replay and hostile tests iterate.
//!
//! `CUDA_MULTIMEM_DRIVER` decides: `sim[:options]` runs on the simulated driver (what
//! `cargo xtask test` sets, once per driver version), `cuda` on the real one (`cargo xtask
//! test-hw`). When it is unset, the suite runs on the simulator and says so once — the library
//! itself never falls back on its own; this harness does, because it is test tooling.

use std::sync::Once;

pub mod collectives;

use cuda_multimem::{DeviceBuffer, DeviceRepr, Driver, DRIVER_ENV};
use cuda_multimem_collectives::Communicator;
use cuda_multimem_sim::{SimConfig, Simulator};

/// The default simulated machine when `CUDA_MULTIMEM_DRIVER` is unset.
pub const DEFAULT_SIM: &str = "devices=2,version=13030";

/// The driver a test runs on, and the simulator behind it when it is simulated.
pub struct Env {
    /// The driver.
    pub driver: Driver,
    /// The simulator, when the driver is simulated (for failure injection and accounting).
    pub sim: Option<Simulator>,
}

static NOTE: Once = Once::new();

/// The driver chosen by `CUDA_MULTIMEM_DRIVER` (the simulator when unset, said once).
pub fn env() -> Env {
    let sel = std::env::var(DRIVER_ENV).unwrap_or_default();
    let options = if sel.is_empty() {
        NOTE.call_once(|| eprintln!("note: {DRIVER_ENV} is unset; the suite runs on the simulated driver ({DEFAULT_SIM})"));
        Some(DEFAULT_SIM.to_string())
    } else {
        sel.strip_prefix("sim")
            .map(|r| r.trim_start_matches(':').to_string())
    };
    match options {
        Some(o) => {
            cuda_multimem_collectives::sim::install();
            let sim = Simulator::start(SimConfig::parse(&o).expect("valid simulator options"))
                .expect("simulator starts");
            let driver = cuda_multimem_sim::driver_over(&sim).expect("driver over the simulator");
            Env {
                driver,
                sim: Some(sim),
            }
        }
        None => Env {
            driver: Driver::from_env().expect("the driver named by CUDA_MULTIMEM_DRIVER loads"),
            sim: None,
        },
    }
}

/// A simulated machine started for one test, whatever `CUDA_MULTIMEM_DRIVER` says.
pub fn sim(config: SimConfig) -> Env {
    cuda_multimem_collectives::sim::install();
    let sim = Simulator::start(config).expect("simulator starts");
    let driver = cuda_multimem_sim::driver_over(&sim).expect("driver over the simulator");
    Env {
        driver,
        sim: Some(sim),
    }
}

/// [`sim`] with random delays of up to `max` (drawn from `seed`) before every kernel launch and
/// every delay point inside the simulated kernels (`Simulator::set_kernel_delays`), so devices
/// drift apart and protocol races show.
pub fn sim_delayed(config: SimConfig, max: std::time::Duration, seed: u64) -> Env {
    let e = sim(config);
    e.sim
        .as_ref()
        .expect("a simulated environment")
        .set_kernel_delays(max, seed);
    e
}

/// Print a skip line that `cargo xtask test`/`test-hw` collect and report as skipped (never as
/// passed). Use: `if let Some(r) = why_not { return skip("name", r) }`.
pub fn skip(test: &str, reason: impl std::fmt::Display) {
    eprintln!("SKIPPED: {test}: {reason}");
}

/// Random data: a small, seeded xorshift generator (tests need reproducible, non-trivial data).
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed` (0 is replaced by a fixed constant).
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// A float in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `len` random elements in [-1, 1) (the values of the collectives' `random_input` for
    /// this generator's state).
    pub fn input<T: cuda_multimem_collectives::Element>(&mut self, len: usize) -> Vec<T> {
        cuda_multimem_collectives::random_input(len, &mut self.0)
    }
    /// Fill `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// `len` random bytes from a generator seeded with `seed`.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

/// Fail each driver call `attempt` makes, one per round (`CUDA_ERROR_OUT_OF_MEMORY`, the n-th
/// call in round n), until a round makes no call that fails. A round with an injected failure
/// must return an error and leave the simulator's live resources as they were before it; a round
/// without one must succeed, pass `on_success`, and once its value is dropped leave them as they
/// were too. Returns how many failures were injected (callers assert a floor, so a construction
/// that stops reaching the driver shows). Run `attempt` once beforehand, so that the loader has
/// resolved every entry point (a failed `cuGetProcAddress` would be cached, which is not what
/// these rounds are about).
pub fn fail_each_call<T, E: std::fmt::Display>(
    sim: &Simulator,
    mut attempt: impl FnMut() -> Result<T, E>,
    on_success: impl FnOnce(&T),
) -> usize {
    use cuda_multimem_sys::CUresult;
    let initial = sim.live_resources();
    let mut injected = 0;
    for skip in 0.. {
        sim.inject_failure(cuda_multimem_sim::FailurePlan {
            call: None,
            skip,
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        });
        let r = attempt();
        let fired = sim.clear_failure();
        match (r, fired) {
            (Ok(v), None) => {
                on_success(&v);
                drop(v);
                assert_eq!(
                    sim.live_resources(),
                    initial,
                    "left over after the clean round"
                );
                return injected;
            }
            (Err(_), Some(f)) => {
                injected += 1;
                assert_eq!(
                    sim.live_resources(),
                    initial,
                    "after failing {f} (call #{skip})"
                );
            }
            (Ok(_), Some(f)) => panic!("succeeded although {f} failed"),
            (Err(err), None) => panic!("failed without an injected failure: {err}"),
        }
    }
    unreachable!("the rounds end with a clean one")
}

/// Where a sum of `n` ranks' elements of `dtype` reduced in some order other than rank order
/// (`got`, raw little-endian) is further from the rank-order reference `want` than reordering
/// allows for inputs in [-1, 1) scaled by at most 2^11: the f32 accumulation's rounding (n²
/// ulps of the largest partial sum) plus one rounding step of the stored type. `None` when every
/// element is within it.
pub fn first_beyond_sum_tolerance(
    dtype: cuda_multimem_collectives::DType,
    n: usize,
    got: &[u8],
    want: &[u8],
) -> Option<String> {
    use cuda_multimem_collectives::DType;
    let ulp_of_type = match dtype {
        DType::F32 => f32::EPSILON,
        DType::F16 => 1.0 / 1024.0,
        DType::Bf16 => 1.0 / 128.0,
    };
    (0..want.len() / dtype.size()).find_map(|i| {
        let (g, w) = (dtype.load(got, i), dtype.load(want, i));
        let tol = n as f32 * n as f32 * f32::EPSILON * 2048.0 + w.abs() * ulp_of_type;
        (g.is_nan() != w.is_nan() || (g - w).abs() > tol)
            .then(|| format!("element {i}: got {g} want {w} (tolerance {tol})"))
    })
}

/// One zeroed `DeviceBuffer` of `count` elements on each rank's device of `comm`, by rank (the
/// caller's own memory, as operands of the collectives).
pub fn zeroed_per_rank<T: DeviceRepr>(comm: &Communicator, count: usize) -> Vec<DeviceBuffer<T>> {
    (0..comm.size())
        .map(|r| DeviceBuffer::zeroed(comm.device(r).unwrap(), count).unwrap())
        .collect()
}

/// A command running only `test` (its full path, `module::name`, ignored or not) of this test
/// binary in a child process, one thread, output not captured: for the tests that need a
/// process of their own (another rank, a fresh environment, a fresh simulator).
pub fn child_test(test: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("this test binary"));
    cmd.args([
        "--exact",
        test,
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// Run `cmd` (a [`child_test`]) to its end; it must exit successfully having passed its one
/// test, else the test fails with `what` and the child's output.
pub fn assert_child_passes(mut cmd: std::process::Command, what: &str) {
    let out = cmd.output().expect("the child test process runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{what} failed:\n{text}"
    );
}

/// The one place the suite builds a team of the local devices: a communicator over `devices`
/// (by rank; a device may repeat, for ranks that share a GPU where the library allows it) with
/// `config` and `policy`, and a stream per rank (on its rank's device).
pub fn team_on(
    devices: &[cuda_multimem::Device],
    config: cuda_multimem_collectives::CommConfig,
    policy: cuda_multimem_collectives::MulticastPolicy,
) -> (Communicator, Vec<cuda_multimem::Stream>) {
    let comm = Communicator::builder(devices)
        .config(config)
        .multicast(policy)
        .build()
        .unwrap_or_else(|e| panic!("a team of {} devices builds: {e}", devices.len()));
    let s = devices
        .iter()
        .map(|d| cuda_multimem::Stream::new(d).expect("a stream"))
        .collect();
    (comm, s)
}

/// A simulated team of `n` devices (driver 13000, peer-to-peer only) built with `config` as
/// it is, and a stream per rank.
pub fn sim_team_as_is(
    n: usize,
    config: cuda_multimem_collectives::CommConfig,
) -> (Env, Communicator, Vec<cuda_multimem::Stream>) {
    let e = sim(SimConfig::new(n, 13000));
    let (comm, s) = team_on(
        &e.driver.devices(),
        config,
        cuda_multimem_collectives::MulticastPolicy::Never,
    );
    (e, comm, s)
}

/// [`sim_team_as_is`] with a 300 ms timeout (a test that waits on one waits briefly).
pub fn sim_team(
    n: usize,
    config: cuda_multimem_collectives::CommConfig,
) -> (Env, Communicator, Vec<cuda_multimem::Stream>) {
    sim_team_as_is(
        n,
        cuda_multimem_collectives::CommConfig {
            timeout: std::time::Duration::from_millis(300),
            ..config
        },
    )
}

/// Wait for every stream of `streams`.
pub fn sync_all(streams: &[cuda_multimem::Stream]) {
    for s in streams {
        s.synchronize().expect("the stream synchronises");
    }
}

/// The argument an `Error::InvalidArgument` names (anything else fails the test).
pub fn invalid_arg_of<T: std::fmt::Debug>(r: cuda_multimem::Result<T>) -> &'static str {
    match r {
        Err(cuda_multimem::Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}
