//! Driver selection for programs that link the simulator: a `cuda_multimem::Driver` over a
//! simulated machine, or the one `CUDA_MULTIMEM_DRIVER` names. `cuda-multimem` itself does not
//! depend on this crate, so the library cannot fall back to the simulator; a program that links
//! it chooses the simulator here, explicitly.

use cuda_multimem::{Driver, Error, Result, DRIVER_ENV};

use crate::{SimConfig, Simulator};

/// Start a simulated machine described by `config` and a driver over it; the simulator lives as
/// long as the driver (and every clone of it).
///
/// ```
/// let driver = cuda_multimem_sim::simulated_driver(cuda_multimem_sim::SimConfig::new(2, 13030))?;
/// assert!(driver.is_simulated() && driver.device_count() == 2);
/// # Ok::<(), cuda_multimem::Error>(())
/// ```
pub fn simulated_driver(config: SimConfig) -> Result<Driver> {
    let sim = Simulator::start(config).map_err(|e| Error::Config(e.to_string()))?;
    driver_over(&sim)
}

/// A driver over a running simulator (it keeps the simulator alive). Two calls give two driver
/// values over the same simulated machine.
pub fn driver_over(sim: &Simulator) -> Result<Driver> {
    Driver::from_sys(sim.driver()?, true)
}

/// The driver `CUDA_MULTIMEM_DRIVER` selects: the real one when unset or `cuda`, the simulated
/// one for `sim` or `sim:<options>` (see [`SimConfig::parse`]); anything else is an
/// [`Error::Config`].
pub fn driver_from_env() -> Result<Driver> {
    match std::env::var(DRIVER_ENV) {
        Err(std::env::VarError::NotPresent) => Driver::load(),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(Error::Config(format!("{DRIVER_ENV}={v:?} is not UTF-8")))
        }
        Ok(v) => driver_from_selection(&v),
    }
}

/// Interpret a `CUDA_MULTIMEM_DRIVER` value: empty or `cuda` loads the real driver, `sim` or
/// `sim:<options>` starts a simulated machine; anything else is an [`Error::Config`].
pub fn driver_from_selection(value: &str) -> Result<Driver> {
    let v = value.trim();
    if v.is_empty() || v == "cuda" {
        return Driver::load();
    }
    let options = match v.strip_prefix("sim") {
        Some("") => "",
        Some(rest) => rest.strip_prefix(':').ok_or_else(|| expected(value))?,
        None => return Err(expected(value)),
    };
    let config =
        SimConfig::parse(options).map_err(|e| Error::Config(format!("{DRIVER_ENV}: {e}")))?;
    simulated_driver(config)
}

fn expected(value: &str) -> Error {
    Error::Config(format!(
        "{DRIVER_ENV}={value}: expected `cuda` or `sim[:key=value,...]`"
    ))
}
