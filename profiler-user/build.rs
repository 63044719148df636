//! Builds the eBPF object and embeds it (see ebpf_build.rs, shared with `cargo xtask build-ebpf`).
include!("ebpf_build.rs");

fn main() {
    let manifest_dir = std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest_dir.parent().unwrap().to_path_buf();
    for dir in [
        "profiler-ebpf/src",
        "profiler-ebpf/Cargo.toml",
        "profiler-common/src",
        // Embedded by include_dir!, which cargo does not track by itself.
        "profiler-user/ui",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }
    println!("cargo:rerun-if-env-changed={EBPF_OBJECT_ENV}");
    let object = match std::env::var_os(EBPF_OBJECT_ENV) {
        Some(path) => std::path::PathBuf::from(path),
        None => match build_ebpf(&workspace) {
            Ok(path) => path,
            Err(err) => {
                println!("cargo:warning={err}");
                std::process::exit(1);
            }
        },
    };
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("profiler.bpf.o");
    std::fs::copy(&object, &out).unwrap_or_else(|err| {
        println!("cargo:warning=cannot copy {}: {err}", object.display());
        std::process::exit(1);
    });
}
