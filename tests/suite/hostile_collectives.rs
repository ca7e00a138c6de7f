//! Hostile use of the collectives' public API: arguments a careless or malicious caller passes
//! (lengths, offsets, views, roots, shapes, streams, configurations, drop orders) must give an
//! error value naming the argument, never a panic, a hang or memory corruption.
