//! The site policy that keeps NVLink multicast off: `NCCL_NVLS_ENABLE=0` (NCCL's switch, set by
//! sites for every library) or `CUDA_MULTIMEM_DISABLE_MULTICAST=1` (ours); the other libraries'
//! switches that such sites set alongside, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` and
//! `NVSHMEM_DISABLE_NVLS=1`, are honoured too.
//!
//! The variables are read at every check, so a program (or a test harness) that changes them sees
//! the change at once. The policy protects real hardware: a simulated driver creates no hardware
//! multicast object, so it is exempt from the variables (that is how the `multicast` example and
//! the suite exercise multicast on machines that forbid it). [`disable_multicast_on_this_thread`]
//! refuses multicast on the calling thread for every driver, simulated or real — tests use it to
//! check the refusal without touching the process environment that other tests share. Nothing can
//! lift the variables' refusal for a real driver.

use std::cell::Cell;

use crate::{Driver, Error, Result};

/// NCCL's switch: `NCCL_NVLS_ENABLE=0` turns NVLink SHARP / multicast off.
pub const NVLS_ENABLE_ENV: &str = "NCCL_NVLS_ENABLE";
/// This library's switch: `CUDA_MULTIMEM_DISABLE_MULTICAST=1` turns multicast off.
pub const DISABLE_MULTICAST_ENV: &str = "CUDA_MULTIMEM_DISABLE_MULTICAST";

/// PyTorch symmetric memory's switch, honoured as well.
pub const TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV: &str = "TORCH_SYMM_MEM_DISABLE_MULTICAST";
/// NVSHMEM's switch, honoured as well.
pub const NVSHMEM_DISABLE_NVLS_ENV: &str = "NVSHMEM_DISABLE_NVLS";

thread_local! {
    static FORCED_OFF: Cell<u32> = const { Cell::new(0) };
}

/// Why the environment forbids multicast, reading the variables through `lookup` (a pure function
/// of the values, so it is testable without changing the process environment).
///
/// `NCCL_NVLS_ENABLE` disables when NCCL reads it as `0` (C's `strtoll`: `0`, `0x0`, and any
/// non-empty value without leading digits, such as `false`).
/// `CUDA_MULTIMEM_DISABLE_MULTICAST` (and `TORCH_SYMM_MEM_DISABLE_MULTICAST`,
/// `NVSHMEM_DISABLE_NVLS`) disables for any value except empty, `0`, `false`, `no` and `off` — an
/// unrecognised value fails safe.
pub fn policy_from(lookup: impl Fn(&str) -> Option<String>) -> std::result::Result<(), String> {
    if let Some(v) = lookup(NVLS_ENABLE_ENV) {
        if nccl_reads_zero(&v) {
            return Err(format!("{NVLS_ENABLE_ENV}={v} is set"));
        }
    }
    for var in [
        DISABLE_MULTICAST_ENV,
        TORCH_SYMM_MEM_DISABLE_MULTICAST_ENV,
        NVSHMEM_DISABLE_NVLS_ENV,
    ] {
        if let Some(v) = lookup(var) {
            let t = v.trim().to_ascii_lowercase();
            if !matches!(t.as_str(), "" | "0" | "false" | "no" | "off") {
                return Err(format!("{var}={v} is set"));
            }
        }
    }
    Ok(())
}

/// Whether NCCL reads `v` as 0: NCCL ignores an empty value and reads any other with
/// `strtoll(v, NULL, 0)`, which skips leading white space, takes a sign, a `0x` (hex) or `0`
/// (octal) prefix, and stops at the first character that is not a digit — so `0x0`, `00`, `08`,
/// `false` and `off` (no digits at all) are 0 and switch NVLS off there too.
fn nccl_reads_zero(v: &str) -> bool {
    if v.is_empty() {
        return false;
    }
    let s = v.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let hex = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()));
    let digits = match hex {
        Some(h) => h.split(|c: char| !c.is_ascii_hexdigit()).next(),
        None if s.starts_with('0') => s.split(|c: char| !('0'..='7').contains(&c)).next(),
        None => s.split(|c: char| !c.is_ascii_digit()).next(),
    };
    digits.unwrap_or("").bytes().all(|b| b == b'0')
}

/// Whether this process's environment allows NVLink multicast on real GPUs: `Ok(())`, or the
/// reason it does not, naming the variable (`NCCL_NVLS_ENABLE=0 is set`). Also refused while
/// [`disable_multicast_on_this_thread`] is in force on the calling thread. `cargo xtask info`
/// prints this.
pub fn multicast_allowed() -> std::result::Result<(), String> {
    if FORCED_OFF.with(|c| c.get()) > 0 {
        return Err(
            "multicast is disabled on this thread (disable_multicast_on_this_thread)".into(),
        );
    }
    policy_from(|k| std::env::var(k).ok())
}

/// Whether `driver` may create multicast objects and multicast endpoints: the environment decides
/// for a real driver ([`multicast_allowed`]); a simulated driver is refused only under
/// [`disable_multicast_on_this_thread`].
pub fn multicast_allowed_for(driver: &Driver) -> std::result::Result<(), String> {
    if FORCED_OFF.with(|c| c.get()) > 0 {
        return Err(
            "multicast is disabled on this thread (disable_multicast_on_this_thread)".into(),
        );
    }
    if driver.is_simulated() {
        return Ok(());
    }
    policy_from(|k| std::env::var(k).ok())
}

/// Check the policy before any driver call of `what`.
pub(crate) fn check(driver: &Driver, what: &'static str) -> Result<()> {
    multicast_allowed_for(driver).map_err(|reason| Error::Disabled {
        feature: what,
        reason,
    })
}

/// While the returned value lives, the calling thread behaves as if `CUDA_MULTIMEM_DISABLE_MULTICAST=1`
/// were set, for every driver (simulated ones included). Nests.
#[must_use = "multicast is disabled only while the returned guard lives"]
pub fn disable_multicast_on_this_thread() -> MulticastOff {
    FORCED_OFF.with(|c| c.set(c.get() + 1));
    MulticastOff {
        _not_send: std::marker::PhantomData,
    }
}

/// Returned by [`disable_multicast_on_this_thread`]; multicast comes back (as far as the
/// environment allows) when it is dropped. Tied to its thread.
#[derive(Debug)]
pub struct MulticastOff {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for MulticastOff {
    fn drop(&mut self) {
        FORCED_OFF.with(|c| c.set(c.get().saturating_sub(1)));
    }
}
