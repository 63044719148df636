//! The messages other programs read and write, and nothing else: pprof's `profile.proto`
//! (`proto`) and Pyroscope's push and query API (`api`). At the bottom of the crate, so the
//! store, the exporters and the server all build on it without importing each other.
pub mod api;
pub mod proto;
