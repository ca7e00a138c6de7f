//! `cargo xtask test`: the whole workspace on the simulated driver, once per driver version.

use std::process::{Command, Stdio};

use crate::{workspace_root, Result};

/// The simulated driver versions every suite runs at.
pub const VERSIONS: [i32; 5] = [12000, 12080, 13000, 13030, 13050];

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
    // the case: two domains of one GPU on one machine
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
    println!("== example hier_allreduce under mpirun (feature mpi) on the simulated driver");
    let (built, _) = run_capture(cargo().args([
        "build",
        "--quiet",
        "-p",
        "cuda-multimem-examples",
        "--features",
        "mpi",
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

/// Entry point of `cargo xtask test`.
pub fn test(versions: &[i32], devices: usize, extra: &[String]) -> Result<()> {
    println!("== build (workspace, all targets)");
    crate::run(cargo().args(["build", "--workspace", "--all-targets", "--quiet"]))?;
    let mut tally = Tally::default();
    let mut failed_runs = Vec::new();

    println!("== unit and doc tests (no driver selection needed)");
    let (ok, out) = run_capture(
        cargo()
            .args([
                "test",
                "--workspace",
                "--exclude",
                "cuda-multimem-tests",
                // the collectives' doc example runs on the simulator (sim::install)
                "--features",
                "cuda-multimem-collectives/sim",
                "--",
                "--nocapture",
            ])
            .args(extra),
    )?;
    tally.read(&out, "unit");
    if !ok {
        failed_runs.push("unit and doc tests".to_string());
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
        println!("== MPI bootstrap (feature mpi) on the simulated driver");
        let (ok, out) = run_capture(
            cargo()
                .args([
                    "test",
                    "-p",
                    "cuda-multimem-collectives",
                    "--features",
                    "mpi,sim",
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
        hier_example_under_mpirun(&mut tally, &mut failed_runs)?;
    } else {
        tally.skipped.push("[mpi] MPI bootstrap: `mpirun` is not on this machine (install openmpi-bin and libopenmpi-dev)".into());
        tally.skipped.push("[mpi] example hier_allreduce under mpirun: `mpirun` is not on this machine (install openmpi-bin and libopenmpi-dev)".into());
    }

    for v in versions {
        let sel = format!("sim:devices={devices},version={v}");
        println!("== suite on the simulated driver, CUDA_MULTIMEM_DRIVER={sel}");
        let (ok, out) = run_capture(
            cargo()
                .args(["test", "-p", "cuda-multimem-tests", "--", "--nocapture"])
                .args(extra)
                .env("CUDA_MULTIMEM_DRIVER", &sel),
        )?;
        tally.read(&out, &format!("sim {v}"));
        if !ok {
            failed_runs.push(format!("suite at {sel}"));
        }
    }
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
    fn tally_reads_libtest_summaries_and_skip_lines() {
        let mut t = Tally::default();
        t.read("test result: ok. 7 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.06s\nSKIPPED: a: no GPU\n", "x");
        assert_eq!((t.passed, t.failed, t.ignored), (7, 1, 2));
        assert_eq!(t.skipped, ["[x] a: no GPU"]);
    }
}
