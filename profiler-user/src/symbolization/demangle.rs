//! Demangling of Rust (legacy and v0) and C++ (Itanium) symbol names.

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

#[cfg(test)]
mod tests {
    use super::demangle;

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
}
