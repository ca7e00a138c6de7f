//! Stage data to the GPU and back through managed memory with prefetches, and check it.
//!
//! Uses the driver `CUDA_MULTIMEM_DRIVER` selects when it is set; otherwise the real driver, and
//! when none can be loaded (or it has no device) says so and runs on the simulated driver. (The
//! example may fall back; the library never does.)
//!
//! ```text
//! cargo run -p cuda-multimem --example managed
//! CUDA_MULTIMEM_DRIVER=sim:devices=1,version=12080 cargo run -p cuda-multimem --example managed
//! ```

use std::process::ExitCode;

use cuda_multimem::managed::{self, Location, ManagedBuffer};
use cuda_multimem::{Driver, Error, Stream, DRIVER_ENV};

const MIB: usize = 1 << 20;
const SIMULATED: &str = "sim:devices=1,version=13000";

fn driver() -> Result<Driver, Error> {
    if std::env::var_os(DRIVER_ENV).is_some() {
        return cuda_multimem_sim::driver_from_env();
    }
    match Driver::load() {
        Ok(d) if d.device_count() > 0 => Ok(d),
        Ok(_) => {
            println!(
                "the CUDA driver reports no device; running on the simulated driver ({SIMULATED})"
            );
            cuda_multimem_sim::driver_from_selection(SIMULATED)
        }
        Err(e) => {
            println!("no CUDA driver could be loaded ({e}); running on the simulated driver ({SIMULATED})");
            cuda_multimem_sim::driver_from_selection(SIMULATED)
        }
    }
}

fn run() -> Result<bool, Error> {
    let driver = driver()?;
    let gpu = driver.device(0)?;
    println!(
        "driver {} ({}), device 0: {}",
        driver.version(),
        if driver.is_simulated() {
            "simulated"
        } else {
            "real"
        },
        gpu.name()?
    );
    if !gpu.concurrent_managed_access()? {
        println!(
            "device 0 has no concurrent managed access; prefetching to it is not possible here"
        );
        return Ok(true);
    }
    let stream = Stream::new(&gpu)?;
    let mut buf = ManagedBuffer::new(&gpu, 64 * MIB)?;

    // Fill on the host with a reproducible pattern.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let expected: Vec<u8> = (0..buf.len())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    buf.host_slice_mut()?.copy_from_slice(&expected);

    // Advise: the GPU is where the data belongs, and the host reads it back.
    buf.set_preferred_location(Location::device(&gpu))?;
    buf.add_accessed_by(Location::device(&gpu))?;
    println!(
        "advice: preferred location {:?}, accessed by {:?}",
        buf.preferred_location()?,
        buf.accessed_by()?
    );

    // To the GPU in 2 MiB ranges: many ranges, one call where the driver has the batch call.
    let ranges: Vec<_> = (0..32)
        .map(|i| buf.subrange(i * 2 * MIB, 2 * MIB))
        .collect::<Result<_, _>>()?;
    managed::prefetch_many(&ranges, &[Location::device(&gpu)], &stream)?;
    stream.synchronize()?;
    println!(
        "prefetched to the GPU: last prefetch location {:?}",
        buf.last_prefetch_location()?
    );

    // And back to the host.
    buf.unset_preferred_location()?;
    buf.prefetch(Location::Host, &stream)?;
    stream.synchronize()?;
    println!(
        "prefetched to the host: last prefetch location {:?}",
        buf.last_prefetch_location()?
    );

    let got = buf.host_slice()?;
    let bad = got.iter().zip(&expected).filter(|(a, b)| a != b).count();
    if bad == 0 {
        println!("OK: all {} bytes came back unchanged", got.len());
        Ok(true)
    } else {
        println!("MISMATCH: {bad} of {} bytes differ", got.len());
        Ok(false)
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
