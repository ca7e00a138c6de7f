//! `cargo xtask` (the alias in `.cargo/config.toml` runs this): check the command line, answer
//! `--help` and argument errors at once, run `modules` here, and hand every other command to the
//! xtask tools, building them first where needed.

use xtask_front::cli::{self, Parsed, USAGE_EXIT};
use xtask_front::{launch, modules};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match cli::parse("cargo xtask", &args) {
        Ok(Parsed::Help(h)) => {
            print!("{h}");
            0
        }
        Err(e) => {
            eprintln!("{e}");
            USAGE_EXIT
        }
        Ok(Parsed::Run(cli::Cmd::Modules { check, verbose })) => {
            modules::run(&launch::workspace_root(), check, verbose)
        }
        Ok(Parsed::Run(_)) => launch::run_tools(&args),
    };
    std::process::exit(code);
}
