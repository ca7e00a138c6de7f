//! A growable buffer of VMM memory (cuda.core's `VirtualMemoryResource` is the model).
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::sync::Arc;

use cuda_multimem_sys::CUdeviceptr;

use super::mapping::set_access_range;
use super::{Access, AllocationBuilder, Location, Mapping, PhysicalAllocation, Reservation};
use crate::{Error, Result};

/// Device memory that can grow while keeping its contents: chunks of physical memory mapped back
/// to back. [`VmmBuffer::grow`] first tries to extend the address range in place (a reservation
/// right after the current one, through an address hint), so the address stays; otherwise it
/// reserves a bigger range and maps every chunk again, so the address changes but the memory —
/// and its data — is the same. Everything is given back when the buffer is dropped.
pub struct VmmBuffer {
    builder: AllocationBuilder,
    access: Vec<(Location, Access)>,
    size: usize,
    mappings: Vec<Mapping>,
    chunks: Vec<Arc<PhysicalAllocation>>,
    reservations: Vec<Arc<Reservation>>,
}

impl std::fmt::Debug for VmmBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VmmBuffer({:#x}, {} bytes in {} chunk(s))",
            self.device_ptr(),
            self.size,
            self.chunks.len()
        )
    }
}

impl VmmBuffer {
    /// A buffer of at least `size` bytes (rounded as `builder` says), allocated by `builder`,
    /// with `access` granted (empty: read-write for the memory's own location).
    pub fn new(
        builder: AllocationBuilder,
        size: usize,
        access: &[(Location, Access)],
    ) -> Result<VmmBuffer> {
        let access = if access.is_empty() {
            vec![(builder.spec().location, Access::ReadWrite)]
        } else {
            access.to_vec()
        };
        let chunk = builder.create(size)?;
        let m = Mapping::map_whole(&chunk, &access)?;
        Ok(VmmBuffer {
            builder,
            access,
            size: chunk.size(),
            reservations: vec![m.reservation().clone()],
            mappings: vec![m],
            chunks: vec![chunk],
        })
    }

    /// The start address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.mappings[0].device_ptr()
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The physical chunks, in address order.
    pub fn chunks(&self) -> &[Arc<PhysicalAllocation>] {
        &self.chunks
    }

    /// Grow to at least `new_size` bytes, keeping the contents. Returns whether the address
    /// stayed (extended in place) or moved (remapped). On error the buffer is unchanged.
    ///
    /// This takes `&mut self` rather than returning a new buffer: the grown buffer *is* the old
    /// one (same physical memory), and no stale handle to the old address range can remain.
    pub fn grow(&mut self, new_size: usize) -> Result<bool> {
        if new_size <= self.size {
            return Err(Error::invalid(
                "new_size",
                format!(
                    "{new_size} bytes; expected more than the current {}",
                    self.size
                ),
            ));
        }
        let growth = new_size - self.size;
        // The growth is what the builder rounds (or refuses): the caller's argument is new_size.
        let delta = self.builder.rounded_size(growth).map_err(|e| match e {
            Error::InvalidArgument {
                arg: "size",
                reason,
            } => Error::invalid(
                "new_size",
                format!(
                    "{new_size} bytes grows the {}-byte buffer by {growth}: {reason}",
                    self.size
                ),
            ),
            e => e,
        })?;
        let total = self
            .size
            .checked_add(delta)
            .ok_or_else(|| Error::invalid("new_size", format!("{new_size} bytes overflows")))?;
        let last = self.reservations.last().expect("at least one reservation");
        let end = last.device_ptr() + last.size() as CUdeviceptr;
        let chunk = self.builder.create(delta)?;
        let r = Reservation::builder(chunk.driver(), delta)
            .address_hint(end)
            .reserve()?;
        if r.device_ptr() == end {
            let m = Mapping::new(&r, 0, &chunk, 0, delta)?;
            m.set_access(&self.access)?;
            self.mappings.push(m);
            self.reservations.push(r);
            self.chunks.push(chunk);
            self.size = total;
            return Ok(true);
        }
        drop(r);
        let r = Reservation::new(chunk.driver(), total)?;
        let mut mappings = Vec::with_capacity(self.chunks.len() + 1);
        let mut at = 0;
        for c in self.chunks.iter().chain(std::iter::once(&chunk)) {
            mappings.push(Mapping::new(&r, at, c, 0, c.size())?);
            at += c.size();
        }
        set_access_range(&chunk, r.device_ptr(), total, &self.access)?;
        self.mappings = mappings;
        self.reservations = vec![r];
        self.chunks.push(chunk);
        self.size = total;
        Ok(false)
    }
}
