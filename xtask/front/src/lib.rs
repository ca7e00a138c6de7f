//! The front of `cargo xtask`: the command line ([`cli`]: one grammar and parser, shared with the
//! xtask tools), the module-circle check ([`modules`]), and the launch of the tools ([`launch`]).
//!
//! It has no dependencies, so on a fresh clone `cargo xtask --help`, `help <command>`, every
//! argument error and `cargo xtask modules` answer after this crate alone compiles (seconds);
//! the other commands then build the tools (the `xtask` package: bindgen, plotters, the PTX
//! generator, the simulator) once and run them with the same arguments.

pub mod cli;
pub mod launch;
pub mod modules;
