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

/// What a PTX text needs to load: its `.target` (`sm_XY` as the compute capability `(X, Y)`)
/// and the oldest driver of its `.version` (PTX ISA `8.1` is CUDA 12.1: 12010).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Needs {
    pub(crate) capability: (i32, i32),
    pub(crate) driver: i32,
    pub(crate) isa: (i32, i32),
}

/// The driver that introduced PTX ISA `major.minor` (CUDA's release notes: 8.0 in 12.0, one
/// minor per minor release up to 8.5 in 12.5; 8.6 in 12.7, 8.7 in 12.8, 8.8 in 12.9, 9.0 in
/// 13.0, 9.1 in 13.1 and so on).
fn driver_of_isa((major, minor): (i32, i32)) -> i32 {
    match (major, minor) {
        (8, m) if m <= 5 => 12000 + 10 * m,
        (8, 6) => 12070,
        (8, 7) => 12080,
        (8, 8) => 12090,
        (9, m) => 13000 + 10 * m,
        (x, _) if x < 8 => 11000,
        _ => 99999,
    }
}

/// [`Needs`] of a PTX text (`None` where it names no `.version` or `.target`).
pub(crate) fn needs(ptx: &str) -> Option<Needs> {
    let mut isa = None;
    let mut cap = None;
    for line in ptx.lines().map(str::trim) {
        if let Some(v) = line.strip_prefix(".version ") {
            let (a, b) = v.trim().split_once('.')?;
            isa = Some((a.parse().ok()?, b.parse().ok()?));
        } else if let Some(t) = line.strip_prefix(".target ") {
            let sm = t.split(',').next()?.trim().strip_prefix("sm_")?;
            let digits: String = sm.chars().take_while(char::is_ascii_digit).collect();
            let n: i32 = digits.parse().ok()?;
            cap = Some((n / 10, n % 10));
        }
        if isa.is_some() && cap.is_some() {
            break;
        }
    }
    let isa = isa?;
    Some(Needs {
        capability: cap?,
        driver: driver_of_isa(isa),
        isa,
    })
}

/// Refuse `device` where it cannot load the kernel files `files` (name and committed text):
/// its compute capability below their target, or its driver older than their PTX ISA. The
/// error names the device, what it has and what the kernels need — instead of a JIT log at the
/// first module load.
pub(crate) fn check_device(device: &Device, files: &[(&str, &str)]) -> Result<()> {
    let cap = device.compute_capability()?;
    let driver = device.driver().version();
    for (file, text) in files {
        let Some(n) = needs(text) else { continue };
        if cap < n.capability || driver < n.driver {
            return Err(Error::HardwareTooOld {
                device: device.ordinal(),
                has: format!(
                    "compute capability {}.{}, driver {}.{}",
                    cap.0,
                    cap.1,
                    driver / 1000,
                    driver % 1000 / 10
                ),
                what: format!("the kernels of {file}"),
                needs: format!(
                    "compute capability {}.{} (sm_{}{}) or newer and a CUDA {}.{} driver or newer (PTX ISA {}.{})",
                    n.capability.0,
                    n.capability.1,
                    n.capability.0,
                    n.capability.1,
                    n.driver / 1000,
                    n.driver % 1000 / 10,
                    n.isa.0,
                    n.isa.1
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_kernels_name_their_target_and_isa() {
        let n = needs(super::super::Kernel::P2pOneShot.ptx()).unwrap();
        assert_eq!(n.capability, (9, 0));
        assert_eq!(n.driver, 12010);
        let m = needs(super::super::multimem::PTX).unwrap();
        assert_eq!((m.isa, m.driver), ((8, 2), 12020));
        assert_eq!(needs("// nothing"), None);
        assert_eq!(
            needs(".version 9.0\n.target sm_100a\n").map(|n| (n.capability, n.driver)),
            Some(((10, 0), 13000))
        );
    }
}
