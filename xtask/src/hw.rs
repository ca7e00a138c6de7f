//! Hardware commands: `bundle`, `test-hw`, `bench-hw`, `ptx-check`. `test-hw` and `bench-hw`
//! show their progress (see `progress`).
//!
//! The GPU machines have no Rust toolchain, so everything that runs there is built here, in
//! release, stripped, into `bundle/` (git-ignored): this xtask binary, the suite's test binary, the
//! examples and benchmarks (packed into `bin.tar.xz`: unpacked they and the working tree pass the
//! 64 MiB a GPU machine takes; the first hardware command unpacks them), the PTX kernels and the
//! NCCL reference script. On the
//! GPU machine `bundle/xtask test-hw` (or `bench-hw ...`, `ptx-check`, `info`) runs them; on a
//! machine with cargo and a GPU, `cargo xtask test-hw` builds the bundle first and runs it in place.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::progress::{libtest_start, run_with_progress, Progress};
use crate::test_cmd::Tally;
use crate::{run, workspace_root, Result};

/// Marker file that says "this folder is a bundle".
const MARKER: &str = "bundle.json";

/// The bundle folder when this xtask binary runs from one.
pub fn running_bundle() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.to_path_buf();
    dir.join(MARKER).is_file().then_some(dir)
}

fn cargo_json(args: &[&str]) -> Result<Vec<PathBuf>> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(workspace_root())
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("cargo {} failed", args.join(" ")).into());
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] == "compiler-artifact" {
            if let Some(e) = v["executable"].as_str() {
                exes.push(PathBuf::from(e));
            }
        }
    }
    Ok(exes)
}

fn copy_into(src: &Path, dir: &Path, name: &str) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let dst = dir.join(name);
    let _ = std::fs::remove_file(&dst);
    std::fs::copy(src, &dst)
        .map_err(|e| format!("copy {} -> {}: {e}", src.display(), dst.display()))?;
    Ok(())
}

/// Entry point of `cargo xtask bundle`: build what the GPU machine runs.
pub fn bundle() -> Result<PathBuf> {
    let root = workspace_root();
    let out = root.join("bundle");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.join("bin"))?;
    println!("== building the bundle (release) into {}", out.display());
    // The suite's test binary.
    let tests = cargo_json(&["test", "--release", "-p", "cuda-multimem-tests", "--no-run"])?;
    let suite = tests
        .iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("suite-"))
        })
        .ok_or("no suite test binary was built")?;
    copy_into(suite, &out.join("bin"), "suite")?;
    // Examples and benchmarks of every crate that has them, with the run-time PTX override
    // (`CUDA_MULTIMEM_PTX_DIR`, feature `ptx-override`) that the A/B scripts in bench/ use.
    let exes = cargo_json(&[
        "build",
        "--release",
        "--workspace",
        "--examples",
        "--bins",
        "--exclude",
        "xtask",
        // the front of `cargo xtask` (no use without cargo; `bundle/xtask` parses alike)
        "--exclude",
        "xtask-front",
        "--features",
        "cuda-multimem-collectives/ptx-override",
    ])?;
    for e in &exes {
        let name = e
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        copy_into(e, &out.join("bin"), &name)?;
    }
    // This xtask itself.
    let me = cargo_json(&["build", "--release", "-p", "xtask"])?;
    let me = me
        .iter()
        .find(|p| p.file_name().is_some_and(|n| n == "xtask"))
        .ok_or("xtask not built")?;
    copy_into(me, &out, "xtask")?;
    // PTX kernels and reference scripts.
    for (src, dst) in [
        ("crates/cuda-multimem-collectives/src/kernels", "ptx"),
        ("bench/scripts", "scripts"),
        ("bench/native", "scripts"),
    ] {
        let s = root.join(src);
        if let Ok(rd) = std::fs::read_dir(&s) {
            for f in rd.flatten() {
                copy_into(&f.path(), &out.join(dst), &f.file_name().to_string_lossy())?;
            }
        }
    }
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(&root)
        .output()
        .ok();
    let commit = git
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    std::fs::write(
        out.join(MARKER),
        serde_json::json!({ "commit": commit }).to_string(),
    )?;
    pack(&out)?;
    let size: u64 = walk(&out)
        .iter()
        .filter_map(|p| p.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "bundle: {} ({:.1} MiB, commit {commit})",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > 48 << 20 {
        return Err(
            format!("the bundle is {size} bytes packed; with the working tree the GPU machines take at most 64 MiB").into(),
        );
    }
    Ok(out)
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Ok(rd) = std::fs::read_dir(d) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                v.extend(walk(&p));
            } else {
                v.push(p);
            }
        }
    }
    v
}

fn bundle_dir() -> Result<PathBuf> {
    let b = match running_bundle() {
        Some(b) => b,
        None => bundle()?,
    };
    unpack(&b)?;
    Ok(b)
}

/// The packed binaries: `bin/` as an xz tarball, about a tenth of its size (the executables
/// each hold the whole library; unpacked, the bundle and the working tree together pass the 64
/// MiB the GPU machines take).
const PACKED: &str = "bin.tar.xz";

/// Pack `bin/` into [`PACKED`] and remove it.
fn pack(out: &Path) -> Result<()> {
    run(Command::new("tar")
        .env("XZ_OPT", "-6 -T0")
        .current_dir(out)
        .args(["cJf", PACKED, "bin"]))?;
    std::fs::remove_dir_all(out.join("bin"))?;
    Ok(())
}

/// Unpack [`PACKED`] into `bin/` where it is not unpacked yet (the first hardware command run
/// from a fresh copy of the bundle).
fn unpack(b: &Path) -> Result<()> {
    if b.join("bin").is_dir() || !b.join(PACKED).is_file() {
        return Ok(());
    }
    println!("== unpacking {PACKED}");
    run(Command::new("tar").current_dir(b).args(["xJf", PACKED]))
}

/// Entry point of `cargo xtask test-hw`: the suite against the real driver. Never creates a
/// multicast object: the library refuses while NCCL_NVLS_ENABLE=0 or
/// CUDA_MULTIMEM_DISABLE_MULTICAST=1 is set, and this command sets the latter for its children.
/// Shows progress: one step per test (the suite runs them one at a time).
pub fn test_hw(filter: &[String]) -> Result<()> {
    let b = bundle_dir()?;
    // CUDA_DEVICE_MAX_CONNECTIONS=32 (the driver's most): a hardware queue for each of up to 32
    // ranks of one process on one GPU (collectives::shared's team of 16; 8 unless set)
    let suite = |c: &mut Command| {
        c.env("CUDA_MULTIMEM_DRIVER", "cuda")
            .env("CUDA_MULTIMEM_DISABLE_MULTICAST", "1")
            .env("CUDA_DEVICE_MAX_CONNECTIONS", "32")
            .env("RUST_BACKTRACE", "1");
    };
    // How many tests the filter selects, for "[i/n]".
    let mut list = Command::new(b.join("bin/suite"));
    list.args(["--list", "--format=terse"]).args(filter);
    suite(&mut list);
    let total = list
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.ends_with(": test"))
                .count()
        })
        .unwrap_or(0);
    let mut tally = Tally::default();
    println!("== suite on the real driver (CUDA_MULTIMEM_DRIVER=cuda), {total} tests");
    let progress = Progress::new(total);
    let mut cmd = Command::new(b.join("bin/suite"));
    cmd.args(["--test-threads=1", "--nocapture"]).args(filter);
    suite(&mut cmd);
    let mut current: Option<String> = None;
    let (ok, out) = run_with_progress(&mut cmd, &progress, |line| {
        if let Some(name) = libtest_start(line) {
            current = Some(name.to_string());
            progress.step(name);
        }
        // libtest's verdict ends the line that started the test, or (with --nocapture, after
        // the test's own output) stands on a line of its own.
        if current.is_some() {
            let l = line.trim_end();
            let verdict = ["ok", "FAILED", "ignored"]
                .into_iter()
                .find(|v| l == *v || l.ends_with(&format!(" ... {v}")));
            if let Some(v) = verdict {
                progress.finish(v);
                current = None;
            }
        }
    })?;
    drop(progress);
    tally.read(&out, "hw");
    tally.report();
    if ok && tally.failed == 0 {
        Ok(())
    } else {
        Err("test-hw failed".into())
    }
}

/// Where hardware runs keep their logs: `hw-logs/` beside the bundle on the GPU machine, in the
/// workspace otherwise (git-ignored).
pub fn logs_dir() -> PathBuf {
    match running_bundle().and_then(|b| b.parent().map(Path::to_path_buf)) {
        Some(p) => p.join("hw-logs"),
        None => workspace_root().join("hw-logs"),
    }
}

/// A free file name `hw-logs/<bench>-<date>.jsonl` (`-2`, `-3`, ... for later runs that day).
fn log_file(dir: &Path, bench: &str, date: &str) -> PathBuf {
    let mut p = dir.join(format!("{bench}-{date}.jsonl"));
    let mut n = 2;
    while p.exists() {
        p = dir.join(format!("{bench}-{date}-{n}.jsonl"));
        n += 1;
    }
    p
}

/// "2 x NVIDIA H200" for the devices of a run, from the real driver (the hostname if it cannot
/// be asked).
fn machine_name(ranks: u32) -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    match cuda_multimem::Driver::load()
        .ok()
        .and_then(|d| d.device(0).ok()?.name().ok())
    {
        Some(name) => format!("{ranks} x {name}"),
        None if !host.is_empty() => host,
        None => "unnamed machine".into(),
    }
}

/// A benchmark's binary, the collectives NCCL measures beside it, and the torch script with its
/// arguments (torch symm_mem's operations that need no multicast; for the norm, NCCL's allreduce
/// then add + rms_norm (and its FP8 quantisation) as an engine runs it without the fusion; for the
/// all-to-all and the MoE dispatch / combine, torch's `all_to_all_single` over NCCL).
type BenchPlan = (
    &'static str,
    Option<&'static str>,
    Option<(&'static str, Vec<String>)>,
);

/// The plan of benchmark `what`; `None` for a name not in `cli::BENCHES`.
fn bench_plan(what: &str, args: &[String]) -> Option<BenchPlan> {
    Some(match what {
        "memory" => ("bench-memory", None, None),
        "allreduce" => (
            "bench-allreduce",
            Some("allreduce"),
            Some((
                "torch_symm_mem.py",
                vec!["--kinds".into(), "one_shot,two_shot".into()],
            )),
        ),
        "collectives" => (
            "bench-collectives",
            Some("reduce_scatter,all_gather,broadcast"),
            Some((
                "torch_symm_mem.py",
                vec!["--kinds".into(), "reduce_scatter".into()],
            )),
        ),
        "norm" => (
            "bench-norm",
            None,
            Some((
                "torch_norm_ref.py",
                pass_through(args, &["--tokens", "--hidden"]),
            )),
        ),
        "hier" => ("bench-hier", None, None),
        "alltoall" => (
            "bench-alltoall",
            Some("alltoall"),
            Some(("torch_alltoall_ref.py", reference_args(args))),
        ),
        "moe" => (
            "bench-moe",
            None,
            Some((
                "torch_moe_ref.py",
                pass_through(
                    args,
                    &["--tokens", "--hidden", "--topk", "--experts", "--payload"],
                ),
            )),
        ),
        _ => return None,
    })
}

/// Entry point of `cargo xtask bench-hw <what>`: run the benchmark (and, for the collectives, the
/// reference in the same run), save its RESULT lines to `hw-logs/<bench>-<date>.jsonl`, print
/// the nccl-tests style table and write the charts beside the log (`hw-logs/charts/`).
pub fn bench_hw(what: &str, args: &[String]) -> Result<()> {
    // Checked before the bundle builds (the front checked it too: `cli::BENCHES`).
    let Some((bin, nccl_colls, torch)) = bench_plan(what, args) else {
        return Err(format!(
            "unknown benchmark `{what}` ({})",
            xtask_front::cli::BENCHES.join(", ")
        )
        .into());
    };
    let b = bundle_dir()?;
    let path = b.join("bin").join(bin);
    if !path.is_file() {
        return Err(format!("{} is not in the bundle", path.display()).into());
    }
    let collective = what != "memory";
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    // (step name, command, must succeed)
    let mut steps: Vec<(String, Command, bool)> = Vec::new();
    let mut ours = Command::new(&path);
    ours.args(args)
        .env("CUDA_MULTIMEM_DRIVER", "cuda")
        .env("CUDA_MULTIMEM_DISABLE_MULTICAST", "1")
        .env("CUDA_MULTIMEM_BUNDLE", &b);
    steps.push((bin.to_string(), ours, true));
    if collective {
        // The references in the same run, what a user would pick instead in its best
        // configuration: NCCL one process per GPU, plain buffers and symmetric windows (the C
        // program of bench/native, built there), and torch's symmetric-memory allreduces;
        // NVLink multicast off for all of them.
        if let Some(colls) = nccl_colls {
            let mut nccl = Command::new("bash");
            nccl.arg(b.join("scripts/nccl_ref.sh"))
                .args(["--timeout", "500", "--coll", colls])
                .args(reference_args(args))
                .env("NCCL_NVLS_ENABLE", "0");
            steps.push((
                "reference: NCCL 1 process/GPU, plain + symmetric windows".into(),
                nccl,
                false,
            ));
        }
        if let Some((script, script_args)) = torch {
            let mut torch = Command::new(&python);
            torch
                .arg(b.join("scripts").join(script))
                .args(script_args)
                .args(if script == "torch_symm_mem.py" {
                    reference_args(args)
                } else {
                    Vec::new()
                })
                .env("NCCL_NVLS_ENABLE", "0")
                .env("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
                .env("PYTHONUNBUFFERED", "1");
            steps.push((format!("reference: torch ({script})"), torch, false));
        }
    }
    let progress = Progress::new(steps.len());
    let mut output = String::new();
    let mut failed_reference = false;
    for (name, mut cmd, required) in steps {
        progress.step(&name);
        let (ok, out) = run_with_progress(&mut cmd, &progress, |_| {})?;
        progress.finish(if ok { "ok" } else { "FAILED" });
        if !ok && required {
            return Err(format!("{name} failed").into());
        }
        failed_reference |= !ok;
        output += &out;
    }
    drop(progress);

    let dir = logs_dir();
    std::fs::create_dir_all(&dir)?;
    let date = crate::bench::today();
    let log = log_file(&dir, what, &date);
    if !collective {
        let lines: String = output
            .lines()
            .filter_map(|l| l.trim().strip_prefix("RESULT "))
            .map(|j| format!("{j}\n"))
            .collect();
        std::fs::write(&log, lines)?;
        println!("\nsaved {}", log.display());
        return Ok(());
    }
    let ms = crate::bench::parse(&output)?;
    std::fs::write(&log, crate::bench::to_jsonl(&ms))?;
    println!("\n{}", crate::bench::table(&ms));
    println!("saved {}", log.display());
    let ranks = ms.iter().map(|m| m.ranks).max().unwrap_or(0);
    if !ms.is_empty() {
        for f in crate::bench::charts(&ms, &dir.join("charts"), &machine_name(ranks), &date)? {
            println!("wrote {}", f.display());
        }
    }
    if failed_reference {
        println!("(a reference failed; see its output above)");
    }
    if ms
        .iter()
        .any(|m| m.implementation == crate::bench::OURS && m.correct == Some(false))
    {
        return Err("a result of ours did not match the host reference".into());
    }
    Ok(())
}

/// The size arguments of ours that the references take too (`--sizes`, `--min-bytes`,
/// `--max-bytes`), so every implementation measures the same sizes.
/// The arguments among `keys` (each with its value, or as `key=value`) out of `args`.
fn pass_through(args: &[String], keys: &[&str]) -> Vec<String> {
    let mut v = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        for k in keys {
            if a == k {
                if let Some(x) = it.next() {
                    v.push(a.clone());
                    v.push(x.clone());
                }
            } else if a.starts_with(&format!("{k}=")) {
                v.push(a.clone());
            }
        }
    }
    v
}

fn reference_args(args: &[String]) -> Vec<String> {
    pass_through(args, &["--sizes", "--min-bytes", "--max-bytes"])
}

/// Entry point of `cargo xtask ptx-check`: assemble every kernel with ptxas for sm_90.
/// The most registers per thread a kernel may use: 65536 per multiprocessor over the 1024
/// threads of the largest block our launches take (CommConfig's threads and push_threads, the
/// norm's 1024).
const MAX_REGISTERS: u32 = 64;

/// The entries of ptxas's `-v` report `msg` that use more than `most` registers.
fn entries_over_registers(msg: &str, most: u32) -> Vec<String> {
    let mut entry = String::new();
    let mut heavy = Vec::new();
    for l in msg.lines() {
        if let Some(rest) = l.split("Compiling entry function '").nth(1) {
            entry = rest.split('\'').next().unwrap_or_default().to_string();
        } else if let Some(rest) = l.split("Used ").nth(1) {
            let n: u32 = rest
                .split(' ')
                .next()
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            if rest.contains("registers") && n > most {
                heavy.push(format!("{entry} ({n})"));
            }
        }
    }
    heavy
}

pub fn ptx_check() -> Result<()> {
    let dir = match running_bundle() {
        Some(b) => b.join("ptx"),
        None => workspace_root().join("crates/cuda-multimem-collectives/src/kernels"),
    };
    let ptxas = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into());
    if Command::new(&ptxas).arg("--version").output().is_err() {
        println!("SKIPPED: ptx-check: `{ptxas}` is not on this machine (the GPU machines have it: run `bundle/xtask ptx-check` there)");
        return Ok(());
    }
    let mut files: Vec<_> = walk(&dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "ptx"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no .ptx files under {}", dir.display()).into());
    }
    let tmp = std::env::temp_dir().join("cuda-multimem-ptx-check");
    std::fs::create_dir_all(&tmp)?;
    let (mut ok, mut bad) = (0, 0);
    for f in &files {
        let name = f
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let out = Command::new(&ptxas)
            .args(["-arch=sm_90", "-v", "-o"])
            .arg(tmp.join(format!("{name}.cubin")))
            .arg(f)
            .output()?;
        let msg = String::from_utf8_lossy(&out.stderr);
        let heavy = entries_over_registers(&msg, MAX_REGISTERS);
        if out.status.success() && heavy.is_empty() {
            ok += 1;
            println!("ok    {name}");
            for l in msg
                .lines()
                .filter(|l| l.contains("registers") || l.contains("spill"))
            {
                println!("      {}", l.trim());
            }
        } else if out.status.success() {
            bad += 1;
            println!(
                "FAIL  {name}: entries over {MAX_REGISTERS} registers, which a block of 1024 threads (the most our launches take) cannot hold: cuOccupancyMaxActiveBlocksPerMultiprocessor is 0 and ranks sharing a GPU are refused; give them `.maxntid 1024, 1, 1`: {}",
                heavy.join(", ")
            );
        } else {
            bad += 1;
            println!("FAIL  {name}\n{msg}");
        }
    }
    println!("\nptx-check: {ok} passed, {bad} failed");
    if bad == 0 {
        Ok(())
    } else {
        Err("ptx-check failed".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_check_names_the_entries_over_64_registers() {
        let msg = "ptxas info    : Compiling entry function 'cmm_a' for 'sm_90'\nptxas info    : Used 64 registers, used 1 barriers\nptxas info    : Compiling entry function 'cmm_b' for 'sm_90'\nptxas info    : Used 72 registers, used 2 barriers\n";
        assert_eq!(
            super::entries_over_registers(msg, 64),
            vec!["cmm_b (72)".to_string()]
        );
    }

    #[test]
    fn every_benchmark_the_command_line_accepts_has_a_plan() {
        for b in xtask_front::cli::BENCHES {
            let (bin, _, _) = bench_plan(b, &[]).unwrap_or_else(|| panic!("no plan for `{b}`"));
            assert_eq!(bin, format!("bench-{b}"));
        }
        assert!(bench_plan("bogus", &[]).is_none());
    }
}
