//! The workspace suite: one test binary (small to carry to a GPU machine) whose modules follow
//! the concepts, so that test names carry a stable prefix:
//!
//! - `safe::` — the safe layer and the loader: loader, device, vmm, managed, multicast,
//!   endpoint, team, hostile input;
//! - `sim::` — the simulated driver itself (its options, driver selection);
//! - `collectives::` — the collectives: `allreduce::`, `gather::`, `norm::`, `multimem::`,
//!   `hier::`, `smoke::`, hostile input, failure injection, cudarc operands.
//!
//! `cargo xtask test` runs only `safe::`, `sim::`, `collectives::multimem::` and
//! `collectives::smoke::` at most simulated driver versions (what depends on the version lives
//! there) and the whole suite at the newest.

mod collectives;
mod safe;
mod sim;
