//! The simulated driver itself: its options, and driver selection through the environment.

mod hostile;
