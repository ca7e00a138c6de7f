//! Symmetric memory: one allocation per rank, the same size, each mapped on every peer.

use std::os::fd::AsFd;
use std::sync::Arc;

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::vmm::{Access, HandleTypes, Location, Mapping, PhysicalAllocation};
use cuda_multimem::{Device, DeviceRepr, Error, Result};

use super::Ranks;

/// Memory of every rank, as mapped in this process: rank r's part at `addrs[r]`. In one process
/// each part is one VMM allocation of its device mapped once with access for every device of
/// the team; across processes the local part is exported (POSIX fd or fabric handle), every
/// peer's part imported and mapped with access for the local device.
pub(crate) struct Sym {
    pub(crate) addrs: Vec<CUdeviceptr>,
    pub(crate) bytes: usize,
    /// (rank, its mapping in this process).
    maps: Vec<(usize, Mapping)>,
    /// The devices of this process's ranks: their queued work may still use the mappings.
    devices: Vec<Device>,
}

impl Drop for Sym {
    /// Wait for the work queued on this process's devices before the mappings go: a kernel or
    /// copy of a collective still in flight (the caller dropped the communicator or a buffer
    /// without synchronising, e.g. on an error path) would otherwise touch unmapped memory,
    /// and `cuMemUnmap`, unlike `cuMemFree`, does not wait for the device. Bounded by the
    /// collectives' own waits (each gives up after the configured timeout), as freeing a
    /// `DeviceBuffer` is.
    fn drop(&mut self) {
        for d in &self.devices {
            let _ = d.synchronize();
        }
    }
}

impl Sym {
    /// `zero`: clear the local parts.
    pub(crate) fn new(ranks: &Ranks, bytes: usize, zero: bool) -> Result<Sym> {
        let mut addrs = vec![0; ranks.n];
        let mut maps = Vec::new();
        match &ranks.bootstrap {
            None => {
                // every device of the team once (ranks may share a device)
                let mut access: Vec<(Location, Access)> = Vec::new();
                for l in &ranks.locals {
                    let at = (Location::Device(l.device.ordinal()), Access::ReadWrite);
                    if !access.contains(&at) {
                        access.push(at);
                    }
                }
                for l in &ranks.locals {
                    let a = PhysicalAllocation::builder(
                        l.device.driver(),
                        Location::Device(l.device.ordinal()),
                    )
                    .create(bytes)?;
                    let m = Mapping::map_whole(&a, &access)?;
                    addrs[l.rank] = m.device_ptr();
                    maps.push((l.rank, m));
                }
            }
            Some(b) => {
                let l = &ranks.locals[0];
                let d = l.device.driver();
                let here = [(Location::Device(l.device.ordinal()), Access::ReadWrite)];
                let fds = b.passes_fds();
                let a = PhysicalAllocation::builder(d, Location::Device(l.device.ordinal()))
                    .handle_types(if fds {
                        HandleTypes::POSIX_FD
                    } else {
                        HandleTypes::FABRIC
                    })
                    .create(bytes)?;
                let m = Mapping::map_whole(&a, &here)?;
                addrs[l.rank] = m.device_ptr();
                maps.push((l.rank, m));
                let sizes = ranks.exchange(
                    "allocation sizes",
                    &(a.size() as u64).to_le_bytes(),
                    Some(8),
                )?;
                let size_of = |r: usize| -> Result<usize> {
                    let v = u64::from_le_bytes(sizes[r].as_slice().try_into().unwrap_or_default());
                    usize::try_from(v).map_err(|_| Error::Peer {
                        rank: r,
                        reason: format!("announced an allocation of {v} bytes"),
                    })
                };
                let imported: Vec<Arc<PhysicalAllocation>> = if fds {
                    let fd = a.export_posix_fd()?;
                    let all = ranks.exchange_fds("allocation handles", &[fd.as_fd()])?;
                    let mut v = Vec::new();
                    for (r, f) in all.iter().enumerate().filter(|(r, _)| *r != l.rank) {
                        v.push(PhysicalAllocation::import_posix_fd(
                            d,
                            f[0].as_fd(),
                            size_of(r)?,
                        )?);
                    }
                    v
                } else {
                    let h = a.export_fabric()?;
                    let all = ranks.exchange(
                        "allocation handles",
                        h.as_bytes(),
                        Some(h.as_bytes().len()),
                    )?;
                    let mut v = Vec::new();
                    for (r, h) in all.iter().enumerate().filter(|(r, _)| *r != l.rank) {
                        v.push(PhysicalAllocation::import_fabric(d, h, size_of(r)?)?);
                    }
                    v
                };
                let peers = (0..ranks.n).filter(|&r| r != l.rank);
                for (r, p) in peers.zip(imported) {
                    let m = Mapping::map_whole(&p, &here)?;
                    addrs[r] = m.device_ptr();
                    maps.push((r, m));
                }
            }
        }
        let mut devices: Vec<Device> = Vec::new();
        for l in &ranks.locals {
            if !devices.contains(&l.device) {
                devices.push(l.device.clone());
            }
        }
        let sym = Sym {
            addrs,
            bytes,
            maps,
            devices,
        };
        if zero {
            for l in &ranks.locals {
                l.device.bind()?;
                // SAFETY: the whole local part, just mapped read-write for this device.
                unsafe { l.device.memset_blocking(sym.addrs[l.rank], 0, bytes) }?;
            }
        }
        Ok(sym)
    }

    fn mapping(&self, rank: usize) -> Result<&Mapping> {
        self.maps
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, m)| m)
            .ok_or_else(|| Error::invalid("rank", format!("{rank}; not a rank of this team")))
    }

    /// Zero `bytes` of rank `rank`'s part from byte `offset` (synchronous; a rank whose part
    /// is mapped in this process).
    pub(crate) fn zero(&self, rank: usize, offset: usize, bytes: usize) -> Result<()> {
        self.mapping(rank)?;
        if offset.checked_add(bytes).is_none_or(|e| e > self.bytes) {
            return Err(Error::invalid(
                "bytes",
                format!(
                    "{bytes} bytes at {offset} pass the {}-byte part",
                    self.bytes
                ),
            ));
        }
        // every device of this process was granted access to every part mapped here
        let d = self
            .devices
            .first()
            .ok_or_else(|| Error::invalid("rank", "no device of this process maps the part"))?;
        // SAFETY: inside rank `rank`'s part (checked), mapped read-write for `d`; the copy has
        // landed when this returns.
        unsafe { d.memset_blocking(self.addrs[rank] + offset as u64, 0, bytes) }
    }

    /// Copy `data` into rank `rank`'s part at byte `offset` (synchronous, checked).
    pub(crate) fn write<T: DeviceRepr>(
        &self,
        rank: usize,
        offset: usize,
        data: &[T],
    ) -> Result<()> {
        self.mapping(rank)?.write(offset, data)
    }

    /// Copy rank `rank`'s part from byte `offset` into `out` (synchronous, checked).
    pub(crate) fn read<T: DeviceRepr>(
        &self,
        rank: usize,
        offset: usize,
        out: &mut [T],
    ) -> Result<()> {
        self.mapping(rank)?.read(offset, out)
    }
}
