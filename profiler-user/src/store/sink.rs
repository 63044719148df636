//! The agent's own profiles into the embedded store, in process, stored as the HTTP Push
//! endpoint would store their pprof ([`ingest::profiles_from_model`]).
use crate::{
    export::{ExportError, ProfileSink},
    model::Profile,
};

use super::{Store, ingest};

/// `__name__` of the agent's CPU profiles (docs/pyroscope-protocol.md §6.3).
pub const CPU_PROFILE_NAME: &str = "process_cpu";

pub struct StoreSink {
    store: Store,
}

impl StoreSink {
    pub fn new(store: Store) -> Self {
        StoreSink { store }
    }
}

impl ProfileSink for StoreSink {
    fn write(&mut self, profile: &Profile) -> Result<(), ExportError> {
        // Not through a pprof built and read back: that was a third of the exporter thread's
        // CPU on a busy host, for the same stored profiles.
        let profiles =
            ingest::profiles_from_model(profile).map_err(|err| ExportError::Store(err.into()))?;
        self.store
            .ingest(&profiles)
            .map_err(|err| ExportError::Store(err.into()))
    }
}
