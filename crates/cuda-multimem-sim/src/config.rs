//! What the simulated machine looks like: devices, their capabilities, the driver version.

use std::fmt;

/// Lowest and highest driver versions the simulator can pretend to be.
pub const VERSION_RANGE: (i32, i32) = (12000, 13050);

/// Most devices of one simulated machine: one NVL72 domain (the collectives' largest team).
pub const MAX_DEVICES: usize = 72;

/// One simulated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimDeviceConfig {
    /// Name reported by `cuDeviceGetName`.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Bytes of device memory.
    pub memory: u64,
    /// Multiprocessor count.
    pub multiprocessors: i32,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` (drivers from 12.1).
    pub multicast: bool,
    /// `CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_UNICAST_SUPPORTED` (drivers from 13.3).
    pub logical_endpoint_unicast: bool,
    /// `CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_MULTICAST_SUPPORTED` (drivers from 13.3).
    pub logical_endpoint_multicast: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`.
    pub fabric_handle: bool,
    /// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
    pub posix_fd_handle: bool,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` (-1: the host has no NUMA).
    pub host_numa_id: i32,
    /// NVLink clique: devices with the same clique id are peers (P2P, multicast teams).
    pub clique: u32,
    /// VMM allocation granularity, minimum and recommended, in bytes.
    pub granularity: (usize, usize),
}

impl SimDeviceConfig {
    /// An H200-like device: 141 GB, VMM, multicast, fabric and POSIX-fd handles, 2 MiB granularity,
    /// logical endpoints (reported only by 13.3+ drivers), clique 0, host NUMA node 0.
    pub fn h200() -> Self {
        SimDeviceConfig {
            name: "Simulated NVIDIA H200".into(),
            compute_capability: (9, 0),
            memory: 143_771 << 20,
            multiprocessors: 132,
            vmm: true,
            multicast: true,
            logical_endpoint_unicast: true,
            logical_endpoint_multicast: true,
            fabric_handle: true,
            posix_fd_handle: true,
            concurrent_managed_access: true,
            host_numa_id: 0,
            clique: 0,
            granularity: (2 << 20, 2 << 20),
        }
    }
}

/// The whole simulated machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// The devices, by ordinal.
    pub devices: Vec<SimDeviceConfig>,
    /// What `cuDriverGetVersion` reports; decides which entry points exist.
    pub version: i32,
    /// Host NUMA nodes that exist (ids `0..host_numa_nodes`).
    pub host_numa_nodes: i32,
    /// Polls of `cuLogicalEndpointQuery` before an endpoint reports ready.
    pub endpoint_ready_polls: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig::new(2, 13000)
    }
}

/// A malformed simulator description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An option is not `key=value`.
    #[error("simulator option `{0}` is not of the form key=value")]
    Malformed(String),
    /// An option name the simulator does not know.
    #[error("unknown simulator option `{key}` (known: {known})")]
    UnknownOption {
        /// The option.
        key: String,
        /// The options that exist.
        known: &'static str,
    },
    /// A value that does not parse or is out of range.
    #[error("simulator option `{key}`: `{value}` is invalid: {expected}")]
    InvalidValue {
        /// The option.
        key: String,
        /// The value given.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
}

const KNOWN: &str = "devices, version, vmm, multicast, endpoints, fabric, posix_fd, managed, numa, numa_nodes, cliques, granularity, memory_mib, ready_polls";

impl SimConfig {
    /// `devices` H200-like devices in one NVLink clique, at driver `version`. A machine has at
    /// most [`MAX_DEVICES`] devices: a larger count describes one more (without building a
    /// description per device asked for), which [`SimConfig::validate`] and
    /// [`crate::Simulator::start`] refuse.
    pub fn new(devices: usize, version: i32) -> Self {
        SimConfig {
            devices: (0..devices.min(MAX_DEVICES + 1))
                .map(|_| SimDeviceConfig::h200())
                .collect(),
            version,
            host_numa_nodes: 1,
            endpoint_ready_polls: 3,
        }
    }

    /// Apply `f` to every device.
    pub fn with_all(mut self, f: impl Fn(&mut SimDeviceConfig)) -> Self {
        self.devices.iter_mut().for_each(f);
        self
    }

    /// Check the description.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: String, expected| {
            Err(ConfigError::InvalidValue {
                key: key.into(),
                value,
                expected,
            })
        };
        if self.devices.is_empty() || self.devices.len() > MAX_DEVICES {
            return bad("devices", self.devices.len().to_string(), "1 to 72 devices");
        }
        if !(VERSION_RANGE.0..=VERSION_RANGE.1).contains(&self.version) || self.version % 10 != 0 {
            return bad(
                "version",
                self.version.to_string(),
                "a CUDA version from 12000 to 13050, a multiple of 10",
            );
        }
        if self.host_numa_nodes < 0 {
            return bad(
                "numa_nodes",
                self.host_numa_nodes.to_string(),
                "a count of host NUMA nodes, 0 or more",
            );
        }
        for d in &self.devices {
            let (min, rec) = d.granularity;
            if !min.is_power_of_two() || !rec.is_power_of_two() || rec < min || min < 4096 {
                return bad(
                    "granularity",
                    format!("{min}/{rec}"),
                    "powers of two, at least 4096, recommended >= minimum",
                );
            }
            if d.host_numa_id < -1 || d.host_numa_id >= self.host_numa_nodes {
                return bad(
                    "numa",
                    d.host_numa_id.to_string(),
                    "a host NUMA id below numa_nodes, or -1",
                );
            }
        }
        Ok(())
    }

    /// Parse the options of `CUDA_MULTIMEM_DRIVER=sim:<options>`: comma-separated `key=value`.
    ///
    /// Keys: `devices` (count), `version` (12000..=13050), `vmm`, `multicast`, `endpoints`,
    /// `fabric`, `posix_fd`, `managed` (0/1, every device), `numa` (host NUMA id of every device,
    /// -1 for none), `numa_nodes`, `cliques` (clique size: devices are grouped in order),
    /// `granularity` (bytes), `memory_mib`, `ready_polls`.
    pub fn parse(options: &str) -> Result<Self, ConfigError> {
        let mut cfg = SimConfig::default();
        let mut pairs = Vec::new();
        for opt in options.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = opt
                .split_once('=')
                .ok_or_else(|| ConfigError::Malformed(opt.into()))?;
            pairs.push((k.trim().to_string(), v.trim().to_string()));
        }
        // Each value parses as its field's type, so an out-of-range number is an error rather
        // than a value wrapped into range (`version=4294979296` is not 12000).
        fn num<T: std::str::FromStr>(
            k: &str,
            v: &str,
            expected: &'static str,
        ) -> Result<T, ConfigError> {
            v.parse::<T>().map_err(|_| ConfigError::InvalidValue {
                key: k.into(),
                value: v.into(),
                expected,
            })
        }
        let int = num::<i64>;
        let flag = |k: &str, v: &str| match v {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err(ConfigError::InvalidValue {
                key: k.into(),
                value: v.into(),
                expected: "0 or 1",
            }),
        };
        // The device count first: every other option applies to all devices. A repeated option
        // takes its last value, this one too.
        if let Some((k, v)) = pairs.iter().rev().find(|(k, _)| k == "devices") {
            let n = int(k, v, "a device count from 1 to 72")?;
            if !(1..=MAX_DEVICES as i64).contains(&n) {
                return Err(ConfigError::InvalidValue {
                    key: k.clone(),
                    value: v.clone(),
                    expected: "a device count from 1 to 72",
                });
            }
            cfg = SimConfig::new(n as usize, cfg.version);
        }
        for (k, v) in &pairs {
            match k.as_str() {
                "devices" => {}
                "version" => cfg.version = num(k, v, "a CUDA version such as 13000")?,
                "vmm" => {
                    let f = flag(k, v)?;
                    cfg.devices.iter_mut().for_each(|d| d.vmm = f)
                }
                "multicast" => {
                    let f = flag(k, v)?;
                    cfg.devices.iter_mut().for_each(|d| d.multicast = f)
                }
                "endpoints" => {
                    let f = flag(k, v)?;
                    cfg.devices.iter_mut().for_each(|d| {
                        d.logical_endpoint_unicast = f;
                        d.logical_endpoint_multicast = f;
                    })
                }
                "fabric" => {
                    let f = flag(k, v)?;
                    cfg.devices.iter_mut().for_each(|d| d.fabric_handle = f)
                }
                "posix_fd" => {
                    let f = flag(k, v)?;
                    cfg.devices.iter_mut().for_each(|d| d.posix_fd_handle = f)
                }
                "managed" => {
                    let f = flag(k, v)?;
                    cfg.devices
                        .iter_mut()
                        .for_each(|d| d.concurrent_managed_access = f)
                }
                "numa" => {
                    let n = num(k, v, "a host NUMA id, or -1")?;
                    cfg.devices.iter_mut().for_each(|d| d.host_numa_id = n)
                }
                "numa_nodes" => cfg.host_numa_nodes = num(k, v, "a count of host NUMA nodes")?,
                "cliques" => {
                    let n = int(k, v, "a clique size of at least 1")?;
                    if n < 1 {
                        return Err(ConfigError::InvalidValue {
                            key: k.clone(),
                            value: v.clone(),
                            expected: "a clique size of at least 1",
                        });
                    }
                    cfg.devices
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, d)| d.clique = (i as i64 / n) as u32)
                }
                "granularity" => {
                    let g = num(k, v, "a power of two in bytes")?;
                    cfg.devices.iter_mut().for_each(|d| d.granularity = (g, g))
                }
                "memory_mib" => {
                    let m = num::<u64>(k, v, "MiB of device memory")?;
                    let Some(bytes) = m.checked_mul(1 << 20).filter(|_| m >= 1) else {
                        return Err(ConfigError::InvalidValue {
                            key: k.clone(),
                            value: v.clone(),
                            expected: "at least 1 MiB, at most 2^44 - 1 MiB",
                        });
                    };
                    cfg.devices.iter_mut().for_each(|d| d.memory = bytes)
                }
                "ready_polls" => {
                    cfg.endpoint_ready_polls = int(k, v, "a poll count")?.clamp(0, 1 << 20) as u32
                }
                _ => {
                    return Err(ConfigError::UnknownOption {
                        key: k.clone(),
                        known: KNOWN,
                    })
                }
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

impl fmt::Display for SimConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "simulated CUDA driver {}.{} with {} device(s)",
            self.version / 1000,
            (self.version % 1000) / 10,
            self.devices.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_version() {
        let c = SimConfig::parse("devices=8,version=13030").unwrap();
        assert_eq!(c.devices.len(), 8);
        assert_eq!(c.version, 13030);
    }

    #[test]
    fn rejects_bad_options_with_the_key_named() {
        assert!(matches!(
            SimConfig::parse("devices"),
            Err(ConfigError::Malformed(_))
        ));
        assert!(matches!(
            SimConfig::parse("colour=blue"),
            Err(ConfigError::UnknownOption { .. })
        ));
        let e = SimConfig::parse("devices=0").unwrap_err();
        assert!(e.to_string().contains("devices"), "{e}");
        let e = SimConfig::parse("version=11080").unwrap_err();
        assert!(e.to_string().contains("version"), "{e}");
        let e = SimConfig::parse("version=abc").unwrap_err();
        assert!(e.to_string().contains("abc"), "{e}");
        assert!(SimConfig::parse("multicast=maybe").is_err());
        assert!(SimConfig::parse("granularity=3000").is_err());
    }

    #[test]
    fn clique_size_groups_devices_in_order() {
        let c = SimConfig::parse("devices=4,cliques=2").unwrap();
        let cl: Vec<_> = c.devices.iter().map(|d| d.clique).collect();
        assert_eq!(cl, [0, 0, 1, 1]);
    }
}
