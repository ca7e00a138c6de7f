//! Shared pieces of the examples: choosing the driver (the real one, or — saying so — the
//! simulated one), and the simulator's kernel equivalents.

use cuda_multimem::Driver;
use cuda_multimem_sim::SimConfig;

/// Errors of the examples.
pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A simulated machine of `devices` GPUs at driver `version`, with the collectives' kernel
/// equivalents installed.
pub fn simulated(devices: usize, version: i32) -> Res<Driver> {
    cuda_multimem_collectives::sim::install();
    Ok(cuda_multimem_sim::simulated_driver(SimConfig::new(
        devices, version,
    ))?)
}

/// The driver `CUDA_MULTIMEM_DRIVER` names when it is set; else the real driver with at least
/// `min_devices` GPUs that reach each other; else (saying why) a simulated NVLink machine of
/// `sim_devices` GPUs at CUDA 13.3. Returns the driver and a description of it.
pub fn pick_driver(min_devices: usize, sim_devices: usize) -> Res<(Driver, String)> {
    if let Ok(v) = std::env::var(cuda_multimem::DRIVER_ENV) {
        if v.trim().starts_with("sim") {
            cuda_multimem_collectives::sim::install();
            let d = cuda_multimem_sim::driver_from_selection(&v)?;
            let what = format!(
                "{} simulated GPU(s), driver {} ({}={v})",
                d.device_count(),
                d.version(),
                cuda_multimem::DRIVER_ENV
            );
            return Ok((d, what));
        }
    }
    match Driver::load() {
        Ok(d) if d.device_count() >= min_devices => {
            let devs = d.devices();
            let peers = devs
                .iter()
                .skip(1)
                .all(|p| devs[0].can_access_peer(p).unwrap_or(false));
            if peers {
                let name = devs[0].name().unwrap_or_default();
                let what = format!(
                    "{} x {name} (real GPUs, driver {})",
                    d.device_count(),
                    d.version()
                );
                return Ok((d, what));
            }
            println!("note: the GPUs cannot all access each other; using the simulated driver");
        }
        Ok(d) => println!(
            "note: the real driver has {} GPU(s), {min_devices} are needed; using the simulated driver",
            d.device_count()
        ),
        Err(e) => println!("note: no usable CUDA driver ({e}); using the simulated driver"),
    }
    let d = simulated(sim_devices, 13030)?;
    Ok((
        d,
        format!("a simulated NVLink machine of {sim_devices} GPUs (driver 13030)"),
    ))
}

/// NCCL for the examples that cross NVLink domains: the library `CUDA_MULTIMEM_NCCL` names,
/// else `libnccl.so.2` / `libnccl.so` through the dynamic loader, else the `nvidia-nccl` wheel
/// of the machine's `python3` (where torch installs it). The error says what was tried.
pub fn locate_nccl() -> Result<std::sync::Arc<cuda_multimem_collectives::Nccl>, String> {
    use cuda_multimem_collectives::{nccl::NCCL_ENV, Nccl};
    let first = match Nccl::load() {
        Ok(n) => return Ok(n),
        Err(e) => e.to_string(),
    };
    if std::env::var_os(NCCL_ENV).is_some() {
        return Err(first);
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl,os; print(list(nvidia.nccl.__path__)[0])",
        ])
        .output()
        .map_err(|e| format!("{first}; python3: {e}"))?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || dir.is_empty() {
        return Err(format!("{first}; python3 has no nvidia.nccl wheel"));
    }
    Nccl::load_from(&std::path::Path::new(&dir).join("lib/libnccl.so.2")).map_err(|e| e.to_string())
}
