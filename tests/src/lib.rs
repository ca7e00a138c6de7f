//! Workspace integration tests.
