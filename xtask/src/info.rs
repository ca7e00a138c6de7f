//! `cargo xtask info [--json]`: what the selected driver and its devices can do.

use cuda_multimem::{Device, Driver};
use serde_json::{json, Value};

use crate::Result;

fn feature(available: bool, why_not: impl Into<String>) -> Value {
    if available {
        json!({ "available": true })
    } else {
        json!({ "available": false, "reason": why_not.into() })
    }
}

#[allow(clippy::field_reassign_with_default)] // an FFI struct with a union, filled field by field
fn granularity(d: &Device) -> (Value, Value) {
    use cuda_multimem::sys::*;
    let mut prop = CUmemAllocationProp::default();
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.__bindgen_anon_1.id = d.ordinal();
    let get = |flag: CUmemAllocationGranularity_flags| -> Value {
        let Ok(f) = d.driver().sys().cuMemGetAllocationGranularity() else {
            return Value::Null;
        };
        let mut g = 0usize;
        // SAFETY: valid out-pointer and property struct.
        let rc = unsafe { f(&mut g, &prop, flag) };
        if rc == CUresult::CUDA_SUCCESS {
            json!(g)
        } else {
            Value::Null
        }
    };
    (
        get(CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        get(CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
    )
}

/// Why multicast creation is refused by policy, if it is (the library's own guard decides).
pub fn multicast_policy() -> Option<String> {
    cuda_multimem::multicast::multicast_allowed().err()
}

/// Build the report.
pub fn report(driver: &Driver) -> Result<Value> {
    let sys = driver.sys();
    let v = driver.version();
    let mut devices = Vec::new();
    let mut any_multicast = false;
    let mut any_le = false;
    for d in driver.devices() {
        let (gmin, grec) = granularity(&d);
        let cc = d.compute_capability()?;
        let mc = d.supports_multicast()?;
        any_multicast |= mc;
        let le_u = d.logical_endpoint_unicast()?;
        let le_m = d.logical_endpoint_multicast()?;
        any_le |= le_u.unwrap_or(false) || le_m.unwrap_or(false);
        devices.push(json!({
            "ordinal": d.ordinal(),
            "name": d.name()?,
            "compute_capability": format!("{}.{}", cc.0, cc.1),
            "vmm": d.supports_vmm()?,
            "multicast": mc,
            "logical_endpoint_unicast": le_u,
            "logical_endpoint_multicast": le_m,
            "fabric_handle": d.supports_fabric_handle()?,
            "posix_fd_handle": d.supports_posix_fd_handle()?,
            "concurrent_managed_access": d.concurrent_managed_access()?,
            "host_numa_id": d.host_numa_id()?,
            "granularity_min": gmin,
            "granularity_recommended": grec,
        }));
    }
    let avail = |name: &str, abi: i32| sys.availability(name, abi).map_err(|e| e.to_string());
    let batch = avail("cuMemPrefetchBatchAsync", 13000);
    let mcast = avail("cuMulticastCreate", 12010);
    let per_dev = avail("cuMulticastBindMem", 13010);
    let le = avail("cuLogicalEndpointCreate", 13030);
    let policy = multicast_policy();
    let features = json!({
        "managed_batch_operations": feature(batch.is_ok(), batch.clone().err().unwrap_or_default()),
        "multicast": match (&mcast, any_multicast, &policy) {
            (Err(e), _, _) => feature(false, e.clone()),
            (Ok(()), false, _) => feature(false, "no device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"),
            (Ok(()), true, Some(p)) => feature(false, format!("supported by the driver and devices, disabled by policy: {p}")),
            (Ok(()), true, None) => feature(true, ""),
        },
        "multicast_per_device_bind": feature(per_dev.is_ok(), per_dev.clone().err().unwrap_or_default()),
        "logical_endpoints": match (&le, any_le) {
            (Err(e), _) => feature(false, e.clone()),
            (Ok(()), false) => feature(false, "no device reports logical endpoint support"),
            (Ok(()), true) => feature(true, ""),
        },
    });
    Ok(json!({
        "driver_version": v,
        "simulated": driver.is_simulated(),
        "origin": sys.origin().to_string(),
        "devices": devices,
        "features": features,
    }))
}

/// Entry point of `cargo xtask info`.
pub fn info(as_json: bool) -> Result<()> {
    let driver = cuda_multimem_sim::driver_from_env().map_err(|e| {
        format!("{e}\nno CUDA driver could be used; set CUDA_MULTIMEM_DRIVER=sim (e.g. sim:devices=8,version=13030) to inspect the simulated driver")
    })?;
    let r = report(&driver)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "driver {} ({}){}",
        r["driver_version"],
        r["origin"].as_str().unwrap_or(""),
        if driver.is_simulated() {
            " [simulated]"
        } else {
            ""
        }
    );
    for d in r["devices"].as_array().into_iter().flatten() {
        println!(
            "  device {} {} (sm {}): vmm={} multicast={} le_unicast={} le_multicast={} fabric={} posix_fd={} managed_concurrent={} numa={} granularity={}/{}",
            d["ordinal"], d["name"].as_str().unwrap_or(""), d["compute_capability"].as_str().unwrap_or(""), d["vmm"], d["multicast"],
            d["logical_endpoint_unicast"], d["logical_endpoint_multicast"], d["fabric_handle"], d["posix_fd_handle"],
            d["concurrent_managed_access"], d["host_numa_id"], d["granularity_min"], d["granularity_recommended"]
        );
    }
    for (k, f) in r["features"].as_object().into_iter().flatten() {
        match f["available"].as_bool() {
            Some(true) => println!("  {k}: available"),
            _ => println!("  {k}: unavailable: {}", f["reason"].as_str().unwrap_or("")),
        }
    }
    Ok(())
}
