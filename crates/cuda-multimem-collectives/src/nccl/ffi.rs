//! The declarations: NCCL's types, constants and the C signatures of the entry points this
//! crate calls, written by hand against NCCL 2.28's `nccl.h` (what 2.14 and later share).

use std::ffi::{c_char, c_int, c_void, CStr};

use cuda_multimem::sys::CUstream;
use cuda_multimem::{Error, Result};

use crate::types::{DType, ReduceOp};

// ncclResult_t
pub(super) const NCCL_SUCCESS: c_int = 0;
pub(super) const NCCL_IN_PROGRESS: c_int = 7;
// ncclConfig_t
pub(super) const NCCL_API_MAGIC: u32 = 0xcafe_beef;
pub(super) const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

pub(super) type RawComm = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes made by one rank ([`super::Nccl::unique_id`]) and handed to every
/// rank of the communicator to be (through a [`crate::Bootstrap`], say).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    pub(super) internal: [u8; 128],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclUniqueId(..)")
    }
}

impl NcclUniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.internal
    }

    /// An id from bytes another rank made (exactly 128).
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclUniqueId> {
        let internal: [u8; 128] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "bytes",
                format!("{} bytes; an ncclUniqueId has 128", bytes.len()),
            )
        })?;
        Ok(NcclUniqueId { internal })
    }
}

/// The prefix of `ncclConfig_t` that NCCL has read since 2.17 (`size`, `magic`, `version`,
/// `blocking`, `cgaClusterSize`, `minCTAs`, `maxCTAs`, `netName`). NCCL copies `size` bytes of
/// the caller's struct over its own defaults and resets the fields newer than `version`, so this
/// prefix is read the same by NCCL 2.17 to 2.28 and later.
#[repr(C)]
pub(super) struct ConfigV21700 {
    pub(super) size: usize,
    pub(super) magic: u32,
    pub(super) version: u32,
    pub(super) blocking: c_int,
    pub(super) cga_cluster_size: c_int,
    pub(super) min_ctas: c_int,
    pub(super) max_ctas: c_int,
    pub(super) net_name: *const c_char,
}

impl ConfigV21700 {
    pub(super) fn nonblocking() -> ConfigV21700 {
        ConfigV21700 {
            size: std::mem::size_of::<ConfigV21700>(),
            magic: NCCL_API_MAGIC,
            version: 21700,
            blocking: 0,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

pub(super) type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
pub(super) type GetUniqueIdFn = unsafe extern "C" fn(*mut NcclUniqueId) -> c_int;
pub(super) type InitRankConfigFn =
    unsafe extern "C" fn(*mut RawComm, c_int, NcclUniqueId, c_int, *mut ConfigV21700) -> c_int;
pub(super) type CommFn = unsafe extern "C" fn(RawComm) -> c_int;
pub(super) type GetAsyncErrorFn = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
pub(super) type CommIntFn = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
pub(super) type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
pub(super) type LastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;
pub(super) type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    CUstream,
) -> c_int;
pub(super) type ReduceScatterFn = AllReduceFn;
pub(super) type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, CUstream) -> c_int;
pub(super) type SplitFn =
    unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut ConfigV21700) -> c_int;

/// Every entry point used, resolved when the library is opened.
pub(super) struct Fns {
    pub(super) get_version: GetVersionFn,
    pub(super) get_unique_id: GetUniqueIdFn,
    pub(super) init_rank_config: InitRankConfigFn,
    pub(super) get_async_error: GetAsyncErrorFn,
    pub(super) finalize: CommFn,
    pub(super) destroy: CommFn,
    pub(super) abort: CommFn,
    pub(super) count: CommIntFn,
    pub(super) user_rank: CommIntFn,
    pub(super) error_string: ErrorStringFn,
    pub(super) all_reduce: AllReduceFn,
    pub(super) reduce_scatter: ReduceScatterFn,
    pub(super) all_gather: AllGatherFn,
    /// 2.18 and later.
    pub(super) split: Option<SplitFn>,
    /// 2.15 and later.
    pub(super) last_error: Option<LastErrorFn>,
}

/// # Safety
/// `p` is null or a NUL-terminated string.
pub(super) unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The first NCCL (`NCCL_VERSION_CODE`) with the FP8 types `ncclFloat8e4m3` (10) and
/// `ncclFloat8e5m2` (11): 2.24.
pub(super) const NCCL_FP8_VERSION: i32 = 22400;

/// `ncclDataType_t` of an element type, for the NCCL of `version` (`NCCL_VERSION_CODE`): FP8
/// only from 2.24 ([`NCCL_FP8_VERSION`]); an older NCCL's refusal names the type and the
/// version.
pub(super) fn nccl_type(d: DType, version: i32) -> cuda_multimem::Result<c_int> {
    Ok(match d {
        DType::I8 => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::Bf16 => 9,
        DType::F8E4M3 | DType::F8E5M2 if version < NCCL_FP8_VERSION => {
            return Err(cuda_multimem::Error::invalid(
                "dtype",
                format!(
                    "{d}: the NCCL loaded ({}.{}.{}) has no FP8 types (ncclFloat8e4m3 and ncclFloat8e5m2 came with NCCL 2.24)",
                    version / 10000,
                    (version / 100) % 100,
                    version % 100
                ),
            ))
        }
        DType::F8E4M3 => 10,
        DType::F8E5M2 => 11,
    })
}

/// `ncclRedOp_t` of an operator.
pub(super) fn nccl_op(o: ReduceOp) -> c_int {
    match o {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Prod => 1,
        ReduceOp::Avg => 4,
    }
}

#[cfg(test)]
mod type_tests {
    use super::*;

    #[test]
    fn every_type_has_its_nccl_datatype_and_fp8_needs_nccl_2_24() {
        let t = |d| nccl_type(d, 22809).unwrap();
        assert_eq!(
            [
                DType::I8,
                DType::U8,
                DType::I32,
                DType::U32,
                DType::I64,
                DType::U64
            ]
            .map(t),
            [0, 1, 2, 3, 4, 5]
        );
        assert_eq!(
            [DType::F16, DType::F32, DType::F64, DType::Bf16].map(t),
            [6, 7, 8, 9]
        );
        assert_eq!([DType::F8E4M3, DType::F8E5M2].map(t), [10, 11]);
        let e = nccl_type(DType::F8E5M2, 22305).unwrap_err().to_string();
        assert!(
            e.contains("dtype") && e.contains("e5m2") && e.contains("2.23.5"),
            "{e}"
        );
        assert_eq!(nccl_type(DType::F8E4M3, 22400).unwrap(), 10);
    }
}
