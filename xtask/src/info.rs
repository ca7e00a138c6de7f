//! `cargo xtask info [--json]`: what the selected driver and its devices can do, and how the
//! devices reach each other.
//!
//! The human form is three tables: the devices, their features (each missing one with the reason:
//! the attribute is 0, the driver predates it, or a policy variable disables it), and a peer
//! matrix in the manner of `nvidia-smi topo -m` from `cuDeviceCanAccessPeer` and
//! `cuDeviceGetP2PAttribute`, followed by the fabric cliques and cluster where the driver reports
//! them (CUDA 13.4+). `--json` carries the same facts.

use cuda_multimem::sys::{
    CUcliqueInfo, CUcliqueType, CUdevice_P2PAttribute, CUdevice_attribute as A, CUresult, CUuuid,
};
use cuda_multimem::{Device, Driver};
use serde_json::{json, Value};

use crate::Result;

/// One capability of a device: available, or not and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Feature {
    /// Whether a program can use it.
    pub available: bool,
    /// Why not; when available, an empty string or a note (the NUMA node, a caveat).
    pub reason: String,
}

impl Feature {
    fn yes() -> Self {
        Feature {
            available: true,
            reason: String::new(),
        }
    }
    fn no(reason: impl Into<String>) -> Self {
        Feature {
            available: false,
            reason: reason.into(),
        }
    }
    /// `{"available": true}`, `{"available": true, "note": ...}` (host NUMA: "node 0"; a caveat),
    /// or `{"available": false, "reason": ...}`.
    fn json(&self) -> Value {
        match (self.available, self.reason.is_empty()) {
            (_, true) => json!({ "available": self.available }),
            (true, false) => json!({ "available": true, "note": self.reason }),
            (false, false) => json!({ "available": false, "reason": self.reason }),
        }
    }
}

fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A boolean device attribute as a feature: the attribute's name and the CUDA version that
/// introduced it say why it is missing.
fn attribute_feature(d: &Device, attr: A, name: &str, since: i32) -> Result<Feature> {
    Ok(match d.attribute_opt(attr)? {
        Some(v) if v != 0 => Feature::yes(),
        Some(_) => Feature::no(format!("{name} = 0")),
        None => Feature::no(format!(
            "driver {} predates {name} (CUDA {})",
            cuda_version(d.driver().version()),
            cuda_version(since)
        )),
    })
}

/// A feature that also needs an entry point: the attribute decides, then the function's presence.
fn with_entry(f: Feature, driver: &Driver, symbol: &str, abi: i32) -> Feature {
    if !f.available {
        return f;
    }
    match driver.sys().availability(symbol, abi) {
        Ok(()) => f,
        Err(e) => Feature::no(e.to_string()),
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

/// `cuDeviceGetP2PAttribute(attr, src, dst)`, or the driver's refusal as text.
fn p2p_attribute(
    driver: &Driver,
    attr: CUdevice_P2PAttribute,
    src: i32,
    dst: i32,
) -> std::result::Result<i32, String> {
    let f = driver
        .sys()
        .cuDeviceGetP2PAttribute()
        .map_err(|e| e.to_string())?;
    let mut v = 0;
    // SAFETY: one int written through a valid pointer; the ordinals are the driver's devices.
    let rc = unsafe { f(&mut v, attr, src, dst) };
    if rc == CUresult::CUDA_SUCCESS {
        Ok(v)
    } else {
        Err(format!("cuDeviceGetP2PAttribute: {rc:?}"))
    }
}

/// The device's fabric cluster UUID and cliques (CUDA 13.4+), or why they are not reported.
fn fabric(d: &Device) -> std::result::Result<(String, Vec<CUcliqueInfo>), String> {
    let sys = d.driver().sys();
    let uuid_fn = sys
        .cuDeviceGetFabricClusterUuid()
        .map_err(|e| e.to_string())?;
    let count_fn = sys.cuDeviceGetCliqueCount().map_err(|e| e.to_string())?;
    let info_fn = sys.cuDeviceGetCliqueInfo().map_err(|e| e.to_string())?;
    let mut u = CUuuid::default();
    // SAFETY: one CUuuid written through a valid pointer.
    let rc = unsafe { uuid_fn(&mut u, d.ordinal()) };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetFabricClusterUuid: {rc:?}"));
    }
    let mut n = 0usize;
    // SAFETY: one size_t written through a valid pointer.
    let rc = unsafe { count_fn(&mut n, d.ordinal()) };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCliqueCount: {rc:?}"));
    }
    let mut cliques = vec![CUcliqueInfo::default(); n];
    // SAFETY: the array holds `n` entries, the count passed in; the driver writes at most that many.
    let rc = unsafe { info_fn(cliques.as_mut_ptr(), &mut n, d.ordinal()) };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCliqueInfo: {rc:?}"));
    }
    cliques.truncate(n);
    let hex: String = u
        .bytes
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect();
    Ok((hex, cliques))
}

fn clique_type_name(t: CUcliqueType) -> String {
    match t {
        CUcliqueType::CU_CLIQUE_TYPE_UNICAST_POINTER => "unicast_pointer".into(),
        CUcliqueType::CU_CLIQUE_TYPE_MULTICAST_POINTER => "multicast_pointer".into(),
        CUcliqueType::CU_CLIQUE_TYPE_UNICAST_LOGICAL_ENDPOINT => "unicast_logical_endpoint".into(),
        CUcliqueType::CU_CLIQUE_TYPE_MULTICAST_LOGICAL_ENDPOINT => {
            "multicast_logical_endpoint".into()
        }
        other => format!("type_{}", other.0),
    }
}

/// The device's features, in table order: (JSON key, column title, feature).
fn device_features(d: &Device) -> Result<Vec<(&'static str, &'static str, Feature)>> {
    let driver = d.driver();
    let vmm = with_entry(
        attribute_feature(
            d,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
            10020,
        )?,
        driver,
        "cuMemCreate",
        10020,
    );
    let mut multicast = with_entry(
        attribute_feature(
            d,
            A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
            "MULTICAST_SUPPORTED",
            12010,
        )?,
        driver,
        "cuMulticastCreate",
        12010,
    );
    if multicast.available {
        let env = multicast_policy();
        match (cuda_multimem::multicast::multicast_allowed_for(driver), env) {
            (Err(p), _) => multicast = Feature::no(format!("disabled by policy: {p}")),
            (Ok(()), Some(p)) => {
                multicast.reason = format!("policy ignored by the simulated driver: {p}")
            }
            (Ok(()), None) => {}
        }
    }
    let le = |attr, name| -> Result<Feature> {
        Ok(with_entry(
            attribute_feature(d, attr, name, 13030)?,
            driver,
            "cuLogicalEndpointCreate",
            13030,
        ))
    };
    let le_u = le(
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_UNICAST_SUPPORTED,
        "LOGICAL_ENDPOINT_UNICAST_SUPPORTED",
    )?;
    let le_m = le(
        A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_MULTICAST_SUPPORTED,
        "LOGICAL_ENDPOINT_MULTICAST_SUPPORTED",
    )?;
    let fabric = attribute_feature(
        d,
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
        "HANDLE_TYPE_FABRIC_SUPPORTED",
        12030,
    )?;
    let fd = attribute_feature(
        d,
        A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        10020,
    )?;
    let managed = attribute_feature(
        d,
        A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
        "CONCURRENT_MANAGED_ACCESS",
        8000,
    )?;
    let numa = match d.attribute_opt(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)? {
        Some(id) if id >= 0 => Feature {
            available: true,
            reason: format!("node {id}"),
        },
        Some(id) => Feature::no(format!("HOST_NUMA_ID = {id} (the host has no NUMA)")),
        None => Feature::no(format!(
            "driver {} predates HOST_NUMA_ID (CUDA 12.2)",
            cuda_version(driver.version())
        )),
    };
    Ok(vec![
        ("vmm", "VMM", vmm),
        ("multicast", "Multicast", multicast),
        ("logical_endpoint_unicast", "LE unicast", le_u),
        ("logical_endpoint_multicast", "LE multicast", le_m),
        ("fabric_handle", "Fabric", fabric),
        ("posix_fd_handle", "POSIX fd", fd),
        ("concurrent_managed_access", "Managed", managed),
        ("host_numa", "Host NUMA", numa),
    ])
}

/// Build the report.
pub fn report(driver: &Driver) -> Result<Value> {
    let sys = driver.sys();
    let v = driver.version();
    let devices = driver.devices();
    let mut dev_json = Vec::new();
    let mut any_multicast = false;
    let mut any_le = false;
    let mut fabrics = Vec::new();
    for d in &devices {
        let (gmin, grec) = granularity(d);
        let cc = d.compute_capability()?;
        let feats = device_features(d)?;
        any_multicast |= d.supports_multicast()?;
        any_le |= d.logical_endpoint_unicast()?.unwrap_or(false)
            || d.logical_endpoint_multicast()?.unwrap_or(false);
        let features: serde_json::Map<String, Value> = feats
            .iter()
            .map(|(k, _, f)| (k.to_string(), f.json()))
            .collect();
        let fab = fabric(d);
        let fabric_json = match &fab {
            Ok((uuid, cliques)) => json!({
                "cluster_uuid": uuid,
                "cliques": cliques.iter().map(|c| json!({ "type": clique_type_name(c.type_), "id": c.id })).collect::<Vec<_>>(),
            }),
            Err(e) => json!({ "reason": e }),
        };
        fabrics.push(fab.ok());
        dev_json.push(json!({
            "ordinal": d.ordinal(),
            "name": d.name()?,
            "compute_capability": format!("{}.{}", cc.0, cc.1),
            "memory_bytes": d.total_memory()?,
            "multiprocessors": d.multiprocessor_count()?,
            "granularity_min": gmin,
            "granularity_recommended": grec,
            "features": features,
            "fabric": fabric_json,
        }));
    }
    // Every ordered pair of distinct devices.
    let unicast_clique = |i: usize| -> Option<u32> {
        let (_, cliques) = fabrics[i].as_ref()?;
        cliques
            .iter()
            .find(|c| c.type_ == CUcliqueType::CU_CLIQUE_TYPE_UNICAST_POINTER)
            .map(|c| c.id)
    };
    let mut peers = Vec::new();
    for (i, a) in devices.iter().enumerate() {
        for (j, b) in devices.iter().enumerate() {
            if i == j {
                continue;
            }
            let attr = |x| match p2p_attribute(driver, x, a.ordinal(), b.ordinal()) {
                Ok(v) => json!(v),
                Err(e) => json!({ "error": e }),
            };
            let same_cluster = match (&fabrics[i], &fabrics[j]) {
                (Some((x, _)), Some((y, _))) => json!(x == y),
                _ => Value::Null,
            };
            let same_clique = match (unicast_clique(i), unicast_clique(j)) {
                (Some(x), Some(y)) => json!(x == y && same_cluster == json!(true)),
                _ => Value::Null,
            };
            peers.push(json!({
                "from": a.ordinal(),
                "to": b.ordinal(),
                "can_access_peer": a.can_access_peer(b)?,
                "access_supported": attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED),
                "native_atomics": attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED),
                "cuda_array_access": attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED),
                "performance_rank": attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK),
                "same_unicast_clique": same_clique,
                "same_fabric_cluster": same_cluster,
            }));
        }
    }
    let avail = |name: &str, abi: i32| sys.availability(name, abi).map_err(|e| e.to_string());
    let batch = avail("cuMemPrefetchBatchAsync", 13000);
    let mcast = avail("cuMulticastCreate", 12010);
    let per_dev = avail("cuMulticastBindMem", 13010);
    let le = avail("cuLogicalEndpointCreate", 13030);
    let policy = multicast_policy();
    let lib_policy = cuda_multimem::multicast::multicast_allowed_for(driver).err();
    let entry = |r: &std::result::Result<(), String>| match r {
        Ok(()) => Feature::yes(),
        Err(e) => Feature::no(e.clone()),
    };
    let features = json!({
        "managed_batch_operations": entry(&batch).json(),
        "multicast": match (&mcast, any_multicast, &lib_policy) {
            (Err(e), _, _) => Feature::no(e.clone()),
            (Ok(()), false, _) => Feature::no("no device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"),
            (Ok(()), true, Some(p)) => Feature::no(format!("supported by the driver and devices, disabled by policy: {p}")),
            (Ok(()), true, None) => Feature::yes(),
        }.json(),
        "multicast_per_device_bind": entry(&per_dev).json(),
        "logical_endpoints": match (&le, any_le) {
            (Err(e), _) => Feature::no(e.clone()),
            (Ok(()), false) => Feature::no("no device reports logical endpoint support"),
            (Ok(()), true) => Feature::yes(),
        }.json(),
    });
    Ok(json!({
        "driver_version": v,
        "simulated": driver.is_simulated(),
        "origin": sys.origin().to_string(),
        "multicast_policy": match &policy {
            None => json!({ "allowed": true }),
            Some(p) => json!({ "allowed": false, "reason": p, "applies": lib_policy.is_some() }),
        },
        "devices": dev_json,
        "peers": peers,
        "features": features,
    }))
}

/// A left-aligned text table: header, then rows, columns two spaces apart.
fn table(header: &[String], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        s.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(header);
    for r in rows {
        out += &line(r);
    }
    out
}

/// The human form of a report (what `cargo xtask info` prints).
pub fn render(r: &Value) -> String {
    let mut out = String::new();
    let v = r["driver_version"].as_i64().unwrap_or(0) as i32;
    out += &format!(
        "CUDA driver {} ({v}), {}{}\n",
        cuda_version(v),
        r["origin"].as_str().unwrap_or(""),
        if r["simulated"] == json!(true) {
            " [simulated]"
        } else {
            ""
        }
    );
    let p = &r["multicast_policy"];
    out += &match p["reason"].as_str() {
        None => "multicast policy: allowed (no NCCL_NVLS_ENABLE=0, CUDA_MULTIMEM_DISABLE_MULTICAST=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 or NVSHMEM_DISABLE_NVLS=1)\n".to_string(),
        Some(why) if p["applies"] == json!(true) => format!("multicast policy: disabled: {why}\n"),
        Some(why) => format!("multicast policy: {why} (a simulated driver does not apply it)\n"),
    };
    let devices: Vec<&Value> = r["devices"].as_array().into_iter().flatten().collect();

    // Devices.
    let rows: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            let gib = d["memory_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 30) as f64;
            let g = |k: &str| {
                d[k].as_u64()
                    .map(crate::bench::human_bytes)
                    .unwrap_or_else(|| "-".into())
            };
            vec![
                format!("GPU{}", d["ordinal"]),
                d["name"].as_str().unwrap_or("").to_string(),
                d["compute_capability"].as_str().unwrap_or("").to_string(),
                format!("{gib:.1} GiB"),
                d["multiprocessors"].to_string(),
                format!("{}/{}", g("granularity_min"), g("granularity_recommended")),
            ]
        })
        .collect();
    out += "\n";
    out += &table(
        &["GPU", "Name", "CC", "Memory", "SMs", "Granularity min/rec"].map(String::from),
        &rows,
    );

    // Features, with numbered notes for every reason.
    let keys = [
        ("vmm", "VMM"),
        ("multicast", "Multicast"),
        ("logical_endpoint_unicast", "LE unicast"),
        ("logical_endpoint_multicast", "LE multicast"),
        ("fabric_handle", "Fabric handle"),
        ("posix_fd_handle", "POSIX fd"),
        ("concurrent_managed_access", "Managed concurrent"),
        ("host_numa", "Host NUMA"),
    ];
    let mut notes: Vec<String> = Vec::new();
    let mut note = |why: &str| -> usize {
        match notes.iter().position(|n| n == why) {
            Some(i) => i + 1,
            None => {
                notes.push(why.to_string());
                notes.len()
            }
        }
    };
    let rows: Vec<Vec<String>> = devices
        .iter()
        .map(|d| {
            let mut row = vec![format!("GPU{}", d["ordinal"])];
            for (k, _) in keys {
                let f = &d["features"][k];
                let why = f["reason"].as_str().or(f["note"].as_str()).unwrap_or("");
                row.push(match (f["available"].as_bool().unwrap_or(false), why) {
                    (true, "") => "yes".into(),
                    (true, w) if k == "host_numa" => w.to_string(),
                    (true, w) => format!("yes [{}]", note(w)),
                    (false, w) => format!("no [{}]", note(w)),
                });
            }
            row
        })
        .collect();
    let mut header = vec!["GPU".to_string()];
    header.extend(keys.iter().map(|(_, t)| t.to_string()));
    out += "\n";
    out += &table(&header, &rows);
    for (i, n) in notes.iter().enumerate() {
        out += &format!("  [{}] {n}\n", i + 1);
    }

    // Peer matrix, as `nvidia-smi topo -m` lays it out.
    let n = devices.len();
    let pair = |i: usize, j: usize| -> Option<&Value> {
        r["peers"].as_array()?.iter().find(|p| {
            p["from"] == json!(devices[i]["ordinal"]) && p["to"] == json!(devices[j]["ordinal"])
        })
    };
    let mut header = vec![String::new()];
    header.extend((0..n).map(|j| format!("GPU{}", devices[j]["ordinal"])));
    header.push("Unicast clique".into());
    let rows: Vec<Vec<String>> = (0..n)
        .map(|i| {
            let mut row = vec![format!("GPU{}", devices[i]["ordinal"])];
            for j in 0..n {
                row.push(if i == j {
                    " X".into()
                } else {
                    pair(i, j).map(cell).unwrap_or_else(|| "?".into())
                });
            }
            let cl = devices[i]["fabric"]["cliques"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "unicast_pointer"))
                .map(|c| c["id"].to_string())
                .unwrap_or_else(|| "-".into());
            row.push(cl);
            row
        })
        .collect();
    out += "\nPeers (cuDeviceCanAccessPeer, cuDeviceGetP2PAttribute)\n";
    out += &table(&header, &rows);
    out += "\nLegend:\n";
    out += "  X    = self\n";
    out += "  P2P  = peer access (cuDeviceCanAccessPeer and ACCESS_SUPPORTED)\n";
    out += "  +A   = native atomics over the link (NATIVE_ATOMIC_SUPPORTED)\n";
    out += "  rN   = PERFORMANCE_RANK N (relative; lower is faster)\n";
    out += "  -    = no peer access\n";
    out += "  The CUDA driver API reports no link type (NVLink, PCIe) or link count: nvidia-smi topo -m (NVML) does.\n";

    // Fabric.
    out += "\nFabric (cuDeviceGetFabricClusterUuid, cuDeviceGetCliqueInfo)\n";
    let reasons: Vec<&str> = devices
        .iter()
        .filter_map(|d| d["fabric"]["reason"].as_str())
        .collect();
    if !reasons.is_empty() && reasons.len() == n && reasons.iter().all(|x| *x == reasons[0]) {
        out += &format!("  not reported: {}\n", reasons[0]);
    } else {
        for d in &devices {
            let f = &d["fabric"];
            out += &match f["reason"].as_str() {
                Some(why) => format!("  GPU{}: not reported: {why}\n", d["ordinal"]),
                None => format!(
                    "  GPU{}: cluster {}, cliques {}\n",
                    d["ordinal"],
                    f["cluster_uuid"].as_str().unwrap_or(""),
                    f["cliques"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|c| format!("{} {}", c["type"].as_str().unwrap_or(""), c["id"]))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
        }
    }

    // Driver-level features.
    out += "\nDriver features\n";
    for (k, f) in r["features"].as_object().into_iter().flatten() {
        match f["available"].as_bool() {
            Some(true) => out += &format!("  {k}: available\n"),
            _ => {
                out += &format!(
                    "  {k}: unavailable: {}\n",
                    f["reason"].as_str().unwrap_or("")
                )
            }
        }
    }
    out
}

/// One cell of the peer matrix.
fn cell(p: &Value) -> String {
    let can = p["can_access_peer"] == json!(true) && p["access_supported"] != json!(0);
    if !can {
        return " -".into();
    }
    let mut s = "P2P".to_string();
    if p["native_atomics"] == json!(1) {
        s += "+A";
    }
    if let Some(rank) = p["performance_rank"].as_i64() {
        s += &format!(" r{rank}");
    }
    s
}

/// Entry point of `cargo xtask info`.
pub fn info(as_json: bool) -> Result<()> {
    let driver = cuda_multimem_sim::driver_from_env().map_err(|e| {
        format!("{e}\nno CUDA driver could be used; set CUDA_MULTIMEM_DRIVER=sim (e.g. sim:devices=8,version=13030) to inspect the simulated driver")
    })?;
    let r = report(&driver)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", render(&r));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn simulated(options: &str) -> Driver {
        cuda_multimem_sim::driver_from_selection(&format!("sim:{options}"))
            .expect("simulated driver")
    }

    #[test]
    fn peers_follow_the_simulated_cliques() {
        let d = simulated("devices=4,cliques=2,version=13050");
        let r = report(&d).unwrap();
        let peers = r["peers"].as_array().unwrap();
        assert_eq!(peers.len(), 12);
        let p = |a: i64, b: i64| {
            peers
                .iter()
                .find(|p| p["from"] == a && p["to"] == b)
                .unwrap()
                .clone()
        };
        assert_eq!(p(0, 1)["can_access_peer"], true);
        assert_eq!(p(0, 1)["access_supported"], 1);
        assert_eq!(p(0, 1)["native_atomics"], 1);
        assert_eq!(p(0, 1)["same_unicast_clique"], true);
        assert_eq!(p(1, 2)["can_access_peer"], false);
        assert_eq!(p(1, 2)["access_supported"], 0);
        assert_eq!(p(1, 2)["same_fabric_cluster"], false);
        let text = render(&r);
        assert!(text.contains("P2P+A r0"), "{text}");
        assert!(text.contains("unicast_pointer 1"), "{text}");
    }

    #[test]
    fn missing_features_say_why() {
        let d = simulated("devices=2,version=13000,fabric=0");
        let r = report(&d).unwrap();
        let f = &r["devices"][0]["features"];
        assert_eq!(f["logical_endpoint_unicast"]["available"], false);
        let why = f["logical_endpoint_unicast"]["reason"].as_str().unwrap();
        assert!(why.contains("predates") && why.contains("13.3"), "{why}");
        assert_eq!(
            f["fabric_handle"]["reason"],
            "HANDLE_TYPE_FABRIC_SUPPORTED = 0"
        );
        let fabric = r["devices"][0]["fabric"]["reason"].as_str().unwrap();
        assert!(fabric.contains("cuDeviceGetFabricClusterUuid"), "{fabric}");
        assert_eq!(r["peers"][0]["same_unicast_clique"], Value::Null);
    }
}
