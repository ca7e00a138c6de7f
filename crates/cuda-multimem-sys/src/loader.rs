//! The run-time loader: opening the driver library, the symbol table, lazy typed resolution.

use std::any::Any;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::bindings::*;

/// The environment variable that names an explicit driver library path.
pub const LIBRARY_ENV: &str = "CUDA_MULTIMEM_LIBCUDA";

/// Library names tried, in order, when [`LIBRARY_ENV`] is unset. Never a toolkit stub.
pub const LIBRARY_CANDIDATES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// The function type inside a generated `PFN_` typedef (`Option<unsafe extern "C" fn(..)>`).
pub type FnOf<P> = <P as PfnOption>::Fn;

/// Implemented for `Option<F>`: names the function type `F` of a bindgen `PFN_` typedef.
pub trait PfnOption {
    /// The function-pointer type.
    type Fn: Copy;
}
impl<F: Copy> PfnOption for Option<F> {
    type Fn = F;
}

/// `cuGetProcAddress` at ABI 12000 (the `_v2` export, with a symbol status out-parameter).
pub type GetProcAddressFn = FnOf<PFN_cuGetProcAddress_v12000>;
/// `cuDriverGetVersion`.
pub type DriverGetVersionFn = FnOf<PFN_cuDriverGetVersion_v2020>;

/// One row of the generated symbol table: a driver symbol and one ABI version of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SymbolInfo {
    /// Base name, as `cuGetProcAddress` takes it (`cuMemAdvise`, not `cuMemAdvise_v2`).
    pub name: &'static str,
    /// The same, NUL-terminated.
    pub cname: &'static CStr,
    /// The CUDA version of this ABI (the `<version>` of `PFN_<name>_v<version>`).
    pub abi: i32,
}

/// Where a [`Driver`]'s entry points come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A driver library opened from this path (or library name resolved by the dynamic loader).
    Library(PathBuf),
    /// An entry provided in code, e.g. the simulated driver; the string describes it.
    Custom(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Library(p) => write!(f, "library {}", p.display()),
            Origin::Custom(s) => f.write_str(s),
        }
    }
}

/// The two functions from which everything else is resolved (like ash's `Entry`).
#[derive(Clone)]
pub struct Entry {
    /// `cuGetProcAddress_v2`.
    pub get_proc_address: GetProcAddressFn,
    /// `cuDriverGetVersion`.
    pub driver_get_version: DriverGetVersionFn,
    /// Where they come from.
    pub origin: Origin,
    /// Kept alive as long as the [`Driver`] is (a simulator session, say).
    pub keepalive: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// Why a symbol is not available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissReason {
    /// The driver is older than the ABI version; the driver was not asked.
    DriverTooOld,
    /// The driver does not know the symbol (`CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`).
    SymbolNotFound,
    /// The driver knows the symbol but not at this ABI (`CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`).
    VersionNotSufficient,
    /// The driver answered success with a null pointer (not supported on this platform).
    NotSupportedOnPlatform,
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MissReason::DriverTooOld => "the driver predates this ABI; not asked",
            MissReason::SymbolNotFound => "cuGetProcAddress: symbol not found",
            MissReason::VersionNotSufficient => "cuGetProcAddress: version not sufficient",
            MissReason::NotSupportedOnPlatform => {
                "cuGetProcAddress: not supported on this platform"
            }
        })
    }
}

/// Errors of loading the driver and resolving its entry points.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No driver library could be opened.
    #[error("no CUDA driver library could be opened; tried: {}", fmt_tried(.tried))]
    LibraryNotFound {
        /// Each path or name tried, with the dynamic loader's message.
        tried: Vec<(String, String)>,
    },
    /// A library was opened but it is not a usable CUDA driver.
    #[error("{path} is not a usable CUDA driver: {detail}")]
    NotADriver {
        /// The library's path.
        path: String,
        /// What was wrong (a missing entry point, a toolkit stub, ...).
        detail: String,
    },
    /// The driver lacks this function at this ABI.
    #[error(
        "the CUDA driver lacks `{symbol}` at ABI {needed}: driver version is {driver} ({reason})"
    )]
    Unsupported {
        /// The symbol's base name.
        symbol: &'static str,
        /// The ABI version the caller's signature needs.
        needed: i32,
        /// The driver's version (`cuDriverGetVersion`).
        driver: i32,
        /// What the driver said, or that it was not asked.
        reason: MissReason,
    },
    /// A symbol, ABI version or table row that the pinned headers do not have (a caller's name
    /// or index, not a driver's answer).
    #[error("{what} is not in the pinned CUDA headers' symbol table")]
    NotInHeaders {
        /// What was asked for: `` `name` at ABI version ``, or the row index.
        what: String,
    },
    /// A loader call itself failed.
    #[error("{call} failed with {code}")]
    Driver {
        /// The driver call.
        call: &'static str,
        /// Its status.
        code: CUresult,
    },
}

fn fmt_tried(tried: &[(String, String)]) -> String {
    tried
        .iter()
        .map(|(p, e)| format!("{p} ({e})"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The loaded (or simulated) driver: its version and a lazily filled, thread-safe table of
/// typed entry points, one per (symbol, ABI version) of `cudaTypedefs.h`.
///
/// The generated accessors (`driver.cuMemCreate()`, `driver.cuMemAdvise_v8000()`, ...) return the
/// function pointer or a [`LoadError`]; the unsuffixed name is the symbol's newest ABI.
pub struct Driver {
    entry: Entry,
    version: i32,
    slots: Box<[OnceLock<Result<usize, MissOrCode>>]>,
    // Dropped last: the function pointers above point into it.
    _library: Option<libloading::Library>,
}

#[derive(Debug, Clone, Copy)]
enum MissOrCode {
    Miss(MissReason),
    Code(CUresult),
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("origin", &self.entry.origin)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl Driver {
    /// Open the driver library: the path in `CUDA_MULTIMEM_LIBCUDA` if set, else `libcuda.so.1`,
    /// then `libcuda.so`, through the system's dynamic loader.
    pub fn load() -> Result<Driver, LoadError> {
        if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
            return Driver::load_from(PathBuf::from(p));
        }
        let mut tried = Vec::new();
        for name in LIBRARY_CANDIDATES {
            match Driver::load_from(name) {
                Ok(d) => return Ok(d),
                Err(LoadError::LibraryNotFound { tried: t }) => tried.extend(t),
                Err(e) => return Err(e),
            }
        }
        Err(LoadError::LibraryNotFound { tried })
    }

    /// Open the driver library at `path` (a path, or a name for the dynamic loader).
    pub fn load_from(path: impl Into<PathBuf>) -> Result<Driver, LoadError> {
        let path: PathBuf = path.into();
        let shown = path.display().to_string();
        // SAFETY: opening a shared library runs its initialisers; the CUDA driver library's
        // initialisers have no preconditions. A library that is not a CUDA driver is rejected
        // below before any of its functions is called through a guessed signature, except the
        // two looked up by exact, documented name.
        let lib =
            unsafe { libloading::Library::new(&path) }.map_err(|e| LoadError::LibraryNotFound {
                tried: vec![(shown.clone(), e.to_string())],
            })?;
        let not_a_driver = |detail: String| LoadError::NotADriver {
            path: shown.clone(),
            detail,
        };
        // SAFETY: these exported names have exactly these C signatures in every CUDA driver
        // since 12.0 (cuGetProcAddress_v2) and 2.2 (cuDriverGetVersion).
        let gpa: GetProcAddressFn =
            unsafe { lib.get::<GetProcAddressFn>(b"cuGetProcAddress_v2\0") }
                .map(|s| *s)
                .map_err(|e| {
                    not_a_driver(format!(
                        "no cuGetProcAddress_v2 (a driver older than CUDA 12.0?): {e}"
                    ))
                })?;
        // SAFETY: as above.
        let dgv: DriverGetVersionFn =
            unsafe { lib.get::<DriverGetVersionFn>(b"cuDriverGetVersion\0") }
                .map(|s| *s)
                .map_err(|e| not_a_driver(format!("no cuDriverGetVersion: {e}")))?;
        let entry = Entry {
            get_proc_address: gpa,
            driver_get_version: dgv,
            origin: Origin::Library(path),
            keepalive: None,
        };
        Driver::build(entry, Some(lib)).map_err(|e| match e {
            LoadError::Driver { code, .. } if code == CUresult::CUDA_ERROR_STUB_LIBRARY => {
                not_a_driver("it is a CUDA toolkit stub library, not the driver".into())
            }
            LoadError::Driver { call, code } => not_a_driver(format!("{call} failed with {code}")),
            e => e,
        })
    }

    /// Build a driver from an [`Entry`] provided in code (the simulator's, for example).
    pub fn from_entry(entry: Entry) -> Result<Driver, LoadError> {
        Driver::build(entry, None)
    }

    fn build(entry: Entry, library: Option<libloading::Library>) -> Result<Driver, LoadError> {
        let mut version: c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        let rc = unsafe { (entry.driver_get_version)(&mut version) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(LoadError::Driver {
                call: "cuDriverGetVersion",
                code: rc,
            });
        }
        let slots = (0..SYMBOLS.len()).map(|_| OnceLock::new()).collect();
        Ok(Driver {
            entry,
            version,
            slots,
            _library: library,
        })
    }

    /// The driver's version, as `cuDriverGetVersion` reports it (13000 for CUDA 13.0).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// Where the entry points come from.
    pub fn origin(&self) -> &Origin {
        &self.entry.origin
    }

    /// The entry this driver was built from.
    pub fn entry(&self) -> &Entry {
        &self.entry
    }

    /// Index into [`SYMBOLS`] of `name` at ABI `abi`, if the headers have that pair.
    pub fn symbol_index(name: &str, abi: i32) -> Option<usize> {
        SYMBOLS.iter().position(|s| s.name == name && s.abi == abi)
    }

    /// Whether `name` at ABI `abi` resolves on this driver (resolving and caching it).
    pub fn availability(&self, name: &str, abi: i32) -> Result<(), LoadError> {
        let index = Driver::symbol_index(name, abi).ok_or_else(|| LoadError::NotInHeaders {
            what: format!("`{name}` at ABI {abi}"),
        })?;
        self.raw(index).map(|_| ())
    }

    /// Resolve row `index` of [`SYMBOLS`] as an untyped address.
    pub fn raw(&self, index: usize) -> Result<*mut c_void, LoadError> {
        let info = SYMBOLS.get(index).ok_or_else(|| LoadError::NotInHeaders {
            what: format!("row {index} (the table has {} rows)", SYMBOLS.len()),
        })?;
        // Definitive answers (an address, or a symbol the driver lacks) are cached; a failing
        // cuGetProcAddress call itself (a transient status) is not, so a later call asks again.
        let r = match self.slots[index].get() {
            Some(r) => *r,
            None => {
                let r = self.lookup(info);
                if !matches!(r, Err(MissOrCode::Code(_))) {
                    let _ = self.slots[index].set(r);
                }
                r
            }
        };
        match r {
            Ok(p) => Ok(p as *mut c_void),
            Err(MissOrCode::Miss(reason)) => Err(LoadError::Unsupported {
                symbol: info.name,
                needed: info.abi,
                driver: self.version,
                reason,
            }),
            Err(MissOrCode::Code(code)) => Err(LoadError::Driver {
                call: "cuGetProcAddress",
                code,
            }),
        }
    }

    /// Resolve row `index` as the function type `F`.
    ///
    /// # Safety
    /// `F` must be the function type of row `index`'s `PFN_` typedef. The generated accessors
    /// guarantee this; call them instead.
    #[inline]
    pub unsafe fn resolve<P: PfnOption>(&self, index: usize) -> Result<P::Fn, LoadError> {
        const { assert!(std::mem::size_of::<P>() == std::mem::size_of::<usize>()) };
        let p = self.raw(index)?;
        // SAFETY: `p` is non-null and the caller promises `P::Fn` is this ABI's signature;
        // `Option<fn>` and `fn` share the pointer's representation.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, P::Fn>(&p) })
    }

    fn lookup(&self, info: &SymbolInfo) -> Result<usize, MissOrCode> {
        // Measured on a real 13.0 driver: asking for a version newer than the driver fails with
        // CUDA_ERROR_INVALID_VALUE for every symbol, so a newer ABI is refused without asking.
        if self.version < info.abi {
            return Err(MissOrCode::Miss(MissReason::DriverTooOld));
        }
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status = CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        // SAFETY: symbol is NUL-terminated, the out-pointers are valid for one write each.
        let rc = unsafe {
            (self.entry.get_proc_address)(
                info.cname.as_ptr() as *const c_char,
                &mut pfn,
                info.abi,
                CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_LEGACY_STREAM.0 as cuuint64_t,
                &mut status,
            )
        };
        if status == CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND {
            return Err(MissOrCode::Miss(MissReason::SymbolNotFound));
        }
        if status == CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT {
            return Err(MissOrCode::Miss(MissReason::VersionNotSufficient));
        }
        if rc != CUresult::CUDA_SUCCESS {
            return Err(MissOrCode::Code(rc));
        }
        if pfn.is_null() {
            return Err(MissOrCode::Miss(MissReason::NotSupportedOnPlatform));
        }
        Ok(pfn as usize)
    }
}

/// The name of a `CUresult` (`CUDA_ERROR_INVALID_VALUE`), if the pinned headers know it.
pub fn result_name(r: CUresult) -> Option<&'static str> {
    crate::table::result_name(r)
}

impl fmt::Display for CUresult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match result_name(*self) {
            Some(n) => write!(f, "{n} ({})", self.0),
            None => write!(f, "CUresult {}", self.0),
        }
    }
}

/// Expands the generated table into [`SYMBOLS`], the typed accessors and [`result_name`].
#[doc(hidden)]
#[macro_export]
macro_rules! driver_table {
    (
        entries: [ $( $i:literal $name:ident $abi:literal $acc:ident $pfn:ident; )* ],
        newest: [ $( $ni:literal $nname:ident $nabi:literal $npfn:ident; )* ],
        results: [ $( $res:ident, )* ],
    ) => {
        /// Every (symbol, ABI version) pair of `cudaTypedefs.h`, sorted by name, then version.
        pub static SYMBOLS: &[$crate::SymbolInfo] = &[
            $( $crate::SymbolInfo {
                name: stringify!($name),
                cname: match ::core::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                    Ok(c) => c,
                    Err(_) => panic!("symbol names have no NUL"),
                },
                abi: $abi,
            }, )*
        ];

        /// Typed, lazily resolved accessors, one per (symbol, ABI version) of `cudaTypedefs.h`.
        #[allow(non_snake_case)]
        impl $crate::Driver {
            $(
                #[doc = concat!("`", stringify!($name), "` at ABI ", stringify!($abi), " (`", stringify!($pfn), "`).")]
                #[inline]
                pub fn $acc(&self) -> ::core::result::Result<$crate::FnOf<$pfn>, $crate::LoadError> {
                    // SAFETY: the table pairs this index with this typedef.
                    unsafe { self.resolve::<$pfn>($i) }
                }
            )*
            $(
                #[doc = concat!("`", stringify!($nname), "` at its newest ABI, ", stringify!($nabi), " (`", stringify!($npfn), "`).")]
                #[inline]
                pub fn $nname(&self) -> ::core::result::Result<$crate::FnOf<$npfn>, $crate::LoadError> {
                    // SAFETY: the table pairs this index with this typedef.
                    unsafe { self.resolve::<$npfn>($ni) }
                }
            )*
        }

        pub(crate) fn result_name(r: CUresult) -> Option<&'static str> {
            $( if r == CUresult::$res { return Some(stringify!($res)); } )*
            None
        }
    };
}

pub use crate::table::SYMBOLS;
