//! Managed (unified) memory: advice, prefetch, discard and discard-and-prefetch on any managed
//! range, one range or many, on CUDA 12 and 13 drivers.
//!
//! The design follows cuda.core's: the operations are free functions that take any
//! [`ManagedRange`] — a validated pointer and length inside a managed allocation — and
//! [`ManagedBuffer`], a thin typed owner of a `cuMemAllocManaged` allocation (or a non-owning
//! wrapper of one made elsewhere), whose methods delegate to them. There is no god object: code
//! that holds managed memory it did not allocate here borrows it as a [`ManagedRange`] and uses
//! the same functions.
//!
//! - Advice ([`set_read_mostly`], [`set_preferred_location`], [`add_accessed_by`], ...) is
//!   applied with `cuMemAdvise`; its getters ask the driver (`cuMemRangeGetAttribute(s)`), so
//!   they report what the driver holds, not a cached copy.
//! - Range operations ([`prefetch`], [`discard`], [`discard_and_prefetch`] and their `_many`
//!   forms) are stream-ordered: they are queued on a [`Stream`](crate::Stream).
//!
//! ```
//! use cuda_multimem::managed::{self, Location, ManagedBuffer};
//! use cuda_multimem::{Driver, Stream};
//!
//! let driver = cuda_multimem_sim::driver_from_selection("sim:devices=1,version=13000")?; // or Driver::load()
//! let gpu = driver.device(0)?;
//! let stream = Stream::new(&gpu)?;
//! let mut buf = ManagedBuffer::new(&gpu, 4 << 20)?;
//! buf.host_slice_mut()?.fill(7);
//! buf.set_preferred_location(Location::device(&gpu))?;
//! // The whole buffer to the GPU, or parts of it, one call for many ranges:
//! buf.prefetch(Location::device(&gpu), &stream)?;
//! let halves = [buf.subrange(0, 2 << 20)?, buf.subrange(2 << 20, 2 << 20)?];
//! managed::prefetch_many(&halves, &[Location::Host], &stream)?;
//! stream.synchronize()?;
//! assert_eq!(buf.last_prefetch_location()?, Some(Location::Host));
//! assert!(buf.host_slice()?.iter().all(|&b| b == 7));
//! # Ok::<(), cuda_multimem::Error>(())
//! ```
//!
//! Driver versions: from CUDA 12.2 locations travel as `CUmemLocation` (host NUMA nodes
//! included); before 12.2 the older `CUdevice` ABIs of `cuMemAdvise` and `cuMemPrefetchAsync`
//! are used, and host-NUMA locations are [`Error::Unsupported`](crate::Error::Unsupported),
//! saying so. The CUDA 13.0 batch calls serve many ranges at once; on CUDA 12 prefetching many
//! ranges loops over the single-range call, and discard / discard-and-prefetch (which exist only
//! as 13.0 batch calls) are `Unsupported`.

mod advice;
mod buffer;
mod location;
mod ops;
mod range;

pub use advice::{
    accessed_by, add_accessed_by, last_prefetch_location, preferred_location, read_mostly,
    remove_accessed_by, set_accessed_by, set_preferred_location, set_read_mostly,
    unset_preferred_location,
};
pub use buffer::{Attach, ManagedBuffer};
pub use location::Location;
pub use ops::{
    discard, discard_and_prefetch, discard_and_prefetch_many, discard_many, prefetch,
    prefetch_many, prefetch_many_with, PrefetchPolicy, AUTO_BATCH_MIN_MEAN_RANGE,
};
pub use range::ManagedRange;
