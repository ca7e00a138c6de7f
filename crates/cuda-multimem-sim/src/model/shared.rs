//! Cross-process state of exported multicast objects and logical endpoints: a *shared table* is a
//! memfd that every process holding the object maps; its first word is a spin lock, then a
//! `#[repr(C)]` plain-data struct. Bindings recorded there name the process and the descriptor of
//! the bound allocation's memfd, which that process keeps open, so another process maps the same
//! memory through `/proc/<pid>/fd/<n>`.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

use cuda_multimem_sys::CUresult;

use crate::state::SimResult;

/// Devices a shared table records.
pub(crate) const MAX_DEVICES: usize = crate::config::MAX_DEVICES;
/// Bindings a shared table records.
pub(crate) const MAX_BINDS: usize = 256;

/// One binding in a shared table.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Bind {
    pub live: u32,
    /// Bumped at every registration, so a cached view of a reused slot is not reused.
    pub gen: u32,
    pub dev: i32,
    pub pid: u32,
    pub fd: i32,
    pub _pad: u32,
    pub offset: u64,
    pub len: u64,
    pub file_offset: u64,
}

/// Record a binding of this process in `binds`.
pub(crate) fn register(
    binds: &mut [Bind],
    next_gen: &mut u32,
    dev: i32,
    offset: u64,
    len: u64,
    fd: RawFd,
    file_offset: u64,
) -> SimResult {
    let slot = binds
        .iter()
        .position(|b| b.live == 0)
        .ok_or(CUresult::CUDA_ERROR_OUT_OF_MEMORY)?;
    *next_gen = next_gen.wrapping_add(1);
    binds[slot] = Bind {
        live: 1,
        gen: *next_gen,
        dev,
        pid: std::process::id(),
        fd,
        _pad: 0,
        offset,
        len,
        file_offset,
    };
    Ok(())
}

/// Mark this process's bindings matching `pred` as gone.
pub(crate) fn unregister(binds: &mut [Bind], pred: impl Fn(&Bind) -> bool) {
    let me = std::process::id();
    for b in binds.iter_mut().filter(|b| b.live != 0 && b.pid == me) {
        if pred(b) {
            b.live = 0;
        }
    }
}

/// A shared view of `len` bytes of memfd `fd` from `offset`.
pub(crate) fn view_of(fd: RawFd, offset: usize, len: usize) -> SimResult<usize> {
    // SAFETY: a fresh shared mapping; no existing memory is affected (a bad range only fails).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset as libc::off_t,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(p as usize)
}

/// Open descriptor `fd` of process `pid` (same user) through `/proc`.
pub(crate) fn open_remote(pid: u32, fd: i32) -> SimResult<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}"))
        .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
    // SAFETY: a NUL-terminated path; the fd returned is owned below.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(CUresult::CUDA_ERROR_NOT_PERMITTED);
    }
    // SAFETY: a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A view of another process's bound memory.
pub(crate) fn remote_view(b: &Bind) -> SimResult<usize> {
    let fd = open_remote(b.pid, b.fd).map_err(|_| CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)?;
    view_of(fd.as_raw_fd(), b.file_offset as usize, b.len as usize)
}

/// Views of other processes' bound memory, mapped on first use: (table slot, generation) ->
/// (address, length).
#[derive(Default)]
pub(crate) struct RemoteViews(HashMap<(usize, u32), (usize, usize)>);

impl RemoteViews {
    /// The address where `b` (in table slot `slot`) is mapped here, mapping it the first time.
    pub fn view(&mut self, slot: usize, b: &Bind) -> SimResult<usize> {
        if let Some(&(a, _)) = self.0.get(&(slot, b.gen)) {
            return Ok(a);
        }
        let a = remote_view(b)?;
        self.0.insert((slot, b.gen), (a, b.len as usize));
        Ok(a)
    }

    /// Unmap every view.
    pub fn unmap_all(&mut self) {
        for (_, (a, l)) in self.0.drain() {
            super::memory::unmap(a, l);
        }
    }
}

/// The inode of `fd`.
pub(crate) fn inode(fd: RawFd) -> SimResult<u64> {
    // SAFETY: an all-zero stat is a valid value to be overwritten.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    Ok(stat.st_ino as u64)
}

/// `dup` with close-on-exec.
pub(crate) fn dup(fd: RawFd) -> SimResult<OwnedFd> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) only fails or returns a new fd that we own.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if n < 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// A shared table holding a `T` (plain data, valid all-zero, first field its 8-byte magic).
pub(crate) struct Table<T> {
    base: usize,
    len: usize,
    pub fd: OwnedFd,
    _t: PhantomData<T>,
}

// SAFETY: the mapping is process-wide memory; every access to the data goes through `with`,
// which holds the table's lock (shared by every process mapping it).
unsafe impl<T> Send for Table<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Table<T> {}

impl<T> Table<T> {
    const LEN: usize = 8 + std::mem::size_of::<T>();

    /// The table in `fd` (of the right size), mapped here.
    fn mapped(fd: OwnedFd) -> SimResult<Table<T>> {
        let base = view_of(fd.as_raw_fd(), 0, Self::LEN)?;
        Ok(Table {
            base,
            len: Self::LEN,
            fd,
            _t: PhantomData,
        })
    }

    /// A new table named `name` (a memfd name), initialised by `init`.
    pub fn create(name: &str, init: impl FnOnce(&mut T) -> SimResult) -> SimResult<Table<T>> {
        let name = std::ffi::CString::new(name).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: a NUL-terminated name; the fd returned is owned below.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        // SAFETY: a fresh fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own memfd (zero-filled: a valid all-zero `T`).
        if unsafe { libc::ftruncate(fd.as_raw_fd(), Self::LEN as libc::off_t) } != 0 {
            return Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        }
        let t = Self::mapped(fd)?;
        t.with(init)?;
        Ok(t)
    }

    /// Map the table in `fd`, checking its size and its magic (the first 8 bytes of `T`).
    pub fn map(fd: OwnedFd, magic: &[u8; 8]) -> SimResult<Table<T>> {
        // SAFETY: an all-zero stat is a valid value to be overwritten.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat writes one stat.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0
            || stat.st_size as usize != Self::LEN
        {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let t = Self::mapped(fd)?;
        // SAFETY: the data starts 8 bytes in and begins with 8 magic bytes (T's first field).
        let m = t.with(|d| unsafe { *(d as *const T as *const [u8; 8]) });
        if &m != magic {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        Ok(t)
    }

    /// Run `f` on the table's data, holding its cross-process lock.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        // SAFETY: the first 4 bytes of the mapping are the lock word, only accessed atomically.
        let lock = unsafe { &*(self.base as *const AtomicU32) };
        while lock
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
        struct Unlock<'a>(&'a AtomicU32);
        impl Drop for Unlock<'_> {
            fn drop(&mut self) {
                self.0.store(0, Ordering::Release);
            }
        }
        let _unlock = Unlock(lock);
        // SAFETY: the data follows the lock word; holding the lock gives exclusive access among
        // every process that maps the table; T is plain data, all-zero initially.
        f(unsafe { &mut *((self.base + 8) as *mut T) })
    }
}

impl<T> Drop for Table<T> {
    fn drop(&mut self) {
        super::memory::unmap(self.base, self.len);
    }
}
