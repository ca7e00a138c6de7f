//! `cargo xtask test`: the workspace's unit and doc tests, the MPI runs, and the suite on the
//! simulated driver: by default all of it at [`FULL_VERSION`] and, at each of [`OTHER_VERSIONS`],
//! only the tests whose behaviour depends on the driver version ([`VERSION_DEPENDENT`]);
//! `--versions a,b` runs all of it at each version named.

use std::process::{Command, Stdio};

use crate::{workspace_root, Result};

/// The driver version the whole suite runs at by default: the newest the simulator models, the
/// one with every function of the table.
pub const FULL_VERSION: i32 = 13050;

/// The other driver versions of the default run, each a different function table (12080: the
/// first `cuMemcpyBatchAsync`; 13000: its second ABI and the managed-memory batch calls; 13030:
/// logical endpoints; 12000: none of these): only [`VERSION_DEPENDENT`] runs there.
pub const OTHER_VERSIONS: [i32; 4] = [12000, 12080, 13000, 13030];

/// The suite's version-dependent tests: a test runs at every version of the default run when its
/// name starts with one of these. Why each:
/// - `safe::`: the safe layer over the loader; which entry points resolve, at which ABI, and
///   which way the wrappers go (batch copies, managed memory, endpoints) is the version's.
/// - `sim::`: the simulator itself, whose function table and refusals follow the version.
/// - `collectives::multimem::`: the multicast path, whose setup (multicast objects, logical
///   endpoints on 13.3+) the version decides.
/// - `collectives::smoke::`: every collective once at small sizes, so a collective that breaks
///   on an older driver's table shows there without its whole matrix running at each version.
///
/// Every entry must select at least one test (checked before anything runs), so a rename in the
/// suite cannot silently drop tests from the older versions.
pub const VERSION_DEPENDENT: [&str; 4] = [
    "safe::",
    "sim::",
    "collectives::multimem::",
    "collectives::smoke::",
];

/// Which tests of the suite one run takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The whole suite (and the tests crate's other targets).
    Whole,
    /// [`VERSION_DEPENDENT`] only.
    VersionDependent,
}

/// The runs of the suite: (driver version, selection). Empty `versions`: the default plan.
pub fn plan(versions: &[i32]) -> Vec<(i32, Selection)> {
    if versions.is_empty() {
        std::iter::once((FULL_VERSION, Selection::Whole))
            .chain(OTHER_VERSIONS.map(|v| (v, Selection::VersionDependent)))
            .collect()
    } else {
        versions.iter().map(|&v| (v, Selection::Whole)).collect()
    }
}

/// The names of `--list --format=terse` output (`name: test` lines).
pub fn listed_tests(list: &str) -> Vec<String> {
    list.lines()
        .filter_map(|l| l.trim_end().strip_suffix(": test"))
        .map(str::to_string)
        .collect()
}

/// How many of `tests` each filter selects (name starts with it); an error naming every filter
/// that selects none.
pub fn check_filters(filters: &[&str], tests: &[String]) -> Result<Vec<(String, usize)>> {
    let counts: Vec<(String, usize)> = filters
        .iter()
        .map(|f| {
            (
                f.to_string(),
                tests.iter().filter(|t| t.starts_with(f)).count(),
            )
        })
        .collect();
    let empty: Vec<&str> = counts
        .iter()
        .filter(|(_, n)| *n == 0)
        .map(|(f, _)| f.as_str())
        .collect();
    if empty.is_empty() {
        return Ok(counts);
    }
    Err(format!(
        "the version-dependent test filter(s) {} select no test of the suite ({} tests listed): \
         VERSION_DEPENDENT in xtask/src/test_cmd.rs no longer matches the modules of tests/suite; \
         rename the entries after the suite's modules (the tests they meant must still run at \
         every driver version)",
        empty
            .iter()
            .map(|f| format!("`{f}`"))
            .collect::<Vec<_>>()
            .join(", "),
        tests.len()
    )
    .into())
}

/// The tests among `tests` that [`VERSION_DEPENDENT`] (here `filters`) selects, in order.
pub fn select<'a>(filters: &[&str], tests: &'a [String]) -> Vec<&'a str> {
    tests
        .iter()
        .filter(|t| filters.iter().any(|f| t.starts_with(f)))
        .map(String::as_str)
        .collect()
}

/// Tally of one or more libtest runs, read from their output.
#[derive(Default, Debug)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// `SKIPPED: name: reason` lines printed by the suite's harness.
    pub skipped: Vec<String>,
}

impl Tally {
    /// Add what a libtest run printed.
    pub fn read(&mut self, output: &str, label: &str) {
        for line in output.lines() {
            let l = line.trim();
            if let Some(rest) = l.strip_prefix("test result: ") {
                for part in rest.split([';', '.']) {
                    let mut it = part.split_whitespace();
                    let (Some(n), Some(what)) = (it.next(), it.next()) else {
                        continue;
                    };
                    let Ok(n) = n.parse::<u64>() else { continue };
                    match what {
                        "passed" => self.passed += n,
                        "failed" => self.failed += n,
                        "ignored" => self.ignored += n,
                        _ => {}
                    }
                }
            } else if let Some(s) = l.strip_prefix("SKIPPED: ") {
                self.skipped.push(format!("[{label}] {s}"));
            }
        }
    }

    /// Print the summary; the last line is the plain `N passed, N failed, N skipped` form.
    pub fn report(&self) {
        if !self.skipped.is_empty() {
            println!("\nskipped (each counted as skipped, not passed):");
            for s in &self.skipped {
                println!("  {s}");
            }
        }
        // A test that printed a skip line returned early: count it as skipped, not passed.
        let skipped = self.skipped.len() as u64;
        println!(
            "\n{} passed, {} failed, {} skipped",
            self.passed.saturating_sub(skipped),
            self.failed,
            skipped
        );
    }
}

/// How many processes run the suite at once: `CUDA_MULTIMEM_TEST_JOBS`, else 4 (its tests
/// mostly wait on simulated devices; measured on 2 cores: the whole suite in 48 s in 6
/// processes where one process took 140 s).
fn jobs() -> usize {
    std::env::var("CUDA_MULTIMEM_TEST_JOBS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(4)
}

/// `names` dealt round-robin into at most `n` non-empty shards (neighbours in the list — often
/// the slow tests of one module — go to different shards).
pub fn shard(names: &[String], n: usize) -> Vec<Vec<String>> {
    let n = n.clamp(1, names.len().max(1));
    let mut v = vec![Vec::new(); n];
    for (i, name) in names.iter().enumerate() {
        v[i % n].push(name.clone());
    }
    v.retain(|s| !s.is_empty());
    v
}

/// Run a command and return (success, combined output) without echoing it (shards run at once:
/// their outputs are printed one after another by the caller).
fn quiet_capture(cmd: &mut Command) -> Result<(bool, String)> {
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    Ok((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

/// Run a command, echo its output, and return (success, combined output).
pub fn run_capture(cmd: &mut Command) -> Result<(bool, String)> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    let out = child.wait_with_output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{text}");
    Ok((out.status.success(), text))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

/// The runs of the hierarchical example under `mpirun` (README, "Across nodes"), on the
/// simulated driver with the host test double across domains: (processes, `--domain-size`).
const HIER_MPI_RUNS: [(usize, usize); 2] = [
    // the issue's case: two domains of one GPU on one machine
    (2, 1),
    // two domains of two GPUs: the domain's reduce-scatter and all-gather across processes
    (4, 2),
];

/// What the example prints last when every rank's results matched.
const HIER_MPI_OK: &str = "all results match the host reference on all";

/// Build `examples/hier_allreduce.rs` with the `mpi` feature and run it under `mpirun` on the
/// simulated driver (`HIER_MPI_RUNS`); each run counts as one test, passed only if mpirun
/// exits 0 and the example says every rank matched the host reference.
fn hier_example_under_mpirun(tally: &mut Tally, failed_runs: &mut Vec<String>) -> Result<()> {
    let (built, _) = run_capture(cargo().args([
        "build",
        "--quiet",
        "--workspace",
        "--features",
        "cuda-multimem-examples/mpi",
        "--example",
        "hier_allreduce",
    ]))?;
    if !built {
        tally.failed += 1;
        failed_runs.push("build of the hier_allreduce example with feature mpi".into());
        return Ok(());
    }
    let exe = target_dir()?.join("debug/examples/hier_allreduce");
    for (n, d) in HIER_MPI_RUNS {
        let line = format!("mpirun -n {n} --oversubscribe hier_allreduce --domain-size {d}");
        println!("-- {line}");
        let (ok, out) = run_capture(
            Command::new("mpirun")
                .args(["-n", &n.to_string(), "--oversubscribe"])
                .arg(&exe)
                .args(["--domain-size", &d.to_string()])
                .env("CUDA_MULTIMEM_DRIVER", "sim")
                // Open MPI refuses to run as root (containers, CI) without these.
                .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        )?;
        if ok && out.contains(&format!("{HIER_MPI_OK} {n} ranks")) {
            tally.passed += 1;
        } else {
            tally.failed += 1;
            failed_runs.push(line);
        }
    }
    Ok(())
}

/// Cargo's target directory for this workspace (`cargo metadata`: it follows
/// `CARGO_TARGET_DIR` and cargo's configuration).
fn target_dir() -> Result<std::path::PathBuf> {
    let out = cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err("cargo metadata failed".into());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["target_directory"]
        .as_str()
        .map(std::path::PathBuf::from)
        .ok_or_else(|| "cargo metadata gave no target_directory".into())
}

/// The elapsed seconds of each section of `cargo xtask test`: printed as each ends, and as a
/// table before the tally (so CI's log says where the time goes).
#[derive(Default)]
struct Clock {
    current: Option<(String, std::time::Instant)>,
    done: Vec<(String, f64)>,
}

impl Clock {
    /// End the current section and start `name`.
    fn section(&mut self, name: impl Into<String>) {
        self.end();
        let name = name.into();
        println!("== {name}");
        self.current = Some((name, std::time::Instant::now()));
    }

    fn end(&mut self) {
        if let Some((name, t)) = self.current.take() {
            let s = t.elapsed().as_secs_f64();
            println!("-- {name}: {s:.0} s");
            self.done.push((name, s));
        }
    }

    fn report(&mut self) {
        self.end();
        println!("\n== cargo xtask test: seconds per section");
        for (name, s) in &self.done {
            println!("{s:6.0}  {name}");
        }
    }
}

/// One test executable of `cargo test --workspace --no-run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestBinary {
    /// The folder of its package's manifest (cargo runs tests there).
    pub package_dir: std::path::PathBuf,
    /// `lib`, `bin`, `test`, …
    pub kind: String,
    pub name: String,
    pub exe: std::path::PathBuf,
}

impl TestBinary {
    /// Whether this is a test executable of the tests crate (`tests/`: its lib and the suite).
    fn of_tests_crate(&self) -> bool {
        self.package_dir == workspace_root().join("tests")
    }

    fn is_suite(&self) -> bool {
        self.of_tests_crate() && self.kind == "test" && self.name == "suite"
    }

    /// `cuda-multimem-sim test guide`, for the log.
    fn label(&self) -> String {
        let dir = self
            .package_dir
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        format!("{dir} {} {}", self.kind, self.name)
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.current_dir(&self.package_dir)
            .env("CARGO_MANIFEST_DIR", &self.package_dir);
        if self.is_suite() {
            // as test-hw: a hardware queue for each of up to 32 ranks of one process on one
            // device (collectives::shared's team of 16 runs instead of skipping)
            c.env("CUDA_DEVICE_MAX_CONNECTIONS", "32");
        }
        c
    }
}

/// The test executables among cargo's JSON messages (`compiler-artifact` lines of a test profile
/// with an executable), in a stable order.
pub fn test_binaries(messages: &str) -> Vec<TestBinary> {
    let mut v: Vec<TestBinary> = messages
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| {
            let exe = m["executable"].as_str()?;
            let manifest = std::path::Path::new(m["manifest_path"].as_str()?);
            Some(TestBinary {
                package_dir: manifest.parent()?.to_path_buf(),
                kind: m["target"]["kind"][0]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                name: m["target"]["name"].as_str().unwrap_or_default().to_string(),
                exe: exe.into(),
            })
        })
        .collect();
    v.sort_by(|a, b| (&a.package_dir, &a.kind, &a.name).cmp(&(&b.package_dir, &b.kind, &b.name)));
    v.dedup();
    v
}

/// The suite's test names, as `suite --list --format=terse` gives them with `extra` (the user's
/// libtest filters and flags) applied.
fn list_suite(suite: &TestBinary, extra: &[String]) -> Result<Vec<String>> {
    let out = suite
        .command()
        .args(["--list", "--format=terse"])
        .args(extra)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start {}: {e}", suite.exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "listing the suite's tests ({} --list) failed",
            suite.exe.display()
        )
        .into());
    }
    Ok(listed_tests(&String::from_utf8_lossy(&out.stdout)))
}

/// Entry point of `cargo xtask test`; `versions` empty: the default plan ([`plan`]).
///
/// Every cargo command here selects the whole workspace (`--workspace`, with `--test`,
/// `--example` or `--features pkg/feature` to narrow): cargo unifies features over the packages
/// selected, so `-p cuda-multimem-tests` or `--exclude` would build the library stack again with
/// other features (three builds of it before, about a minute of CPU each on 2 cores). The test
/// executables of one build then run directly.
pub fn test(versions: &[i32], devices: usize, extra: &[String]) -> Result<()> {
    let mut clock = Clock::default();
    clock.section("build (workspace, all targets)");
    crate::run(cargo().args(["build", "--workspace", "--all-targets", "--quiet"]))?;
    clock.section("the test executables (cargo test --workspace --no-run) and the suite's list");
    let built = cargo()
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--quiet",
            "--message-format=json-render-diagnostics",
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot start cargo test --no-run: {e}"))?;
    if !built.status.success() {
        return Err("cargo test --workspace --no-run failed".into());
    }
    let binaries = test_binaries(&String::from_utf8_lossy(&built.stdout));
    let suite = binaries
        .iter()
        .find(|b| b.is_suite())
        .ok_or("cargo test --workspace --no-run built no `suite` test of the tests crate")?
        .clone();
    let plan = plan(versions);
    // The version-dependent tests, checked before anything runs: each filter must select a test
    // of the whole suite; the runs take those of them that `extra` selects too.
    let dependent = if plan.iter().any(|(_, s)| *s == Selection::VersionDependent) {
        let all = list_suite(&suite, &[])?;
        let counts = check_filters(&VERSION_DEPENDENT, &all)?;
        let chosen = list_suite(&suite, extra)?;
        let names: Vec<String> = select(&VERSION_DEPENDENT, &chosen)
            .into_iter()
            .map(str::to_string)
            .collect();
        println!(
            "version-dependent tests: {} of the {} selected ({})",
            names.len(),
            chosen.len(),
            counts
                .iter()
                .map(|(f, n)| format!("{f} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        names
    } else {
        Vec::new()
    };
    let mut tally = Tally::default();
    let mut failed_runs = Vec::new();

    clock.section("unit tests (no driver selection needed)");
    for b in binaries.iter().filter(|b| !b.of_tests_crate()) {
        println!("-- {}", b.label());
        let (ok, out) = run_capture(b.command().arg("--nocapture").args(extra))?;
        tally.read(&out, "unit");
        if !ok {
            failed_runs.push(format!("unit tests of {}", b.label()));
        }
    }
    clock.section("doc tests");
    // The collectives' doc example runs on the simulator (sim::install): the workspace's
    // features include cuda-multimem-collectives/sim (the tests crate enables it).
    let (ok, out) = run_capture(
        cargo()
            .args(["test", "--workspace", "--doc", "--", "--nocapture"])
            .args(extra),
    )?;
    tally.read(&out, "doc");
    if !ok {
        failed_runs.push("doc tests".to_string());
    }

    // The MPI bootstrap: a test that starts `mpirun -n 2` over this crate's test binary, on the
    // simulator. Needs the `mpi` feature (an MPI library and libclang to build) and `mpirun`.
    if Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        clock.section("MPI bootstrap (feature mpi) on the simulated driver");
        let (ok, out) = run_capture(
            cargo()
                .args([
                    "test",
                    "--workspace",
                    "--features",
                    "cuda-multimem-collectives/mpi",
                    "--test",
                    "mpi",
                    "--",
                    "--nocapture",
                ])
                .args(extra),
        )?;
        tally.read(&out, "mpi");
        if !ok {
            failed_runs.push("MPI bootstrap test".to_string());
        }
        clock.section("example hier_allreduce under mpirun (feature mpi) on the simulated driver");
        hier_example_under_mpirun(&mut tally, &mut failed_runs)?;
    } else {
        tally.skipped.push("[mpi] MPI bootstrap: `mpirun` is not on this machine (install openmpi-bin and libopenmpi-dev)".into());
        tally.skipped.push("[mpi] example hier_allreduce under mpirun: `mpirun` is not on this machine (install openmpi-bin and libopenmpi-dev)".into());
    }

    for (v, selection) in plan {
        let sel = format!("sim:devices={devices},version={v}");
        // (executable, test-name arguments)
        let runs: Vec<(&TestBinary, &[String])> = match selection {
            Selection::Whole => {
                clock.section(format!(
                    "suite on the simulated driver, CUDA_MULTIMEM_DRIVER={sel}"
                ));
                binaries
                    .iter()
                    .filter(|b| b.of_tests_crate())
                    .map(|b| (b, &[][..]))
                    .collect()
            }
            Selection::VersionDependent if dependent.is_empty() => {
                println!("no version-dependent test among those selected: nothing to run at {sel}");
                continue;
            }
            Selection::VersionDependent => {
                clock.section(format!(
                    "the {} version-dependent tests on the simulated driver, CUDA_MULTIMEM_DRIVER={sel}",
                    dependent.len()
                ));
                vec![(&suite, &dependent[..])]
            }
        };
        for (b, names) in runs {
            // the suite in parallel processes (one simulated machine is live per process at a
            // time, and the suite's tests mostly wait: shards overlap their waits)
            let names: Vec<String> = if names.is_empty() && b.is_suite() {
                list_suite(b, extra)?
            } else {
                names.to_vec()
            };
            let shards = if names.is_empty() {
                vec![Vec::new()]
            } else {
                shard(&names, jobs())
            };
            let outs = std::thread::scope(|sc| {
                let handles: Vec<_> = shards
                    .iter()
                    .map(|part| {
                        let sel = &sel;
                        sc.spawn(move || -> std::result::Result<(bool, String), String> {
                            let mut cmd = b.command();
                            cmd.arg("--nocapture");
                            if !part.is_empty() {
                                cmd.arg("--exact").args(part);
                            } else {
                                cmd.args(extra);
                            }
                            quiet_capture(cmd.env("CUDA_MULTIMEM_DRIVER", sel))
                                .map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("a shard's thread panicked".to_string()))
                    })
                    .collect::<Vec<_>>()
            });
            for (i, o) in outs.into_iter().enumerate() {
                let (ok, out) = o?;
                print!("{out}");
                tally.read(&out, &format!("sim {v}"));
                if !ok {
                    failed_runs.push(format!("{} (shard {i}) at {sel}", b.label()));
                }
            }
        }
    }
    clock.report();
    tally.report();
    if failed_runs.is_empty() && tally.failed == 0 {
        Ok(())
    } else {
        Err(format!("failed: {}", failed_runs.join("; ")).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_plan_runs_everything_once_and_the_dependent_tests_at_the_other_versions() {
        let p = plan(&[]);
        assert_eq!(p[0], (13050, Selection::Whole));
        assert_eq!(
            p[1..],
            [12000, 12080, 13000, 13030].map(|v| (v, Selection::VersionDependent))
        );
        // Explicit versions: the whole suite at each, as before.
        assert_eq!(
            plan(&[12000, 13030]),
            [(12000, Selection::Whole), (13030, Selection::Whole)]
        );
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn filters_select_by_prefix_and_each_must_select_a_test() {
        let listed = listed_tests(
            "safe::vmm::maps: test\nsim::sticky: test\ncollectives::allreduce::sum: test\n\
             collectives::multimem::one: test\ncollectives::smoke::all_gather: test\n\
             collectives::hier::sim::isolated: test\nsome_bench: bench\n",
        );
        assert_eq!(listed.len(), 6);
        let counts = check_filters(&VERSION_DEPENDENT, &listed).unwrap();
        assert_eq!(
            counts,
            [
                ("safe::".to_string(), 1),
                ("sim::".to_string(), 1),
                ("collectives::multimem::".to_string(), 1),
                ("collectives::smoke::".to_string(), 1)
            ]
        );
        // A prefix, not libtest's substring match: `collectives::hier::sim::` is not `sim::`.
        assert_eq!(
            select(&VERSION_DEPENDENT, &listed),
            [
                "safe::vmm::maps",
                "sim::sticky",
                "collectives::multimem::one",
                "collectives::smoke::all_gather"
            ]
        );
    }

    #[test]
    fn a_filter_that_selects_nothing_fails_naming_it() {
        // The suite's layout before the safe/sim/collectives modules: every filter is stale.
        let old = names(&["vmm::maps", "multimem::one", "hostile_sim::sticky"]);
        let e = check_filters(&VERSION_DEPENDENT, &old)
            .unwrap_err()
            .to_string();
        for f in VERSION_DEPENDENT {
            assert!(e.contains(&format!("`{f}`")), "{e}");
        }
        assert!(e.contains("3 tests listed"), "{e}");
        let one_stale = names(&["safe::a", "sim::b", "collectives::multimem::c"]);
        let e = check_filters(&VERSION_DEPENDENT, &one_stale)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`collectives::smoke::`") && !e.contains("`safe::`"),
            "{e}"
        );
    }

    #[test]
    fn test_binaries_come_from_cargos_artifact_messages() {
        let root = workspace_root();
        let msg = |dir: &str, kind: &str, name: &str, test: bool, exe: Option<&str>| {
            serde_json::json!({
                "reason": "compiler-artifact",
                "manifest_path": root.join(dir).join("Cargo.toml"),
                "target": { "kind": [kind], "name": name },
                "profile": { "test": test },
                "executable": exe,
            })
            .to_string()
        };
        let text = [
            msg("tests", "test", "suite", true, Some("/t/suite-1")),
            msg(
                "tests",
                "lib",
                "cuda_multimem_tests",
                true,
                Some("/t/tests-2"),
            ),
            msg(
                "crates/cuda-multimem-sim",
                "test",
                "guide",
                true,
                Some("/t/guide-3"),
            ),
            // a library (no executable), a binary built to run (not a test), other messages
            msg(
                "crates/cuda-multimem-sim",
                "lib",
                "cuda_multimem_sim",
                false,
                None,
            ),
            msg(
                "bench",
                "bin",
                "bench-memory",
                false,
                Some("/t/bench-memory"),
            ),
            r#"{"reason":"build-finished","success":true}"#.to_string(),
            "not json".to_string(),
        ]
        .join("\n");
        let b = test_binaries(&text);
        let names: Vec<&str> = b.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["guide", "cuda_multimem_tests", "suite"]);
        assert!(b[2].is_suite() && b[1].of_tests_crate() && !b[1].is_suite());
        assert!(!b[0].of_tests_crate());
        assert_eq!(b[0].label(), "cuda-multimem-sim test guide");
    }

    #[test]
    fn the_help_names_the_default_versions() {
        let about = xtask_front::cli::COMMANDS
            .iter()
            .find(|c| c.name == "test")
            .map(|c| c.about)
            .unwrap_or_default();
        for v in std::iter::once(FULL_VERSION).chain(OTHER_VERSIONS) {
            assert!(about.contains(&v.to_string()), "{v}: {about}");
        }
    }

    #[test]
    fn shards_deal_every_name_once_round_robin() {
        let v = names(&["a", "b", "c", "d", "e"]);
        let s = shard(&v, 2);
        assert_eq!(s, vec![names(&["a", "c", "e"]), names(&["b", "d"])]);
        assert_eq!(shard(&v, 9).len(), 5);
        assert_eq!(shard(&v, 0), vec![v.clone()]);
        assert!(shard(&[], 4).is_empty());
    }

    #[test]
    fn tally_reads_libtest_summaries_and_skip_lines() {
        let mut t = Tally::default();
        t.read("test result: ok. 7 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.06s\nSKIPPED: a: no GPU\n", "x");
        assert_eq!((t.passed, t.failed, t.ignored), (7, 1, 2));
        assert_eq!(t.skipped, ["[x] a: no GPU"]);
    }
}
