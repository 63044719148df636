//! (stage module; filled in by its own change)
