//! Range operations: prefetch, discard, discard-and-prefetch, one range or many.

use std::sync::Arc;

use cuda_multimem_sys::{CUdeviceptr, CUmemLocation};

use super::advice::LOCATION_ABI;
use super::{Location, ManagedRange};
use crate::error::{cu, Error, Result};
use crate::Stream;

/// The first driver with the batch calls (`cuMemPrefetchBatchAsync`, `cuMemDiscardBatchAsync`,
/// `cuMemDiscardAndPrefetchBatchAsync`).
const BATCH_ABI: i32 = 13000;

/// The mean range size from which [`PrefetchPolicy::Auto`] uses the batch call: 1 MiB.
///
/// The anchor measurements (ANCHORS.md; H200, driver 13.0, ranges first touched on the host and
/// moved to GPU 0): 4096 ranges of 64 KiB took 132 ms as a loop of `cuMemPrefetchAsync` and
/// 136–149 ms as one `cuMemPrefetchBatchAsync` (the batch is no faster); 2048 ranges of 2 MiB
/// took 234–253 ms as a loop and 173–188 ms as a batch (the batch is about 25 % faster).
///
/// Our own run through this API (2026-11-30, `nvidia-h200-x2`, driver 13.0, same setup, two runs
/// each) puts the crossover between 256 KiB and 1 MiB:
///
/// | ranges | loop | batch |
/// | --- | --- | --- |
/// | 4096 × 32 KiB | 139–142 ms | 171–172 ms |
/// | 4096 × 64 KiB | 123–129 ms | 131–137 ms |
/// | 4096 × 128 KiB | 178–179 ms | 189–195 ms |
/// | 1024 × 256 KiB | 37–39 ms | 46–50 ms |
/// | 512 × 1 MiB | 49–50 ms | 30–31 ms |
/// | 1024 × 2 MiB | 119–134 ms | 85–86 ms |
/// | 16 × 2 MiB | 1.9–2.1 ms | 1.6 ms |
///
/// (One run of 256 × 256 KiB favoured the batch, 17 ms against 10 ms; the larger 256 KiB run
/// above did not.) Hence: batch from a mean of 1 MiB, loop below.
pub const AUTO_BATCH_MIN_MEAN_RANGE: usize = 1 << 20;

/// How [`prefetch_many_with`] issues many prefetches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum PrefetchPolicy {
    /// Decide per call: the batch call when the driver has it (CUDA 13.0+), there are at least
    /// two ranges and their mean size is at least [`AUTO_BATCH_MIN_MEAN_RANGE`]; otherwise a
    /// loop of single-range prefetches. This follows the measurements quoted at
    /// [`AUTO_BATCH_MIN_MEAN_RANGE`]: the batch call pays off for many large ranges and not for
    /// many small ones.
    #[default]
    Auto,
    /// One `cuMemPrefetchAsync` per range (every driver).
    Loop,
    /// One `cuMemPrefetchBatchAsync` (CUDA 13.0+; [`Error::Unsupported`] before).
    Batch,
}

/// Check that `range` belongs to the same driver as `stream`.
fn same_driver(range: &ManagedRange<'_>, stream: &Stream, index: usize) -> Result<()> {
    if !Arc::ptr_eq(
        &range.device().driver().inner,
        &stream.device().driver().inner,
    ) {
        return Err(Error::invalid(
            "stream",
            format!("range {index} belongs to another Driver than the stream"),
        ));
    }
    Ok(())
}

/// An error of the many-range checks as the one-range call's caller sees it: `range` and
/// `location`, the arguments it passed, instead of `ranges` and `locations`.
fn as_one(e: Error) -> Error {
    match e {
        Error::InvalidArgument {
            arg: "ranges",
            reason,
        } => Error::InvalidArgument {
            arg: "range",
            reason,
        },
        Error::InvalidArgument {
            arg: "locations",
            reason,
        } => Error::InvalidArgument {
            arg: "location",
            reason,
        },
        e => e,
    }
}

/// Validate many ranges and their locations (one broadcasts, else one per range) before any
/// driver call.
fn check_many(
    ranges: &[ManagedRange<'_>],
    locations: Option<&[Location]>,
    stream: &Stream,
) -> Result<()> {
    if ranges.is_empty() {
        return Err(Error::invalid(
            "ranges",
            "no ranges given; expected at least one",
        ));
    }
    for (i, r) in ranges.iter().enumerate() {
        same_driver(r, stream, i)?;
    }
    if let Some(locations) = locations {
        if locations.is_empty() {
            return Err(Error::invalid(
                "locations",
                "no locations given; expected one (for every range) or one per range",
            ));
        }
        if locations.len() != 1 && locations.len() != ranges.len() {
            return Err(Error::invalid(
                "locations",
                format!(
                    "{} locations for {} ranges; expected 1 (for every range) or {}",
                    locations.len(),
                    ranges.len(),
                    ranges.len()
                ),
            ));
        }
        for l in locations {
            l.validate(stream.device().driver(), "locations")?;
        }
    }
    Ok(())
}

/// The location of range `i`.
fn location_of(locations: &[Location], i: usize) -> Location {
    if locations.len() == 1 {
        locations[0]
    } else {
        locations[i]
    }
}

/// The batch calls' location arrays: one entry per run of equal consecutive locations, with the
/// index of the run's first range (the first index is 0, indices increase, all below the count).
fn location_runs(locations: &[Location], count: usize) -> (Vec<CUmemLocation>, Vec<usize>) {
    let mut locs = Vec::new();
    let mut idxs = Vec::new();
    let mut prev = None;
    for i in 0..count {
        let l = location_of(locations, i);
        if prev != Some(l) {
            locs.push(l.to_raw());
            idxs.push(i);
            prev = Some(l);
        }
    }
    (locs, idxs)
}

/// Prefetch one range without re-validating: the 12.2 ABI where the driver has it, else the
/// `CUdevice` one (host NUMA locations then unsupported).
fn prefetch_one(range: ManagedRange<'_>, location: Location, stream: &Stream) -> Result<()> {
    let driver = stream.device().driver();
    if driver.version() < LOCATION_ABI {
        let dev = location.legacy().ok_or_else(|| Error::Unsupported {
            symbol: "cuMemPrefetchAsync",
            needed: LOCATION_ABI,
            driver: driver.version(),
            reason: format!(
                "{location} needs the CUmemLocation ABI of cuMemPrefetchAsync (CUDA 12.2); this \
                 driver has only the CUdevice ABI, which names devices and the host but no NUMA \
                 node"
            ),
        })?;
        // SAFETY: the range lies in managed memory borrowed for its lifetime; the stream is live.
        return unsafe {
            cu!(
                driver,
                cuMemPrefetchAsync_v8000(range.ptr(), range.len(), dev, stream.raw())
            )
        };
    }
    // SAFETY: as above; flags must be 0.
    unsafe {
        cu!(
            driver,
            cuMemPrefetchAsync_v12020(range.ptr(), range.len(), location.to_raw(), 0, stream.raw())
        )
    }
}

/// Queue a prefetch of `range` to `location` on `stream` (`cuMemPrefetchAsync`). Every location
/// kind is accepted; host NUMA locations need CUDA 12.2+.
pub fn prefetch(range: ManagedRange<'_>, location: Location, stream: &Stream) -> Result<()> {
    check_many(&[range], Some(&[location]), stream).map_err(as_one)?;
    stream.device().bind()?;
    prefetch_one(range, location, stream)
}

/// Queue prefetches of `ranges` on `stream`, choosing loop or batch by
/// [`PrefetchPolicy::Auto`]. `locations` holds one location for every range, or one per range.
pub fn prefetch_many(
    ranges: &[ManagedRange<'_>],
    locations: &[Location],
    stream: &Stream,
) -> Result<()> {
    prefetch_many_with(ranges, locations, stream, PrefetchPolicy::Auto)
}

/// The policy [`PrefetchPolicy::Auto`] resolves to for these ranges on a driver of `version`.
fn resolve(policy: PrefetchPolicy, ranges: &[ManagedRange<'_>], version: i32) -> PrefetchPolicy {
    match policy {
        PrefetchPolicy::Auto => {
            let total: u128 = ranges.iter().map(|r| r.len() as u128).sum();
            let mean = total / ranges.len().max(1) as u128;
            if version >= BATCH_ABI
                && ranges.len() >= 2
                && mean >= AUTO_BATCH_MIN_MEAN_RANGE as u128
            {
                PrefetchPolicy::Batch
            } else {
                PrefetchPolicy::Loop
            }
        }
        p => p,
    }
}

/// Queue prefetches of `ranges` on `stream` with an explicit `policy`. `locations` holds one
/// location for every range, or one per range; empty input and mismatched lengths are rejected
/// before any driver call. [`PrefetchPolicy::Batch`] needs CUDA 13.0 ([`Error::Unsupported`]
/// before); a loop stops at the first failing range (earlier ones stay queued).
pub fn prefetch_many_with(
    ranges: &[ManagedRange<'_>],
    locations: &[Location],
    stream: &Stream,
    policy: PrefetchPolicy,
) -> Result<()> {
    check_many(ranges, Some(locations), stream)?;
    let driver = stream.device().driver();
    if driver.version() < LOCATION_ABI {
        if let Some(l) = locations.iter().find(|l| l.is_host_numa()) {
            return Err(Error::Unsupported {
                symbol: "cuMemPrefetchAsync",
                needed: LOCATION_ABI,
                driver: driver.version(),
                reason: format!(
                    "{l} needs the CUmemLocation ABI of cuMemPrefetchAsync (CUDA 12.2)"
                ),
            });
        }
    }
    stream.device().bind()?;
    match resolve(policy, ranges, driver.version()) {
        PrefetchPolicy::Batch => batch(ranges, Some(locations), stream, BatchOp::Prefetch),
        _ => {
            for (i, r) in ranges.iter().enumerate() {
                prefetch_one(*r, location_of(locations, i), stream)?;
            }
            Ok(())
        }
    }
}

#[derive(Clone, Copy)]
enum BatchOp {
    Prefetch,
    Discard,
    DiscardAndPrefetch,
}

/// One batch call over validated input.
fn batch(
    ranges: &[ManagedRange<'_>],
    locations: Option<&[Location]>,
    stream: &Stream,
    op: BatchOp,
) -> Result<()> {
    let driver = stream.device().driver();
    let mut ptrs: Vec<CUdeviceptr> = ranges.iter().map(|r| r.ptr()).collect();
    let mut sizes: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
    let n = ranges.len();
    let (mut locs, mut idxs) = location_runs(locations.unwrap_or(&[Location::Host]), n);
    let nlocs = locs.len();
    // SAFETY (all three): `ptrs` and `sizes` hold `n` entries, `locs` and `idxs` hold `nlocs`
    // entries whose indices start at 0, increase and stay below `n`; the ranges lie in managed
    // memory borrowed for the call; the stream is a live, non-legacy stream; flags are 0.
    match op {
        BatchOp::Prefetch => unsafe {
            cu!(
                driver,
                cuMemPrefetchBatchAsync(
                    ptrs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    n,
                    locs.as_mut_ptr(),
                    idxs.as_mut_ptr(),
                    nlocs,
                    0,
                    stream.raw()
                )
            )
        },
        // SAFETY: as stated above the match.
        BatchOp::Discard => unsafe {
            cu!(
                driver,
                cuMemDiscardBatchAsync(ptrs.as_mut_ptr(), sizes.as_mut_ptr(), n, 0, stream.raw())
            )
        },
        // SAFETY: as stated above the match.
        BatchOp::DiscardAndPrefetch => unsafe {
            cu!(
                driver,
                cuMemDiscardAndPrefetchBatchAsync(
                    ptrs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    n,
                    locs.as_mut_ptr(),
                    idxs.as_mut_ptr(),
                    nlocs,
                    0,
                    stream.raw()
                )
            )
        },
    }
}

/// Queue a discard of `range` on `stream`: its contents become indeterminate until written or
/// prefetched, which spares the driver migrating them. Uses `cuMemDiscardBatchAsync` (the only
/// discard call); [`Error::Unsupported`] before CUDA 13.0.
pub fn discard(range: ManagedRange<'_>, stream: &Stream) -> Result<()> {
    discard_many(&[range], stream).map_err(as_one)
}

/// Queue a discard of every range in `ranges` on `stream` with one `cuMemDiscardBatchAsync`;
/// empty input is rejected before the call; [`Error::Unsupported`] before CUDA 13.0.
pub fn discard_many(ranges: &[ManagedRange<'_>], stream: &Stream) -> Result<()> {
    check_many(ranges, None, stream)?;
    stream.device().bind()?;
    batch(ranges, None, stream, BatchOp::Discard)
}

/// Queue a discard of `range` followed by a prefetch to `location` on `stream`
/// (`cuMemDiscardAndPrefetchBatchAsync`): the pages arrive at `location` without their old
/// contents being moved. [`Error::Unsupported`] before CUDA 13.0.
pub fn discard_and_prefetch(
    range: ManagedRange<'_>,
    location: Location,
    stream: &Stream,
) -> Result<()> {
    discard_and_prefetch_many(&[range], &[location], stream).map_err(as_one)
}

/// Queue discard-and-prefetch of `ranges` on `stream` with one
/// `cuMemDiscardAndPrefetchBatchAsync`. `locations` holds one location for every range, or one
/// per range; empty input and mismatched lengths are rejected before the call;
/// [`Error::Unsupported`] before CUDA 13.0.
pub fn discard_and_prefetch_many(
    ranges: &[ManagedRange<'_>],
    locations: &[Location],
    stream: &Stream,
) -> Result<()> {
    check_many(ranges, Some(locations), stream)?;
    stream.device().bind()?;
    batch(ranges, Some(locations), stream, BatchOp::DiscardAndPrefetch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_start_at_zero_and_increase() {
        let locs = [
            Location::Device(0),
            Location::Device(0),
            Location::Host,
            Location::Host,
            Location::Device(0),
        ];
        let (l, i) = location_runs(&locs, 5);
        assert_eq!(i, vec![0, 2, 4]);
        assert_eq!(l.len(), 3);
        let (l, i) = location_runs(&[Location::Host], 7);
        assert_eq!((l.len(), i), (1, vec![0]));
    }
}
