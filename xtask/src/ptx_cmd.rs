//! `cargo xtask ptx [--check]`: regenerate (or verify) the committed PTX kernels of
//! `cuda-multimem-collectives` with the generator crate `cuda-multimem-ptxgen`.

use crate::{workspace_root, Result};

/// Where the committed kernels live.
pub const KERNELS: &str = "crates/cuda-multimem-collectives/src/kernels";

/// Entry point of `cargo xtask ptx [--check]`.
pub fn ptx(check: bool) -> Result<()> {
    let dir = workspace_root().join(KERNELS);
    let files = cuda_multimem_ptxgen::files();
    if !check {
        for (file, text) in &files {
            std::fs::write(dir.join(file), text)
                .map_err(|e| format!("write {}: {e}", dir.join(file).display()))?;
        }
        println!("wrote {} PTX files into {}", files.len(), dir.display());
        return Ok(());
    }
    // Compare with the files on disk (what a checkout holds), not with the text compiled into
    // the generator's dependency: the two are the same file, but the disk is what CI diffs.
    let differ: Vec<&str> = files
        .iter()
        .filter(|(file, text)| {
            std::fs::read(dir.join(file)).ok().as_deref() != Some(text.as_bytes())
        })
        .map(|(file, _)| *file)
        .collect();
    if differ.is_empty() {
        println!(
            "ptx --check: the {} committed PTX files match a fresh generation",
            files.len()
        );
        Ok(())
    } else {
        Err(format!(
            "ptx --check: {} under {KERNELS} differ from a fresh generation (run `cargo xtask ptx`)",
            differ.join(", ")
        )
        .into())
    }
}
