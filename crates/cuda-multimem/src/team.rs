//! A team: devices and a size give a multicast range bound to each member's memory, backed by
//! logical endpoints where the driver (13.3+) and every member support multicast endpoints, else
//! by a classic multicast object. [`Team::backend`] says which.
//!
//! ```no_run
//! use cuda_multimem::team::Team;
//! let driver = cuda_multimem::Driver::from_env()?;
//! let team = Team::new(&driver.devices()[..2], 2 << 20)?;
//! team.store(0, &[1, 2, 3, 4])?; // reaches both members' memory
//! let mut back = [0u8; 4];
//! team.load(1, 0, &mut back)?;
//! # Ok::<(), cuda_multimem::Error>(())
//! ```
//!
//! Both backends refuse to build under the multicast guard (`NCCL_NVLS_ENABLE=0`,
//! `CUDA_MULTIMEM_DISABLE_MULTICAST=1`) on a real driver, before any driver call.
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::Arc;
use std::time::Duration;

use cuda_multimem_sys::{
    CUdeviceptr, CUfabricCpyOperand, CUfabricCpyOperandType, CUDA_FABRIC_COPY_BATCH_OP,
};

use crate::endpoint::{
    EndpointBinding, EndpointSpec, LogicalEndpoint, LOGICAL_ENDPOINT_MIN_DRIVER,
};
use crate::error::{cu, Error, Result};
use crate::multicast::{MulticastBinding, MulticastMapping, MulticastObject, MulticastSpec};
use crate::vmm::{Access, Granularity, Location, Mapping, PhysicalAllocation};
use crate::{Device, Driver, Stream};

/// How long [`Team::new`] waits for a logical endpoint to be constructed.
pub const ENDPOINT_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// What backs a team's multicast range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// A classic multicast object mapped at a virtual address (`cuMulticast*`, 12.1+).
    MulticastObject,
    /// A multicast logical endpoint addressed by id and offset (`cuLogicalEndpoint*`, 13.3+).
    LogicalEndpoint,
}

/// Builds a [`Team`]: devices, size, and optionally a forced backend.
#[derive(Debug, Clone)]
pub struct TeamBuilder {
    devices: Vec<Device>,
    size: usize,
    backend: Option<Backend>,
}

impl TeamBuilder {
    /// Bytes per member (rounded up to the backend's granularity or bind alignment).
    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }

    /// Force a backend instead of choosing the best supported one. Code that needs a multicast
    /// *address* (device code with `multimem` instructions) asks for [`Backend::MulticastObject`].
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// Build the team: create the object or endpoint, add every member, allocate and bind each
    /// member's memory, and (multicast object) map the multicast range for all members. A failure
    /// half-way undoes what was done.
    pub fn build(&self) -> Result<Team> {
        // Both backends are NVLink multicast: the guard comes before any driver call.
        if let Some(d) = self.devices.first() {
            crate::multicast::guard::check(d.driver(), "multicast teams")?;
        }
        let driver = self.check_members()?;
        let backend = match self.backend {
            Some(b) => b,
            None => choose_backend(&driver, &self.devices)?,
        };
        match backend {
            Backend::MulticastObject => self.build_multicast(&driver),
            Backend::LogicalEndpoint => self.build_endpoint(&driver),
        }
    }

    fn check_members(&self) -> Result<Driver> {
        let [first, rest @ ..] = &self.devices[..] else {
            return Err(Error::invalid(
                "devices",
                "no devices; a team needs at least two",
            ));
        };
        // First: a device of another Driver value would otherwise be blamed on peer access or
        // cliques below (or not be seen as a duplicate).
        if let Some(d) = rest.iter().find(|d| !first.same_driver(d)) {
            return Err(d.other_driver_error("devices"));
        }
        if rest.is_empty() {
            return Err(Error::invalid(
                "devices",
                format!(
                    "a team of one device (device {}) has nothing to multicast to; give at least two",
                    first.ordinal()
                ),
            ));
        }
        for (i, d) in self.devices.iter().enumerate() {
            if self.devices[..i].contains(d) {
                return Err(Error::invalid(
                    "devices",
                    format!("device {} appears twice", d.ordinal()),
                ));
            }
        }
        if self.size == 0 {
            return Err(Error::invalid("size", "0 bytes; expected a positive size"));
        }
        for d in rest {
            if !first.can_access_peer(d)? {
                return Err(Error::invalid(
                    "devices",
                    format!(
                        "devices {} and {} are in different NVLink cliques; a team's members must share one",
                        first.ordinal(),
                        d.ordinal()
                    ),
                ));
            }
        }
        Ok(first.driver().clone())
    }

    /// The size rounded up to `unit` (the backend's granularity or bind alignment); a size that
    /// overflows when rounded is an [`Error::InvalidArgument`] on `size`.
    fn rounded_size(&self, unit: usize) -> Result<usize> {
        self.size.checked_next_multiple_of(unit).ok_or_else(|| {
            Error::invalid(
                "size",
                format!("{} bytes overflows when rounded up to {unit}", self.size),
            )
        })
    }

    /// Allocate `size` bytes on each member, mapped for every member (read-write).
    fn members(&self, driver: &Driver, size: usize) -> Result<Vec<Member>> {
        let access: Vec<(Location, Access)> = self
            .devices
            .iter()
            .map(|d| (Location::Device(d.ordinal()), Access::ReadWrite))
            .collect();
        let mut out = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            let allocation =
                PhysicalAllocation::builder(driver, Location::Device(d.ordinal())).create(size)?;
            let mapping = Arc::new(Mapping::map_whole(&allocation, &access)?);
            out.push(Member {
                device: d.clone(),
                mapping,
            });
        }
        Ok(out)
    }

    fn build_multicast(&self, driver: &Driver) -> Result<Team> {
        let n = self.devices.len() as u32;
        let spec = MulticastSpec::new(n, self.size);
        let g = spec.granularity(driver, Granularity::Minimum)?;
        let alloc_g = crate::vmm::AllocationSpec::device(self.devices[0].ordinal())
            .granularity(driver, Granularity::Minimum)?;
        let size = self.rounded_size(g.max(alloc_g))?;
        let object = MulticastObject::new(driver, &MulticastSpec::new(n, size))?;
        for d in &self.devices {
            object.add_device(d)?;
        }
        let members = self.members(driver, size)?;
        let mut bindings = Vec::with_capacity(members.len());
        for m in &members {
            bindings.push(object.bind_mem(&m.device, 0, m.mapping.allocation(), 0, size)?);
        }
        let mapping = object.map_whole(&self.devices)?;
        Ok(Team {
            backing: Backing::Multicast {
                mapping,
                _bindings: bindings,
                object,
            },
            members,
            size,
            stream: Default::default(),
        })
    }

    fn build_endpoint(&self, driver: &Driver) -> Result<Team> {
        let n = self.devices.len() as u32;
        let limits = EndpointSpec::multicast(n, 1).limits(driver)?;
        let alloc_g = crate::vmm::AllocationSpec::device(self.devices[0].ordinal())
            .granularity(driver, Granularity::Minimum)?;
        let size = self.rounded_size(limits.bind_alignment.max(alloc_g))?;
        let endpoint = LogicalEndpoint::create(driver, &EndpointSpec::multicast(n, size))?;
        for d in &self.devices {
            endpoint.add_device(d)?;
        }
        endpoint.wait_ready(ENDPOINT_READY_TIMEOUT)?;
        let members = self.members(driver, size)?;
        let mut bindings = Vec::with_capacity(members.len());
        for m in &members {
            bindings.push(endpoint.bind_mem(&m.device, 0, m.mapping.allocation(), 0, size)?);
        }
        Ok(Team {
            backing: Backing::Endpoint {
                _bindings: bindings,
                endpoint,
            },
            members,
            size,
            stream: Default::default(),
        })
    }
}

/// The backend a team of `devices` gets: logical endpoints when the driver is 13.3+ and every
/// member supports multicast endpoints; else a multicast object when every member supports
/// multicast; else [`Error::DeviceUnsupported`].
pub fn choose_backend(driver: &Driver, devices: &[Device]) -> Result<Backend> {
    if driver.version() >= LOGICAL_ENDPOINT_MIN_DRIVER {
        let mut all = true;
        for d in devices {
            all &= d.logical_endpoint_multicast()? == Some(true);
        }
        if all {
            return Ok(Backend::LogicalEndpoint);
        }
    }
    for d in devices {
        if !d.supports_multicast()? {
            return Err(Error::DeviceUnsupported {
                device: d.ordinal(),
                what: "multicast (neither multicast objects nor multicast logical endpoints)",
            });
        }
    }
    Ok(Backend::MulticastObject)
}

struct Member {
    device: Device,
    /// The member's memory, mapped for every member (holds the allocation).
    mapping: Arc<Mapping>,
}

enum Backing {
    // Fields drop in order: the mapping, then the bindings, then the object.
    Multicast {
        mapping: MulticastMapping,
        _bindings: Vec<MulticastBinding>,
        object: MulticastObject,
    },
    // The bindings, then the endpoint (then its id range).
    Endpoint {
        _bindings: Vec<EndpointBinding>,
        endpoint: LogicalEndpoint,
    },
}

/// A multicast range over a team of devices, bound to each member's memory. Dropping it tears
/// down in the driver's order: the multicast mapping, the bindings, the object or endpoint, then
/// the members' memory.
pub struct Team {
    // Field order is drop order.
    backing: Backing,
    members: Vec<Member>,
    size: usize,
    stream: std::sync::OnceLock<Stream>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team")
            .field("backend", &self.backend())
            .field(
                "devices",
                &self
                    .members
                    .iter()
                    .map(|m| m.device.ordinal())
                    .collect::<Vec<_>>(),
            )
            .field("size", &self.size)
            .finish()
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        // Work queued by `store` finishes before its endpoint, bindings and memory go.
        if let Some(s) = self.stream.get() {
            let _ = s.synchronize();
        }
    }
}

impl Team {
    /// A builder for a team of `devices`.
    pub fn builder(devices: &[Device]) -> TeamBuilder {
        TeamBuilder {
            devices: devices.to_vec(),
            size: 0,
            backend: None,
        }
    }

    /// A team of `devices` with `size` bytes per member, on the best supported backend.
    pub fn new(devices: &[Device], size: usize) -> Result<Team> {
        Team::builder(devices).size(size).build()
    }

    /// Which backend it uses.
    pub fn backend(&self) -> Backend {
        match self.backing {
            Backing::Multicast { .. } => Backend::MulticastObject,
            Backing::Endpoint { .. } => Backend::LogicalEndpoint,
        }
    }

    /// Bytes per member.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The members, in order.
    pub fn devices(&self) -> Vec<Device> {
        self.members.iter().map(|m| m.device.clone()).collect()
    }

    /// Member `i`'s own memory (unicast address, mapped read-write for every member).
    pub fn member_ptr(&self, i: usize) -> Result<CUdeviceptr> {
        Ok(self.member(i)?.mapping.device_ptr())
    }

    /// The multicast address: `Some` for [`Backend::MulticastObject`]; an endpoint has no address.
    pub fn multicast_address(&self) -> Option<CUdeviceptr> {
        match &self.backing {
            Backing::Multicast { mapping, .. } => Some(mapping.device_ptr()),
            Backing::Endpoint { .. } => None,
        }
    }

    /// The multicast object, for [`Backend::MulticastObject`].
    pub fn multicast_object(&self) -> Option<&MulticastObject> {
        match &self.backing {
            Backing::Multicast { object, .. } => Some(object),
            Backing::Endpoint { .. } => None,
        }
    }

    /// The logical endpoint, for [`Backend::LogicalEndpoint`].
    pub fn endpoint(&self) -> Option<&LogicalEndpoint> {
        match &self.backing {
            Backing::Endpoint { endpoint, .. } => Some(endpoint),
            Backing::Multicast { .. } => None,
        }
    }

    fn member(&self, i: usize) -> Result<&Member> {
        self.members.get(i).ok_or_else(|| {
            Error::invalid(
                "member",
                format!(
                    "member {i} does not exist; the team has {}",
                    self.members.len()
                ),
            )
        })
    }

    /// `len` bytes at `offset` inside the team's range: else an error naming `offset` when it
    /// alone is past the end, else `len_arg` (the caller's slice).
    fn check_range(&self, offset: usize, len: usize, len_arg: &'static str) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(Error::invalid(
                if offset > self.size {
                    "offset"
                } else {
                    len_arg
                },
                format!(
                    "{len} bytes at offset {offset} pass the end of the team's {} bytes",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    /// Store `data` at `offset` through the multicast range, so it reaches every member's memory:
    /// a copy to the multicast address (multicast object), or a fabric copy to the endpoint
    /// (`cuFabricCpyBatchAsync`, driver 13.5+; older drivers answer [`Error::Unsupported`]).
    /// A zero-length store is an Ok no-op (the offset is still checked).
    pub fn store(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len(), "data")?;
        if data.is_empty() {
            return Ok(());
        }
        let first = &self.members[0].device;
        first.bind()?;
        let driver = first.driver();
        match &self.backing {
            Backing::Multicast { mapping, .. } => {
                let dst = mapping.device_ptr() + offset as CUdeviceptr;
                // SAFETY: the destination lies in the mapped multicast range (checked), alive
                // while self lives; the copy has landed when this returns.
                unsafe { first.copy_from_host_blocking(dst, data) }
            }
            Backing::Endpoint { endpoint, .. } => {
                let stream = match self.stream.get() {
                    Some(s) => s,
                    None => {
                        let s = Stream::new(first)?;
                        self.stream.get_or_init(|| s)
                    }
                };
                // The driver reads the source in stream order: stage it in memory we own, so a
                // failed synchronisation below cannot leave the driver reading the caller's slice.
                let staging: Box<[u8]> = data.into();
                let mut src = CUfabricCpyOperand {
                    type_: CUfabricCpyOperandType::CU_FABRIC_COPY_OPERAND_TYPE_POINTER,
                    ..Default::default()
                };
                src.op.ptr.ptr = staging.as_ptr() as CUdeviceptr;
                let mut dst = CUfabricCpyOperand {
                    type_: CUfabricCpyOperandType::CU_FABRIC_COPY_OPERAND_TYPE_LOGICAL_ENDPOINT,
                    ..Default::default()
                };
                dst.op.le.id = endpoint.id();
                dst.op.le.offset = crate::error::to_driver_u64(offset);
                let mut op = CUDA_FABRIC_COPY_BATCH_OP {
                    src,
                    dst,
                    size: data.len(),
                    flags: 0,
                };
                // SAFETY: one operation; the source is readable for `size` bytes until the stream
                // is synchronised below; the endpoint is live and bound.
                unsafe { cu!(driver, cuFabricCpyBatchAsync(1, &mut op, 0, stream.raw())) }?;
                match stream.synchronize() {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        // The copy may still be in flight: the staging buffer must outlive it.
                        // Leaked deliberately (only on this failure path).
                        std::mem::forget(staging);
                        Err(e)
                    }
                }
            }
        }
    }

    /// Read `out.len()` bytes at `offset` of member `member`'s own memory. A zero-length load is
    /// an Ok no-op (member and offset are still checked).
    pub fn load(&self, member: usize, offset: usize, out: &mut [u8]) -> Result<()> {
        let m = self.member(member)?;
        self.check_range(offset, out.len(), "out")?;
        if out.is_empty() {
            return Ok(());
        }
        m.device.bind()?;
        let src = m.mapping.device_ptr() + offset as CUdeviceptr;
        // SAFETY: `out` is writable for its length; the source lies in the member's mapping.
        unsafe {
            cu!(
                m.device.driver(),
                cuMemcpyDtoH_v3020(out.as_mut_ptr().cast(), src, out.len())
            )
        }
    }
}
