//! `cargo xtask`: the workspace's developer commands (bindgen, test, test-hw, bench-hw, info, bundle).

mod bindgen_cmd;

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
}

/// The workspace root (the parent of this crate's folder).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
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
    };
    if let Err(e) = r {
        eprintln!("xtask: {e}");
        std::process::exit(1);
    }
}
