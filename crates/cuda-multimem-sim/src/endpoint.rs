//! CUDA 13.3 logical endpoints: id ranges, unicast and multicast endpoints, asynchronous
//! construction observed through `cuLogicalEndpointQuery`, binds, limits, fabric export/import, and
//! the 13.5 fabric copy that moves data through them.
//!
//! Model (following the `cuda.h` documentation of each call):
//! - ids are reserved in ranges (`IdReserve`) and released in any sub-range whose endpoints were all
//!   destroyed (`IdRelease`);
//! - an endpoint is constructed once its team is complete (unicast: at once; multicast: when
//!   `numDevices` devices were added) and then after [`SimConfig::endpoint_ready_polls`] further
//!   queries that cover it; a bind is refused (`CUDA_ERROR_INVALID_VALUE`, as documented) until a
//!   query over it answered "ready";
//! - binds are per device at an offset, aligned to the bind alignment that `GetLimits` reports
//!   (the device's minimum VMM granularity), inside the endpoint's size;
//! - `Destroy` unbinds what this process bound; the endpoint's resources go with its last id;
//! - fabric handles are 64 bytes (a magic, the exporter's process id, the descriptor number there
//!   of the endpoint's shared table, the object id, the table's inode, a checksum). The first
//!   export gives the endpoint a shared table (a memfd, see `shared.rs`) holding its team, its
//!   construction progress and every process's bindings; another process of the same user imports
//!   it by opening `/proc/<pid>/fd/<n>`, and then sees the same readiness, devices and bindings
//!   (fabric copies to a multicast endpoint reach every process's bound memory).
//!
//! [`SimConfig::endpoint_ready_polls`]: crate::SimConfig::endpoint_ready_polls

pub use crate::model::endpoint::endpoint_targets;
