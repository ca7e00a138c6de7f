//! Advice on managed ranges (`cuMemAdvise`) and its read-back (`cuMemRangeGetAttribute(s)`).

use std::collections::BTreeSet;
use std::ffi::c_void;

use cuda_multimem_sys::{CUmem_advise, CUmem_range_attribute as R};

use super::location::{Location, DEVICE_INVALID};
use super::ManagedRange;
use crate::error::{cu, Error, Result};

/// The first driver with the `CUmemLocation` ABIs and the `_TYPE`/`_ID` range attributes.
pub(crate) const LOCATION_ABI: i32 = 12020;

/// Apply `advice` to `range` with `location` (`None` where the advice ignores it): the 12.2 ABI
/// where the driver has it, else the `CUdevice` one (host NUMA locations then unsupported).
fn advise(range: ManagedRange<'_>, advice: CUmem_advise, location: Option<Location>) -> Result<()> {
    let device = range.device();
    let driver = device.driver();
    if let Some(l) = location {
        l.validate(driver, "location")?;
    }
    // Where the advice ignores its location, name the range's device (valid in both ABIs).
    let loc = location.unwrap_or(Location::Device(device.ordinal()));
    if driver.version() < LOCATION_ABI {
        let dev = loc.legacy().ok_or_else(|| Error::Unsupported {
            symbol: "cuMemAdvise",
            needed: LOCATION_ABI,
            driver: driver.version(),
            reason: format!(
                "{loc} needs the CUmemLocation ABI of cuMemAdvise (CUDA 12.2); this driver has \
                 only the CUdevice ABI, which names devices and the host but no NUMA node"
            ),
        })?;
        device.bind()?;
        // SAFETY: the range lies in managed memory borrowed for the range's lifetime; the
        // advice and device are plain values.
        return unsafe {
            cu!(
                driver,
                cuMemAdvise_v8000(range.ptr(), range.len(), advice, dev)
            )
        };
    }
    device.bind()?;
    // SAFETY: as above; the location is a plain struct passed by value.
    unsafe {
        cu!(
            driver,
            cuMemAdvise_v12020(range.ptr(), range.len(), advice, loc.to_raw())
        )
    }
}

/// Query range attributes into 4-byte slots (`cuMemRangeGetAttributes`).
fn attributes<const N: usize>(range: ManagedRange<'_>, attrs: [R; N]) -> Result<[i32; N]> {
    let mut out = [0i32; N];
    let mut ptrs: Vec<*mut c_void> = out.iter_mut().map(|v| (v as *mut i32).cast()).collect();
    let mut sizes = [4usize; N];
    let mut attrs = attrs;
    range.device().bind()?;
    // SAFETY: N attribute ids, N sizes of 4 and N pointers to 4 writable bytes each.
    unsafe {
        cu!(
            range.device().driver(),
            cuMemRangeGetAttributes(
                ptrs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                attrs.as_mut_ptr(),
                N,
                range.ptr(),
                range.len()
            )
        )
    }?;
    Ok(out)
}

/// Query one range attribute into `out` (`cuMemRangeGetAttribute`).
fn attribute_into(range: ManagedRange<'_>, attr: R, out: &mut [i32]) -> Result<()> {
    range.device().bind()?;
    // SAFETY: `out` is valid for `4 * out.len()` bytes, the size passed.
    unsafe {
        cu!(
            range.device().driver(),
            cuMemRangeGetAttribute(
                out.as_mut_ptr().cast(),
                4 * out.len(),
                attr,
                range.ptr(),
                range.len()
            )
        )
    }
}

/// Whether every page of `range` is read-mostly (the driver's answer).
pub fn read_mostly(range: ManagedRange<'_>) -> Result<bool> {
    let mut v = [0];
    attribute_into(range, R::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, &mut v)?;
    Ok(v[0] != 0)
}

/// Set (`true`) or unset read-mostly advice on `range`.
pub fn set_read_mostly(range: ManagedRange<'_>, on: bool) -> Result<()> {
    let advice = if on {
        CUmem_advise::CU_MEM_ADVISE_SET_READ_MOSTLY
    } else {
        CUmem_advise::CU_MEM_ADVISE_UNSET_READ_MOSTLY
    };
    advise(range, advice, None)
}

/// A location-valued attribute: the `_TYPE`/`_ID` pair from 12.2, else the `CUdevice` form.
fn location_attribute(range: ManagedRange<'_>, legacy: R, t: R, id: R) -> Result<Option<Location>> {
    if range.device().driver().version() >= LOCATION_ABI {
        let [t, id] = attributes(range, [t, id])?;
        Ok(Location::from_type_id(t as u32, id))
    } else {
        let mut v = [DEVICE_INVALID];
        attribute_into(range, legacy, &mut v)?;
        Ok(Location::from_legacy(v[0]))
    }
}

/// The preferred location every page of `range` shares, as the driver reports it; `None` when
/// some page has none or the pages disagree. Before CUDA 12.2 a host NUMA preference reads as
/// [`Location::Host`] (the older attribute knows only "the CPU").
///
/// See [`set_preferred_location`] for what a 13.0 driver was measured to report after a
/// host-NUMA preference.
pub fn preferred_location(range: ManagedRange<'_>) -> Result<Option<Location>> {
    location_attribute(
        range,
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION,
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE,
        R::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID,
    )
}

/// Set the preferred location of `range`: a device (with concurrent managed access), the host,
/// a host NUMA node or the current thread's node (the last two from CUDA 12.2).
///
/// Measured on an H200 host with one NUMA node and driver 13.0 (2026-11-30): a host-NUMA
/// preference ([`Location::HostNuma`] or [`Location::HostNumaCurrent`]) is accepted but does
/// not change what [`preferred_location`] reports afterwards (the earlier preference, or none,
/// stays). The driver documentation says the node becomes the preference, and the simulator
/// does that; read the preference back if your code depends on it.
pub fn set_preferred_location(range: ManagedRange<'_>, location: Location) -> Result<()> {
    advise(
        range,
        CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
        Some(location),
    )
}

/// Remove the preferred location of `range`.
pub fn unset_preferred_location(range: ManagedRange<'_>) -> Result<()> {
    advise(
        range,
        CUmem_advise::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
        None,
    )
}

/// The location every page of `range` was last explicitly prefetched to (the request, not
/// necessarily completed); `None` when some page never was or the pages disagree.
pub fn last_prefetch_location(range: ManagedRange<'_>) -> Result<Option<Location>> {
    location_attribute(
        range,
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION,
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE,
        R::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_ID,
    )
}

/// The processors with accessed-by advice over the whole of `range`, as the driver reports them
/// (devices, and [`Location::Host`] where the driver reports the CPU).
pub fn accessed_by(range: ManagedRange<'_>) -> Result<BTreeSet<Location>> {
    // One slot per device and one for the host; unused slots come back as CU_DEVICE_INVALID.
    let mut v = vec![DEVICE_INVALID; range.device().driver().device_count() + 1];
    attribute_into(range, R::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, &mut v)?;
    Ok(v.into_iter().filter_map(Location::from_legacy).collect())
}

/// Accessed-by takes a device or the host, nothing else (the driver's rule).
fn check_accessed_by(location: Location, arg: &'static str) -> Result<()> {
    match location {
        Location::Device(_) | Location::Host => Ok(()),
        l => Err(Error::invalid(
            arg,
            format!("accessed-by advice takes a device or the host, not {l}"),
        )),
    }
}

/// Add `location` (a device or the host) to the accessed-by set of `range`; advises only when it
/// is not in the set yet.
pub fn add_accessed_by(range: ManagedRange<'_>, location: Location) -> Result<()> {
    check_accessed_by(location, "location")?;
    location.validate(range.device().driver(), "location")?;
    if accessed_by(range)?.contains(&location) {
        return Ok(());
    }
    advise(
        range,
        CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY,
        Some(location),
    )
}

/// Remove `location` from the accessed-by set of `range`; advises only when it is in the set.
pub fn remove_accessed_by(range: ManagedRange<'_>, location: Location) -> Result<()> {
    check_accessed_by(location, "location")?;
    location.validate(range.device().driver(), "location")?;
    if !accessed_by(range)?.contains(&location) {
        return Ok(());
    }
    advise(
        range,
        CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
        Some(location),
    )
}

/// Make the accessed-by set of `range` exactly `locations`: reads the current set and advises
/// only the difference (unset what is no longer wanted, set what is new). Every location is
/// checked before any advice.
pub fn set_accessed_by(
    range: ManagedRange<'_>,
    locations: impl IntoIterator<Item = Location>,
) -> Result<()> {
    let want: BTreeSet<Location> = locations.into_iter().collect();
    for &l in &want {
        check_accessed_by(l, "locations")?;
        l.validate(range.device().driver(), "locations")?;
    }
    let have = accessed_by(range)?;
    for &l in have.difference(&want) {
        advise(
            range,
            CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
            Some(l),
        )?;
    }
    for &l in want.difference(&have) {
        advise(range, CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY, Some(l))?;
    }
    Ok(())
}
