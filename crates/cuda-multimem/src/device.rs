//! Devices and their attributes.

use std::ffi::c_char;

use cuda_multimem_sys::{CUdevice, CUdevice_attribute as A};

use crate::driver::Driver;
use crate::error::{cu, Error, Result};

/// A device: an ordinal of a [`Driver`].
#[derive(Clone)]
pub struct Device {
    driver: Driver,
    ordinal: CUdevice,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.ordinal)
    }
}

impl PartialEq for Device {
    fn eq(&self, o: &Self) -> bool {
        self.ordinal == o.ordinal && self.driver.same_as(&o.driver)
    }
}
impl Eq for Device {}

impl Driver {
    /// Device `ordinal`.
    pub fn device(&self, ordinal: usize) -> Result<Device> {
        if ordinal >= self.device_count() {
            return Err(Error::invalid(
                "ordinal",
                format!(
                    "device {ordinal} does not exist; this machine has {} device(s)",
                    self.device_count()
                ),
            ));
        }
        Ok(Device::new(self.clone(), ordinal as CUdevice))
    }

    /// Every device.
    pub fn devices(&self) -> Vec<Device> {
        (0..self.device_count() as CUdevice)
            .map(|o| Device::new(self.clone(), o))
            .collect()
    }
}

impl Device {
    pub(crate) fn new(driver: Driver, ordinal: CUdevice) -> Self {
        Device { driver, ordinal }
    }

    /// Whether `other` comes from the same `Driver` value (a clone of it), not merely the same
    /// ordinal. Two `Driver` values over one driver are different values: their devices must not
    /// be mixed in one team or object.
    pub(crate) fn same_driver(&self, other: &Device) -> bool {
        self.driver.same_as(&other.driver)
    }

    /// The error for a member of another `Driver` value (`arg` names the argument).
    pub(crate) fn other_driver_error(&self, arg: &'static str) -> crate::Error {
        crate::Error::invalid(
            arg,
            format!(
                "device {} comes from another Driver value; every member must come from the same Driver",
                self.ordinal
            ),
        )
    }

    /// The driver this device belongs to.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The ordinal (the `CUdevice` value).
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Make this device's primary context current on the calling thread (retaining it on first
    /// use). Every wrapper that needs a context calls this; call it yourself before raw calls.
    pub fn bind(&self) -> Result<()> {
        let ctx = self.driver.primary_context(self.ordinal)?;
        // SAFETY: ctx is a live primary context retained by the driver value.
        unsafe { cu!(self.driver, cuCtxSetCurrent(ctx)) }
    }

    /// Wait for all work queued on this device's primary context (`cuCtxSynchronize`), binding
    /// it first.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the device's primary context is current; the call only waits.
        unsafe { cu!(self.driver, cuCtxSynchronize_v2000()) }
    }

    /// Copy `data` from host memory to `dst` and return once it is in device memory.
    ///
    /// A plain `cuMemcpyHtoD` from pageable memory returns once the data are staged, before the
    /// DMA to the device has completed (CUDA's "API synchronization behavior"), so a kernel on a
    /// non-blocking stream launched right after may still read the old contents (the
    /// two-process allreduce test saw exactly that on H200s, past the first MiB). The copy runs
    /// on the legacy default stream; this then synchronises that stream (which the copy itself
    /// already waited for), not the device: kernels on non-blocking streams are not waited for.
    ///
    /// # Safety
    /// `dst .. dst + data.len()` is device memory (or a mapping) this device may write.
    pub unsafe fn copy_from_host_blocking(
        &self,
        dst: cuda_multimem_sys::CUdeviceptr,
        data: &[u8],
    ) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller promises the destination; the slice is live for the call.
        unsafe {
            cu!(
                self.driver,
                cuMemcpyHtoD_v3020(dst, data.as_ptr().cast(), data.len())
            )
        }?;
        // SAFETY: the legacy default stream of the current context.
        unsafe { cu!(self.driver, cuStreamSynchronize(std::ptr::null_mut())) }
    }

    /// Set `len` bytes at `dst` to `value` and return once they are set. A plain `cuMemsetD8` on
    /// device memory is queued on the legacy default stream and returns at once; kernels on
    /// non-blocking streams do not wait for it (they could run before it, or be overwritten by
    /// it). This synchronises the legacy stream after it.
    ///
    /// # Safety
    /// `dst .. dst + len` is device memory (or a mapping) this device may write.
    pub unsafe fn memset_blocking(
        &self,
        dst: cuda_multimem_sys::CUdeviceptr,
        value: u8,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller promises the destination.
        unsafe { cu!(self.driver, cuMemsetD8_v3020(dst, value, len)) }?;
        // SAFETY: the legacy default stream of the current context.
        unsafe { cu!(self.driver, cuStreamSynchronize(std::ptr::null_mut())) }
    }

    /// Copy `dst.len()` bytes from device memory at `src` to host memory (`cuMemcpyDtoH`). A
    /// device-to-host copy to pageable memory returns once the bytes are in `dst`; it waits
    /// for the legacy and blocking streams' earlier work, not for kernels on non-blocking streams
    /// (synchronise those first). An empty `dst` is a no-op.
    ///
    /// # Safety
    /// `src .. src + dst.len()` is device memory (or a mapping) this device may read.
    pub unsafe fn copy_to_host(
        &self,
        src: cuda_multimem_sys::CUdeviceptr,
        dst: &mut [u8],
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller promises the source; `dst` is valid for `dst.len()` writes.
        unsafe {
            cu!(
                self.driver,
                cuMemcpyDtoH_v3020(dst.as_mut_ptr().cast(), src, dst.len())
            )
        }
    }

    /// The raw primary context (retained on first use).
    pub fn primary_context(&self) -> Result<cuda_multimem_sys::CUcontext> {
        self.driver.primary_context(self.ordinal)
    }

    /// The device's name.
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the buffer is valid for 256 bytes, which is the length passed.
        unsafe {
            cu!(
                self.driver,
                cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.ordinal)
            )
        }?;
        let bytes: Vec<u8> = buf
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        let mut b = 0usize;
        // SAFETY: one size_t written through a valid pointer.
        unsafe { cu!(self.driver, cuDeviceTotalMem_v3020(&mut b, self.ordinal)) }?;
        Ok(b)
    }

    /// (free, total) bytes of this device's memory (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: two size_t written through valid pointers; a context is current.
        unsafe { cu!(self.driver, cuMemGetInfo_v3020(&mut free, &mut total)) }?;
        Ok((free, total))
    }

    /// A raw device attribute.
    pub fn attribute(&self, attr: A) -> Result<i32> {
        let mut v = 0;
        // SAFETY: one int written through a valid pointer.
        unsafe {
            cu!(
                self.driver,
                cuDeviceGetAttribute(&mut v, attr, self.ordinal)
            )
        }?;
        Ok(v)
    }

    /// An attribute the driver may predate: `None` when it answers `CUDA_ERROR_INVALID_VALUE`
    /// (as a 13.0 driver does for the logical-endpoint attributes 153-158).
    pub fn attribute_opt(&self, attr: A) -> Result<Option<i32>> {
        match self.attribute(attr) {
            Ok(v) => Ok(Some(v)),
            Err(Error::Driver { code, .. })
                if code == cuda_multimem_sys::CUresult::CUDA_ERROR_INVALID_VALUE =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn flag(&self, attr: A) -> Result<bool> {
        Ok(self.attribute_opt(attr)?.unwrap_or(0) != 0)
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Multiprocessor count.
    pub fn multiprocessor_count(&self) -> Result<i32> {
        self.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }

    /// Whether the VMM calls (`cuMemCreate`, `cuMemMap`, ...) are supported.
    pub fn supports_vmm(&self) -> Result<bool> {
        self.flag(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
    }

    /// Whether switch multicast is supported (false on drivers before 12.1).
    pub fn supports_multicast(&self) -> Result<bool> {
        self.flag(A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)
    }

    /// Whether POSIX-fd shareable handles are supported.
    pub fn supports_posix_fd_handle(&self) -> Result<bool> {
        self.flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    }

    /// Whether fabric shareable handles are supported.
    pub fn supports_fabric_handle(&self) -> Result<bool> {
        self.flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)
    }

    /// Whether the device accesses managed memory concurrently with the CPU.
    pub fn concurrent_managed_access(&self) -> Result<bool> {
        self.flag(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)
    }

    /// The host NUMA node closest to the device; `None` when the driver predates the attribute
    /// (before 12.2) or the host has no NUMA (-1).
    pub fn host_numa_id(&self) -> Result<Option<i32>> {
        Ok(self
            .attribute_opt(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?
            .filter(|&v| v >= 0))
    }

    /// Unicast logical endpoints; `None` when the driver predates them (before 13.3).
    pub fn logical_endpoint_unicast(&self) -> Result<Option<bool>> {
        Ok(self
            .attribute_opt(A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_UNICAST_SUPPORTED)?
            .map(|v| v != 0))
    }

    /// Multicast logical endpoints; `None` when the driver predates them (before 13.3).
    pub fn logical_endpoint_multicast(&self) -> Result<Option<bool>> {
        Ok(self
            .attribute_opt(A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_MULTICAST_SUPPORTED)?
            .map(|v| v != 0))
    }

    /// Counted operations through logical endpoints; `None` before 13.3.
    pub fn logical_endpoint_counted_ops(&self) -> Result<Option<bool>> {
        Ok(self
            .attribute_opt(A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_COUNTED_OPS_SUPPORTED)?
            .map(|v| v != 0))
    }

    /// Bit mask of logical-endpoint IPC handle types; `None` before 13.3.
    pub fn logical_endpoint_handle_types(&self) -> Result<Option<i32>> {
        self.attribute_opt(A::CU_DEVICE_ATTRIBUTE_LOGICAL_ENDPOINT_SUPPORTED_HANDLE_TYPES)
    }

    /// Whether this device can access `peer`'s memory directly.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        let mut v = 0;
        // SAFETY: one int written through a valid pointer.
        unsafe {
            cu!(
                self.driver,
                cuDeviceCanAccessPeer(&mut v, self.ordinal, peer.ordinal)
            )
        }?;
        Ok(v != 0)
    }

    /// Enable access from this device's context to `peer`'s ordinary allocations
    /// (`cuCtxEnablePeerAccess`); already enabled is not an error. VMM memory uses access
    /// descriptors instead (see `vmm`).
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer == self {
            return Err(Error::invalid(
                "peer",
                format!("device {} cannot be its own peer", self.ordinal),
            ));
        }
        let pctx = peer.primary_context()?;
        self.bind()?;
        // SAFETY: pctx is a live primary context; flags must be 0.
        match unsafe { cu!(self.driver, cuCtxEnablePeerAccess(pctx, 0)) } {
            Err(Error::Driver { code, .. })
                if code == cuda_multimem_sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED =>
            {
                Ok(())
            }
            r => r,
        }
    }
}
