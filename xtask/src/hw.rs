//! Hardware commands: `bundle`, `test-hw`, `bench-hw`, `ptx-check`.
//!
//! The GPU machines have no Rust toolchain, so everything that runs there is built here, in
//! release, stripped, into `bundle/` (git-ignored, well under 64 MiB): this xtask binary, the suite's
//! test binary, the examples and benchmarks, the PTX kernels and the NCCL reference script. On the
//! GPU machine `bundle/xtask test-hw` (or `bench-hw ...`, `ptx-check`, `info`) runs them; on a
//! machine with cargo and a GPU, `cargo xtask test-hw` builds the bundle first and runs it in place.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::test_cmd::{run_capture, Tally};
use crate::{workspace_root, Result};

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
    if size > 60 << 20 {
        return Err(
            format!("the bundle is {size} bytes; the GPU machines take at most 64 MiB").into(),
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
    match running_bundle() {
        Some(b) => Ok(b),
        None => bundle(),
    }
}

/// Entry point of `cargo xtask test-hw`: the suite against the real driver. Never creates a
/// multicast object: the library refuses while NCCL_NVLS_ENABLE=0 or
/// CUDA_MULTIMEM_DISABLE_MULTICAST=1 is set, and this command sets the latter for its children.
pub fn test_hw(filter: &[String]) -> Result<()> {
    let b = bundle_dir()?;
    let mut tally = Tally::default();
    println!("== suite on the real driver (CUDA_MULTIMEM_DRIVER=cuda)");
    let (ok, out) = run_capture(
        Command::new(b.join("bin/suite"))
            .args(["--test-threads=1", "--nocapture"])
            .args(filter)
            .env("CUDA_MULTIMEM_DRIVER", "cuda")
            .env("CUDA_MULTIMEM_DISABLE_MULTICAST", "1")
            .env("RUST_BACKTRACE", "1"),
    )?;
    tally.read(&out, "hw");
    tally.report();
    if ok && tally.failed == 0 {
        Ok(())
    } else {
        Err("test-hw failed".into())
    }
}

/// One `RESULT {json}` line of a benchmark.
fn results(output: &str) -> Vec<serde_json::Value> {
    output
        .lines()
        .filter_map(|l| l.trim().strip_prefix("RESULT "))
        .filter_map(|j| serde_json::from_str(j).ok())
        .collect()
}

fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// Entry point of `cargo xtask bench-hw <what>`.
pub fn bench_hw(what: &str, args: &[String]) -> Result<()> {
    let b = bundle_dir()?;
    let bin = match what {
        "memory" => "bench-memory",
        "allreduce" => "bench-allreduce",
        other => return Err(format!("unknown benchmark `{other}` (memory, allreduce)").into()),
    };
    let path = b.join("bin").join(bin);
    if !path.is_file() {
        return Err(format!("{} is not in the bundle", path.display()).into());
    }
    let (ok, ours) = run_capture(
        Command::new(path)
            .args(args)
            .env("CUDA_MULTIMEM_DRIVER", "cuda")
            .env("CUDA_MULTIMEM_DISABLE_MULTICAST", "1")
            .env("CUDA_MULTIMEM_BUNDLE", &b),
    )?;
    if !ok {
        return Err(format!("{bin} failed").into());
    }
    if what != "allreduce" {
        return Ok(());
    }
    // The reference in the same run: NCCL through torch, graph-captured, multicast off.
    println!("== reference: NCCL (graph-captured, NCCL_NVLS_ENABLE=0)");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let (nccl_ok, nccl) = run_capture(
        Command::new(python)
            .arg(b.join("scripts/nccl_allreduce.py"))
            .env("NCCL_NVLS_ENABLE", "0")
            .env("PYTHONUNBUFFERED", "1"),
    )?;
    let ours = results(&ours);
    let theirs = results(&nccl);
    println!(
        "\n{:>9} {:>10} {:>9} {:>9} {:>24} {:>7} | {:>10} {:>9} {:>9} {:>7} | {:>7}",
        "bytes",
        "time_us",
        "algbw",
        "busbw",
        "path",
        "correct",
        "nccl_us",
        "algbw",
        "busbw",
        "correct",
        "speedup"
    );
    for o in &ours {
        let bytes = o["bytes"].as_u64().unwrap_or(0);
        let n = theirs.iter().find(|t| t["bytes"].as_u64() == Some(bytes));
        let t_ours = o["time_us"].as_f64().unwrap_or(f64::NAN);
        // a number, or "-" where NCCL did not run that size
        let num = |v: Option<f64>, w: usize, p: usize| match v {
            Some(x) if x.is_finite() => format!("{x:>w$.p$}"),
            _ => format!("{:>w$}", "-"),
        };
        let t_nccl = n.and_then(|n| n["time_us"].as_f64());
        println!(
            "{:>9} {:>10.2} {:>9.1} {:>9.1} {:>24} {:>7} | {} {} {} {:>7} | {}",
            human_bytes(bytes),
            t_ours,
            o["algbw"].as_f64().unwrap_or(f64::NAN),
            o["busbw"].as_f64().unwrap_or(f64::NAN),
            o["path"].as_str().unwrap_or("?"),
            o["correct"],
            num(t_nccl, 10, 2),
            num(n.and_then(|n| n["algbw"].as_f64()), 9, 1),
            num(n.and_then(|n| n["busbw"].as_f64()), 9, 1),
            n.map(|n| n["correct"].to_string())
                .unwrap_or_else(|| "-".into()),
            match t_nccl {
                Some(t) => format!("{:>6.2}x", t / t_ours),
                None => format!("{:>7}", "-"),
            },
        );
    }
    if !nccl_ok {
        println!("(the NCCL reference failed; see its output above)");
    }
    if ours
        .iter()
        .any(|o| o["correct"] != serde_json::Value::Bool(true))
    {
        return Err("an allreduce result did not match the host reference".into());
    }
    Ok(())
}

/// Entry point of `cargo xtask ptx-check`: assemble every kernel with ptxas for sm_90.
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
        if out.status.success() {
            ok += 1;
            println!("ok    {name}");
            for l in msg
                .lines()
                .filter(|l| l.contains("registers") || l.contains("spill"))
            {
                println!("      {}", l.trim());
            }
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
