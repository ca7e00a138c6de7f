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

/// Why the collectives cannot run on `driver` (its version below what their PTX needs: CUDA
/// 12.1, PTX ISA 8.1 — a communicator refuses to build there, `Error::HardwareTooOld`), if so.
/// The tests of the collectives that run at every simulated driver version skip with it; the
/// refusal itself is a test of its own.
pub fn collectives_unsupported(driver: &cuda_multimem::Driver) -> Option<String> {
    (driver.version() < 12010).then(|| {
        format!(
            "the collectives' kernels need a CUDA 12.1 driver or newer (PTX ISA 8.1); this driver is {}",
            driver.version()
        )
    })
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
        cuda_multimem_collectives::testing::random_input(len, &mut self.0)
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
        _ => 0.0,
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
/// `config` (a default timeout made [`generous`]) and `policy`, and a stream per rank (on its
/// rank's device).
pub fn team_on(
    devices: &[cuda_multimem::Device],
    config: cuda_multimem_collectives::CommConfig,
    policy: cuda_multimem_collectives::MulticastPolicy,
) -> (Communicator, Vec<cuda_multimem::Stream>) {
    let repeats = devices
        .iter()
        .enumerate()
        .any(|(i, d)| devices[..i].contains(d));
    let comm = Communicator::builder(devices)
        .config(generous(config))
        .multicast(policy)
        .allow_shared_devices(repeats)
        .build()
        .unwrap_or_else(|e| panic!("a team of {} devices builds: {e}", devices.len()));
    let s = devices
        .iter()
        .map(|d| cuda_multimem::Stream::new(d).expect("a stream"))
        .collect();
    (comm, s)
}

/// `n` ranks placed round-robin on the devices of `e` (rank r on device r mod G), so a team of
/// any size runs on any machine — several ranks sharing a GPU where it has fewer (the real
/// kernels of a team of 8 on one GPU). Where the devices cannot all reach each other, every rank
/// goes to device 0.
pub fn placed(e: &Env, n: usize) -> Vec<cuda_multimem::Device> {
    let mut d = e.driver.devices();
    let peers = d
        .iter()
        .skip(1)
        .all(|p| d[0].can_access_peer(p).unwrap_or(false));
    if !peers {
        d.truncate(1);
    }
    (0..n).map(|r| d[r % d.len()].clone()).collect()
}

/// The barrier timeout of the suite's teams where a test leaves `CommConfig::timeout` at its
/// default: generous, so that no timeout a test does not expect fires on a loaded machine (a
/// wait that ends normally costs nothing more; a test that expects a timeout sets its own).
pub const TEAM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// `config` with [`TEAM_TIMEOUT`] where its timeout is the default.
pub fn generous(
    config: cuda_multimem_collectives::CommConfig,
) -> cuda_multimem_collectives::CommConfig {
    let default = cuda_multimem_collectives::CommConfig::default().timeout;
    if config.timeout == default {
        cuda_multimem_collectives::CommConfig {
            timeout: TEAM_TIMEOUT,
            ..config
        }
    } else {
        config
    }
}

/// A simulated team of `n` devices (driver 13000, peer-to-peer only) built with `config` (a
/// default timeout made [`generous`]), and a stream per rank.
pub fn sim_team(
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

/// A held kernel's parameter is this bit and the hold's id ([`Hold::param`]).
pub const HOLD_BIT: u64 = 1 << 63;

/// How long a hold holds at most (then the kernel ends by itself: a test that forgot to release
/// it fails on its own terms, it does not hang).
pub const HOLD_MAX: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Default)]
struct HoldState {
    started: std::sync::atomic::AtomicBool,
    released: std::sync::atomic::AtomicBool,
}

/// Every hold's state, by id.
static HOLDS: std::sync::Mutex<Vec<std::sync::Arc<HoldState>>> = std::sync::Mutex::new(Vec::new());

/// A simulated kernel that runs until the test releases it: what tests use on the simulator
/// where they would otherwise count on a kernel of a fixed duration still running (or having
/// started) when the host gets to its next step — which a loaded machine does not promise. A
/// host kernel equivalent takes [`Hold::param`] where it takes a duration and passes it to
/// [`sleep_or_hold`]. Never give a hold's parameter to a real GPU's kernel: it would take it
/// for nanoseconds. Released when dropped.
pub struct Hold {
    id: usize,
}

impl Hold {
    /// A new hold, not started, not released.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Hold {
        let mut h = HOLDS.lock().unwrap();
        h.push(std::sync::Arc::new(HoldState::default()));
        Hold { id: h.len() - 1 }
    }

    fn state(&self) -> std::sync::Arc<HoldState> {
        HOLDS.lock().unwrap()[self.id].clone()
    }

    /// The kernel parameter that makes [`sleep_or_hold`] hold on this hold.
    pub fn param(&self) -> u64 {
        HOLD_BIT | self.id as u64
    }

    /// Wait until the held kernel has started (it marks that once it got past whatever it does
    /// first); panics after [`HOLD_MAX`].
    pub fn wait_started(&self) {
        let s = self.state();
        let t = std::time::Instant::now();
        while !s.started.load(std::sync::atomic::Ordering::Acquire) {
            assert!(t.elapsed() < HOLD_MAX, "the held kernel never started");
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Let the held kernel end.
    pub fn release(&self) {
        self.state()
            .released
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

/// In a host kernel equivalent: sleep `ns` nanoseconds, or, where `ns` is a [`Hold::param`],
/// mark that hold started and block until it is released (at most [`HOLD_MAX`]).
pub fn sleep_or_hold(ns: u64) {
    if ns & HOLD_BIT == 0 {
        std::thread::sleep(std::time::Duration::from_nanos(ns));
        return;
    }
    let s = HOLDS.lock().unwrap()[(ns & !HOLD_BIT) as usize].clone();
    s.started.store(true, std::sync::atomic::Ordering::Release);
    let t = std::time::Instant::now();
    while !s.released.load(std::sync::atomic::Ordering::Acquire) && t.elapsed() < HOLD_MAX {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Holds simulated streams until the host opens it: work queued behind [`Gate::hold`] starts
/// only at [`Gate::open`], so every rank's kernels of a call start together however long the
/// host took to queue them (on a loaded machine, longer than a short barrier timeout meant for
/// a peer that never comes). Simulator only: a held host kernel ([`Hold`]) on a stream of the
/// gate's own, and the held streams wait for an event recorded after it.
pub struct Gate {
    function: cuda_multimem::Function,
    stream: cuda_multimem::Stream,
    event: cuda_multimem::Event,
    holds: std::sync::Mutex<Vec<Hold>>,
    _module: cuda_multimem::Module,
}

const GATE_PTX: &str = ".version 7.0
.target sm_70
.address_size 64

.visible .entry cmm_test_gate(
	.param .u64 p_hold
)
{
	ret;
}
";

impl Gate {
    /// A gate on `env`'s simulated device 0 (its module, stream and event live as long as it:
    /// make it before counting a simulator's live resources).
    pub fn new(env: &Env) -> Gate {
        assert!(env.sim.is_some(), "a gate holds simulated streams only");
        cuda_multimem_sim::register_kernel("cmm_test_gate", |a| {
            sleep_or_hold(a.u64(0)?);
            Ok(())
        });
        let d = env.driver.device(0).expect("device 0");
        let module = cuda_multimem::Module::load_ptx(&d, GATE_PTX).expect("the gate's module");
        Gate {
            function: module.function("cmm_test_gate").expect("the gate kernel"),
            stream: cuda_multimem::Stream::new(&d).expect("the gate's stream"),
            event: cuda_multimem::Event::new(&d, false).expect("the gate's event"),
            holds: std::sync::Mutex::new(Vec::new()),
            _module: module,
        }
    }

    /// Close the gate and make every stream of `streams` wait for it: what they are given next
    /// starts at [`Gate::open`].
    pub fn hold(&self, streams: &[cuda_multimem::Stream]) {
        let hold = Hold::new();
        // SAFETY: the gate kernel takes one .u64 parameter and touches no memory.
        unsafe {
            self.function
                .launch_u64(
                    &cuda_multimem::LaunchConfig::linear(1, 1),
                    &self.stream,
                    &[hold.param()],
                )
                .expect("the gate's launch")
        };
        self.event.record(&self.stream).expect("the gate's event");
        for s in streams {
            s.wait(&self.event).expect("a stream waits for the gate");
        }
        self.holds.lock().unwrap().push(hold);
    }

    /// Open the gate: the held streams go on.
    pub fn open(&self) {
        self.holds.lock().unwrap().clear();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
        let _ = self.stream.synchronize();
    }
}

/// The simulated driver version `CUDA_MULTIMEM_DRIVER` selects (`sim:...,version=V`; `cargo
/// xtask test` runs the suite at each), else 13000: for tests that make simulated machines of
/// their own (as many devices as they need) at the version under test.
pub fn sim_version() -> i32 {
    std::env::var(DRIVER_ENV)
        .ok()
        .and_then(|v| {
            v.split([':', ','])
                .find_map(|kv| kv.trim().strip_prefix("version=")?.parse().ok())
        })
        .unwrap_or(13000)
}
