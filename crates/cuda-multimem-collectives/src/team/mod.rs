//! Who is in a team and what it shares, knowing no collective: the ranks and their validated
//! exchanges ([`Ranks`]), the ranks this process drives ([`Local`]: device, call order, the
//! stream discipline), and symmetric memory ([`Sym`]: every rank's part mapped on every peer).

mod local;
pub(crate) mod placement;
mod ranks;
mod sym;

pub(crate) use local::Local;
pub(crate) use ranks::Ranks;
pub(crate) use sym::Sym;
