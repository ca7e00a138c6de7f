//! Multicast objects (`cuMulticast*`, drivers from 12.1): a team of devices, each binding its own
//! memory at an offset, and a virtual range through which a store reaches all of them.
//!
//! Ownership enforces the driver's teardown order (see `docs/design/multicast-and-endpoints.md`):
//! - a [`MulticastMapping`] (the mapped multicast range) holds its object and its reservation;
//! - a [`MulticastBinding`] holds its object and the memory it binds. A binding dropped while a
//!   mapping of its object exists is unbound when the last mapping is unmapped (its record, with
//!   the memory, waits in the object), so unbinding always follows unmapping;
//! - the object is released (`cuMemRelease`) when its last handle, binding and mapping are gone.
//!
//! Creating or importing an object checks the multicast guard first ([`multicast_allowed_for`]):
//! with `NCCL_NVLS_ENABLE=0` or `CUDA_MULTIMEM_DISABLE_MULTICAST=1` it is [`Error::Disabled`]
//! before any driver call.
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

pub(crate) mod guard;

pub use guard::{
    disable_multicast_on_this_thread, multicast_allowed, multicast_allowed_for, policy_from,
    MulticastOff, DISABLE_MULTICAST_ENV, NVLS_ENABLE_ENV, NVSHMEM_DISABLE_NVLS_ENV,
    TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV,
};

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use cuda_multimem_sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags, CUmemGenericAllocationHandle,
    CUmulticastGranularity_flags, CUmulticastObjectProp,
};
use parking_lot::Mutex;

use crate::error::{cu, Error, Result};
use crate::vmm::{
    ensure_context, FabricHandle, Granularity, HandleTypes, Location, Mapping, PhysicalAllocation,
    Reservation,
};
use crate::{Device, Driver};

/// The first driver with multicast objects.
pub const MULTICAST_MIN_DRIVER: i32 = 12010;
/// The first driver with the per-device binds (`cuMulticastBindMem` / `BindAddr` `_v2`).
pub const PER_DEVICE_BIND_MIN_DRIVER: i32 = 13010;

/// What a multicast object is: team size, bytes per device, exportable handle types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MulticastSpec {
    /// Number of devices in the team (across every process and node that takes part: it may be
    /// more than this machine has).
    pub devices: u32,
    /// Bytes each device can bind; rounded up to the minimum multicast granularity on creation.
    pub size: usize,
    /// Handle types it can be exported as (chosen up front).
    pub handle_types: HandleTypes,
}

impl MulticastSpec {
    /// A team of `devices`, `size` bytes per device, not exportable.
    pub fn new(devices: u32, size: usize) -> Self {
        MulticastSpec {
            devices,
            size,
            handle_types: HandleTypes::NONE,
        }
    }

    /// Choose the exportable handle types.
    pub fn handle_types(mut self, t: HandleTypes) -> Self {
        self.handle_types = t;
        self
    }

    /// The raw property block.
    pub fn raw(&self) -> CUmulticastObjectProp {
        CUmulticastObjectProp {
            numDevices: self.devices,
            size: self.size,
            handleTypes: self.handle_types.raw().0 as u64,
            flags: 0,
        }
    }

    fn precheck(&self, driver: &Driver) -> Result<()> {
        // A driver before 12.1 lacks the calls: say so (Error::Unsupported) before asking devices.
        driver.sys().cuMulticastGetGranularity()?;
        // The team may be larger than this machine (members in other processes or nodes).
        if self.devices == 0 {
            return Err(Error::invalid(
                "spec.devices",
                "a team of 0 devices; expected at least one",
            ));
        }
        let mut capable = Vec::new();
        for d in driver.devices() {
            if d.supports_multicast()? {
                capable.push(d);
            }
        }
        if capable.is_empty() {
            return Err(Error::DeviceUnsupported {
                device: 0,
                what: "multicast objects (no device of this machine reports multicast support)",
            });
        }
        for (on, what, supported) in [
            (
                self.handle_types.posix_fd,
                "POSIX-fd handles",
                Device::supports_posix_fd_handle as fn(&Device) -> Result<bool>,
            ),
            (
                self.handle_types.fabric,
                "fabric handles",
                Device::supports_fabric_handle,
            ),
        ] {
            if on {
                let mut any = false;
                for d in &capable {
                    any |= supported(d)?;
                }
                if !any {
                    return Err(Error::DeviceUnsupported {
                        device: capable[0].ordinal(),
                        what,
                    });
                }
            }
        }
        Ok(())
    }

    /// The multicast granularity for this spec (`cuMulticastGetGranularity`): sizes, bind offsets
    /// and mapped ranges are multiples of the minimum; the recommended one is faster.
    pub fn granularity(&self, driver: &Driver, which: Granularity) -> Result<usize> {
        self.precheck(driver)?;
        let prop = self.raw();
        let option = match which {
            Granularity::Minimum => CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM,
            Granularity::Recommended => {
                CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_RECOMMENDED
            }
        };
        ensure_context(driver, 0)?;
        let mut g = 0usize;
        // SAFETY: one size_t out-pointer and a fully initialised property block.
        unsafe { cu!(driver, cuMulticastGetGranularity(&mut g, &prop, option)) }?;
        Ok(g)
    }
}

/// The memory a multicast binding keeps alive.
#[derive(Debug, Clone)]
pub enum MulticastMemory {
    /// Bound by handle (`cuMulticastBindMem`).
    Allocation(Arc<PhysicalAllocation>),
    /// Bound by address (`cuMulticastBindAddr`).
    Mapping(Arc<Mapping>),
}

#[derive(Debug)]
struct BindRecord {
    device: i32,
    offset: usize,
    size: usize,
    // Dropped after the unbind.
    _memory: MulticastMemory,
}

#[derive(Default)]
struct State {
    /// Devices added through this process.
    added: Vec<i32>,
    /// Whether memory was ever bound (no device can be added after that).
    bound_once: bool,
    /// Live bindings (device, offset, size).
    bound: Vec<(i32, usize, usize)>,
    /// Live mappings of the multicast range.
    mapped: usize,
    /// Bindings dropped while mapped: unbound when the last mapping goes.
    pending_unbind: Vec<BindRecord>,
}

struct Inner {
    driver: Driver,
    handle: CUmemGenericAllocationHandle,
    spec: MulticastSpec,
    granularity: usize,
    /// Exported or imported: other processes take part (they add devices; binds block on them).
    shared: std::sync::atomic::AtomicBool,
    imported: bool,
    state: Mutex<State>,
}

impl Inner {
    fn unbind(&self, r: &BindRecord) -> Result<()> {
        // SAFETY: exactly a range this object bound, on a live handle (we are alive), while no
        // mapping of it exists.
        unsafe {
            cu!(
                self.driver,
                cuMulticastUnbind(self.handle, r.device, r.offset, r.size)
            )
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let pending = std::mem::take(&mut self.state.get_mut().pending_unbind);
        for r in &pending {
            if let Err(e) = self.unbind(r) {
                eprintln!("cuda-multimem: unbinding a multicast object's memory failed during a teardown ({e})");
            }
        }
        drop(pending);
        let h = self.handle;
        self.driver.teardown(
            || format!("the multicast object {h:#x} (cuMemRelease)"),
            // SAFETY: our handle reference; no binding or mapping holds us any more; a retry
            // releases it once.
            move |d| unsafe { cu!(d, cuMemRelease(h)) },
        );
    }
}

/// A multicast object. Cheap to share through its bindings and mappings, which hold it.
pub struct MulticastObject {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MulticastObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MulticastObject")
            .field("handle", &format_args!("{:#x}", self.inner.handle))
            .field("spec", &self.inner.spec)
            .field("granularity", &self.inner.granularity)
            .field("added", &self.inner.state.lock().added)
            .finish()
    }
}

fn multiple(arg: &'static str, v: usize, g: usize) -> Result<()> {
    crate::error::check_multiple(arg, v, g, "multicast granularity")
}

impl MulticastObject {
    /// Create a multicast object (`cuMulticastCreate`); `spec.size` is rounded up to the minimum
    /// multicast granularity. Refused with [`Error::Disabled`] under the multicast guard, before
    /// any driver call.
    pub fn new(driver: &Driver, spec: &MulticastSpec) -> Result<MulticastObject> {
        guard::check(driver, "multicast objects")?;
        if spec.size == 0 {
            return Err(Error::invalid(
                "spec.size",
                "0 bytes; expected a positive size",
            ));
        }
        let g = spec.granularity(driver, Granularity::Minimum)?;
        let mut spec = *spec;
        spec.size = spec.size.checked_next_multiple_of(g).ok_or_else(|| {
            Error::invalid("spec.size", format!("{} bytes is too large", spec.size))
        })?;
        let prop = spec.raw();
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and property block.
        unsafe { cu!(driver, cuMulticastCreate(&mut h, &prop)) }?;
        Ok(MulticastObject::adopt(driver, h, spec, g, false))
    }

    fn adopt(
        driver: &Driver,
        handle: CUmemGenericAllocationHandle,
        spec: MulticastSpec,
        granularity: usize,
        imported: bool,
    ) -> MulticastObject {
        MulticastObject {
            inner: Arc::new(Inner {
                driver: driver.clone(),
                handle,
                spec,
                granularity,
                shared: std::sync::atomic::AtomicBool::new(imported),
                imported,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.inner.driver
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUmemGenericAllocationHandle {
        self.inner.handle
    }

    /// The spec, with the size as rounded.
    pub fn spec(&self) -> &MulticastSpec {
        &self.inner.spec
    }

    /// Bytes per device.
    pub fn size(&self) -> usize {
        self.inner.spec.size
    }

    /// The minimum multicast granularity of this object.
    pub fn granularity(&self) -> usize {
        self.inner.granularity
    }

    /// Devices added through this process.
    pub fn devices_added(&self) -> Vec<i32> {
        self.inner.state.lock().added.clone()
    }

    /// Whether other processes take part (exported or imported).
    pub fn is_shared(&self) -> bool {
        self.inner.shared.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Add `device` to the team (`cuMulticastAddDevice`). Refused before the call for a device
    /// added already, a full team, an object that memory was bound to, a device without multicast,
    /// or a device outside the first member's NVLink clique.
    pub fn add_device(&self, device: &Device) -> Result<()> {
        if !Arc::ptr_eq(&device.driver().inner, &self.inner.driver.inner) {
            return Err(device.other_driver_error("device"));
        }
        let mut st = self.inner.state.lock();
        let d = device.ordinal();
        if st.added.contains(&d) {
            return Err(Error::invalid(
                "device",
                format!("device {d} was already added to this multicast object"),
            ));
        }
        if st.added.len() as u32 >= self.inner.spec.devices {
            return Err(Error::invalid(
                "device",
                format!(
                    "the team is full: {} device(s) added of {}",
                    st.added.len(),
                    self.inner.spec.devices
                ),
            ));
        }
        if st.bound_once {
            return Err(Error::invalid(
                "device",
                format!(
                    "device {d} cannot be added: memory was already bound to this multicast object"
                ),
            ));
        }
        if !device.supports_multicast()? {
            return Err(Error::DeviceUnsupported {
                device: d,
                what: "multicast objects",
            });
        }
        if let Some(&first) = st.added.first() {
            let f = self.inner.driver.device(first as usize)?;
            if !f.can_access_peer(device)? {
                return Err(Error::invalid(
                    "device",
                    format!("device {d} is not in the NVLink clique of device {first}, the team's first member"),
                ));
            }
        }
        ensure_context(&self.inner.driver, d)?;
        // SAFETY: a live multicast handle and a valid device ordinal.
        unsafe {
            cu!(
                self.inner.driver,
                cuMulticastAddDevice(self.inner.handle, d)
            )
        }?;
        st.added.push(d);
        Ok(())
    }

    /// The checks every bind and map make: the team is complete (else the driver would block —
    /// refused for objects no other process takes part in), offsets and sizes are granularity
    /// multiples inside the object.
    fn check_range(&self, what: &str, offset: usize, size: usize) -> Result<()> {
        let st = self.inner.state.lock();
        if !self.is_shared() && (st.added.len() as u32) < self.inner.spec.devices {
            return Err(Error::invalid(
                "self",
                format!(
                    "{what} before every device was added ({} of {}: {:?}) would block forever; add \
                     the remaining devices first",
                    st.added.len(),
                    self.inner.spec.devices,
                    st.added
                ),
            ));
        }
        drop(st);
        if size == 0 {
            return Err(Error::invalid("size", "0 bytes; expected a positive size"));
        }
        let g = self.inner.granularity;
        multiple("offset", offset, g)?;
        multiple("size", size, g)?;
        crate::error::check_within(size, offset, self.inner.spec.size, "multicast object")
    }

    fn check_bind(
        &self,
        device: &Device,
        offset: usize,
        size: usize,
        memory: &PhysicalAllocation,
        memory_offset: usize,
    ) -> Result<()> {
        self.check_range("binding", offset, size)?;
        let d = device.ordinal();
        let st = self.inner.state.lock();
        if !self.is_shared() && !st.added.contains(&d) {
            return Err(Error::invalid(
                "device",
                format!("device {d} is not in this multicast team {:?}", st.added),
            ));
        }
        if st
            .bound
            .iter()
            .any(|&(bd, o, s)| bd == d && o < offset + size && offset < o + s)
        {
            return Err(Error::invalid(
                "offset",
                format!(
                    "device {d} already has memory bound overlapping {size} bytes at offset {offset} \
                     (a binding dropped while the object is mapped stays bound until the mapping goes)"
                ),
            ));
        }
        drop(st);
        multiple("memory offset", memory_offset, self.inner.granularity)?;
        crate::error::check_within(size, memory_offset, memory.size(), "memory")?;
        match memory.spec().location {
            Location::Device(m) if m == d => {}
            Location::HostNuma(n)
                if self.inner.driver.version() >= PER_DEVICE_BIND_MIN_DRIVER
                    && device.host_numa_id()? == Some(n) => {}
            other => {
                return Err(Error::invalid(
                    "memory",
                    format!(
                        "the memory is at {other:?}, not on device {d} (or its host NUMA node)"
                    ),
                ))
            }
        }
        if self.is_shared() && memory.spec().handle_types == HandleTypes::NONE {
            return Err(Error::invalid(
                "memory",
                "an exported or imported multicast object binds only shareable memory; create the \
                 allocation with a handle type",
            ));
        }
        Ok(())
    }

    fn record(
        &self,
        device: i32,
        offset: usize,
        size: usize,
        memory: MulticastMemory,
    ) -> MulticastBinding {
        let mut st = self.inner.state.lock();
        st.bound_once = true;
        st.bound.push((device, offset, size));
        MulticastBinding {
            object: self.inner.clone(),
            record: Some(BindRecord {
                device,
                offset,
                size,
                _memory: memory,
            }),
        }
    }

    /// Bind `size` bytes of `allocation` from `allocation_offset` at `offset`, for `device`
    /// (`cuMulticastBindMem`; the per-device `_v2` form on 13.1+ drivers). Every device must have
    /// been added; offsets and size are multiples of the multicast granularity; the allocation is
    /// `device`'s memory.
    pub fn bind_mem(
        &self,
        device: &Device,
        offset: usize,
        allocation: &Arc<PhysicalAllocation>,
        allocation_offset: usize,
        size: usize,
    ) -> Result<MulticastBinding> {
        self.check_bind(device, offset, size, allocation, allocation_offset)?;
        let (h, d, m) = (self.inner.handle, device.ordinal(), allocation.raw());
        ensure_context(&self.inner.driver, d)?;
        if self.inner.driver.version() >= PER_DEVICE_BIND_MIN_DRIVER {
            // SAFETY: live multicast and allocation handles (kept alive by the binding); flags 0.
            unsafe {
                cu!(
                    self.inner.driver,
                    cuMulticastBindMem(h, d, offset, m, allocation_offset, size, 0)
                )
            }?;
        } else {
            // SAFETY: as above; the 12.1 ABI binds for the allocation's own device (checked).
            unsafe {
                cu!(
                    self.inner.driver,
                    cuMulticastBindMem_v12010(h, offset, m, allocation_offset, size, 0)
                )
            }?;
        }
        Ok(self.record(
            d,
            offset,
            size,
            MulticastMemory::Allocation(allocation.clone()),
        ))
    }

    /// Bind all of `mapping` (by its address, `cuMulticastBindAddr`; `_v2` on 13.1+) at `offset`,
    /// for `device`. Same rules as [`MulticastObject::bind_mem`]; the address must be aligned to
    /// the multicast granularity.
    pub fn bind_addr(
        &self,
        device: &Device,
        offset: usize,
        mapping: &Arc<Mapping>,
    ) -> Result<MulticastBinding> {
        let size = mapping.size();
        self.check_bind(
            device,
            offset,
            size,
            mapping.allocation(),
            mapping.allocation_offset(),
        )?;
        let ptr = mapping.device_ptr();
        multiple("mapping address", ptr as usize, self.inner.granularity)?;
        let (h, d) = (self.inner.handle, device.ordinal());
        ensure_context(&self.inner.driver, d)?;
        if self.inner.driver.version() >= PER_DEVICE_BIND_MIN_DRIVER {
            // SAFETY: a live multicast handle; the range is mapped while the binding (which holds
            // the mapping) lives; flags 0.
            unsafe {
                cu!(
                    self.inner.driver,
                    cuMulticastBindAddr(h, d, offset, ptr, size, 0)
                )
            }?;
        } else {
            // SAFETY: as above, 12.1 ABI.
            unsafe {
                cu!(
                    self.inner.driver,
                    cuMulticastBindAddr_v12010(h, offset, ptr, size, 0)
                )
            }?;
        }
        Ok(self.record(d, offset, size, MulticastMemory::Mapping(mapping.clone())))
    }

    /// Map `size` bytes of the object from `offset` at `reservation_offset` of `reservation`
    /// (`cuMemMap` of the multicast handle), readable and writable by each of `access` (members of
    /// the team). Every device must have been added.
    pub fn map(
        &self,
        reservation: &Arc<Reservation>,
        reservation_offset: usize,
        offset: usize,
        size: usize,
        access: &[Device],
    ) -> Result<MulticastMapping> {
        self.check_range("mapping", offset, size)?;
        multiple(
            "reservation_offset",
            reservation_offset,
            self.inner.granularity,
        )?;
        // Inside the reservation first: the address sum cannot overflow then.
        crate::error::check_within(size, reservation_offset, reservation.size(), "reservation")?;
        let ptr = reservation.device_ptr() + reservation_offset as CUdeviceptr;
        multiple("reservation address", ptr as usize, self.inner.granularity)?;
        if access.is_empty() {
            return Err(Error::invalid(
                "access",
                "no devices; expected the team's members",
            ));
        }
        {
            let st = self.inner.state.lock();
            for a in access {
                if !self.is_shared() && !st.added.contains(&a.ordinal()) {
                    return Err(Error::invalid(
                        "access",
                        format!(
                            "device {} is not in this multicast team {:?}",
                            a.ordinal(),
                            st.added
                        ),
                    ));
                }
            }
        }
        ensure_context(&self.inner.driver, access[0].ordinal())?;
        // SAFETY: the range lies in a live reservation (held by the mapping) and the handle is
        // live (held too); flags 0.
        unsafe {
            cu!(
                self.inner.driver,
                cuMemMap(ptr, size, offset, self.inner.handle, 0)
            )
        }?;
        self.inner.state.lock().mapped += 1;
        // From here the mapping value owns the unmap (also on the error below).
        let m = MulticastMapping {
            object: self.inner.clone(),
            reservation: reservation.clone(),
            ptr,
            size,
        };
        let descs: Vec<CUmemAccessDesc> = access
            .iter()
            .map(|d| CUmemAccessDesc {
                location: Location::Device(d.ordinal()).raw(),
                flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: `descs` holds `descs.len()` descriptors; the range is mapped.
        unsafe {
            cu!(
                self.inner.driver,
                cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
            )
        }?;
        Ok(m)
    }

    /// Reserve a range of the object's size (aligned to its granularity) and map all of it for
    /// `access` — the common case in one call.
    pub fn map_whole(&self, access: &[Device]) -> Result<MulticastMapping> {
        let r = Reservation::builder(&self.inner.driver, self.inner.spec.size)
            .alignment(self.inner.granularity)
            .reserve()?;
        self.map(&r, 0, 0, self.inner.spec.size, access)
    }

    /// Export as a POSIX fd (the spec must have asked for it). Other processes import it with
    /// [`MulticastObject::import_posix_fd`], add their devices and bind their memory.
    pub fn export_posix_fd(&self) -> Result<OwnedFd> {
        if !self.inner.spec.handle_types.posix_fd {
            return Err(Error::invalid(
                "handle_types",
                "the multicast object was created without the POSIX-fd handle type; choose it in the spec",
            ));
        }
        let fd = crate::vmm::share::export_posix_fd(&self.inner.driver, self.inner.handle)?;
        self.inner
            .shared
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(fd)
    }

    /// Export as a fabric handle (the spec must have asked for it).
    pub fn export_fabric(&self) -> Result<FabricHandle> {
        if !self.inner.spec.handle_types.fabric {
            return Err(Error::invalid(
                "handle_types",
                "the multicast object was created without the fabric handle type; choose it in the spec",
            ));
        }
        let h = crate::vmm::share::export_fabric(&self.inner.driver, self.inner.handle)?;
        self.inner
            .shared
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(h)
    }

    fn check_import(driver: &Driver, spec: &MulticastSpec) -> Result<usize> {
        guard::check(driver, "multicast objects")?;
        let g = spec.granularity(driver, Granularity::Minimum)?;
        if spec.size == 0 || spec.size % g != 0 {
            return Err(Error::invalid(
                "spec.size",
                format!(
                    "{} bytes; an exported multicast object's size is a positive multiple of the granularity {g}",
                    spec.size
                ),
            ));
        }
        ensure_context(driver, 0)?;
        Ok(g)
    }

    /// Import an object exported as a POSIX fd, described by `spec` (as the exporter created it,
    /// size rounded; untrusted, so checked). The fd stays the caller's. Honours the guard.
    pub fn import_posix_fd(
        driver: &Driver,
        fd: BorrowedFd<'_>,
        spec: &MulticastSpec,
    ) -> Result<MulticastObject> {
        let g = MulticastObject::check_import(driver, spec)?;
        let h = crate::vmm::share::import_posix_fd(driver, fd)?;
        MulticastObject::adopt_imported(driver, h, *spec, g, "fd")
    }

    /// Import an object exported as a fabric handle: `bytes` must be exactly 64 (checked before
    /// the call), `spec` as in [`MulticastObject::import_posix_fd`].
    pub fn import_fabric(
        driver: &Driver,
        bytes: &[u8],
        spec: &MulticastSpec,
    ) -> Result<MulticastObject> {
        let handle = FabricHandle::from_bytes(bytes)?;
        let g = MulticastObject::check_import(driver, spec)?;
        let h = crate::vmm::share::import_fabric(driver, &handle)?;
        MulticastObject::adopt_imported(driver, h, *spec, g, "bytes")
    }

    /// Own an imported handle, after making sure it is a multicast object's. Allocations and
    /// multicast objects share the shareable-handle calls, so the import itself cannot tell them
    /// apart: a physical allocation's fd or fabric handle imports fine and would even map like
    /// a multicast object. The driver describes an allocation's handle
    /// (`cuMemGetAllocationPropertiesFromHandle`) and refuses a multicast object's
    /// (`CUDA_ERROR_INVALID_VALUE`, or `INVALID_HANDLE`); any other answer is an error.
    fn adopt_imported(
        driver: &Driver,
        h: CUmemGenericAllocationHandle,
        spec: MulticastSpec,
        granularity: usize,
        arg: &'static str,
    ) -> Result<MulticastObject> {
        // Owned from here: released on any error below.
        let object = MulticastObject::adopt(driver, h, spec, granularity, true);
        let mut prop = cuda_multimem_sys::CUmemAllocationProp::default();
        // SAFETY: valid out-pointer and a live handle.
        match unsafe { cu!(driver, cuMemGetAllocationPropertiesFromHandle(&mut prop, h)) } {
            Ok(()) => Err(Error::invalid(
                arg,
                format!(
                    "the imported handle is a physical allocation's ({:?}), not a multicast \
                     object's; import it with PhysicalAllocation::import_posix_fd or \
                     import_fabric",
                    Location::from_raw(&prop.location)
                ),
            )),
            Err(Error::Driver { code, .. })
                if code == cuda_multimem_sys::CUresult::CUDA_ERROR_INVALID_VALUE
                    || code == cuda_multimem_sys::CUresult::CUDA_ERROR_INVALID_HANDLE =>
            {
                Ok(object)
            }
            Err(e) => Err(e),
        }
    }

    /// Whether this object was imported.
    pub fn is_imported(&self) -> bool {
        self.inner.imported
    }
}

/// One device's memory bound to a multicast object at an offset. Holds the object and the memory;
/// dropping it unbinds (`cuMulticastUnbind`) — at once, or when the object's last mapping is
/// unmapped if one exists.
pub struct MulticastBinding {
    object: Arc<Inner>,
    record: Option<BindRecord>,
}

impl std::fmt::Debug for MulticastBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.record {
            Some(r) => write!(
                f,
                "MulticastBinding(device {}, {} bytes at offset {})",
                r.device, r.size, r.offset
            ),
            None => write!(f, "MulticastBinding(released)"),
        }
    }
}

impl MulticastBinding {
    /// The device whose memory is bound.
    pub fn device(&self) -> i32 {
        self.record.as_ref().map_or(-1, |r| r.device)
    }
    /// Offset into the multicast object.
    pub fn offset(&self) -> usize {
        self.record.as_ref().map_or(0, |r| r.offset)
    }
    /// Bytes bound.
    pub fn size(&self) -> usize {
        self.record.as_ref().map_or(0, |r| r.size)
    }
}

impl Drop for MulticastBinding {
    fn drop(&mut self) {
        let Some(r) = self.record.take() else { return };
        let mut st = self.object.state.lock();
        if st.mapped > 0 {
            // Still bound in the driver until the mapping goes: it stays in `bound`, so a new
            // bind over the same range is refused with a clear error meanwhile.
            st.pending_unbind.push(r);
        } else {
            st.bound
                .retain(|&(d, o, s)| !(d == r.device && o == r.offset && s == r.size));
            drop(st);
            let _ = self.object.unbind(&r);
        }
    }
}

/// The multicast object mapped into a reserved range: a store here reaches every bound device.
/// Holds the object and the reservation; unmapped (`cuMemUnmap`) on drop, after which bindings
/// dropped meanwhile are unbound.
pub struct MulticastMapping {
    object: Arc<Inner>,
    reservation: Arc<Reservation>,
    ptr: CUdeviceptr,
    size: usize,
}

impl std::fmt::Debug for MulticastMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MulticastMapping({:#x}, {} bytes)", self.ptr, self.size)
    }
}

impl MulticastMapping {
    /// The multicast address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }
    /// The reservation it lies in.
    pub fn reservation(&self) -> &Arc<Reservation> {
        &self.reservation
    }
}

impl Drop for MulticastMapping {
    fn drop(&mut self) {
        let (ptr, size) = (self.ptr, self.size);
        self.object.driver.teardown(
            || format!("the multicast mapping {ptr:#x} of {size} bytes (cuMemUnmap)"),
            // SAFETY: exactly the range we mapped; the reservation and object are alive (held).
            move |d| unsafe { cu!(d, cuMemUnmap(ptr, size)) },
        );
        let mut st = self.object.state.lock();
        st.mapped -= 1;
        if st.mapped == 0 {
            for r in std::mem::take(&mut st.pending_unbind) {
                st.bound
                    .retain(|&(d, o, s)| !(d == r.device && o == r.offset && s == r.size));
                if let Err(e) = self.object.unbind(&r) {
                    eprintln!("cuda-multimem: unbinding a multicast object's memory failed during a teardown ({e})");
                }
            }
        }
    }
}
