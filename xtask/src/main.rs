//! `cargo xtask`: the workspace's developer commands.
//!
//! - `bindgen [--check]`: regenerate (or verify) the committed bindings of cuda-multimem-sys.
//! - `ptx [--check]`: regenerate (or verify) the committed PTX kernels of
//!   cuda-multimem-collectives (generator: cuda-multimem-ptxgen).
//! - `test`: the whole workspace on the simulated driver at each driver version.
//! - `test-hw`: the suite against the real driver (builds a bundle first unless run from one).
//! - `bench-hw memory|allreduce`: benchmarks on the real driver, side by side with the reference.
//! - `ptx-check`: assemble every PTX kernel with ptxas for sm_90 (where ptxas exists).
//! - `info [--json]`: what the selected driver and its devices can do, and the peer matrix.
//! - `chart <results> [--out-dir docs/charts] [--date D --machine M]`: table and SVG charts of a
//!   benchmark run's RESULT lines (`bench-hw` saves them in `hw-logs/` and charts them itself).
//! - `bundle`: build what the GPU machines run (they have no Rust toolchain) into `bundle/`.

mod bench;
mod bindgen_cmd;
mod hw;
mod info;
mod progress;
mod ptx_cmd;
mod test_cmd;

use std::path::PathBuf;
use std::process::Command;

use clap::{Parser, Subcommand};

pub type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "cuda-multimem developer commands")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Regenerate the committed bindings of cuda-multimem-sys from the pinned CUDA 13.5 headers.
    Bindgen {
        /// Regenerate into a temporary folder and fail on any difference.
        #[arg(long)]
        check: bool,
    },
    /// Regenerate the committed PTX kernels of cuda-multimem-collectives (cuda-multimem-ptxgen).
    Ptx {
        /// Regenerate in memory and fail naming every committed file that differs.
        #[arg(long)]
        check: bool,
    },
    /// Build, then run every suite on the simulated driver at each driver version.
    Test {
        /// Driver versions (default: 12000, 12080, 13000, 13030, 13050).
        #[arg(long, value_delimiter = ',')]
        versions: Vec<i32>,
        /// Simulated devices.
        #[arg(long, default_value_t = 2)]
        devices: usize,
        /// Extra arguments for the test binaries (after `--`).
        #[arg(last = true)]
        extra: Vec<String>,
    },
    /// Run the suite against the real driver; capabilities the device lacks are skipped with a reason.
    TestHw {
        /// Test-name filter and libtest arguments.
        #[arg(last = true)]
        filter: Vec<String>,
    },
    /// Benchmarks on the real driver: `memory` or `allreduce`.
    BenchHw {
        /// Which benchmark.
        what: String,
        /// Arguments for the benchmark binary.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Assemble every PTX kernel with ptxas for sm_90.
    PtxCheck,
    /// Report the selected driver's capabilities (CUDA_MULTIMEM_DRIVER picks the driver).
    Info {
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Build the binaries the GPU machines run into bundle/.
    Bundle,
    /// Print the nccl-tests style table of a benchmark run and write its SVG charts
    /// (`<bench>-time.svg`, `<bench>-bandwidth.svg` per collective).
    Chart {
        /// The run's results: a `hw-logs/<bench>-<date>.jsonl`, or captured benchmark output.
        results: PathBuf,
        /// Where the charts go (default: docs/charts).
        #[arg(long)]
        out_dir: Option<PathBuf>,
        /// The run's date, YYYY-MM-DD, for the titles (default: today).
        #[arg(long)]
        date: Option<String>,
        /// The machine, for the titles (e.g. "2 x H200, NV18").
        #[arg(long)]
        machine: Option<String>,
    },
}

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
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bindgen { check } => bindgen_cmd::bindgen(check),
        Cmd::Ptx { check } => ptx_cmd::ptx(check),
        Cmd::Test {
            versions,
            devices,
            extra,
        } => {
            let v = if versions.is_empty() {
                test_cmd::VERSIONS.to_vec()
            } else {
                versions
            };
            test_cmd::test(&v, devices, &extra)
        }
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
    };
    if let Err(e) = r {
        eprintln!("xtask: {e}");
        std::process::exit(1);
    }
}
