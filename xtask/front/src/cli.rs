//! The command line of `cargo xtask`: one grammar ([`COMMANDS`]), one parser ([`parse`]) and the
//! help text made from the grammar. The front (`cargo xtask`) parses with it before anything
//! heavy builds, so `--help` and every argument error answer at once; the tools binary
//! (`xtask`, also `bundle/xtask` on the GPU machines) parses the same arguments with the same
//! code, so the two cannot disagree.
//!
//! The grammar follows the clap definition it replaces: long options only (plus `-h`), an
//! option's value as the next argument or after `=`, `--versions` repeatable and comma
//! separated, everything after `--` passed on untouched, `help <command>`.

use std::fmt::Write as _;
use std::path::PathBuf;

/// The benchmarks `bench-hw` runs (the tools map each to its binary and references).
pub const BENCHES: [&str; 7] = [
    "memory",
    "allreduce",
    "collectives",
    "norm",
    "hier",
    "alltoall",
    "moe",
];

/// What one argument of a command is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `--name`, no value.
    Flag,
    /// `--name VALUE` or `--name=VALUE`; `list`: may be repeated, each value split at commas.
    Value { value: &'static str, list: bool },
    /// A positional argument (before `--`).
    Positional { required: bool },
    /// Everything after `--`, passed on untouched.
    Rest,
}

/// One argument of a command.
#[derive(Debug)]
pub struct Arg {
    /// The option's long name without `--`, or a positional's placeholder (`WHAT`).
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
}

/// One command of `cargo xtask`.
#[derive(Debug)]
pub struct Spec {
    pub name: &'static str,
    pub about: &'static str,
    pub args: &'static [Arg],
}

const fn flag(name: &'static str, help: &'static str) -> Arg {
    Arg {
        name,
        kind: Kind::Flag,
        help,
    }
}

const fn value(name: &'static str, value: &'static str, help: &'static str) -> Arg {
    Arg {
        name,
        kind: Kind::Value { value, list: false },
        help,
    }
}

const fn positional(name: &'static str, help: &'static str) -> Arg {
    Arg {
        name,
        kind: Kind::Positional { required: true },
        help,
    }
}

const fn rest(name: &'static str, help: &'static str) -> Arg {
    Arg {
        name,
        kind: Kind::Rest,
        help,
    }
}

/// Every command, in the order `--help` lists them.
pub const COMMANDS: &[Spec] = &[
    Spec {
        name: "bindgen",
        about: "Regenerate the committed bindings of cuda-multimem-sys from the pinned CUDA 13.5 headers",
        args: &[flag(
            "check",
            "Regenerate into a temporary folder and fail on any difference",
        )],
    },
    Spec {
        name: "ptx",
        about: "Regenerate the committed PTX kernels of cuda-multimem-collectives (cuda-multimem-ptxgen)",
        args: &[flag(
            "check",
            "Regenerate in memory and fail naming every committed file that differs",
        )],
    },
    Spec {
        name: "test",
        about: "Build, then run the tests on the simulated driver: the whole suite at driver version \
                13050, the version-dependent tests at 12000, 12080, 13000 and 13030",
        args: &[
            Arg {
                name: "versions",
                kind: Kind::Value {
                    value: "VERSIONS",
                    list: true,
                },
                help: "Driver versions, comma separated or repeated; the whole suite runs at each \
                       (default: as above)",
            },
            value("devices", "DEVICES", "Simulated devices [default: 2]"),
            rest("EXTRA", "Extra arguments for the test binaries (after `--`)"),
        ],
    },
    Spec {
        name: "test-hw",
        about: "Run the suite against the real driver; capabilities the device lacks are skipped with a reason",
        args: &[rest("FILTER", "Test-name filter and libtest arguments")],
    },
    Spec {
        name: "bench-hw",
        about: "Benchmarks on the real driver: memory, allreduce, collectives, norm, hier, alltoall or moe (beside NCCL / torch where they have the operation)",
        args: &[
            positional(
                "WHAT",
                "Which benchmark: memory, allreduce, collectives, norm (with the FP8 outputs), hier, alltoall (beside ncclAlltoAll and torch all_to_all_single), moe (dispatch/combine beside torch's all_to_all_single-based one)",
            ),
            rest("ARGS", "Arguments for the benchmark binary"),
        ],
    },
    Spec {
        name: "ptx-check",
        about: "Assemble every PTX kernel with ptxas for sm_90",
        args: &[],
    },
    Spec {
        name: "info",
        about: "Report the selected driver's capabilities (CUDA_MULTIMEM_DRIVER picks the driver)",
        args: &[flag("json", "One JSON object")],
    },
    Spec {
        name: "bundle",
        about: "Build the binaries the GPU machines run into bundle/",
        args: &[],
    },
    Spec {
        name: "chart",
        about: "Print the nccl-tests style table of a benchmark run and write its SVG charts \
                (`<bench>-time.svg`, `<bench>-bandwidth.svg` per collective)",
        args: &[
            positional(
                "RESULTS",
                "The run's results: a `hw-logs/<bench>-<date>.jsonl`, or captured benchmark output",
            ),
            value(
                "out-dir",
                "OUT_DIR",
                "Where the charts go (default: docs/charts)",
            ),
            value(
                "date",
                "DATE",
                "The run's date, YYYY-MM-DD, for the titles (default: today)",
            ),
            value(
                "machine",
                "MACHINE",
                "The machine, for the titles (e.g. \"2 x H200, NV18\")",
            ),
        ],
    },
    Spec {
        name: "modules",
        about: "Show how the library crates' modules import each other (crate:: and super:: paths); \
                with --check, fail on any circle",
        args: &[
            flag(
                "check",
                "Exit 1 when the child modules of any module import each other in a circle",
            ),
            flag(
                "verbose",
                "Also print every module's import edges between its children, each with one file:line",
            ),
        ],
    },
];

/// A command line that parsed.
#[derive(Debug, PartialEq, Eq)]
pub enum Cmd {
    Bindgen {
        check: bool,
    },
    Ptx {
        check: bool,
    },
    Test {
        /// Empty: the default plan (see the tools' `test_cmd`).
        versions: Vec<i32>,
        devices: usize,
        extra: Vec<String>,
    },
    TestHw {
        filter: Vec<String>,
    },
    BenchHw {
        /// One of [`BENCHES`].
        what: String,
        args: Vec<String>,
    },
    PtxCheck,
    Info {
        json: bool,
    },
    Bundle,
    Chart {
        results: PathBuf,
        out_dir: Option<PathBuf>,
        date: Option<String>,
        machine: Option<String>,
    },
    Modules {
        check: bool,
        verbose: bool,
    },
}

impl Cmd {
    /// Whether the command runs in the front itself (it needs none of the tools' dependencies).
    pub fn runs_in_front(&self) -> bool {
        matches!(self, Cmd::Modules { .. })
    }
}

/// What a command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    Run(Cmd),
    /// Print this (on stdout) and exit 0.
    Help(String),
}

/// A command line that does not parse: the message to print on stderr before exiting 2.
#[derive(Debug, PartialEq, Eq)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The exit status of a usage error (clap's, which this grammar replaces).
pub const USAGE_EXIT: i32 = 2;

fn spec(name: &str) -> Option<&'static Spec> {
    COMMANDS.iter().find(|c| c.name == name)
}

/// Parse a command line (without the program name). `program` is how the help names the
/// program (`cargo xtask`, or `bundle/xtask` in a bundle).
pub fn parse(program: &str, args: &[String]) -> Result<Parsed, UsageError> {
    let Some(first) = args.first() else {
        // clap's behaviour without a command: the help, on stderr, as an error.
        return Err(UsageError(top_help(program)));
    };
    match first.as_str() {
        "-h" | "--help" => return Ok(Parsed::Help(top_help(program))),
        "help" => {
            return match args.get(1..).unwrap_or_default() {
                [] => Ok(Parsed::Help(top_help(program))),
                [name] => match spec(name) {
                    Some(s) => Ok(Parsed::Help(command_help(program, s))),
                    None => Err(unknown_command(program, name)),
                },
                [_, extra, ..] => Err(UsageError(format!(
                    "error: unexpected argument '{extra}' found\n\nUsage: {program} help [COMMAND]\n\n\
                     For more information, try '{program} --help'."
                ))),
            };
        }
        _ => {}
    }
    let Some(s) = spec(first) else {
        return Err(if first.starts_with('-') {
            UsageError(format!(
                "error: unexpected argument '{first}' found\n\nUsage: {program} <COMMAND>\n\n\
                 For more information, try '{program} --help'."
            ))
        } else {
            unknown_command(program, first)
        });
    };
    let m = match match_args(program, s, &args[1..])? {
        Some(m) => m,
        None => return Ok(Parsed::Help(command_help(program, s))),
    };
    let err = |msg: String| usage_error(program, s, msg, None);
    let cmd = match s.name {
        "bindgen" => Cmd::Bindgen {
            check: m.flag("check"),
        },
        "ptx" => Cmd::Ptx {
            check: m.flag("check"),
        },
        "test" => {
            let mut versions = Vec::new();
            for v in m.values("versions") {
                for part in v.split(',') {
                    versions.push(part.trim().parse::<i32>().map_err(|e| {
                        err(format!(
                            "invalid value '{part}' for '--versions <VERSIONS>': {e} \
                             (a driver version is a number such as 13030)"
                        ))
                    })?);
                }
            }
            let devices = match m.value("devices") {
                None => 2,
                Some(d) => d.parse::<usize>().map_err(|e| {
                    err(format!(
                        "invalid value '{d}' for '--devices <DEVICES>': {e}"
                    ))
                })?,
            };
            Cmd::Test {
                versions,
                devices,
                extra: m.rest,
            }
        }
        "test-hw" => Cmd::TestHw { filter: m.rest },
        "bench-hw" => {
            let what = m.positionals[0].clone();
            if !BENCHES.contains(&what.as_str()) {
                return Err(usage_error(
                    program,
                    s,
                    format!(
                        "unknown benchmark '{what}' (the benchmarks: {})",
                        BENCHES.join(", ")
                    ),
                    similar(&what, BENCHES.iter().copied())
                        .map(|b| format!("a similar benchmark exists: '{b}'")),
                ));
            }
            Cmd::BenchHw { what, args: m.rest }
        }
        "ptx-check" => Cmd::PtxCheck,
        "info" => Cmd::Info {
            json: m.flag("json"),
        },
        "bundle" => Cmd::Bundle,
        "chart" => Cmd::Chart {
            results: PathBuf::from(&m.positionals[0]),
            out_dir: m.value("out-dir").map(PathBuf::from),
            date: m.value("date").map(str::to_string),
            machine: m.value("machine").map(str::to_string),
        },
        "modules" => Cmd::Modules {
            check: m.flag("check"),
            verbose: m.flag("verbose"),
        },
        other => unreachable!("command `{other}` is in COMMANDS but not parsed"),
    };
    Ok(Parsed::Run(cmd))
}

/// The arguments of one command line, matched against its spec.
#[derive(Default)]
struct Matches {
    flags: Vec<&'static str>,
    values: Vec<(&'static str, String)>,
    positionals: Vec<String>,
    rest: Vec<String>,
}

impl Matches {
    fn flag(&self, name: &str) -> bool {
        self.flags.contains(&name)
    }
    fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.values
            .iter()
            .filter(move |(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
    fn value(&self, name: &str) -> Option<&str> {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Match `args` against `s`; `None` when they ask for the command's help.
fn match_args(
    program: &str,
    s: &'static Spec,
    args: &[String],
) -> Result<Option<Matches>, UsageError> {
    let mut m = Matches::default();
    let positionals: Vec<&Arg> = s
        .args
        .iter()
        .filter(|a| matches!(a.kind, Kind::Positional { .. }))
        .collect();
    let takes_rest = s.args.iter().any(|a| a.kind == Kind::Rest);
    let mut seen: Vec<&'static str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--" {
            if !takes_rest {
                return Err(usage_error(
                    program,
                    s,
                    "unexpected argument '--' found (this command takes no arguments after `--`)"
                        .into(),
                    None,
                ));
            }
            m.rest.extend(it.by_ref().cloned());
            break;
        }
        if a == "-h" || a == "--help" {
            return Ok(None);
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            let Some(arg) = s
                .args
                .iter()
                .find(|x| x.name == name && matches!(x.kind, Kind::Flag | Kind::Value { .. }))
            else {
                let options = s.args.iter().filter_map(|x| match x.kind {
                    Kind::Flag | Kind::Value { .. } => Some(x.name),
                    _ => None,
                });
                let tip =
                    similar(name, options).map(|o| format!("a similar argument exists: '--{o}'"));
                let tip = match (tip, takes_rest) {
                    (Some(t), _) => Some(t),
                    (None, true) => Some(format!("to pass '{a}' on to the program, use '-- {a}'")),
                    (None, false) => None,
                };
                return Err(usage_error(
                    program,
                    s,
                    format!("unexpected argument '{a}' found"),
                    tip,
                ));
            };
            let repeatable = matches!(arg.kind, Kind::Value { list: true, .. });
            if seen.contains(&arg.name) && !repeatable {
                return Err(usage_error(
                    program,
                    s,
                    format!(
                        "the argument '{}' cannot be used multiple times",
                        display(arg)
                    ),
                    None,
                ));
            }
            seen.push(arg.name);
            match arg.kind {
                Kind::Flag => {
                    if inline.is_some() {
                        return Err(usage_error(
                            program,
                            s,
                            format!(
                                "unexpected value for '--{}' in '{a}' (it takes none)",
                                arg.name
                            ),
                            None,
                        ));
                    }
                    m.flags.push(arg.name);
                }
                Kind::Value { .. } => {
                    let v = match inline {
                        Some(v) => v,
                        None => match it.next() {
                            Some(v) if !v.starts_with('-') || v == "-" => v.clone(),
                            _ => {
                                return Err(usage_error(
                                    program,
                                    s,
                                    format!(
                                        "a value is required for '{}' but none was supplied",
                                        display(arg)
                                    ),
                                    None,
                                ))
                            }
                        },
                    };
                    m.values.push((arg.name, v));
                }
                Kind::Positional { .. } | Kind::Rest => unreachable!("matched options only"),
            }
            continue;
        }
        if a.starts_with('-') && a.len() > 1 {
            return Err(usage_error(
                program,
                s,
                format!("unexpected argument '{a}' found"),
                takes_rest.then(|| format!("to pass '{a}' on to the program, use '-- {a}'")),
            ));
        }
        if m.positionals.len() < positionals.len() {
            m.positionals.push(a.clone());
        } else {
            return Err(usage_error(
                program,
                s,
                format!("unexpected argument '{a}' found"),
                takes_rest.then(|| format!("to pass '{a}' on to the program, use '-- {a}'")),
            ));
        }
    }
    let missing: Vec<String> = positionals
        .iter()
        .skip(m.positionals.len())
        .filter(|p| matches!(p.kind, Kind::Positional { required: true }))
        .map(|p| format!("  <{}>", p.name))
        .collect();
    if !missing.is_empty() {
        return Err(usage_error(
            program,
            s,
            format!(
                "the following required arguments were not provided:\n{}",
                missing.join("\n")
            ),
            None,
        ));
    }
    Ok(Some(m))
}

/// `--versions <VERSIONS>`, `--check`, `<WHAT>`.
fn display(a: &Arg) -> String {
    match a.kind {
        Kind::Flag => format!("--{}", a.name),
        Kind::Value { value, .. } => format!("--{} <{value}>", a.name),
        Kind::Positional { required: true } => format!("<{}>", a.name),
        Kind::Positional { required: false } => format!("[{}]", a.name),
        Kind::Rest => format!("[{}]...", a.name),
    }
}

fn usage(program: &str, s: &Spec) -> String {
    let mut u = format!("{program} {}", s.name);
    if s.args
        .iter()
        .any(|a| matches!(a.kind, Kind::Flag | Kind::Value { .. }))
    {
        u += " [OPTIONS]";
    }
    for a in s.args {
        match a.kind {
            Kind::Positional { .. } => {
                u += " ";
                u += &display(a);
            }
            Kind::Rest => {
                let _ = write!(u, " [-- <{}>...]", a.name);
            }
            _ => {}
        }
    }
    u
}

fn usage_error(program: &str, s: &Spec, msg: String, tip: Option<String>) -> UsageError {
    let tip = tip.map(|t| format!("\n\n  tip: {t}")).unwrap_or_default();
    UsageError(format!(
        "error: {msg}{tip}\n\nUsage: {}\n\nFor more information, try '{program} {} --help'.",
        usage(program, s),
        s.name
    ))
}

fn unknown_command(program: &str, name: &str) -> UsageError {
    let tip = similar(name, COMMANDS.iter().map(|c| c.name))
        .map(|c| format!("\n\n  tip: a similar command exists: '{c}'"))
        .unwrap_or_default();
    UsageError(format!(
        "error: unrecognized command '{name}'{tip}\n\nUsage: {program} <COMMAND>\n\n\
         For more information, try '{program} --help'."
    ))
}

/// Two columns: each entry's left part padded to the widest.
fn columns(rows: &[(String, &str)]) -> String {
    let w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(l, r)| format!("  {l:w$}  {r}\n"))
        .collect()
}

/// `cargo xtask --help`.
pub fn top_help(program: &str) -> String {
    let mut rows: Vec<(String, &str)> = COMMANDS
        .iter()
        .map(|c| (c.name.to_string(), c.about))
        .collect();
    rows.push((
        "help".into(),
        "Print this message or the help of the given command",
    ));
    format!(
        "cuda-multimem developer commands\n\nUsage: {program} <COMMAND>\n\nCommands:\n{}\n\
         Options:\n  -h, --help  Print help\n",
        columns(&rows)
    )
}

/// `cargo xtask <command> --help`, `cargo xtask help <command>`.
pub fn command_help(program: &str, s: &Spec) -> String {
    let mut out = format!("{}\n\nUsage: {}\n", s.about, usage(program, s));
    let arguments: Vec<(String, &str)> = s
        .args
        .iter()
        .filter(|a| matches!(a.kind, Kind::Positional { .. } | Kind::Rest))
        .map(|a| (display(a), a.help))
        .collect();
    if !arguments.is_empty() {
        out += "\nArguments:\n";
        out += &columns(&arguments);
    }
    let mut options: Vec<(String, &str)> = s
        .args
        .iter()
        .filter(|a| matches!(a.kind, Kind::Flag | Kind::Value { .. }))
        .map(|a| (format!("    {}", display(a)), a.help))
        .collect();
    options.push(("-h, --help".into(), "Print help"));
    out += "\nOptions:\n";
    out += &columns(&options);
    out
}

/// The candidate closest to `word` when it is close enough to be a likely typo (a third of its
/// letters wrong at most, a swap of two neighbours counting as one).
fn similar<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|c| (distance(word, c), c))
        .filter(|(d, c)| *d <= 1.max(c.chars().count() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Edit distance with swaps of neighbours (optimal string alignment), in chars.
fn distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // d[i][j]: the distance between a[..i] and b[..j]
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    d[0] = (0..=b.len()).collect();
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j - 1] + cost)
                .min(d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "cargo xtask";

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_string).collect()
    }

    fn run(line: &str) -> Cmd {
        match parse(P, &args(line)) {
            Ok(Parsed::Run(c)) => c,
            other => panic!("`{line}`: expected a command, got {other:?}"),
        }
    }

    fn help(line: &str) -> String {
        match parse(P, &args(line)) {
            Ok(Parsed::Help(h)) => h,
            other => panic!("`{line}`: expected help, got {other:?}"),
        }
    }

    fn error(line: &str) -> String {
        match parse(P, &args(line)) {
            Err(UsageError(e)) => e,
            other => panic!("`{line}`: expected a usage error, got {other:?}"),
        }
    }

    #[test]
    fn help_lists_every_command_and_help_of_a_command_its_options() {
        let top = help("--help");
        assert_eq!(top, help("-h"));
        assert_eq!(top, help("help"));
        for c in COMMANDS {
            assert!(top.contains(&format!("\n  {} ", c.name)), "{top}");
        }
        let t = help("help test");
        assert_eq!(t, help("test --help"));
        assert_eq!(t, help("test --devices 3 -h"));
        assert!(
            t.contains("Usage: cargo xtask test [OPTIONS] [-- <EXTRA>...]"),
            "{t}"
        );
        assert!(
            t.contains("--versions <VERSIONS>") && t.contains("--devices <DEVICES>"),
            "{t}"
        );
        let b = help("bench-hw --help");
        assert!(
            b.contains("Usage: cargo xtask bench-hw <WHAT> [-- <ARGS>...]"),
            "{b}"
        );
        // After `--`, `--help` belongs to the program.
        assert_eq!(
            run("test-hw -- --help"),
            Cmd::TestHw {
                filter: args("--help")
            }
        );
    }

    #[test]
    fn no_command_is_an_error_that_shows_the_help() {
        let e = error("");
        assert!(e.contains("Commands:"), "{e}");
    }

    #[test]
    fn unknown_commands_are_refused_with_a_suggestion() {
        let e = error("tset");
        assert!(e.contains("unrecognized command 'tset'"), "{e}");
        assert!(e.contains("a similar command exists: 'test'"), "{e}");
        let e = error("frobnicate");
        assert!(
            e.contains("unrecognized command 'frobnicate'") && !e.contains("tip"),
            "{e}"
        );
        assert!(error("help frobnicate").contains("unrecognized command 'frobnicate'"));
        assert!(error("--verbose").contains("unexpected argument '--verbose'"));
    }

    #[test]
    fn unknown_benchmarks_are_refused_naming_the_benchmarks() {
        let e = error("bench-hw bogus");
        assert!(e.contains("unknown benchmark 'bogus'"), "{e}");
        assert!(
            e.contains("memory, allreduce, collectives, norm, hier, alltoall, moe"),
            "{e}"
        );
        assert!(error("bench-hw allreduse").contains("a similar benchmark exists: 'allreduce'"));
        assert!(!error("bench-hw nope").contains("tip"));
        assert!(error("bench-hw").contains("required arguments were not provided:\n  <WHAT>"));
        for b in BENCHES {
            assert_eq!(
                run(&format!("bench-hw {b} -- --sizes 1M")),
                Cmd::BenchHw {
                    what: b.to_string(),
                    args: args("--sizes 1M")
                }
            );
        }
        // The benchmark's own arguments go after `--`, as before.
        let e = error("bench-hw memory --sizes 1");
        assert!(
            e.contains("unexpected argument '--sizes'") && e.contains("use '-- --sizes'"),
            "{e}"
        );
        assert!(error("bench-hw memory allreduce").contains("unexpected argument 'allreduce'"));
    }

    #[test]
    fn bad_flags_and_values_are_refused() {
        let e = error("test --devics 3");
        assert!(e.contains("unexpected argument '--devics'"), "{e}");
        assert!(e.contains("a similar argument exists: '--devices'"), "{e}");
        assert!(
            e.contains("For more information, try 'cargo xtask test --help'."),
            "{e}"
        );
        let e = error("test --versions 12000,abc");
        assert!(
            e.contains("invalid value 'abc' for '--versions <VERSIONS>'"),
            "{e}"
        );
        assert!(
            error("test --devices two").contains("invalid value 'two' for '--devices <DEVICES>'")
        );
        assert!(error("test --devices").contains("a value is required for '--devices <DEVICES>'"));
        assert!(error("test --devices --versions 1").contains("a value is required"));
        assert!(error("test --devices 2 --devices 3").contains("cannot be used multiple times"));
        assert!(error("bindgen --check --check").contains("cannot be used multiple times"));
        assert!(error("bindgen --check=yes").contains("takes none"));
        assert!(error("bindgen --json").contains("unexpected argument '--json'"));
        assert!(error("info -j").contains("unexpected argument '-j'"));
        assert!(error("test foo").contains("use '-- foo'"));
        assert!(error("bundle -- x").contains("no arguments after `--`"));
        assert!(error("chart").contains("<RESULTS>"));
    }

    #[test]
    fn every_command_parses_as_before() {
        assert_eq!(run("bindgen"), Cmd::Bindgen { check: false });
        assert_eq!(run("bindgen --check"), Cmd::Bindgen { check: true });
        assert_eq!(run("ptx --check"), Cmd::Ptx { check: true });
        assert_eq!(
            run("test"),
            Cmd::Test {
                versions: vec![],
                devices: 2,
                extra: vec![]
            }
        );
        assert_eq!(
            run("test --versions 12000,13030 --versions=13050 --devices=4 -- --exact a::b"),
            Cmd::Test {
                versions: vec![12000, 13030, 13050],
                devices: 4,
                extra: args("--exact a::b")
            }
        );
        assert_eq!(run("test-hw"), Cmd::TestHw { filter: vec![] });
        assert_eq!(
            run("test-hw -- allreduce:: --test-threads 1"),
            Cmd::TestHw {
                filter: args("allreduce:: --test-threads 1")
            }
        );
        assert_eq!(run("ptx-check"), Cmd::PtxCheck);
        assert_eq!(run("info"), Cmd::Info { json: false });
        assert_eq!(run("info --json"), Cmd::Info { json: true });
        assert_eq!(run("bundle"), Cmd::Bundle);
        assert_eq!(
            run("chart hw-logs/a.jsonl --out-dir x --date 2026-12-01 --machine=H200"),
            Cmd::Chart {
                results: "hw-logs/a.jsonl".into(),
                out_dir: Some("x".into()),
                date: Some("2026-12-01".into()),
                machine: Some("H200".into()),
            }
        );
        assert_eq!(
            run("modules --check --verbose"),
            Cmd::Modules {
                check: true,
                verbose: true
            }
        );
        assert!(run("modules").runs_in_front());
        assert!(!run("test").runs_in_front());
    }

    #[test]
    fn values_may_be_spelled_after_an_equals_sign_even_with_a_dash() {
        assert_eq!(
            run("chart r --machine=-x"),
            Cmd::Chart {
                results: "r".into(),
                out_dir: None,
                date: None,
                machine: Some("-x".into())
            }
        );
    }
}
