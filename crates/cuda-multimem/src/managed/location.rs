//! Where managed memory lives or is meant to live.

use cuda_multimem_sys::{CUdevice, CUmemLocation, CUmemLocationType};

use crate::error::Result;
use crate::{Device, Driver};

/// `CU_DEVICE_CPU`: the host, in the older `CUdevice` ABIs.
pub(crate) const DEVICE_CPU: CUdevice = -1;
/// `CU_DEVICE_INVALID`.
pub(crate) const DEVICE_INVALID: CUdevice = -2;

/// A location for managed memory: a device, the host, a host NUMA node, or the host NUMA node
/// of the calling thread's CPU.
///
/// Which operation takes which location follows the driver's rules: prefetch and preferred
/// location take all four; accessed-by takes a device or the host only. Host NUMA locations
/// need a CUDA 12.2+ driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// The memory of the device with this ordinal.
    Device(i32),
    /// Host memory (no particular NUMA node).
    Host,
    /// Host memory on this NUMA node.
    HostNuma(i32),
    /// Host memory on the NUMA node closest to the calling thread's CPU. A 13.0 driver reports
    /// a prefetch to it back as this location (not as the node it chose).
    HostNumaCurrent,
}

impl From<&Device> for Location {
    fn from(d: &Device) -> Self {
        Location::Device(d.ordinal())
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Device(d) => write!(f, "device {d}"),
            Location::Host => f.write_str("host"),
            Location::HostNuma(n) => write!(f, "host NUMA node {n}"),
            Location::HostNumaCurrent => f.write_str("the current thread's host NUMA node"),
        }
    }
}

impl Location {
    /// The location of `device`'s memory.
    pub fn device(device: &Device) -> Self {
        Location::from(device)
    }

    /// Whether this is a host-NUMA location (which needs the CUDA 12.2 `CUmemLocation` ABIs).
    pub fn is_host_numa(self) -> bool {
        matches!(self, Location::HostNuma(_) | Location::HostNumaCurrent)
    }

    /// The same place as a VMM location (`None` for [`Location::HostNumaCurrent`], which only
    /// managed memory has).
    fn as_vmm(self) -> Option<crate::vmm::Location> {
        match self {
            Location::Device(d) => Some(crate::vmm::Location::Device(d)),
            Location::Host => Some(crate::vmm::Location::Host),
            Location::HostNuma(n) => Some(crate::vmm::Location::HostNuma(n)),
            Location::HostNumaCurrent => None,
        }
    }

    /// Reject device ordinals the driver lacks and negative NUMA ids, before any driver call
    /// (the VMM location's check).
    pub(crate) fn validate(self, driver: &Driver, arg: &'static str) -> Result<()> {
        self.as_vmm().map_or(Ok(()), |l| l.validate(driver, arg))
    }

    /// The `CUmemLocation` of this location.
    pub(crate) fn to_raw(self) -> CUmemLocation {
        self.as_vmm().map_or_else(
            || CUmemLocation {
                type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT,
                ..Default::default()
            },
            crate::vmm::Location::raw,
        )
    }

    /// The `CUdevice` of the older ABIs (`CU_DEVICE_CPU` for the host); `None` for host NUMA
    /// locations, which those ABIs cannot express.
    pub(crate) fn legacy(self) -> Option<CUdevice> {
        match self {
            Location::Device(d) => Some(d),
            Location::Host => Some(DEVICE_CPU),
            Location::HostNuma(_) | Location::HostNumaCurrent => None,
        }
    }

    /// A location from a `CUdevice` answer of the older attributes (`None`: no single one).
    pub(crate) fn from_legacy(d: CUdevice) -> Option<Location> {
        match d {
            DEVICE_CPU => Some(Location::Host),
            d if d >= 0 => Some(Location::Device(d)),
            _ => None,
        }
    }

    /// A location from a `_TYPE`/`_ID` attribute pair (`None`: invalid, i.e. no single one).
    pub(crate) fn from_type_id(t: u32, id: i32) -> Option<Location> {
        match CUmemLocationType(t) {
            CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => Some(Location::Device(id)),
            CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST => Some(Location::Host),
            CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA => Some(Location::HostNuma(id)),
            CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => {
                Some(Location::HostNumaCurrent)
            }
            _ => None,
        }
    }
}
