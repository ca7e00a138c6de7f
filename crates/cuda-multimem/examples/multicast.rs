//! Build a two-device team, bind each member's memory, store through the multicast range, and
//! read the value back on each device.
//!
//! Uses the driver `CUDA_MULTIMEM_DRIVER` selects when it is set; otherwise the real driver. It
//! runs on the simulated driver instead — and says why — when no driver can be loaded, when there
//! are fewer than two devices, when the devices lack multicast, and whenever multicast is disabled
//! (`NCCL_NVLS_ENABLE=0` or `CUDA_MULTIMEM_DISABLE_MULTICAST=1`): it never creates a multicast
//! object on a real GPU then. (The example may fall back; the library never does.)
//!
//! ```text
//! cargo run -p cuda-multimem --example multicast
//! CUDA_MULTIMEM_DRIVER=sim:devices=4,version=13050 cargo run -p cuda-multimem --example multicast
//! ```

use std::process::ExitCode;

use cuda_multimem::multicast::multicast_allowed_for;
use cuda_multimem::team::{choose_backend, Backend, Team};
use cuda_multimem::{Driver, Error, DRIVER_ENV};

const MIB: usize = 1 << 20;
/// A simulated machine with classic multicast objects (13.1: per-device binds).
const SIMULATED: &str = "sim:devices=2,version=13010";

fn simulated(why: &str) -> Result<Driver, Error> {
    println!("{why}; running on the simulated driver ({SIMULATED})");
    cuda_multimem_sim::driver_from_selection(SIMULATED)
}

fn driver() -> Result<Driver, Error> {
    let d = if std::env::var_os(DRIVER_ENV).is_some() {
        cuda_multimem_sim::driver_from_env()?
    } else {
        match Driver::load() {
            Ok(d) => d,
            Err(e) => return simulated(&format!("no CUDA driver could be loaded ({e})")),
        }
    };
    if d.is_simulated() {
        return Ok(d);
    }
    // A real driver: check the site's policy before anything else touches multicast.
    if let Err(reason) = multicast_allowed_for(&d) {
        return simulated(&format!("multicast is disabled on this machine ({reason})"));
    }
    if d.device_count() < 2 {
        return simulated(&format!(
            "the CUDA driver reports {} device(s); a team needs two",
            d.device_count()
        ));
    }
    if let Err(e) = choose_backend(&d, &d.devices()[..2]) {
        return simulated(&format!(
            "devices 0 and 1 cannot form a multicast team ({e})"
        ));
    }
    Ok(d)
}

fn run() -> Result<bool, Error> {
    let driver = driver()?;
    println!(
        "driver {} ({}), {} device(s)",
        driver.version(),
        if driver.is_simulated() {
            "simulated"
        } else {
            "real"
        },
        driver.device_count()
    );
    let devices = &driver.devices()[..2.min(driver.device_count())];
    let team = Team::new(devices, 2 * MIB)?;
    match team.backend() {
        Backend::MulticastObject => println!(
            "team of devices {:?}: multicast object, {} bytes per member, multicast address {:#x}",
            devices.iter().map(|d| d.ordinal()).collect::<Vec<_>>(),
            team.size(),
            team.multicast_address().unwrap_or(0)
        ),
        Backend::LogicalEndpoint => println!(
            "team of devices {:?}: logical endpoint {}, {} bytes per member",
            devices.iter().map(|d| d.ordinal()).collect::<Vec<_>>(),
            team.endpoint().map_or(0, |e| e.id()),
            team.size()
        ),
    }
    let value: u64 = 0x5eed_0000_c0de_0042;
    let offset = 4096;
    team.store(offset, &value.to_le_bytes())?;
    println!("stored {value:#x} at offset {offset} through the multicast range");
    let mut ok = true;
    for (i, d) in devices.iter().enumerate() {
        let mut b = [0u8; 8];
        team.load(i, offset, &mut b)?;
        let got = u64::from_le_bytes(b);
        let good = got == value;
        ok &= good;
        println!(
            "device {}: read {got:#x} from its own memory at {:#x}: {}",
            d.ordinal(),
            team.member_ptr(i)? + offset as u64,
            if good { "ok" } else { "WRONG" }
        );
    }
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("a member did not see the stored value");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
