//! Multicast objects (`cuMulticast*`, drivers from 12.1) and the VMM calls on their handles:
//! `cuMemMap`/`cuMemUnmap`/`cuMemSetAccess` of a multicast range, `cuMemRelease`, and export /
//! import as a POSIX fd or a fabric handle.
//!
//! Model (following the `cuda.h` documentation of each call):
//! - a multicast object has a team size, a size per device (a multiple of the minimum multicast
//!   granularity, which is the largest minimum VMM granularity of the multicast-capable devices;
//!   the recommended one is 32 times that), and exportable handle types;
//! - devices are added once each, from the same NVLink clique (`CUDA_ERROR_INVALID_DEVICE`
//!   otherwise), a device without multicast is `CUDA_ERROR_NOT_SUPPORTED`, and no device can be
//!   added once memory was bound;
//! - binds and `cuMemMap` block until every device was added. The real driver blocks forever; the
//!   simulator waits [`BLOCK_LIMIT`] for another thread to add the missing devices and then fails
//!   with `CUDA_ERROR_ILLEGAL_STATE`, so a mistaken test fails instead of hanging;
//! - each bind makes a private view of the bound memory (a shared mapping of the allocation's
//!   memfd), so the binding survives an unmap of the address it was bound from, as physical memory
//!   does;
//! - a store through a multicast mapping reaches every device bound at that offset (the mapping's
//!   memory region carries a `memory::Redirect`); a plain load reads the lowest bound device;
//!   [`multicast_targets`] gives simulated kernels every bound device's address for
//!   `multimem.ld_reduce` / `st` / `red`;
//! - order rules, stricter than the documentation spells out (the anchors' measured pitfalls): an
//!   unbind while the object is mapped, and releasing the object's last handle while memory is
//!   bound, are refused with `CUDA_ERROR_ILLEGAL_STATE`, changing nothing;
//! - export: the first export gives the object a *shared table*, a memfd mapped by every process
//!   that holds the object: its description, the devices added (by any process) and every binding
//!   (device, offset, length, and the process id and descriptor number of the bound allocation's
//!   memfd, which the binding keeps open). A POSIX fd is a descriptor of that memfd; a fabric
//!   handle is 64 bytes (magic, exporter pid, the table's descriptor number there, its inode,
//!   checksum) that another process of the same user opens through `/proc/<pid>/fd/<n>`. Imported
//!   in the exporting process, either refers to the same object. In another process the import
//!   shares the table: devices added there count for the team everywhere (binds and maps wait,
//!   polling, for [`SHARED_BLOCK_LIMIT`]), and a store through any process's multicast mapping
//!   reaches every process's bound memory (views of other processes' memfds are opened through
//!   `/proc`).

pub use crate::model::multicast::{multicast_targets, BLOCK_LIMIT, SHARED_BLOCK_LIMIT};
