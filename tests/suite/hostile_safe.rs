//! Hostile use of the safe layer's public API (`cuda-multimem`): VMM, managed memory, multicast
//! objects, logical endpoints, teams, streams, events, graphs and modules with bad arguments
//! must give an error value naming the argument, never a panic, a hang or memory corruption.
