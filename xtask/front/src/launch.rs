//! Running the xtask tools (the `xtask` package) from the front: `cargo build --workspace --bin
//! xtask`, quiet when the tools are built and their sources unchanged, else after saying so and
//! with cargo's own progress showing (instead of minutes of silence); then the binary with the
//! same arguments.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

/// The package of the tools.
pub const TOOLS: &str = "xtask";

/// The workspace root (this crate lives in `xtask/front`).
pub fn workspace_root() -> PathBuf {
    let me = Path::new(env!("CARGO_MANIFEST_DIR"));
    me.ancestors().nth(2).unwrap_or(me).to_path_buf()
}

/// Whether the tools binary is there and newer than every source it was built from.
#[derive(Debug, PartialEq, Eq)]
pub enum State {
    /// Never built in this target directory.
    Missing,
    /// Built, but this source (from cargo's dep-info of the binary) changed since.
    Stale(PathBuf),
    Fresh,
}

/// The state of the binary `bin`, judged by cargo's dep-info file `dep_info` beside it (the
/// sources it was built from, one Makefile rule).
pub fn state(bin: &Path, dep_info: &Path) -> State {
    let Ok(built) = bin.metadata().and_then(|m| m.modified()) else {
        return State::Missing;
    };
    let Ok(rule) = std::fs::read_to_string(dep_info) else {
        return State::Stale(dep_info.to_path_buf());
    };
    for dep in dep_info_sources(&rule) {
        let changed = std::fs::metadata(&dep)
            .and_then(|m| m.modified())
            .map_or(true, |t: SystemTime| t > built);
        if changed {
            return State::Stale(dep);
        }
    }
    State::Fresh
}

/// The prerequisites of the first rule of a Makefile-style dep-info file (`target: a b\ c`).
pub fn dep_info_sources(rule: &str) -> Vec<PathBuf> {
    let line = rule.lines().next().unwrap_or_default();
    // The target ends at the first unescaped ": ".
    let mut rest = None;
    let b = line.as_bytes();
    for i in 0..b.len().saturating_sub(1) {
        if b[i] == b':' && b[i + 1] == b' ' && (i == 0 || b[i - 1] != b'\\') {
            rest = Some(&line[i + 2..]);
            break;
        }
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = rest.unwrap_or_default().chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                cur.push(' ');
                chars.next();
            }
            ' ' => {
                if !cur.is_empty() {
                    out.push(PathBuf::from(std::mem::take(&mut cur)));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(PathBuf::from(cur));
    }
    out
}

/// Cargo's target directory as the environment sets it (`CARGO_TARGET_DIR`,
/// `CARGO_BUILD_TARGET_DIR`, relative to the current folder), else `<root>/target`. Only for
/// the "building" message: cargo itself finds the binary.
fn target_dir(root: &Path) -> PathBuf {
    let set = std::env::var_os("CARGO_TARGET_DIR")
        .or_else(|| std::env::var_os("CARGO_BUILD_TARGET_DIR"))
        .map(PathBuf::from);
    match set {
        Some(d) if d.is_absolute() => d,
        Some(d) => std::env::current_dir().unwrap_or_default().join(d),
        None => root.join("target"),
    }
}

/// The executable of the `xtask` binary among cargo's JSON messages (`compiler-artifact` lines).
pub fn tools_executable(messages: &str) -> Option<PathBuf> {
    let file = format!("{TOOLS}{}", std::env::consts::EXE_SUFFIX);
    messages
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#))
        .filter_map(|l| json_string_after(l, r#""executable":""#))
        .map(PathBuf::from)
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy() == file))
}

/// The JSON string that starts right after `key` in `line`, unescaped (`\"`, `\\`, `\/`).
fn json_string_after(line: &str, key: &str) -> Option<String> {
    let rest = &line[line.find(key)? + key.len()..];
    let mut out = String::new();
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                c => out.push(c),
            },
            c => out.push(c),
        }
    }
    None
}

/// Build the tools where needed (visibly), then run them with `args`; the tools' exit status.
///
/// The build selects the whole workspace and then the one binary (`--workspace --bin xtask`):
/// cargo unifies features over the packages selected, so this builds the libraries with the same
/// features as `cargo xtask test`'s workspace build, and CI builds them once for both (`-p xtask`
/// would build the library stack a second time, with xtask's features only).
pub fn run_tools(args: &[String]) -> i32 {
    let root = workspace_root();
    let manifest = root.join("Cargo.toml");
    let debug = target_dir(&root).join("debug");
    let bin = debug.join(format!("{TOOLS}{}", std::env::consts::EXE_SUFFIX));
    let why = match state(&bin, &debug.join(format!("{TOOLS}.d"))) {
        State::Fresh => None,
        State::Missing => Some("building the xtask tools (first run only)…".to_string()),
        State::Stale(p) => Some(format!(
            "rebuilding the xtask tools ({} changed)…",
            p.strip_prefix(&root).unwrap_or(&p).display()
        )),
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(&cargo);
    build
        .args(["build", "--workspace", "--bin", TOOLS])
        .arg("--message-format=json-render-diagnostics")
        .arg("--manifest-path")
        .arg(&manifest)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    match &why {
        // cargo's progress on stderr, the JSON on stdout for the executable's path
        Some(why) => eprintln!("{why}"),
        None => {
            build.arg("--quiet");
        }
    }
    let built = match build.output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("xtask: cannot start {}: {e}", Path::new(&cargo).display());
            return 1;
        }
    };
    if !built.status.success() {
        eprintln!("xtask: building the xtask tools failed (above)");
        return built.status.code().unwrap_or(1);
    }
    let Some(exe) = tools_executable(&String::from_utf8_lossy(&built.stdout)) else {
        eprintln!("xtask: cargo built no `{TOOLS}` binary (cargo build --workspace --bin {TOOLS})");
        return 1;
    };
    match Command::new(&exe).args(args).status() {
        Ok(s) => s.code().unwrap_or(1),
        Err(e) => {
            eprintln!("xtask: cannot start {}: {e}", exe.display());
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tools_executable_comes_from_cargos_artifact_messages() {
        let exe = format!("/t/debug/xtask{}", std::env::consts::EXE_SUFFIX);
        let msgs = format!(
            "{{\"reason\":\"compiler-artifact\",\"target\":{{\"name\":\"xtask_front\"}},\"executable\":null}}\n\
             {{\"reason\":\"compiler-artifact\",\"target\":{{\"name\":\"xtask\"}},\"executable\":\"{exe}\",\"fresh\":true}}\n\
             {{\"reason\":\"build-finished\",\"success\":true}}\n"
        );
        assert_eq!(tools_executable(&msgs), Some(PathBuf::from(&exe)));
        assert_eq!(
            json_string_after(r#"{"executable":"/a\"b\\c"}"#, r#""executable":""#),
            Some(r#"/a"b\c"#.to_string())
        );
        assert_eq!(tools_executable(r#"{"reason":"build-finished"}"#), None);
    }

    #[test]
    fn dep_info_lists_the_sources_with_escaped_spaces() {
        let d =
            "/t/debug/xtask: /w/xtask/src/main.rs /w/a\\ b.rs /r/lib.rs\n\n/w/xtask/src/main.rs:\n";
        assert_eq!(
            dep_info_sources(d),
            [
                PathBuf::from("/w/xtask/src/main.rs"),
                PathBuf::from("/w/a b.rs"),
                PathBuf::from("/r/lib.rs")
            ]
        );
        assert!(dep_info_sources("").is_empty());
    }

    #[test]
    fn the_tools_are_missing_stale_or_fresh() {
        let dir = std::env::temp_dir().join(format!("xtask-launch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (bin, d, src) = (dir.join("xtask"), dir.join("xtask.d"), dir.join("main.rs"));
        assert_eq!(state(&bin, &d), State::Missing);
        std::fs::write(&src, "fn main() {}").unwrap();
        std::fs::write(&bin, "").unwrap();
        // No dep-info: rebuild (cargo decides; the message says why).
        assert_eq!(state(&bin, &d), State::Stale(d.clone()));
        std::fs::write(&d, format!("{}: {}\n", bin.display(), src.display())).unwrap();
        let old = SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&src)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(state(&bin, &d), State::Fresh);
        let new = SystemTime::now() + std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&src)
            .unwrap()
            .set_modified(new)
            .unwrap();
        assert_eq!(state(&bin, &d), State::Stale(src.clone()));
        std::fs::remove_file(&src).unwrap();
        assert_eq!(state(&bin, &d), State::Stale(src));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_workspace_root_holds_the_workspace_manifest() {
        let m = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(m.contains("[workspace]"));
    }
}
