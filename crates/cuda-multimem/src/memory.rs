//! Plain device memory (`cuMemAlloc`) as a typed buffer, and the element types that may live in
//! device memory.
//!
//! Offsets and lengths are in elements and checked (overflow included) before any driver call.
//! A copy of zero elements is a no-op that succeeds (its offset is still checked).

use std::marker::PhantomData;

use cuda_multimem_sys::CUdeviceptr;

use crate::error::{cu, Error, Result};
use crate::{Device, StreamRef};

/// Types that can be copied to and from device memory as raw bytes: plain old data without
/// padding, for which every bit pattern is a valid value.
///
/// # Safety
/// Implement only for types with no padding bytes, no pointers or references, no invariants
/// (any bit pattern is valid, all zeros included) and the same layout on host and device.
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

macro_rules! device_repr {
    ($($t:ty),*) => {
        $(
            // SAFETY: a primitive number type: no padding, every bit pattern valid.
            unsafe impl DeviceRepr for $t {}
        )*
    };
}
device_repr!(
    u8,
    i8,
    u16,
    i16,
    u32,
    i32,
    u64,
    i64,
    f32,
    f64,
    half::f16,
    half::bf16,
    float8::F8E4M3,
    float8::F8E5M2
);

/// The bytes of `data`.
pub(crate) fn as_bytes<T: DeviceRepr>(data: &[T]) -> &[u8] {
    // SAFETY: T has no padding (DeviceRepr), so every byte of the slice is initialised; the
    // length is the slice's size in bytes and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

/// The bytes of `data`, writable.
pub(crate) fn as_bytes_mut<T: DeviceRepr>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; any bytes written are a valid T (DeviceRepr).
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}

/// `count` elements at `offset` must lie within `len` (overflow included): otherwise an
/// [`Error::InvalidArgument`] naming `offset_arg` when the offset alone is past the end, else
/// `arg`.
fn check_elements(
    (offset_arg, arg): (&'static str, &'static str),
    offset: usize,
    count: usize,
    len: usize,
    what: &str,
) -> Result<()> {
    if offset > len {
        return Err(Error::invalid(
            offset_arg,
            format!("element {offset} is past the end of the {len}-element {what}"),
        ));
    }
    if offset.checked_add(count).is_none_or(|end| end > len) {
        return Err(Error::invalid(
            arg,
            format!("{count} elements at offset {offset} pass the end of the {len}-element {what}"),
        ));
    }
    Ok(())
}

/// Device memory of one device holding `len` values of `T` (`cuMemAlloc`), freed on drop.
///
/// Copies from and to the host are synchronous: [`DeviceBuffer::copy_from_host`] returns once
/// the data are in device memory, visible to kernels on any stream. They do not wait for
/// kernels on non-blocking streams: synchronise those before reading what they wrote.
pub struct DeviceBuffer<T: DeviceRepr> {
    device: Device,
    ptr: CUdeviceptr,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceRepr> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>({:#x}, {} elements, device {})",
            std::any::type_name::<T>(),
            self.ptr,
            self.len,
            self.device.ordinal()
        )
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Allocate `len` elements, uninitialised (the caller writes them before anyone reads).
    fn alloc(device: &Device, len: usize, arg: &'static str) -> Result<DeviceBuffer<T>> {
        if len == 0 {
            return Err(Error::invalid(
                arg,
                "0 elements; a buffer holds at least one",
            ));
        }
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            Error::invalid(
                arg,
                format!(
                    "{len} elements of {} bytes overflow the address space",
                    std::mem::size_of::<T>()
                ),
            )
        })?;
        device.bind()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: out-pointer valid; the device's context is current; bytes > 0.
        unsafe { cu!(device.driver(), cuMemAlloc_v3020(&mut ptr, bytes)) }?;
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// `len` zeroed elements on `device` (at least one).
    pub fn zeroed(device: &Device, len: usize) -> Result<DeviceBuffer<T>> {
        let b = DeviceBuffer::alloc(device, len, "len")?;
        // SAFETY: the whole allocation, just made on this device (freed by `b`'s drop on error).
        unsafe { device.memset_blocking(b.ptr, 0, b.bytes()) }?;
        Ok(b)
    }

    /// A buffer on `device` holding a copy of `data` (at least one element).
    pub fn from_host(device: &Device, data: &[T]) -> Result<DeviceBuffer<T>> {
        let b = DeviceBuffer::alloc(device, data.len(), "data")?;
        // SAFETY: the whole allocation, just made on this device (freed by `b`'s drop on error).
        unsafe { device.copy_from_host_blocking(b.ptr, as_bytes(data)) }?;
        Ok(b)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer holds at least one element. (For symmetry with `len`.)
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device address of element 0 (valid while `self` lives).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The device address of element `offset` (checked, `offset <= len`).
    fn addr(&self, offset: usize) -> CUdeviceptr {
        self.ptr + (offset * std::mem::size_of::<T>()) as CUdeviceptr
    }

    /// Copy `src` to elements `offset .. offset + src.len()`; returns once they are in device
    /// memory (see [`Device::copy_from_host_blocking`]).
    pub fn copy_from_host(&mut self, offset: usize, src: &[T]) -> Result<()> {
        check_elements(("offset", "src"), offset, src.len(), self.len, "buffer")?;
        // SAFETY: the range lies in this allocation of this device (checked above).
        unsafe {
            self.device
                .copy_from_host_blocking(self.addr(offset), as_bytes(src))
        }
    }

    /// Copy elements `offset .. offset + dst.len()` to `dst`.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        check_elements(("offset", "dst"), offset, dst.len(), self.len, "buffer")?;
        // SAFETY: the range lies in this allocation of this device (checked above).
        unsafe {
            self.device
                .copy_to_host(self.addr(offset), as_bytes_mut(dst))
        }
    }

    /// All elements, copied to the host.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        // SAFETY: all zeros is a valid T (DeviceRepr).
        let mut v = vec![unsafe { std::mem::zeroed::<T>() }; self.len];
        self.copy_to_host(0, &mut v)?;
        Ok(v)
    }

    /// Queue a copy of `len` elements of `src` from `src_offset` to this buffer at `offset` on
    /// `stream` (`cuMemcpyDtoDAsync`), a stream of this buffer's device and driver value; `src`
    /// may be on another device of the same driver value. Freeing either buffer waits for the
    /// device's queued work (`cuMemFree`).
    pub fn copy_from_async<'s>(
        &mut self,
        offset: usize,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        len: usize,
        stream: impl Into<StreamRef<'s>>,
    ) -> Result<()> {
        let stream = stream.into();
        stream.check_device("stream", &self.device, "the destination buffer is on")?;
        if !src.device.driver().same_as(self.device.driver()) {
            return Err(Error::invalid(
                "src",
                "a buffer of another Driver value than the destination's",
            ));
        }
        check_elements(("offset", "len"), offset, len, self.len, "buffer")?;
        check_elements(
            ("src_offset", "len"),
            src_offset,
            len,
            src.len,
            "source buffer",
        )?;
        // SAFETY: both ranges lie in live allocations of the same driver value (checked), they
        // are distinct allocations (a `&mut` and a `&` cannot be the same buffer), and freeing
        // either waits for the device's work.
        unsafe {
            stream.copy_dtod_async(
                self.addr(offset),
                src.addr(src_offset),
                len * std::mem::size_of::<T>(),
            )
        }
    }
}

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let (ptr, ordinal) = (self.ptr, self.device.ordinal());
        self.device.driver().teardown(
            || format!("the device memory {ptr:#x} of device {ordinal} (cuMemFree)"),
            move |d| {
                d.bind(ordinal)?;
                // SAFETY: we own the allocation; nothing uses its address after this.
                unsafe { cu!(d, cuMemFree_v3020(ptr)) }
            },
        );
    }
}

/// Page-locked host memory mapped into the device's address space (`cuMemHostAlloc` with
/// `CU_MEMHOSTALLOC_DEVICEMAP`, `cuMemHostGetDevicePointer`), `len` values of `T`, zeroed, freed
/// on drop (`cuMemFreeHost`, after the device's queued work: a kernel may still store into it).
///
/// Kernels store into it through [`HostMappedBuffer::device_ptr`] (at system scope); the host
/// reads it with [`HostMappedBuffer::load`], a plain volatile load: no driver call and no
/// synchronisation. What a kernel stored becomes visible to the host some time after the store
/// (over the bus); a load never waits for it. Meant for small words the host polls (flags,
/// error words), not for bulk data.
pub struct HostMappedBuffer<T: DeviceRepr> {
    device: Device,
    host: *mut T,
    dptr: CUdeviceptr,
    len: usize,
}

// SAFETY: the buffer owns its allocation; every access is a volatile load or store of a
// `DeviceRepr` value (no references into it escape), which any thread may make.
unsafe impl<T: DeviceRepr> Send for HostMappedBuffer<T> {}
// SAFETY: as above; `&self` methods only make volatile loads and stores.
unsafe impl<T: DeviceRepr> Sync for HostMappedBuffer<T> {}

impl<T: DeviceRepr> std::fmt::Debug for HostMappedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostMappedBuffer<{}>(host {:p}, device {:#x}, {} elements, device {})",
            std::any::type_name::<T>(),
            self.host,
            self.dptr,
            self.len,
            self.device.ordinal()
        )
    }
}

impl<T: DeviceRepr> HostMappedBuffer<T> {
    /// `len` zeroed elements (at least one) of page-locked host memory mapped for `device`.
    pub fn zeroed(device: &Device, len: usize) -> Result<HostMappedBuffer<T>> {
        if len == 0 {
            return Err(Error::invalid(
                "len",
                "0 elements; a buffer holds at least one",
            ));
        }
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                Error::invalid(
                    "len",
                    format!(
                        "{len} elements of {} bytes: no bytes, or more than the address space",
                        std::mem::size_of::<T>()
                    ),
                )
            })?;
        device.bind()?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer valid; the device's context is current; bytes > 0.
        unsafe {
            cu!(
                device.driver(),
                cuMemHostAlloc_v2020(
                    &mut host,
                    bytes,
                    cuda_multimem_sys::CU_MEMHOSTALLOC_DEVICEMAP
                )
            )
        }?;
        let mut b = HostMappedBuffer {
            device: device.clone(),
            host: host.cast(),
            dptr: 0,
            len,
        };
        if host.is_null() || (host as usize) & (std::mem::align_of::<T>() - 1) != 0 {
            b.host = std::ptr::null_mut();
            // SAFETY: the allocation just made; not used after this.
            let _ = unsafe { cu!(device.driver(), cuMemFreeHost_v2000(host)) };
            return Err(Error::invalid(
                "len",
                format!("cuMemHostAlloc returned {host:p}, not aligned for the element type"),
            ));
        }
        // SAFETY: the fresh allocation of `bytes` bytes, exclusively ours.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        let mut dptr: CUdeviceptr = 0;
        // SAFETY: out-pointer valid; `host` is a mapped allocation of this context; flags 0
        // (dropping `b` frees it on error).
        unsafe {
            cu!(
                device.driver(),
                cuMemHostGetDevicePointer_v3020(&mut dptr, host, 0)
            )
        }?;
        b.dptr = dptr;
        Ok(b)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer holds at least one element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it is mapped for.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device address of element 0 (valid in kernels of this device's context while `self`
    /// lives).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.dptr
    }

    /// Element `i` as the host sees it now (a volatile load), or `None` past the end.
    pub fn load(&self, i: usize) -> Option<T> {
        // SAFETY: i < len: inside the allocation, aligned (checked at creation); any bit
        // pattern is a valid T (DeviceRepr).
        (i < self.len).then(|| unsafe { std::ptr::read_volatile(self.host.add(i)) })
    }

    /// Store `v` into element `i` (a volatile store); false past the end. Kernels of the device
    /// that store into the same element race with it: make such stores when no kernel does.
    pub fn store(&self, i: usize, v: T) -> bool {
        if i >= self.len {
            return false;
        }
        // SAFETY: as in `load`; the memory is ours and writable.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) };
        true
    }
}

impl<T: DeviceRepr> Drop for HostMappedBuffer<T> {
    fn drop(&mut self) {
        if self.host.is_null() {
            return;
        }
        // a kernel of the device may still store into it: its queued work finishes first
        let _ = self.device.synchronize();
        let (host, ordinal) = (self.host as usize, self.device.ordinal());
        self.device.driver().teardown(
            || format!("the mapped host memory {host:#x} of device {ordinal} (cuMemFreeHost)"),
            move |d| {
                d.bind(ordinal)?;
                // SAFETY: we own the allocation; nothing uses it after this (a kernel storing
                // into it has finished: its owner frees it after the device's work).
                unsafe { cu!(d, cuMemFreeHost_v2000(host as *mut std::ffi::c_void)) }
            },
        );
    }
}
