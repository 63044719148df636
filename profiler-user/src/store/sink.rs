//! The agent's own profiles into the embedded store, in process, through the same pprof → store
//! conversion as the HTTP Push endpoint.
use crate::{
    export::{ExportError, ProfileSink, pprof::build_pprof},
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
        let pprof = build_pprof(profile);
        let profiles = ingest::profiles_from_pprof(
            &pprof,
            profile.kind.name(),
            &profile.series_labels,
            profile.start_unix_ns,
        )
        .map_err(|err| ExportError::Store(err.into()))?;
        self.store
            .ingest(&profiles)
            .map_err(|err| ExportError::Store(err.into()))
    }
}
