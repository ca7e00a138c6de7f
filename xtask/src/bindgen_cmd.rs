//! `cargo xtask bindgen [--check]`: regenerate the committed bindings of `cuda-multimem-sys`.
//!
//! The header set is pinned: `cuda.h` and `cudaTypedefs.h` of CUDA 13.5 from the PyPI wheel
//! `nvidia-cuda-runtime==13.5.37` (under `nvidia/cu13/include`). The wheel is fetched with pip
//! into `target/xtask/headers` (once), bindgen turns the headers into Rust types, and a second
//! generator turns the `PFN_<name>_v<version>` typedefs of `cudaTypedefs.h` into the table of
//! (symbol, ABI version, function type) that the loader resolves through `cuGetProcAddress`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{workspace_root, Result};

/// The wheel that carries the pinned headers.
pub const HEADER_WHEEL: &str = "nvidia-cuda-runtime==13.5.37";

const GENERATED: &str = "crates/cuda-multimem-sys/src/generated";

/// Fetch the pinned headers (cached) and return the include folder.
pub fn headers() -> Result<PathBuf> {
    let root = workspace_root();
    let dir = root.join("target/xtask/headers");
    let include = dir.join("nvidia/cu13/include");
    if include.join("cuda.h").is_file() && include.join("cudaTypedefs.h").is_file() {
        return Ok(include);
    }
    std::fs::create_dir_all(&dir)?;
    let wheel_dir = dir.join("wheel");
    std::fs::create_dir_all(&wheel_dir)?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    crate::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .args([
                "--platform",
                "manylinux_2_17_x86_64",
                "--python-version",
                "3.12",
            ])
            .arg("-d")
            .arg(&wheel_dir)
            .arg(HEADER_WHEEL),
    )?;
    let wheel = std::fs::read_dir(&wheel_dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or("pip download produced no wheel")?;
    // A wheel is a zip archive; Python's zipfile module is always there when pip is.
    crate::run(
        Command::new(&python)
            .args(["-c", "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith('nvidia/cu13/include/')]"])
            .arg(&wheel)
            .arg(&dir),
    )?;
    if !include.join("cuda.h").is_file() {
        return Err(format!("{} has no nvidia/cu13/include/cuda.h", wheel.display()).into());
    }
    Ok(include)
}

/// One `PFN_<name>_v<version>` typedef.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pfn {
    pub name: String,
    pub version: u32,
}

/// Collect the `PFN_` typedefs that bindgen sees (those outside `__CUDA_API_VERSION_INTERNAL`),
/// skipping the per-thread-default-stream variants.
pub fn parse_typedefs(text: &str) -> Vec<Pfn> {
    let mut out = Vec::new();
    let mut depth_internal = 0usize;
    let mut depth = 0usize;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with("#if") {
            depth += 1;
            if l.contains("__CUDA_API_VERSION_INTERNAL") && depth_internal == 0 {
                depth_internal = depth;
            }
            continue;
        }
        if l.starts_with("#endif") {
            if depth_internal == depth {
                depth_internal = 0;
            }
            depth = depth.saturating_sub(1);
            continue;
        }
        if depth_internal != 0 {
            continue;
        }
        let Some(start) = l.find("*PFN_") else {
            continue;
        };
        if !l.starts_with("typedef") {
            continue;
        }
        let rest = &l[start + 5..];
        let Some(end) = rest.find(')') else { continue };
        let full = &rest[..end];
        if full.ends_with("_ptsz") || full.ends_with("_ptds") {
            continue;
        }
        let Some(vpos) = full.rfind("_v") else {
            continue;
        };
        let Ok(version) = full[vpos + 2..].parse::<u32>() else {
            continue;
        };
        out.push(Pfn {
            name: full[..vpos].to_string(),
            version,
        });
    }
    out.sort();
    out.dedup();
    out
}

/// What to tell a person whose machine has no libclang.
const NO_LIBCLANG: &str = "bindgen needs libclang and none was found: install it (`apt-get install libclang-dev`), or set LIBCLANG_PATH to the folder that holds libclang.so";

/// Whether `name` is a libclang shared library (`libclang.so`, `libclang-18.so.1`, ...).
fn is_libclang(name: &str) -> bool {
    name.starts_with("libclang")
        && name.contains(".so")
        && !name.starts_with("libclang_rt")
        && !name.starts_with("libclang-cpp")
}

fn dir_has_libclang(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| is_libclang(&e.file_name().to_string_lossy()))
    })
}

/// Look for libclang where bindgen (through clang-sys) looks: `LIBCLANG_PATH`, the dynamic
/// linker's cache (`ldconfig -p`), `llvm-config --libdir`, and the distributions' LLVM folders.
/// Ordinary builds never need it; only `cargo xtask bindgen` does.
fn find_libclang() -> Result<()> {
    if let Some(p) = std::env::var_os("LIBCLANG_PATH") {
        let p = PathBuf::from(p);
        if p.is_file() || dir_has_libclang(&p) {
            return Ok(());
        }
        return Err(format!(
            "LIBCLANG_PATH={} holds no libclang.so; {NO_LIBCLANG}",
            p.display()
        )
        .into());
    }
    let ldconfig = ["ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .iter()
        .find_map(|c| Command::new(c).arg("-p").output().ok());
    if ldconfig.is_some_and(|o| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .any(|l| l.split_whitespace().next().is_some_and(is_libclang))
    }) {
        return Ok(());
    }
    let llvm_libdir = Command::new("llvm-config")
        .arg("--libdir")
        .output()
        .ok()
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let mut dirs: Vec<PathBuf> = llvm_libdir.into_iter().collect();
    for root in ["/usr/lib", "/usr/local/lib", "/usr/lib64"] {
        dirs.push(PathBuf::from(root));
        dirs.push(PathBuf::from(root).join("x86_64-linux-gnu"));
        if let Ok(rd) = std::fs::read_dir(root) {
            dirs.extend(
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("llvm"))
                    .map(|e| e.path().join("lib")),
            );
        }
    }
    if dirs.iter().any(|d| dir_has_libclang(d)) {
        return Ok(());
    }
    Err(NO_LIBCLANG.into())
}

fn bindings(include: &Path) -> Result<String> {
    // bindgen panics when it cannot load libclang after all (a library the probe took for
    // libclang that does not load): turn that into the same advice.
    match std::panic::catch_unwind(|| bindings_unchecked(include)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("bindgen panicked ({what}); {NO_LIBCLANG}").into())
        }
    }
}

fn bindings_unchecked(include: &Path) -> Result<String> {
    let wrapper = format!(
        "#include \"{}\"\n#include \"{}\"\n",
        include.join("cuda.h").display(),
        include.join("cudaTypedefs.h").display()
    );
    let b = bindgen::Builder::default()
        .header_contents("wrapper.h", &wrapper)
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_type("CU.*|PFN_.*|cuuint.*|cudaError_enum|CUdeviceptr.*")
        .allowlist_var("CU_.*|CUDA_.*|CUDART_.*|MAX_PLANES")
        .blocklist_function(".*")
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .derive_eq(true)
        .derive_hash(true)
        .impl_debug(false)
        .layout_tests(false)
        .generate_comments(true)
        .use_core()
        .formatter(bindgen::Formatter::Prettyplease)
        .raw_line("// Generated by `cargo xtask bindgen` from cuda.h and cudaTypedefs.h of")
        .raw_line(format!("// the wheel {HEADER_WHEEL}. Do not edit by hand."))
        .raw_line(
            "#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, dead_code)]",
        )
        .raw_line("#![allow(clippy::all, rustdoc::all, missing_docs, unnecessary_transmutes)]")
        .generate()
        .map_err(|e| format!("bindgen failed: {e}"))?;
    Ok(b.to_string())
}

fn table(pfns: &[Pfn], results: &[String]) -> String {
    let mut s = String::new();
    s.push_str(
        "// Generated by `cargo xtask bindgen` from the PFN_<name>_v<version> typedefs of\n",
    );
    let _ = writeln!(
        s,
        "// cudaTypedefs.h in the wheel {HEADER_WHEEL}. Do not edit by hand."
    );
    s.push_str("// Each row: index, symbol, ABI version, typed accessor, function-pointer type.\n");
    s.push_str("// The `newest` rows give each symbol's unsuffixed accessor (its newest ABI).\n\n");
    s.push_str("#![allow(missing_docs)]\n\nuse crate::bindings::*;\n\ncrate::driver_table! {\n    entries: [\n");
    for (i, p) in pfns.iter().enumerate() {
        let _ = writeln!(
            s,
            "        {i} {n} {v} {n}_v{v} PFN_{n}_v{v};",
            n = p.name,
            v = p.version
        );
    }
    s.push_str("    ],\n    newest: [\n");
    for (i, p) in pfns.iter().enumerate() {
        if pfns.get(i + 1).is_none_or(|n| n.name != p.name) {
            let _ = writeln!(
                s,
                "        {i} {n} {v} PFN_{n}_v{v};",
                n = p.name,
                v = p.version
            );
        }
    }
    s.push_str("    ],\n    results: [\n");
    for r in results {
        let _ = writeln!(s, "        {r},");
    }
    s.push_str("    ],\n}\n");
    s
}

/// The `CUresult` constant names in the generated bindings, in order of appearance.
fn result_names(bindings: &str) -> Vec<String> {
    bindings
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("pub const ")?;
            let (name, ty) = rest.split_once(':')?;
            ty.trim()
                .starts_with("cudaError_enum =")
                .then(|| name.trim().to_string())
        })
        .collect()
}

/// Regenerate into `out` (the committed folder, or a temporary one for `--check`).
fn generate_into(out: &Path) -> Result<()> {
    find_libclang()?;
    let include = headers()?;
    let typedefs = std::fs::read_to_string(include.join("cudaTypedefs.h"))?;
    let pfns = parse_typedefs(&typedefs);
    if pfns.len() < 400 {
        return Err(format!(
            "only {} PFN typedefs parsed: header layout changed?",
            pfns.len()
        )
        .into());
    }
    std::fs::create_dir_all(out)?;
    let b = bindings(&include)?;
    let results = result_names(&b);
    if results.len() < 50 {
        return Err(format!(
            "only {} CUresult values found in the bindings",
            results.len()
        )
        .into());
    }
    std::fs::write(out.join("bindings.rs"), &b)?;
    std::fs::write(out.join("table.rs"), table(&pfns, &results))?;
    Ok(())
}

/// Entry point of `cargo xtask bindgen [--check]`.
pub fn bindgen(check: bool) -> Result<()> {
    let root = workspace_root();
    let committed = root.join(GENERATED);
    if !check {
        generate_into(&committed)?;
        println!("wrote {}/bindings.rs and table.rs", committed.display());
        return Ok(());
    }
    let tmp = root.join("target/xtask/bindgen-check");
    let _ = std::fs::remove_dir_all(&tmp);
    generate_into(&tmp)?;
    let mut differ = Vec::new();
    for f in ["bindings.rs", "table.rs"] {
        let a = std::fs::read(committed.join(f)).unwrap_or_default();
        let b = std::fs::read(tmp.join(f))?;
        if a != b {
            differ.push(f);
        }
    }
    if differ.is_empty() {
        println!("bindgen --check: committed bindings match a fresh generation");
        Ok(())
    } else {
        Err(format!(
            "bindgen --check: {} differ from a fresh generation (run `cargo xtask bindgen`; fresh output in {})",
            differ.join(", "),
            tmp.display()
        )
        .into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typedef_parser_skips_per_thread_and_internal_variants() {
        let text = "typedef CUresult (CUDAAPI *PFN_cuMemAdvise_v8000)(int);\n\
            typedef CUresult (CUDAAPI *PFN_cuMemAdvise_v12020)(int);\n\
            typedef CUresult (CUDAAPI *PFN_cuMemcpy_v7000_ptds)(int);\n\
            #if defined(__CUDA_API_VERSION_INTERNAL)\n\
            typedef CUresult (CUDAAPI *PFN_cuLinkCreate_v5050)(int);\n\
            #endif\n\
            typedef CUresult (CUDAAPI *PFN_cuInit_v2000)(unsigned int);\n";
        let p = parse_typedefs(text);
        let names: Vec<_> = p
            .iter()
            .map(|p| format!("{}@{}", p.name, p.version))
            .collect();
        assert_eq!(
            names,
            ["cuInit@2000", "cuMemAdvise@8000", "cuMemAdvise@12020"]
        );
    }
}
