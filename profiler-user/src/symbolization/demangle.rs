//! Demangling of Rust (legacy and v0) and C++ (Itanium) symbol names, and the cache of names
//! already demangled.
use std::sync::Arc;

use super::StringInterner;
use crate::bounded::TwoGenerationCache;

/// Returns the human-readable form of `raw`, or `None` when it is not a mangled name we know.
pub(super) fn demangle(raw: &str) -> Option<String> {
    // Rust first: legacy Rust names also start with `_ZN` and would demangle as C++ with the
    // hash kept. `{:#}` drops the hash suffix.
    if let Ok(rust) = rustc_demangle::try_demangle(raw) {
        return Some(format!("{rust:#}"));
    }
    if raw.starts_with("_Z") {
        // Symbol-versioned or suffixed names (`.cold`, `.isra.0`) are handled by cpp_demangle.
        let symbol = cpp_demangle::Symbol::new(raw).ok()?;
        return symbol.demangle().ok();
    }
    None
}

/// Function names by their raw symbol name, at most this many: about the functions a busy host
/// samples within a few minutes. An entry costs about 60 bytes besides its two names, which the
/// cached frames of the function share while they are cached (at most about 2 MiB in all with
/// 120-byte names held by nothing else).
pub const MAX_NAMED_FUNCTIONS: usize = 8_192;

/// A function's name as frames show it: the demangled name, and the raw one when they differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct FunctionName {
    pub(super) function: Arc<str>,
    pub(super) system_name: Option<Arc<str>>,
}

/// The names of functions seen, by raw name. Every new address in a function that misses the
/// frame cache is looked up again, and without this its C++ name was demangled again each
/// time: 30 % of the lookups' CPU on a host compiling C++ with a stripped cc1 (f1 in
/// docs/benchmarks.md).
#[derive(Debug)]
pub(super) struct FunctionNames {
    names: TwoGenerationCache<Arc<str>, FunctionName>,
    hits: u64,
}

impl FunctionNames {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            names: TwoGenerationCache::new(capacity),
            hits: 0,
        }
    }

    /// The name of the function whose symbol is `raw`, demangled when `demangle_names` is set.
    pub(super) fn name(
        &mut self,
        strings: &mut StringInterner,
        raw: &str,
        demangle_names: bool,
    ) -> FunctionName {
        if !demangle_names {
            return FunctionName {
                function: strings.intern(raw),
                system_name: None,
            };
        }
        if let Some(name) = self.names.get(raw) {
            self.hits += 1;
            return name;
        }
        let raw_interned = strings.intern(raw);
        let name = match demangle(raw) {
            Some(demangled) if demangled != raw => FunctionName {
                function: strings.intern(&demangled),
                system_name: Some(Arc::clone(&raw_interned)),
            },
            _ => FunctionName {
                function: Arc::clone(&raw_interned),
                system_name: None,
            },
        };
        self.names.insert(raw_interned, name.clone());
        name
    }

    pub(super) fn len(&self) -> usize {
        self.names.len()
    }

    /// Names answered from the cache so far.
    pub(super) fn hits(&self) -> u64 {
        self.hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demangles_rust_and_cpp() {
        assert_eq!(
            demangle("_ZN4core9panicking9panic_fmt17h5f1a6fd39197ad62E").as_deref(),
            Some("core::panicking::panic_fmt")
        );
        assert_eq!(
            demangle("_ZN2ns6Widget4spinEi").as_deref(),
            Some("ns::Widget::spin(int)")
        );
        assert_eq!(demangle("main"), None);
        assert_eq!(demangle("_Z"), None);
    }

    #[test]
    fn a_name_is_demangled_once_and_the_cache_stays_bounded() {
        let mut strings = StringInterner::default();
        let mut names = FunctionNames::new(4);
        let first = names.name(&mut strings, "_ZN2ns6Widget4spinEi", true);
        assert_eq!(&*first.function, "ns::Widget::spin(int)");
        assert_eq!(first.system_name.as_deref(), Some("_ZN2ns6Widget4spinEi"));
        let again = names.name(&mut strings, "_ZN2ns6Widget4spinEi", true);
        assert_eq!(names.hits(), 1);
        assert!(Arc::ptr_eq(&first.function, &again.function));
        let plain = names.name(&mut strings, "main", true);
        assert_eq!((&*plain.function, plain.system_name), ("main", None));
        // Not demangling: the raw name, and nothing cached.
        let raw = names.name(&mut strings, "_ZN2ns6Widget4spinEv", false);
        assert_eq!(
            (&*raw.function, raw.system_name),
            ("_ZN2ns6Widget4spinEv", None)
        );
        for n in 0..100 {
            names.name(&mut strings, &format!("_ZN2ns1f{n}Ev"), true);
            assert!(names.len() <= 4, "{} names", names.len());
        }
    }
}
