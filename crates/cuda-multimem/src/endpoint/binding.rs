//! Memory bound to a logical endpoint on one device at an offset; unbound on drop.

use std::sync::Arc;

use cuda_multimem_sys::CUdeviceptr;

use super::{EndpointKind, Inner, LogicalEndpoint};
use crate::error::{cu, to_driver_u64, Error, Result};
use crate::vmm::{Location, Mapping, PhysicalAllocation};
use crate::Device;

/// The memory a binding keeps alive.
#[derive(Debug, Clone)]
pub enum EndpointMemory {
    /// Bound by handle (`cuLogicalEndpointBindMem`).
    Allocation(Arc<PhysicalAllocation>),
    /// Bound by address (`cuLogicalEndpointBindAddr`).
    Mapping(Arc<Mapping>),
}

/// `size` bytes of one device's memory bound at `offset` of a logical endpoint. Holds the
/// endpoint and the memory, so neither goes before it; dropping it unbinds
/// (`cuLogicalEndpointUnbind`).
pub struct EndpointBinding {
    endpoint: Arc<Inner>,
    device: i32,
    offset: usize,
    size: usize,
    // Dropped after the unbind in `Drop::drop`.
    memory: EndpointMemory,
}

impl std::fmt::Debug for EndpointBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "EndpointBinding(endpoint {}, device {}, {} bytes at offset {})",
            self.endpoint.id, self.device, self.size, self.offset
        )
    }
}

impl EndpointBinding {
    /// The device whose memory is bound.
    pub fn device(&self) -> i32 {
        self.device
    }
    /// Offset into the endpoint.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Bytes bound.
    pub fn size(&self) -> usize {
        self.size
    }
    /// The memory bound.
    pub fn memory(&self) -> &EndpointMemory {
        &self.memory
    }
}

impl Drop for EndpointBinding {
    fn drop(&mut self) {
        // SAFETY: exactly the range this value bound, on a live endpoint (we hold it).
        let r = unsafe {
            cu!(
                self.endpoint.range.driver,
                cuLogicalEndpointUnbind(
                    self.endpoint.id,
                    self.device,
                    to_driver_u64(self.offset),
                    to_driver_u64(self.size)
                )
            )
        };
        if let Err(e) = r {
            eprintln!(
                "cuda-multimem: unbinding {} bytes at {} of logical endpoint {} failed during a teardown ({e})",
                self.size, self.offset, self.endpoint.id
            );
        }
    }
}

fn multiple(arg: &'static str, v: usize, align: usize) -> Result<()> {
    crate::error::check_multiple(arg, v, align, "endpoint's bind alignment")
}

impl LogicalEndpoint {
    /// The checks every bind makes before the call: ready, a device that may bind, alignment,
    /// inside the endpoint, memory of that device.
    fn check_bind(
        &self,
        device: &Device,
        offset: usize,
        size: usize,
        memory: Location,
        memory_offset: usize,
        memory_size: usize,
    ) -> Result<()> {
        let d = device.ordinal();
        match self.inner.spec.kind {
            EndpointKind::Unicast { owner } if owner != d => {
                return Err(Error::invalid(
                    "device",
                    format!(
                        "device {d} is not the owner (device {owner}) of unicast logical endpoint {}",
                        self.inner.id
                    ),
                ))
            }
            EndpointKind::Unicast { .. } if self.inner.imported => {
                return Err(Error::invalid(
                    "self",
                    format!(
                        "logical endpoint {} is an imported unicast endpoint; those cannot be bound",
                        self.inner.id
                    ),
                ))
            }
            EndpointKind::Multicast { .. }
                if !self.inner.imported && !self.inner.members.lock().contains(&d) =>
            {
                return Err(Error::invalid(
                    "device",
                    format!(
                        "device {d} is not in the team of logical endpoint {} (members added here: {:?})",
                        self.inner.id,
                        self.inner.members.lock()
                    ),
                ))
            }
            _ => {}
        }
        if size == 0 {
            return Err(Error::invalid("size", "0 bytes; expected a positive size"));
        }
        let a = self.inner.limits.bind_alignment;
        multiple("offset", offset, a)?;
        multiple("size", size, a)?;
        multiple("memory offset", memory_offset, a)?;
        crate::error::check_within(size, offset, self.inner.spec.size, "endpoint")?;
        crate::error::check_within(size, memory_offset, memory_size, "memory")?;
        if memory != Location::Device(d) {
            return Err(Error::invalid(
                "memory",
                format!("the memory is at {memory:?}, not on device {d}"),
            ));
        }
        self.ensure_ready()
    }

    /// Bind `size` bytes of `allocation` from `allocation_offset` at `offset` of this endpoint,
    /// for `device` (`cuLogicalEndpointBindMem`). The endpoint must be ready; offsets and size are
    /// multiples of the bind alignment; the allocation is `device`'s memory.
    pub fn bind_mem(
        &self,
        device: &Device,
        offset: usize,
        allocation: &Arc<PhysicalAllocation>,
        allocation_offset: usize,
        size: usize,
    ) -> Result<EndpointBinding> {
        self.check_bind(
            device,
            offset,
            size,
            allocation.spec().location,
            allocation_offset,
            allocation.size(),
        )?;
        device.bind()?;
        // SAFETY: a live, ready endpoint and a live allocation handle (kept alive by the binding).
        unsafe {
            cu!(
                self.driver(),
                cuLogicalEndpointBindMem(
                    self.inner.id,
                    device.ordinal(),
                    to_driver_u64(offset),
                    allocation.raw(),
                    to_driver_u64(allocation_offset),
                    to_driver_u64(size),
                    0
                )
            )
        }?;
        Ok(EndpointBinding {
            endpoint: self.inner.clone(),
            device: device.ordinal(),
            offset,
            size,
            memory: EndpointMemory::Allocation(allocation.clone()),
        })
    }

    /// Bind the whole of `mapping` (its address, `cuLogicalEndpointBindAddr`) at `offset`, for
    /// `device`. Same rules as [`LogicalEndpoint::bind_mem`]; the mapped address must be aligned.
    pub fn bind_addr(
        &self,
        device: &Device,
        offset: usize,
        mapping: &Arc<Mapping>,
    ) -> Result<EndpointBinding> {
        let size = mapping.size();
        let ptr: CUdeviceptr = mapping.device_ptr();
        self.check_bind(
            device,
            offset,
            size,
            mapping.allocation().spec().location,
            0,
            size,
        )?;
        let aligned = ptr % to_driver_u64(self.inner.limits.bind_alignment) == 0;
        if !aligned {
            return Err(Error::invalid(
                "mapping address",
                format!(
                    "{ptr:#x} is not a multiple of the endpoint's bind alignment {}",
                    self.inner.limits.bind_alignment
                ),
            ));
        }
        device.bind()?;
        // SAFETY: a live, ready endpoint; the address range is mapped while the binding (which
        // holds the mapping) lives.
        unsafe {
            cu!(
                self.driver(),
                cuLogicalEndpointBindAddr(
                    self.inner.id,
                    device.ordinal(),
                    to_driver_u64(offset),
                    ptr as *mut std::ffi::c_void,
                    to_driver_u64(size),
                    0
                )
            )
        }?;
        Ok(EndpointBinding {
            endpoint: self.inner.clone(),
            device: device.ordinal(),
            offset,
            size,
            memory: EndpointMemory::Mapping(mapping.clone()),
        })
    }
}
