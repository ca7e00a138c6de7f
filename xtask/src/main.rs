//! `cargo xtask`: the workspace's developer commands.
//!
//! - `bindgen [--check]`: regenerate (or verify) the committed bindings of cuda-multimem-sys.
//! - `ptx [--check]`: regenerate (or verify) the committed PTX kernels of
//!   cuda-multimem-collectives (generator: cuda-multimem-ptxgen).
//! - `test`: the unit tests, and the suite on the simulated driver: all of it at the newest driver
//!   version, the version-dependent tests at the others (`test_cmd`).
//! - `test-hw`: the suite against the real driver (builds a bundle first unless run from one).
//! - `bench-hw memory|allreduce|collectives|norm|hier`: benchmarks on the real driver, side by
//!   side with the references.
//! - `ptx-check`: assemble every PTX kernel with ptxas for sm_90 (where ptxas exists).
//! - `info [--json]`: what the selected driver and its devices can do, and the peer matrix.
//! - `chart <results> [--out-dir docs/charts] [--date D --machine M]`: table and SVG charts of a
//!   benchmark run's RESULT lines (`bench-hw` saves them in `hw-logs/` and charts them itself).
//! - `bundle`: build what the GPU machines run (they have no Rust toolchain) into `bundle/`.
//! - `modules [--check] [--verbose]`: the import graph between sibling modules of the library
//!   crates; `--check` fails on a circle (it runs in the front, `xtask/front`, without these tools).
//!
//! The command line is parsed by the front's grammar (`xtask_front::cli`): `cargo xtask` runs the
//! front, which answers `--help` and refuses bad arguments before these tools build, then runs
//! this binary with the same arguments; `bundle/xtask` is this binary.

mod bench;
mod bindgen_cmd;
mod hw;
mod info;
mod progress;
mod ptx_cmd;
mod test_cmd;

use std::path::PathBuf;
use std::process::Command;

use xtask_front::cli::{self, Cmd, Parsed, USAGE_EXIT};

pub type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// The workspace root: beside a bundled xtask, its bundle; else the parent of this crate.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or_default()
}

/// Run a command, failing with its command line if it exits non-zero.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if !status.success() {
        return Err(format!("{cmd:?} failed: {status}").into());
    }
    Ok(())
}

fn main() {
    // The grammar is the front's (xtask/front): `cargo xtask` checked these arguments already;
    // in a bundle (`bundle/xtask`, no front there) this is the first check.
    let program = if hw::running_bundle().is_some() {
        "xtask"
    } else {
        "cargo xtask"
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = match cli::parse(program, &args) {
        Ok(Parsed::Run(cmd)) => cmd,
        Ok(Parsed::Help(h)) => {
            print!("{h}");
            return;
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(USAGE_EXIT);
        }
    };
    let r = match cmd {
        Cmd::Bindgen { check } => bindgen_cmd::bindgen(check),
        Cmd::Ptx { check } => ptx_cmd::ptx(check),
        Cmd::Test {
            versions,
            devices,
            extra,
        } => test_cmd::test(&versions, devices, &extra),
        Cmd::TestHw { filter } => hw::test_hw(&filter),
        Cmd::BenchHw { what, args } => hw::bench_hw(&what, &args),
        Cmd::PtxCheck => hw::ptx_check(),
        Cmd::Info { json } => info::info(json),
        Cmd::Bundle => hw::bundle().map(|_| ()),
        Cmd::Chart {
            results,
            out_dir,
            date,
            machine,
        } => bench::chart_cmd(&results, out_dir, date, machine),
        Cmd::Modules { check, verbose } => {
            std::process::exit(xtask_front::modules::run(&workspace_root(), check, verbose))
        }
    };
    if let Err(e) = r {
        eprintln!("xtask: {e}");
        std::process::exit(1);
    }
}
