//! CUDA 13.3 logical endpoints: id ranges, unicast and multicast endpoints, asynchronous
//! construction, binds, limits and fabric handles.
//!
//! Design (see `docs/design/multicast-and-endpoints.md`):
//! - [`LogicalEndpoint::create`] reserves one id per endpoint; [`LogicalEndpoint::create_batch`]
//!   reserves one [`IdRange`] for many. Every endpoint holds its range, so the range is released
//!   when its last endpoint goes (the driver refuses to release ids whose endpoints live).
//! - Construction is asynchronous: [`LogicalEndpoint::is_ready`] is the non-blocking check
//!   (`cuLogicalEndpointQuery`), [`LogicalEndpoint::wait_ready`] and [`IdRange::wait_ready`] wait
//!   with a timeout. A bind on an endpoint not yet seen ready is refused before the driver call.
//! - Limits (bind alignment, maximum size) are asked for the spec before construction, and every
//!   offset and size is checked against them before the call.
//! - Creating or importing a multicast endpoint honours the multicast guard
//!   ([`crate::multicast::multicast_allowed_for`]) before any driver call.
//!
//! Logical endpoints need driver 13.3 (13030); on older drivers every entry point is
//! [`Error::Unsupported`] naming the call.
// `is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

mod binding;

pub use binding::{EndpointBinding, EndpointMemory};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use cuda_multimem_sys::{
    CUlogicalEndpointFlag, CUlogicalEndpointId, CUlogicalEndpointIpcHandleType,
    CUlogicalEndpointProp, CUlogicalEndpointType,
};
use parking_lot::Mutex;

use crate::error::{cu, Error, Result};
use crate::{Device, Driver};

/// The first driver with logical endpoints.
pub const LOGICAL_ENDPOINT_MIN_DRIVER: i32 = 13030;

/// Fabric handles in `ipcHandleTypes` and in the device attribute: bit `1 << type`.
const FABRIC: u32 =
    1 << CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC.0;

/// Unicast (one owner device) or multicast (a team).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointKind {
    /// A unicast endpoint owned by a device: only the owner binds memory to it.
    Unicast {
        /// The owner device's ordinal.
        owner: i32,
    },
    /// A multicast endpoint for a team of `devices` devices, each added with
    /// [`LogicalEndpoint::add_device`] (here or in another process).
    Multicast {
        /// The team size.
        devices: u32,
    },
}

/// What to create: kind, size per device, counted operations, IPC handle types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    /// Unicast or multicast.
    pub kind: EndpointKind,
    /// Bytes that can be bound per device; a multiple of the bind alignment, at most the maximum
    /// size ([`EndpointSpec::limits`]).
    pub size: usize,
    /// `CU_LOGICAL_ENDPOINT_FLAG_COUNTED_OPS`: the endpoint will be used with counted operations.
    pub counted_ops: bool,
    /// Whether the endpoint may be exported as a fabric handle (chosen up front: the driver
    /// cannot add it later).
    pub fabric_handle: bool,
}

/// The driver's limits for a spec (`cuLogicalEndpointGetLimits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointLimits {
    /// Offsets, sizes and bound addresses are multiples of this.
    pub bind_alignment: usize,
    /// The largest endpoint size for this spec.
    pub max_size: usize,
}

impl EndpointSpec {
    /// A unicast endpoint owned by `owner`, `size` bytes.
    pub fn unicast(owner: &Device, size: usize) -> Self {
        EndpointSpec {
            kind: EndpointKind::Unicast {
                owner: owner.ordinal(),
            },
            size,
            counted_ops: false,
            fabric_handle: false,
        }
    }

    /// A multicast endpoint for a team of `devices`, `size` bytes per device.
    pub fn multicast(devices: u32, size: usize) -> Self {
        EndpointSpec {
            kind: EndpointKind::Multicast { devices },
            size,
            counted_ops: false,
            fabric_handle: false,
        }
    }

    /// Ask for counted operations.
    pub fn counted_ops(mut self, on: bool) -> Self {
        self.counted_ops = on;
        self
    }

    /// Allow export as a fabric handle.
    pub fn fabric_handle(mut self, on: bool) -> Self {
        self.fabric_handle = on;
        self
    }

    /// Whether this is a multicast endpoint.
    pub fn is_multicast(&self) -> bool {
        matches!(self.kind, EndpointKind::Multicast { .. })
    }

    /// The raw property block.
    pub fn raw(&self) -> CUlogicalEndpointProp {
        let mut p = CUlogicalEndpointProp::default();
        match self.kind {
            EndpointKind::Unicast { owner } => {
                p.type_ = CUlogicalEndpointType::CU_LOGICAL_ENDPOINT_TYPE_UNICAST;
                p.__bindgen_anon_1.unicast.device = owner;
            }
            EndpointKind::Multicast { devices } => {
                p.type_ = CUlogicalEndpointType::CU_LOGICAL_ENDPOINT_TYPE_MULTICAST;
                p.__bindgen_anon_1.multicast.numDevices = devices;
            }
        }
        p.size = crate::error::to_driver_u64(self.size);
        p.ipcHandleTypes = if self.fabric_handle { FABRIC } else { 0 };
        p.flags = if self.counted_ops {
            CUlogicalEndpointFlag::CU_LOGICAL_ENDPOINT_FLAG_COUNTED_OPS.0
        } else {
            0
        };
        p
    }

    /// Check the parts of the spec that need no driver: the guard for multicast, the owner or team
    /// size against the machine, a non-zero size.
    fn precheck(&self, driver: &Driver) -> Result<()> {
        if self.is_multicast() {
            crate::multicast::guard::check(driver, "multicast logical endpoints")?;
        }
        match self.kind {
            EndpointKind::Unicast { owner } => {
                if owner < 0 || owner as usize >= driver.device_count() {
                    return Err(Error::invalid(
                        "spec.kind",
                        format!(
                            "owner device {owner} does not exist; this machine has {} device(s)",
                            driver.device_count()
                        ),
                    ));
                }
            }
            EndpointKind::Multicast { devices } => {
                if devices == 0 {
                    return Err(Error::invalid(
                        "spec.kind",
                        "a multicast endpoint needs a team of at least one device, got 0",
                    ));
                }
            }
        }
        if self.size == 0 {
            return Err(Error::invalid(
                "spec.size",
                "0 bytes; expected a positive size",
            ));
        }
        Ok(())
    }

    /// Check the device capabilities the spec needs (attributes 153-158).
    fn check_support(&self, driver: &Driver) -> Result<()> {
        let need = |d: &Device, what: &'static str, v: Result<Option<bool>>| -> Result<()> {
            match v? {
                Some(true) => Ok(()),
                _ => Err(Error::DeviceUnsupported {
                    device: d.ordinal(),
                    what,
                }),
            }
        };
        let devices: Vec<Device> = match self.kind {
            EndpointKind::Unicast { owner } => vec![driver.device(owner as usize)?],
            // Members are checked as they are added; here, the device of the first context.
            EndpointKind::Multicast { .. } => driver.devices().into_iter().take(1).collect(),
        };
        for d in &devices {
            match self.kind {
                EndpointKind::Unicast { .. } => {
                    need(d, "unicast logical endpoints", d.logical_endpoint_unicast())?
                }
                EndpointKind::Multicast { .. } => need(
                    d,
                    "multicast logical endpoints",
                    d.logical_endpoint_multicast(),
                )?,
            }
            if self.counted_ops {
                need(
                    d,
                    "counted operations on logical endpoints",
                    d.logical_endpoint_counted_ops(),
                )?;
            }
            if self.fabric_handle {
                let types = d.logical_endpoint_handle_types()?.unwrap_or(0);
                if types as u32 & FABRIC == 0 {
                    return Err(Error::DeviceUnsupported {
                        device: d.ordinal(),
                        what: "fabric handles for logical endpoints",
                    });
                }
            }
        }
        Ok(())
    }

    /// The driver's limits for this spec (bind alignment, maximum size).
    pub fn limits(&self, driver: &Driver) -> Result<EndpointLimits> {
        self.precheck(driver)?;
        let prop = self.raw();
        let (mut align, mut max) = (0u64, 0u64);
        crate::vmm::ensure_context(driver, 0)?;
        // SAFETY: two u64 out-pointers and a fully initialised property block.
        unsafe {
            cu!(
                driver,
                cuLogicalEndpointGetLimits(&mut align, &mut max, &prop)
            )
        }?;
        let call = "cuLogicalEndpointGetLimits";
        Ok(EndpointLimits {
            bind_alignment: crate::error::from_driver_u64(call, "the bind alignment", align)?,
            max_size: crate::error::from_driver_u64(call, "the maximum size", max)?,
        })
    }

    /// Everything checkable before creation: guard, devices, capabilities, and the size against
    /// the limits. Returns the limits.
    pub fn validate(&self, driver: &Driver) -> Result<EndpointLimits> {
        self.precheck(driver)?;
        // A driver before 13.3 lacks the calls: say so (Error::Unsupported) before asking devices.
        driver.sys().cuLogicalEndpointCreate()?;
        self.check_support(driver)?;
        let l = self.limits(driver)?;
        if self.size % l.bind_alignment != 0 {
            let hint = match self.size.checked_next_multiple_of(l.bind_alignment) {
                Some(up) => format!("round it up to {up}"),
                None => "rounded up, it overflows".to_string(),
            };
            return Err(Error::invalid(
                "spec.size",
                format!(
                    "{} bytes is not a multiple of the bind alignment {}; {hint}",
                    self.size, l.bind_alignment,
                ),
            ));
        }
        if self.size > l.max_size {
            return Err(Error::invalid(
                "spec.size",
                format!(
                    "{} bytes exceeds the maximum endpoint size {} for this spec",
                    self.size, l.max_size
                ),
            ));
        }
        Ok(l)
    }
}

/// A reserved range of logical endpoint ids, shared by the endpoints created on it and released
/// (`cuLogicalEndpointIdRelease`) when the last of them is dropped.
pub struct IdRange {
    driver: Driver,
    base: CUlogicalEndpointId,
    len: u32,
    endpoints: Mutex<Vec<Weak<Inner>>>,
}

impl std::fmt::Debug for IdRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IdRange({}..{})",
            self.base,
            self.base as u64 + self.len as u64
        )
    }
}

impl IdRange {
    fn reserve(driver: &Driver, count: u32) -> Result<Arc<IdRange>> {
        if count == 0 {
            return Err(Error::invalid("count", "0 ids; expected at least one"));
        }
        let mut base: CUlogicalEndpointId = 0;
        crate::vmm::ensure_context(driver, 0)?;
        // SAFETY: one id written through a valid out-pointer.
        unsafe { cu!(driver, cuLogicalEndpointIdReserve(&mut base, count)) }?;
        Ok(Arc::new(IdRange {
            driver: driver.clone(),
            base,
            len: count,
            endpoints: Mutex::new(Vec::new()),
        }))
    }

    /// The first id.
    pub fn base(&self) -> CUlogicalEndpointId {
        self.base
    }

    /// The number of ids.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the range is empty (never: a range holds at least one id).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether every endpoint of the range that still exists is constructed: non-blocking, one
    /// `cuLogicalEndpointQuery` per run of consecutive live ids (one call while the whole batch
    /// lives). Ids of endpoints already dropped are skipped: the driver would refuse a query that
    /// covers a destroyed endpoint, and the range stays reserved for the endpoints that remain
    /// (it is refcounted among them). When it says yes, every live endpoint of the range is marked
    /// ready. A range whose endpoints were all dropped has nothing under construction: `true`.
    pub fn query(&self) -> Result<bool> {
        let live: Vec<Arc<Inner>> = self
            .endpoints
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut ids: Vec<CUlogicalEndpointId> = live.iter().map(|e| e.id).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut i = 0;
        while i < ids.len() {
            let start = ids[i];
            let mut count = 1u32;
            while i + (count as usize) < ids.len() && ids[i + count as usize] == start + count {
                count += 1;
            }
            let mut status = 0;
            // SAFETY: one int written through a valid out-pointer; ids of live endpoints.
            unsafe {
                cu!(
                    self.driver,
                    cuLogicalEndpointQuery(start, count, &mut status)
                )
            }?;
            if status == 0 {
                return Ok(false);
            }
            i += count as usize;
        }
        for e in &live {
            e.ready.store(true, Ordering::Release);
        }
        Ok(true)
    }

    /// Poll [`IdRange::query`] until it says ready, or fail with [`Error::Timeout`].
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let what = || format!("construction of logical endpoints {self:?}");
        crate::stream::poll_until(timeout, READY_PAUSES, what, || self.query())
    }
}

impl Drop for IdRange {
    fn drop(&mut self) {
        let (base, len) = (self.base, self.len);
        self.driver.teardown(
            || format!("the logical endpoint ids {base}..+{len} (cuLogicalEndpointIdRelease)"),
            // SAFETY: the range was reserved by us and every endpoint on it was destroyed (they
            // hold this range, so they are gone).
            move |d| unsafe { cu!(d, cuLogicalEndpointIdRelease(base, len)) },
        );
    }
}

/// The pauses of the endpoint waits (construction takes milliseconds).
const READY_PAUSES: (Duration, Duration) = (Duration::from_micros(20), Duration::from_millis(5));

pub(crate) struct Inner {
    range: Arc<IdRange>,
    id: CUlogicalEndpointId,
    spec: EndpointSpec,
    limits: EndpointLimits,
    ready: AtomicBool,
    imported: bool,
    /// Devices added through this process (multicast).
    members: Mutex<Vec<i32>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let id = self.id;
        self.range.driver.teardown(
            || format!("the logical endpoint {id} (cuLogicalEndpointDestroy)"),
            // SAFETY: the endpoint was created or imported on this id by us; every binding holds
            // this value, so none is left.
            move |d| unsafe { cu!(d, cuLogicalEndpointDestroy(id)) },
        );
    }
}

/// A logical endpoint (created or imported); destroyed when it and every binding of it are gone,
/// its id range released when the range's last endpoint is gone.
pub struct LogicalEndpoint {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for LogicalEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogicalEndpoint")
            .field("id", &self.inner.id)
            .field("spec", &self.inner.spec)
            .field("ready", &self.inner.ready.load(Ordering::Relaxed))
            .finish()
    }
}

/// The 64 opaque bytes of an exported logical endpoint.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct EndpointFabricHandle(pub [u8; 64]);

impl std::fmt::Debug for EndpointFabricHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EndpointFabricHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl EndpointFabricHandle {
    /// The bytes, to send to another process.
    pub fn as_bytes(&self) -> &[u8; 64] {
        &self.0
    }

    /// Bytes received from another process; exactly 64 (anything else is refused here, garbage of
    /// the right length by the driver on import).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let b: [u8; 64] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "bytes",
                format!(
                    "a logical endpoint fabric handle is 64 bytes, got {}",
                    bytes.len()
                ),
            )
        })?;
        Ok(EndpointFabricHandle(b))
    }
}

impl LogicalEndpoint {
    fn new_on(
        range: &Arc<IdRange>,
        id: CUlogicalEndpointId,
        spec: EndpointSpec,
        limits: EndpointLimits,
        imported: bool,
    ) -> LogicalEndpoint {
        let inner = Arc::new(Inner {
            range: range.clone(),
            id,
            spec,
            limits,
            ready: AtomicBool::new(false),
            imported,
            members: Mutex::new(Vec::new()),
        });
        range.endpoints.lock().push(Arc::downgrade(&inner));
        LogicalEndpoint { inner }
    }

    /// Create one endpoint on an id of its own. Returns at once: check [`is_ready`] or
    /// [`wait_ready`] before binding (and, for multicast, add every member first).
    ///
    /// [`is_ready`]: LogicalEndpoint::is_ready
    /// [`wait_ready`]: LogicalEndpoint::wait_ready
    pub fn create(driver: &Driver, spec: &EndpointSpec) -> Result<LogicalEndpoint> {
        Ok(
            LogicalEndpoint::create_batch(driver, std::slice::from_ref(spec))?
                .pop()
                .expect("one spec gives one endpoint"),
        )
    }

    /// Create one endpoint per spec on one reserved id range (consecutive ids, one readiness query
    /// for all through [`LogicalEndpoint::id_range`]). The range is released when the last of them
    /// is dropped. A failure half-way destroys what was created and releases the range.
    pub fn create_batch(driver: &Driver, specs: &[EndpointSpec]) -> Result<Vec<LogicalEndpoint>> {
        if specs.is_empty() {
            return Err(Error::invalid(
                "specs",
                "no endpoint specs; expected at least one",
            ));
        }
        let count = u32::try_from(specs.len())
            .map_err(|_| Error::invalid("specs", format!("{} specs is too many", specs.len())))?;
        let mut limits = Vec::with_capacity(specs.len());
        for s in specs {
            limits.push(s.validate(driver)?);
        }
        let range = IdRange::reserve(driver, count)?;
        let mut out = Vec::with_capacity(specs.len());
        for (i, (s, l)) in specs.iter().zip(limits).enumerate() {
            let id = range.base + i as u32;
            let prop = s.raw();
            // SAFETY: a reserved, unused id and a fully initialised property block.
            unsafe { cu!(driver, cuLogicalEndpointCreate(id, &prop)) }?;
            out.push(LogicalEndpoint::new_on(&range, id, s.clone(), l, false));
        }
        Ok(out)
    }

    /// Import an endpoint exported by another process (or this one) as `handle`, described by
    /// `spec` (what the exporter created; both sides agree on it through their exchange). The
    /// importer reserves its own id. Honours the multicast guard (the handle's kind is not known
    /// before the import). Like a created endpoint, it must be seen ready before use.
    pub fn import_fabric(
        driver: &Driver,
        handle: &EndpointFabricHandle,
        spec: &EndpointSpec,
    ) -> Result<LogicalEndpoint> {
        crate::multicast::guard::check(driver, "importing logical endpoints")?;
        let limits = spec.validate(driver)?;
        let range = IdRange::reserve(driver, 1)?;
        // SAFETY: a reserved, unused id; the handle is 64 readable bytes of the fabric type.
        unsafe {
            cu!(
                driver,
                cuLogicalEndpointImport(
                    range.base,
                    handle.0.as_ptr().cast(),
                    CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC
                )
            )
        }?;
        Ok(LogicalEndpoint::new_on(
            &range,
            range.base,
            spec.clone(),
            limits,
            true,
        ))
    }

    /// Export as a fabric handle (the spec must have asked for fabric handles).
    pub fn export_fabric(&self) -> Result<EndpointFabricHandle> {
        if !self.inner.spec.fabric_handle {
            return Err(Error::invalid(
                "self",
                format!(
                    "logical endpoint {} was created without fabric handles; set \
                     EndpointSpec::fabric_handle(true) at creation",
                    self.inner.id
                ),
            ));
        }
        let mut h = [0u8; 64];
        // SAFETY: 64 writable bytes, the size of CUlogicalEndpointFabricHandle; a live endpoint.
        unsafe {
            cu!(
                self.driver(),
                cuLogicalEndpointExport(
                    h.as_mut_ptr().cast(),
                    self.inner.id,
                    CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC
                )
            )
        }?;
        Ok(EndpointFabricHandle(h))
    }

    /// The driver.
    pub fn driver(&self) -> &Driver {
        &self.inner.range.driver
    }

    /// The endpoint's id.
    pub fn id(&self) -> CUlogicalEndpointId {
        self.inner.id
    }

    /// The id range it was created on (shared with its batch).
    pub fn id_range(&self) -> &Arc<IdRange> {
        &self.inner.range
    }

    /// What it was created (or imported) as.
    pub fn spec(&self) -> &EndpointSpec {
        &self.inner.spec
    }

    /// The limits of its spec.
    pub fn limits(&self) -> EndpointLimits {
        self.inner.limits
    }

    /// Whether it was imported.
    pub fn is_imported(&self) -> bool {
        self.inner.imported
    }

    /// Devices added to this multicast endpoint through this process.
    pub fn members(&self) -> Vec<i32> {
        self.inner.members.lock().clone()
    }

    /// Add `device` to this multicast endpoint's team. Refused before the call for a unicast
    /// endpoint, a device added already, a full team, or a device without multicast endpoints.
    pub fn add_device(&self, device: &Device) -> Result<()> {
        let EndpointKind::Multicast { devices } = self.inner.spec.kind else {
            return Err(Error::invalid(
                "self",
                format!(
                    "logical endpoint {} is unicast; only multicast endpoints take devices",
                    self.inner.id
                ),
            ));
        };
        if !Arc::ptr_eq(&device.driver().inner, &self.driver().inner) {
            return Err(device.other_driver_error("device"));
        }
        let mut members = self.inner.members.lock();
        let d = device.ordinal();
        if members.contains(&d) {
            return Err(Error::invalid(
                "device",
                format!(
                    "device {d} was already added to logical endpoint {}",
                    self.inner.id
                ),
            ));
        }
        if members.len() as u32 >= devices {
            return Err(Error::invalid(
                "device",
                format!(
                    "the team of logical endpoint {} is full ({devices} device(s): {members:?})",
                    self.inner.id
                ),
            ));
        }
        if device.logical_endpoint_multicast()? != Some(true) {
            return Err(Error::DeviceUnsupported {
                device: d,
                what: "multicast logical endpoints",
            });
        }
        device.bind()?;
        // SAFETY: a live endpoint id and a valid device ordinal.
        unsafe { cu!(self.driver(), cuLogicalEndpointAddDevice(self.inner.id, d)) }?;
        members.push(d);
        Ok(())
    }

    /// Whether the endpoint is constructed: non-blocking (one `cuLogicalEndpointQuery` until it
    /// says yes, then remembered).
    pub fn is_ready(&self) -> Result<bool> {
        if self.inner.ready.load(Ordering::Acquire) {
            return Ok(true);
        }
        let mut status = 0;
        // SAFETY: one int written through a valid out-pointer; a live endpoint id.
        unsafe {
            cu!(
                self.driver(),
                cuLogicalEndpointQuery(self.inner.id, 1, &mut status)
            )
        }?;
        if status != 0 {
            self.inner.ready.store(true, Ordering::Release);
        }
        Ok(status != 0)
    }

    /// Poll [`LogicalEndpoint::is_ready`] until it is, or fail with [`Error::Timeout`]. For a
    /// multicast endpoint, every member must be added (here or elsewhere) for this to succeed.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let id = self.inner.id;
        crate::stream::poll_until(
            timeout,
            READY_PAUSES,
            || format!("construction of logical endpoint {id}"),
            || self.is_ready(),
        )
    }

    /// The error for using an endpoint that was not seen ready (one query is made first).
    fn ensure_ready(&self) -> Result<()> {
        if self.is_ready()? {
            return Ok(());
        }
        let team = match self.inner.spec.kind {
            EndpointKind::Multicast { devices } => format!(
                "; {} of {devices} team member(s) added here",
                self.inner.members.lock().len()
            ),
            EndpointKind::Unicast { .. } => String::new(),
        };
        Err(Error::invalid(
            "self",
            format!(
                "logical endpoint {} is not ready yet{team}: poll is_ready() or call wait_ready() \
                 before binding",
                self.inner.id
            ),
        ))
    }
}
