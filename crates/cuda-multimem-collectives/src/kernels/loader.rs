//! The one loader of every kernel family's module: the committed PTX text, or (feature
//! `ptx-override`) the file of the same name in `CUDA_MULTIMEM_PTX_DIR`.

use std::borrow::Cow;

use cuda_multimem::{Device, Error, Module, Result};

/// The PTX this process loads for the kernel file `file` whose committed text is `committed`:
/// the committed text. With the non-default feature `ptx-override` (kernel tuning on a GPU
/// machine without rebuilding; the A/B scripts in `bench/`), the file of the same name in the
/// folder named by `CUDA_MULTIMEM_PTX_DIR` instead, when that variable is set (it must declare
/// the same entries and parameters). Every family's file goes through here.
pub fn ptx_text(file: &'static str, committed: &'static str) -> std::io::Result<Cow<'static, str>> {
    #[cfg(feature = "ptx-override")]
    if let Some(dir) = std::env::var_os(super::PTX_DIR_ENV) {
        return Ok(std::fs::read_to_string(std::path::Path::new(&dir).join(file))?.into());
    }
    let _ = file;
    Ok(committed.into())
}

/// Load the module of kernel file `file` (committed text `committed`) on `device`.
pub(crate) fn load_module(
    device: &Device,
    file: &'static str,
    committed: &'static str,
) -> Result<Module> {
    let text = ptx_text(file, committed)
        .map_err(|e| Error::os("read PTX from CUDA_MULTIMEM_PTX_DIR", e))?;
    Module::load_ptx(device, &text)
}
