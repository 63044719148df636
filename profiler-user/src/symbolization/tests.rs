//! Symbolization tests against ELF files built at test time.
use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
};

use super::{
    StringInterner, Symbolizer, SymbolizerOptions,
    fixtures::{
        FixtureDir, TestResult, find_symbol, line_of, mapped_file, read_build_id, run,
        symbol_named, user_frame,
    },
    own_mappings_of,
};
use crate::model::{FileId, FrameKind, MappedFile, SymbolizedFrame, UnwoundFrame, UnwoundStack};

const C_SOURCE: &str = r#"#include <stdio.h>
volatile int sink;
__attribute__((noinline)) int fixture_alpha(int x) { sink += x; return sink * 2; }
__attribute__((noinline)) int fixture_beta(int x) { sink -= x; return fixture_alpha(x) + 1; }
static inline __attribute__((always_inline)) int fixture_inlined_helper(int x) { sink ^= x * 7; return sink + 3; }
__attribute__((noinline)) int fixture_outer(int x) { int y = fixture_inlined_helper(x); return y * fixture_inlined_helper(y); }
int main(int argc, char **argv) { (void)argv; printf("%d\n", fixture_beta(argc) + fixture_outer(argc)); return 0; }
"#;

/// Options with no system debug dirs, so only the fixtures' debug files count.
fn isolated_options(debug_dir: &Path) -> SymbolizerOptions {
    SymbolizerOptions {
        debug_dirs: vec![debug_dir.to_path_buf()],
        ..SymbolizerOptions::default()
    }
}

fn outer_line(frame: &SymbolizedFrame) -> &crate::model::FrameLine {
    // `lines` is never empty; the last one is the outer function.
    &frame.lines[frame.lines.len() - 1]
}

fn build_c(dir: &FixtureDir, name: &str, args: &[&str]) -> TestResult<std::path::PathBuf> {
    dir.compile("gcc", "fixture.c", C_SOURCE, name, args)
}

#[test]
fn c_functions_resolve_with_source_lines() -> TestResult {
    let dir = FixtureDir::new()?;
    let binary = build_c(&dir, "c_debug", &["-g", "-O0"])?;
    let file = mapped_file(&binary)?;
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));

    for name in ["fixture_alpha", "fixture_beta"] {
        let symbol = symbol_named(&binary, name)?;
        let frame = symbolizer.symbolize(&user_frame(&file, symbol.file_offset));
        assert!(!frame.unsymbolized, "{name}: {frame:?}");
        assert_eq!(frame.kind, FrameKind::Native);
        assert_eq!(
            frame.address,
            super::fixtures::FIXTURE_MAPPING_START + symbol.file_offset
        );
        let line = outer_line(&frame);
        assert_eq!(&*line.function, name);
        assert_eq!(line.system_name, None);
        let source_file = line.file.as_deref().unwrap_or_default();
        assert!(source_file.ends_with("fixture.c"), "{source_file}");
        assert_eq!(line.line, line_of(C_SOURCE, &format!("int {name}("))?);
        let mapping = frame.mapping.as_ref().ok_or("no mapping")?;
        assert_eq!(&*mapping.filename, &*file.path);
        assert_eq!(mapping.build_id, file.build_id);
        assert_eq!(mapping.start, super::fixtures::FIXTURE_MAPPING_START);
    }
    Ok(())
}

#[test]
fn inlined_functions_become_extra_lines_innermost_first() -> TestResult {
    let dir = FixtureDir::new()?;
    let binary = build_c(&dir, "c_inline", &["-g", "-O2"])?;
    let file = mapped_file(&binary)?;
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let outer = symbol_named(&binary, "fixture_outer")?;

    let inlined_frame = (0..outer.size.max(1))
        .map(|delta| symbolizer.symbolize(&user_frame(&file, outer.file_offset + delta)))
        .find(|frame| frame.lines.len() >= 2)
        .ok_or("no address of fixture_outer reports an inlined function")?;
    assert_eq!(&*inlined_frame.lines[0].function, "fixture_inlined_helper");
    assert_eq!(&*outer_line(&inlined_frame).function, "fixture_outer");
    assert_eq!(
        inlined_frame.lines[0].line,
        line_of(C_SOURCE, "int fixture_inlined_helper(")?
    );
    assert_eq!(
        outer_line(&inlined_frame).line,
        line_of(C_SOURCE, "int fixture_outer(")?
    );

    // With inline frames off, the same address has just the outer function.
    let mut flat = Symbolizer::new(SymbolizerOptions {
        inline_frames: false,
        ..isolated_options(dir.path())
    });
    let offset = inlined_frame.address - super::fixtures::FIXTURE_MAPPING_START;
    let flat_frame = flat.symbolize(&user_frame(&file, offset));
    assert_eq!(flat_frame.lines.len(), 1);
    assert_eq!(&*flat_frame.lines[0].function, "fixture_outer");
    Ok(())
}

#[test]
fn stripped_binary_uses_dynsym_or_falls_back_to_offset() -> TestResult {
    let dir = FixtureDir::new()?;
    let original = build_c(&dir, "c_rdynamic", &["-O0", "-rdynamic"])?;
    let alpha = symbol_named(&original, "fixture_alpha")?;
    let binary = dir.copy(&original, "c_rdynamic_stripped")?;
    run(Command::new("strip").arg("--strip-all").arg(&binary))?;
    assert!(
        symbol_named(&binary, "fixture_alpha").is_ok(),
        "dynsym entry kept"
    );

    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let frame = symbolizer.symbolize(&user_frame(&mapped_file(&binary)?, alpha.file_offset));
    assert!(!frame.unsymbolized, "{frame:?}");
    assert_eq!(&*frame.lines[0].function, "fixture_alpha");
    assert_eq!(frame.lines[0].line, 0);

    // Without -rdynamic the function has no name once stripped: its frames are named after
    // the start of the `.eh_frame` FDE that holds them, one name for the whole function.
    let original = build_c(&dir, "c_plain", &["-O0"])?;
    let beta = symbol_named(&original, "fixture_beta")?;
    let alpha = symbol_named(&original, "fixture_alpha")?;
    let binary = dir.copy(&original, "c_plain_stripped")?;
    run(Command::new("strip").arg("--strip-all").arg(&binary))?;
    let file = mapped_file(&binary)?;
    let beta_name = format!("c_plain_stripped!sub_{:x}", beta.address);
    for offset in [beta.file_offset, beta.file_offset + beta.size / 2] {
        let frame = symbolizer.symbolize(&user_frame(&file, offset));
        assert!(frame.unsymbolized, "{frame:?}");
        assert_eq!(&*frame.lines[0].function, beta_name, "offset {offset:#x}");
        assert_eq!(frame.lines[0].file.as_deref(), Some(&*file.path));
        assert!(frame.mapping.is_some());
    }
    // Another function, another name.
    let frame = symbolizer.symbolize(&user_frame(&file, alpha.file_offset + 1));
    assert_eq!(
        &*frame.lines[0].function,
        format!("c_plain_stripped!sub_{:x}", alpha.address)
    );
    // Where no FDE reaches (the ELF header), the offset is all there is.
    let frame = symbolizer.symbolize(&user_frame(&file, 0x10));
    assert!(frame.unsymbolized, "{frame:?}");
    assert_eq!(&*frame.lines[0].function, "c_plain_stripped+0x10");
    let stats = symbolizer.stats();
    assert_eq!((stats.misses, stats.named_by_function_start), (4, 3));
    Ok(())
}

/// The functions of a stripped binary are remembered, and every address sampled in one is
/// named as a lookup of its own names it: checked on a real stripped program (bash, and
/// gcc's `cc1` where installed: 28,000 dynamic symbols among 45,000 functions), address by
/// address across its code, against a symbolizer that looks up every address.
#[test]
fn remembered_functions_name_every_address_as_its_lookup_does() -> TestResult {
    let cc1 = Command::new("gcc")
        .arg("-print-prog-name=cc1")
        .output()
        .ok()
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .filter(|path| path.is_absolute());
    let mut checked_files = 0;
    for binary in std::iter::once(PathBuf::from("/usr/bin/bash")).chain(cc1) {
        let data = std::fs::read(&binary)?;
        let elf = object::File::parse(&*data)?;
        use object::{Object, ObjectSection};
        assert!(
            elf.section_by_name(".symtab").is_none(),
            "{} is not stripped",
            binary.display()
        );
        let text = elf.section_by_name(".text").ok_or("no .text")?;
        let (text_offset, text_size) = text.file_range().ok_or("no .text bytes")?;
        let file = mapped_file(&binary)?;
        let options = SymbolizerOptions {
            debug_dirs: Vec::new(),
            ..SymbolizerOptions::default()
        };
        let mut remembering = Symbolizer::new(options.clone());
        let mut looking_up = Symbolizer::without_remembered_functions(options);
        // Addresses in an order that revisits functions from both ends: a step that is not
        // a multiple of any alignment, over 6,000 addresses, walked forwards then backwards.
        let step = (text_size / 3_001).max(1) | 1;
        let offsets: Vec<u64> = (0..3_000).map(|i| text_offset + i * step + i % 7).collect();
        for &offset in offsets.iter().chain(offsets.iter().rev()) {
            let frame = user_frame(&file, offset);
            let (remembered, looked_up) =
                (remembering.symbolize(&frame), looking_up.symbolize(&frame));
            assert_eq!(
                (&remembered.lines, remembered.unsymbolized),
                (&looked_up.lines, looked_up.unsymbolized),
                "{} at file offset {offset:#x}",
                binary.display()
            );
        }
        // Nearby addresses, so functions are hit again at other addresses than the first.
        for &offset in &offsets {
            for delta in [1, 5, 17] {
                let frame = user_frame(&file, offset + delta);
                let remembered = remembering.symbolize(&frame);
                let looked_up = looking_up.symbolize(&frame);
                assert_eq!(
                    (&remembered.lines, remembered.unsymbolized),
                    (&looked_up.lines, looked_up.unsymbolized),
                    "{} at file offset {:#x}",
                    binary.display(),
                    offset + delta
                );
            }
        }
        let stats = remembering.stats();
        assert!(
            stats.function_range_hits > 500 && stats.function_ranges > 100,
            "{}: the path under test was hardly taken: {stats:?}",
            binary.display()
        );
        let plain = looking_up.stats();
        assert_eq!(plain.function_range_hits, 0);
        assert_eq!(
            (
                stats.misses,
                stats.frames_symbolized,
                stats.named_by_function_start
            ),
            (
                plain.misses,
                plain.frames_symbolized,
                plain.named_by_function_start
            )
        );
        checked_files += 1;
    }
    assert!(checked_files >= 1);
    Ok(())
}

/// A binary with a symbol table, or whose debug information a lookup reads, remembers no
/// function: its names may differ within one FDE.
#[test]
fn functions_are_not_remembered_where_other_symbols_may_name_them() -> TestResult {
    let dir = FixtureDir::new()?;
    let original = build_c(&dir, "c_plain_symtab", &["-O0"])?;
    let beta = symbol_named(&original, "fixture_beta")?;
    // Symbols kept, DWARF gone: the symbol table names every function.
    let binary = dir.copy(&original, "c_plain_no_debug")?;
    run(Command::new("strip").arg("--strip-debug").arg(&binary))?;
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let file = mapped_file(&binary)?;
    // The ELF header: no symbol, no FDE; a padding byte past the last function's FDE.
    for offset in [0x10, beta.file_offset, beta.file_offset + 1] {
        symbolizer.symbolize(&user_frame(&file, offset));
    }
    assert_eq!(symbolizer.stats().function_ranges, 0);
    // Stripped, the same binary remembers the function its addresses fall in.
    let binary = dir.copy(&original, "c_plain_all_stripped")?;
    run(Command::new("strip").arg("--strip-all").arg(&binary))?;
    let file = mapped_file(&binary)?;
    symbolizer.symbolize(&user_frame(&file, beta.file_offset));
    assert_eq!(symbolizer.stats().function_ranges, 1);
    let frame = symbolizer.symbolize(&user_frame(&file, beta.file_offset + 2));
    assert_eq!(
        &*frame.lines[0].function,
        format!("c_plain_all_stripped!sub_{:x}", beta.address)
    );
    assert_eq!(symbolizer.stats().function_range_hits, 1);
    Ok(())
}

/// A function with an exported symbol inside it (a label with a size, as hand-written assembly
/// has) is not remembered, the symbol is: the addresses the symbol covers are named by it, the
/// others after the function's start, whichever is sampled first.
#[test]
fn a_function_that_a_symbol_reaches_into_is_not_remembered() -> TestResult {
    const SOURCE: &str = r#"volatile int sink;
static __attribute__((noinline)) int fixture_host(int x) {
    sink += x;
    __asm__ volatile(".globl fixture_inner\n.type fixture_inner, @function\nfixture_inner:\n"
                     "nop\nnop\nnop\nnop\nnop\nnop\nnop\nnop\n.size fixture_inner, 8\n");
    sink *= 3;
    return sink;
}
__attribute__((noinline)) int fixture_exported_host(int x) {
    sink -= x;
    __asm__ volatile(".globl fixture_exported_inner\n.type fixture_exported_inner, @function\n"
                     "fixture_exported_inner:\nnop\nnop\nnop\nnop\n"
                     ".size fixture_exported_inner, 4\n");
    sink *= 5;
    return sink;
}
int main(int argc, char **argv) { (void)argv; return fixture_host(argc) + fixture_exported_host(argc); }
"#;
    let dir = FixtureDir::new()?;
    let original = dir.compile("gcc", "inner.c", SOURCE, "c_inner", &["-O0", "-rdynamic"])?;
    let host = symbol_named(&original, "fixture_host")?;
    let inner = symbol_named(&original, "fixture_inner")?;
    assert!(host.file_offset < inner.file_offset && inner.size == 8);
    let binary = dir.copy(&original, "c_inner_stripped")?;
    run(Command::new("strip").arg("--strip-all").arg(&binary))?;
    let file = mapped_file(&binary)?;
    let host_name = format!("c_inner_stripped!sub_{:x}", host.address);
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    // Before the label first, then in it, then after it.
    let frame = symbolizer.symbolize(&user_frame(&file, host.file_offset + 1));
    assert_eq!(&*frame.lines[0].function, host_name);
    for offset in [inner.file_offset, inner.file_offset + 7] {
        let frame = symbolizer.symbolize(&user_frame(&file, offset));
        assert_eq!(
            (&*frame.lines[0].function, frame.unsymbolized),
            ("fixture_inner", false),
            "file offset {offset:#x}"
        );
    }
    let frame = symbolizer.symbolize(&user_frame(&file, inner.file_offset + 8));
    assert_eq!(&*frame.lines[0].function, host_name);
    // Only the label is remembered (its second address named without a lookup): not the
    // function around it.
    let stats = symbolizer.stats();
    assert_eq!((stats.function_ranges, stats.function_range_hits), (1, 1));
    let frame = symbolizer.symbolize(&user_frame(&file, host.file_offset + 2));
    assert_eq!(&*frame.lines[0].function, host_name);
    assert_eq!(symbolizer.stats().function_range_hits, 1);

    // An exported function with an exported label inside: neither the function's symbol
    // is remembered (the label starts in it), and the label's addresses keep its name.
    let outer = symbol_named(&original, "fixture_exported_host")?;
    let label = symbol_named(&original, "fixture_exported_inner")?;
    assert!(
        outer.file_offset < label.file_offset && label.file_offset < outer.file_offset + outer.size
    );
    for (offset, name) in [
        (outer.file_offset + 1, "fixture_exported_host"),
        (label.file_offset + 1, "fixture_exported_inner"),
        (outer.file_offset + 2, "fixture_exported_host"),
        (label.file_offset + 2, "fixture_exported_inner"),
    ] {
        let frame = symbolizer.symbolize(&user_frame(&file, offset));
        assert_eq!(&*frame.lines[0].function, name, "file offset {offset:#x}");
    }
    // The label's second address came from its remembered range, never the function's.
    assert_eq!(symbolizer.stats().function_range_hits, 2);
    Ok(())
}

/// A file is symbolized from what it held when first read, even once another file replaced it
/// at its path (a rebuilt binary, an upgraded package): the frames are of the old one.
#[test]
fn a_file_replaced_at_its_path_is_still_read_as_it_was() -> TestResult {
    let dir = FixtureDir::new()?;
    // The same code under other names, at the same offsets, moved over `binary`'s path.
    // Returns where `renamed_beta` is.
    let replace = |binary: &Path, name: &str| -> TestResult<u64> {
        let renamed = dir.compile(
            "gcc",
            "renamed.c",
            &C_SOURCE.replace("fixture_", "renamed_"),
            name,
            &["-g", "-O0"],
        )?;
        let beta = symbol_named(&renamed, "renamed_beta")?;
        std::fs::rename(&renamed, binary)?;
        Ok(beta.file_offset)
    };
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let binary = build_c(&dir, "c_replaced", &["-g", "-O0"])?;
    let file = mapped_file(&binary)?;
    let alpha = symbol_named(&binary, "fixture_alpha")?;
    let beta = symbol_named(&binary, "fixture_beta")?;
    let frame = symbolizer.symbolize(&user_frame(&file, alpha.file_offset));
    assert_eq!(&*frame.lines[0].function, "fixture_alpha");
    // Read already, then replaced; and replaced before its first lookup (read through the
    // agent's descriptor of the old file).
    let renamed_beta = replace(&binary, "c_renamed")?;
    let early_binary = build_c(&dir, "c_replaced_early", &["-g", "-O0"])?;
    let early = mapped_file(&early_binary)?;
    replace(&early_binary, "c_renamed_early")?;
    // Were the new file read, the name would be `renamed_beta`, at the same offset.
    assert_eq!(renamed_beta, beta.file_offset);
    for file in [&file, &early] {
        let frame = symbolizer.symbolize(&user_frame(file, beta.file_offset));
        assert!(!frame.unsymbolized, "{frame:?}");
        assert_eq!(&*outer_line(&frame).function, "fixture_beta");
    }
    Ok(())
}

/// Splits `binary`'s debug info into `debug_file` and links it with `.gnu_debuglink`.
fn split_debug_with_link(binary: &Path, debug_file: &Path) -> TestResult {
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(binary)
        .arg(debug_file))?;
    run(Command::new("strip")
        .args(["--strip-debug", "--strip-unneeded"])
        .arg(binary))?;
    // objcopy looks the debug file up by the path given and records its base name.
    run(Command::new("objcopy")
        .arg(format!("--add-gnu-debuglink={}", debug_file.display()))
        .arg(binary))?;
    Ok(())
}

fn assert_resolves_c_functions(
    binary: &Path,
    offsets_from: &Path,
    options: SymbolizerOptions,
) -> TestResult {
    assert!(
        symbol_named(binary, "fixture_beta").is_err(),
        "the binary itself must not have the symbol"
    );
    let file = mapped_file(binary)?;
    let mut symbolizer = Symbolizer::new(options);
    for name in ["fixture_alpha", "fixture_beta"] {
        let symbol = symbol_named(offsets_from, name)?;
        let frame = symbolizer.symbolize(&user_frame(&file, symbol.file_offset));
        assert!(!frame.unsymbolized, "{name}: {frame:?}");
        assert_eq!(&*outer_line(&frame).function, name);
        assert_eq!(
            outer_line(&frame).line,
            line_of(C_SOURCE, &format!("int {name}("))?
        );
    }
    assert_eq!(symbolizer.stats().errors, 0);
    Ok(())
}

#[test]
fn debug_link_next_to_binary_resolves() -> TestResult {
    let dir = FixtureDir::new()?;
    let original = build_c(&dir, "c_original", &["-g", "-O0"])?;
    let binary = dir.copy(&original, "c_linked")?;
    split_debug_with_link(&binary, &dir.path().join("c_linked.debug"))?;
    let no_debug_dirs = dir.path().join("no-such-debug-dir");
    assert_resolves_c_functions(&binary, &original, isolated_options(&no_debug_dirs))
}

#[test]
fn debug_link_in_dot_debug_dir_resolves() -> TestResult {
    let dir = FixtureDir::new()?;
    let original = build_c(&dir, "c_original", &["-g", "-O0"])?;
    let binary = dir.copy(&original, "c_linked")?;
    let staging = dir.path().join("c_linked.debug");
    split_debug_with_link(&binary, &staging)?;
    std::fs::create_dir(dir.path().join(".debug"))?;
    std::fs::rename(&staging, dir.path().join(".debug").join("c_linked.debug"))?;
    let no_debug_dirs = dir.path().join("no-such-debug-dir");
    assert_resolves_c_functions(&binary, &original, isolated_options(&no_debug_dirs))
}

/// Built with debug info and a build id, stripped, its debug file (compressed when asked) under
/// `dir`'s `debug-root` by build id: (the original, the stripped binary, the debug file).
fn split_by_build_id(
    dir: &FixtureDir,
    source: &str,
    compress: bool,
) -> TestResult<(PathBuf, PathBuf, PathBuf)> {
    let original = dir.compile(
        "gcc",
        "fixture.c",
        source,
        "c_original",
        &["-g", "-O0", "-Wl,--build-id=sha1"],
    )?;
    let build_id = read_build_id(&original)?.ok_or("gcc produced no build id")?;
    let (head, tail) = build_id.split_at(2);
    let debug_path = dir
        .path()
        .join("debug-root")
        .join(".build-id")
        .join(head)
        .join(format!("{tail}.debug"));
    std::fs::create_dir_all(debug_path.parent().ok_or("no parent")?)?;
    let mut objcopy = Command::new("objcopy");
    objcopy.arg("--only-keep-debug");
    if compress {
        objcopy.arg("--compress-debug-sections=zlib");
    }
    run(objcopy.arg(&original).arg(&debug_path))?;
    let binary = dir.copy(&original, "c_stripped")?;
    run(Command::new("strip").arg("--strip-all").arg(&binary))?;
    assert_eq!(read_build_id(&binary)?.as_deref(), Some(build_id.as_str()));
    Ok((original, binary, debug_path))
}

/// The fixture's functions and 3,000 more: debug info of a few hundred KiB, as a library has.
fn large_c_source() -> String {
    let mut source = C_SOURCE.to_owned();
    for i in 0..3000 {
        source.push_str(&format!(
            "__attribute__((noinline)) int filler_{i}(int x) {{ return x * {i} + sink; }}\n"
        ));
    }
    source
}

#[test]
fn build_id_debug_file_resolves_fully_stripped_binary() -> TestResult {
    let dir = FixtureDir::new()?;
    let (original, binary, _) = split_by_build_id(&dir, C_SOURCE, false)?;
    let debug_root = dir.path().join("debug-root");

    assert_resolves_c_functions(&binary, &original, isolated_options(&debug_root))?;

    // Without the debug dir the same frames stay unsymbolized.
    let file = mapped_file(&binary)?;
    let mut symbolizer = Symbolizer::new(isolated_options(&dir.path().join("elsewhere")));
    let beta = symbol_named(&original, "fixture_beta")?;
    assert!(
        symbolizer
            .symbolize(&user_frame(&file, beta.file_offset))
            .unsymbolized
    );
    Ok(())
}

#[test]
fn a_separate_debug_files_dwarf_counts_against_the_bound_as_decompressed() -> TestResult {
    let dir = FixtureDir::new()?;
    // Compressed, as distributions ship their debug files.
    let (original, binary, debug_path) = split_by_build_id(&dir, &large_c_source(), true)?;
    let debug_root = dir.path().join("debug-root");
    // The sizes of its sections, compressed and (in a decompressed copy) not.
    let decompressed_copy = dir.path().join("decompressed.debug");
    run(Command::new("objcopy")
        .arg("--decompress-debug-sections")
        .arg(&debug_path)
        .arg(&decompressed_copy))?;
    let dwarf_bytes = |path: &Path| -> TestResult<u64> {
        use object::{Object, ObjectSection};
        let data = std::fs::read(path)?;
        let elf = object::File::parse(&*data)?;
        Ok(
            [".debug_info", ".debug_line", ".debug_str", ".debug_abbrev"]
                .iter()
                .filter_map(|name| elf.section_by_name(name))
                .map(|section| section.size())
                .sum(),
        )
    };
    let (compressed, decompressed) = (dwarf_bytes(&debug_path)?, dwarf_bytes(&decompressed_copy)?);
    assert!(decompressed > compressed, "{decompressed} <= {compressed}");

    let file = mapped_file(&binary)?;
    let mut symbolizer = Symbolizer::new(isolated_options(&debug_root));
    let beta = symbol_named(&original, "fixture_beta")?;
    let frame = symbolizer.symbolize(&user_frame(&file, beta.file_offset));
    assert_eq!(&*outer_line(&frame).function, "fixture_beta");
    // The DWARF blazesym decompresses is held with the resolver: the bound counts all of it.
    let counted = symbolizer.stats().resolver_bytes;
    assert!(
        counted >= decompressed,
        "{counted} bytes counted, {decompressed} of DWARF decompressed"
    );
    Ok(())
}

const CPP_SOURCE: &str = r#"#include <cstdio>
namespace ns {
struct Widget {
    int state;
    __attribute__((noinline)) int spin(int n);
};
int Widget::spin(int n) { state += n; return state; }
}
template <typename T> __attribute__((noinline)) T twice(T v) { return v + v; }
int main(int argc, char **) {
    ns::Widget w{argc};
    std::printf("%d %ld\n", w.spin(argc), twice<long>(argc));
    return 0;
}
"#;

#[test]
fn cpp_names_are_demangled() -> TestResult {
    let dir = FixtureDir::new()?;
    let binary = dir.compile("g++", "fixture.cpp", CPP_SOURCE, "cpp_app", &["-g", "-O0"])?;
    let file = mapped_file(&binary)?;
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));

    for (raw, expected) in [
        ("_ZN2ns6Widget4spinEi", "ns::Widget::spin(int)"),
        ("_Z5twiceIlET_S0_", "long twice<long>(long)"),
    ] {
        let symbol = symbol_named(&binary, raw)?;
        let frame = symbolizer.symbolize(&user_frame(&file, symbol.file_offset));
        let line = outer_line(&frame);
        assert_eq!(&*line.function, expected);
        assert_eq!(line.system_name.as_deref(), Some(raw));
        assert!(
            line.file
                .as_deref()
                .unwrap_or_default()
                .ends_with("fixture.cpp")
        );
    }

    // Demangling can be turned off.
    let mut raw_symbolizer = Symbolizer::new(SymbolizerOptions {
        demangle: false,
        ..isolated_options(dir.path())
    });
    let symbol = symbol_named(&binary, "_ZN2ns6Widget4spinEi")?;
    let frame = raw_symbolizer.symbolize(&user_frame(&file, symbol.file_offset));
    assert_eq!(&*outer_line(&frame).function, "_ZN2ns6Widget4spinEi");
    assert_eq!(outer_line(&frame).system_name, None);
    Ok(())
}

const RUST_SOURCE: &str = r#"
mod engine {
    #[inline(never)]
    pub fn crunch(x: u64) -> u64 {
        x.wrapping_mul(31).rotate_left(7)
    }
}
fn main() {
    let n = std::env::args().count() as u64;
    println!("{}", engine::crunch(std::hint::black_box(n)));
}
"#;

#[test]
fn rust_names_are_demangled() -> TestResult {
    let dir = FixtureDir::new()?;
    let binary = dir.compile(
        "rustc",
        "fixture.rs",
        RUST_SOURCE,
        "rust_app",
        &[
            "-C",
            "opt-level=0",
            "-g",
            "--crate-name",
            "fixture_app",
            "--edition",
            "2021",
        ],
    )?;
    let symbol = find_symbol(&binary, |name| {
        rustc_demangle::try_demangle(name)
            .is_ok_and(|demangled| format!("{demangled:#}") == "fixture_app::engine::crunch")
    })?;
    let file = mapped_file(&binary)?;
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let frame = symbolizer.symbolize(&user_frame(&file, symbol.file_offset));
    let line = outer_line(&frame);
    assert_eq!(&*line.function, "fixture_app::engine::crunch");
    assert_eq!(line.system_name.as_deref(), Some(symbol.raw_name.as_str()));
    assert!(
        line.file
            .as_deref()
            .unwrap_or_default()
            .ends_with("fixture.rs")
    );
    assert_eq!(line.line, line_of(RUST_SOURCE, "pub fn crunch")?);
    Ok(())
}

/// A text symbol of the running kernel whose address no other kallsyms entry shares.
fn unique_kernel_text_symbol() -> TestResult<(u64, String)> {
    let kallsyms = std::fs::read_to_string("/proc/kallsyms")?;
    let mut entries: Vec<(u64, char, &str, bool)> = Vec::new();
    for line in kallsyms.lines() {
        let mut tokens = line.split_ascii_whitespace();
        let (Some(addr), Some(kind), Some(name)) = (tokens.next(), tokens.next(), tokens.next())
        else {
            continue;
        };
        let addr = u64::from_str_radix(addr, 16)?;
        let kind = kind.chars().next().unwrap_or('?');
        entries.push((addr, kind, name, tokens.next().is_some()));
    }
    let mut address_counts = std::collections::HashMap::new();
    for (addr, ..) in &entries {
        *address_counts.entry(*addr).or_insert(0u32) += 1;
    }
    let is_candidate = |(addr, kind, _, in_module): &&(u64, char, &str, bool)| {
        *addr != 0 && *kind == 'T' && !in_module && address_counts.get(addr) == Some(&1)
    };
    let preferred = entries
        .iter()
        .filter(is_candidate)
        .find(|(_, _, name, _)| *name == "do_sys_openat2");
    let chosen = preferred
        .or_else(|| entries.iter().find(is_candidate))
        .ok_or("no usable 'T' symbol in /proc/kallsyms (are addresses hidden?)")?;
    Ok((chosen.0, chosen.2.to_owned()))
}

#[test]
fn kernel_addresses_resolve_through_kallsyms() -> TestResult {
    let (addr, name) = unique_kernel_text_symbol()?;
    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    for probe in [addr, addr + 1] {
        let frame = symbolizer.symbolize(&UnwoundFrame::Kernel(probe));
        assert_eq!(frame.kind, FrameKind::Kernel);
        assert_eq!(frame.address, probe);
        assert!(!frame.unsymbolized, "{frame:?}");
        assert_eq!(&*frame.lines[0].function, name);
        assert_eq!(frame.lines[0].file.as_deref(), Some("[kernel.kallsyms]"));
        assert!(frame.mapping.is_none());
    }

    let unknown = symbolizer.symbolize(&UnwoundFrame::Kernel(0x1000));
    assert!(unknown.unsymbolized);
    assert_eq!(&*unknown.lines[0].function, "[unknown kernel]");
    Ok(())
}

/// The distinct nonzero symbol addresses of the running kernel, ascending; only those of
/// text symbols (`T`, `t`) when `text_only`.
fn kallsyms_starts(text_only: bool) -> TestResult<Vec<u64>> {
    let kallsyms = std::fs::read_to_string("/proc/kallsyms")?;
    let mut starts: Vec<u64> = kallsyms
        .lines()
        .filter_map(|line| {
            let mut tokens = line.split_ascii_whitespace();
            let (addr, kind) = (tokens.next()?, tokens.next()?);
            let wanted = !text_only || matches!(kind, "T" | "t");
            wanted.then(|| u64::from_str_radix(addr, 16).ok())?
        })
        .filter(|&addr| addr != 0)
        .collect();
    starts.sort_unstable();
    starts.dedup();
    Ok(starts)
}

/// A stack's kernel frames missing from the cache are looked up in one call: the frames
/// must be those of one lookup at a time, in the stack's order, a repeated address one frame.
#[test]
fn kernel_frames_looked_up_together_are_those_looked_up_alone() -> TestResult {
    let text = kallsyms_starts(true)?;
    if text.len() < 100 {
        return Err("kallsyms has too few text symbols (are addresses hidden?)".into());
    }
    // Unsorted, a repeat, an address inside a function, one no symbol covers.
    let step = text.len() / 7;
    let addrs = [
        text[5 * step] + 3,
        text[step],
        0x1000,
        text[3 * step],
        text[step],
        text[6 * step] + 1,
        text[2 * step],
    ];
    let stack: Vec<UnwoundFrame> = addrs
        .iter()
        .map(|&addr| UnwoundFrame::Kernel(addr))
        .collect();

    let mut together = Symbolizer::new(SymbolizerOptions::default());
    let frames = together.symbolize_frames(&stack);
    let mut alone = Symbolizer::new(SymbolizerOptions::default());
    assert_eq!(frames.len(), addrs.len());
    for (frame, &addr) in frames.iter().zip(&addrs) {
        let expected = alone.symbolize(&UnwoundFrame::Kernel(addr));
        assert_eq!(frame.address, addr);
        assert_eq!(frame.unsymbolized, expected.unsymbolized, "{addr:#x}");
        assert_eq!(frame.lines, expected.lines, "{addr:#x}");
    }
    assert!(frames[1].lines[0].file.is_some(), "{:?}", frames[1]);
    assert!(frames[2].unsymbolized);
    assert!(
        Arc::ptr_eq(&frames[1], &frames[4]),
        "a repeated address is one frame"
    );
    assert_eq!(together.stats().misses, 1, "only the uncovered address");
    // Now all cached: the same frames again.
    let again = together.symbolize_frames(&stack);
    assert!(frames.iter().zip(&again).all(|(a, b)| Arc::ptr_eq(a, b)));
    Ok(())
}

/// Kernel addresses in a function looked up before are named from the remembered function,
/// the name blazesym gives them; an address at or past the next symbol's start is not.
#[test]
fn kernel_functions_are_remembered_within_their_symbols_bounds() -> TestResult {
    let starts = kallsyms_starts(false)?;
    // Text symbols at least 16 bytes long, with a long one after them.
    let (function, next) = kallsyms_starts(true)?
        .into_iter()
        .filter_map(|addr| {
            let idx = starts.partition_point(|&start| start <= addr);
            let next = *starts.get(idx)?;
            let after = *starts.get(idx + 1)?;
            (next - addr >= 16 && after - next >= 16).then_some((addr, next))
        })
        .nth(100)
        .ok_or("no two long text symbols in /proc/kallsyms (are addresses hidden?)")?;

    let mut symbolizer = Symbolizer::new(SymbolizerOptions::default());
    let probes = [
        function + 1,
        function + 9,
        next - 1,
        next,
        next + 3,
        function,
    ];
    let frames: Vec<_> = probes
        .iter()
        .map(|&addr| symbolizer.symbolize(&UnwoundFrame::Kernel(addr)))
        .collect();
    let stats = symbolizer.stats();
    // function + 9 and next - 1 from the first lookup's function; next + 3 needs its own
    // (its function was first seen at its start, which is not remembered), and is remembered;
    // function itself, at its start, is looked up again.
    assert_eq!(stats.kernel_function_hits, 2, "{stats:?}");
    assert_eq!(stats.kernel_functions, 2, "{stats:?}");
    let mut fresh = Symbolizer::new(SymbolizerOptions::default());
    for (frame, &addr) in frames.iter().zip(&probes) {
        let expected = fresh.symbolize(&UnwoundFrame::Kernel(addr));
        assert_eq!(frame.address, addr);
        assert!(!frame.unsymbolized, "{frame:?}");
        assert_eq!(frame.lines, expected.lines, "{addr:#x}");
    }
    assert_eq!(frames[0].lines, frames[2].lines);
    assert_ne!(
        frames[2].lines, frames[3].lines,
        "the next symbol is another function"
    );
    Ok(())
}

#[test]
fn missing_kallsyms_leaves_kernel_frames_unsymbolized() {
    let mut symbolizer = Symbolizer::new(SymbolizerOptions {
        kallsyms_path: "/nonexistent/kallsyms".into(),
        ..SymbolizerOptions::default()
    });
    let frame = symbolizer.symbolize(&UnwoundFrame::Kernel(0xffff_ffff_8100_0000));
    assert!(frame.unsymbolized);
    assert_eq!(&*frame.lines[0].function, "[unknown kernel]");
    assert_eq!(symbolizer.stats().misses, 1);
}

#[test]
fn repeated_keys_share_frames_and_stats_count() -> TestResult {
    let dir = FixtureDir::new()?;
    let binary = build_c(&dir, "c_cache", &["-g", "-O0"])?;
    let file = mapped_file(&binary)?;
    let alpha = symbol_named(&binary, "fixture_alpha")?;
    let beta = symbol_named(&binary, "fixture_beta")?;
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));

    let first = symbolizer.symbolize(&user_frame(&file, alpha.file_offset));
    let again = symbolizer.symbolize(&user_frame(&file, alpha.file_offset));
    assert!(Arc::ptr_eq(&first, &again));
    let other = symbolizer.symbolize(&user_frame(&file, beta.file_offset));
    assert!(!Arc::ptr_eq(&first, &other));
    // Same file and mapping start: one shared MappingInfo.
    match (&first.mapping, &other.mapping) {
        (Some(a), Some(b)) => assert!(Arc::ptr_eq(a, b)),
        _ => return Err("user frames must have a mapping".into()),
    }
    let vdso = symbolizer.symbolize(&UnwoundFrame::UserUnmapped {
        addr: 0x7fff_0000_1000,
        name: Some(Arc::from("[vdso]")),
    });
    assert_eq!(&*vdso.lines[0].function, "[vdso]");
    assert!(vdso.unsymbolized && vdso.mapping.is_none());
    let anonymous = symbolizer.symbolize(&UnwoundFrame::UserUnmapped {
        addr: 0x1234,
        name: None,
    });
    assert_eq!(&*anonymous.lines[0].function, "[unknown]");
    let jit = symbolizer.symbolize(&UnwoundFrame::UserUnmapped {
        addr: 0x7f00_1234_5678,
        name: Some(Arc::from("[anon]")),
    });
    assert_eq!(&*jit.lines[0].function, "[anonymous code]");

    let stats = symbolizer.stats();
    assert_eq!(stats.frames_symbolized, 2);
    assert_eq!(stats.cache_hits, 1);
    // Two lookups in the file (the repeat was a cache hit; the unmapped frames need none).
    assert_eq!(stats.native_lookups, 2);
    assert!(stats.native_lookup_time > std::time::Duration::ZERO);
    assert!(stats.native_lookup_cpu_time > std::time::Duration::ZERO);
    // The first read the file's symbols; its time is part of the lookups'.
    assert_eq!(stats.file_loads, 1);
    assert!(stats.file_load_time > std::time::Duration::ZERO);
    assert!(stats.file_load_time <= stats.native_lookup_time);
    assert_eq!(stats.cache_entries, 2);
    assert_eq!(stats.misses, 3);
    assert_eq!(stats.errors, 0);

    // A stack keeps its length and order.
    let stack = UnwoundStack {
        frames: vec![
            user_frame(&file, alpha.file_offset),
            UnwoundFrame::UserUnmapped {
                addr: 1,
                name: None,
            },
            user_frame(&file, beta.file_offset),
        ],
        truncated: false,
    };
    let symbolized = symbolizer.symbolize_stack(&stack);
    assert_eq!(symbolized.len(), 3);
    assert!(Arc::ptr_eq(&symbolized[0], &first));
    assert!(Arc::ptr_eq(&symbolized[2], &other));
    Ok(())
}

/// The frame cache stays within its bound: a frame used within the last generation survives a
/// turn, one unused for a whole generation is dropped and symbolized again (same frame, new
/// `Arc`) when it comes back.
#[test]
fn frame_cache_keeps_recent_frames_within_its_bound() -> TestResult {
    let dir = FixtureDir::new()?;
    let binary = build_c(&dir, "c_small_cache", &["-O0"])?;
    let file = mapped_file(&binary)?;
    let alpha = symbol_named(&binary, "fixture_alpha")?;
    let mut symbolizer = Symbolizer::new(SymbolizerOptions {
        max_cached_frames: 4,
        ..isolated_options(dir.path())
    });
    let at = |delta: u64| user_frame(&file, alpha.file_offset + delta);
    let hot = symbolizer.symbolize(&at(0));
    let cold = symbolizer.symbolize(&at(1));
    for delta in 2..40 {
        symbolizer.symbolize(&at(delta));
        // Used all along: never dropped.
        assert!(Arc::ptr_eq(&symbolizer.symbolize(&at(0)), &hot));
        let stats = symbolizer.stats();
        assert!(stats.cache_entries <= 4, "{} entries", stats.cache_entries);
    }
    let stats = symbolizer.stats();
    assert!(stats.cache_evicted >= 30, "{stats:?}");
    let again = symbolizer.symbolize(&at(1));
    assert!(!Arc::ptr_eq(&cold, &again), "the unused frame was dropped");
    assert_eq!(cold, again, "and symbolized again the same");
    Ok(())
}

/// The parsed symbol tables of files are bounded by an estimate of their size: a file not
/// used lately gives its tables up, and is read again when a frame needs it.
#[test]
fn parsed_files_are_bounded_least_recently_used_first() -> TestResult {
    let dir = FixtureDir::new()?;
    let (a, b) = (
        build_c(&dir, "c_bound_a", &["-O0"])?,
        build_c(&dir, "c_bound_b", &["-O0"])?,
    );
    let (file_a, file_b) = (mapped_file(&a)?, mapped_file(&b)?);
    let (alpha_a, alpha_b) = (
        symbol_named(&a, "fixture_alpha")?,
        symbol_named(&b, "fixture_alpha")?,
    );
    // Room for one file's tables only.
    let mut symbolizer = Symbolizer::new(SymbolizerOptions {
        max_resolver_bytes: 1,
        ..isolated_options(dir.path())
    });
    let first = symbolizer.symbolize(&user_frame(&file_a, alpha_a.file_offset));
    assert_eq!(symbolizer.stats().resolvers, 1);
    symbolizer.symbolize(&user_frame(&file_b, alpha_b.file_offset));
    let stats = symbolizer.stats();
    assert_eq!(
        (stats.resolvers, stats.resolvers_dropped),
        (1, 1),
        "a's tables dropped for b's"
    );
    assert!(stats.resolver_bytes > 0);
    // a again, at an address not cached: read again, same symbol.
    let again = symbolizer.symbolize(&user_frame(&file_a, alpha_a.file_offset + 1));
    assert_eq!(outer_line(&again).function, outer_line(&first).function);
    assert_eq!(symbolizer.stats().resolvers_dropped, 2);
    Ok(())
}

/// A file's parsed tables go once it has not been looked up for `resolver_idle`, however much
/// room is left; one in use stays, and the dropped one is read again when next needed.
#[test]
fn parsed_files_unused_for_a_while_are_dropped() -> TestResult {
    let dir = FixtureDir::new()?;
    let (a, b) = (
        build_c(&dir, "c_idle_a", &["-O0"])?,
        build_c(&dir, "c_idle_b", &["-O0"])?,
    );
    let (file_a, file_b) = (mapped_file(&a)?, mapped_file(&b)?);
    let (alpha_a, alpha_b) = (
        symbol_named(&a, "fixture_alpha")?,
        symbol_named(&b, "fixture_alpha")?,
    );
    let idle = std::time::Duration::from_millis(300);
    let mut symbolizer = Symbolizer::new(SymbolizerOptions {
        resolver_idle: idle,
        ..isolated_options(dir.path())
    });
    let first = symbolizer.symbolize(&user_frame(&file_a, alpha_a.file_offset));
    std::thread::sleep(idle);
    symbolizer.symbolize(&user_frame(&file_b, alpha_b.file_offset));
    assert_eq!(symbolizer.stats().resolvers, 2, "both within the room left");
    symbolizer.drop_idle_resolvers();
    let stats = symbolizer.stats();
    assert_eq!(
        (stats.resolvers, stats.resolvers_dropped),
        (1, 1),
        "a's tables dropped, b's (just used) kept"
    );
    let b_bytes = stats.resolver_bytes;
    assert!(b_bytes > 0);
    let again = symbolizer.symbolize(&user_frame(&file_a, alpha_a.file_offset + 1));
    assert_eq!(outer_line(&again).function, outer_line(&first).function);
    let stats = symbolizer.stats();
    assert_eq!(stats.resolvers, 2, "a read again");
    assert!(stats.resolver_bytes > b_bytes);
    Ok(())
}

#[test]
fn unreadable_and_malformed_files_stay_unsymbolized() -> TestResult {
    let dir = FixtureDir::new()?;
    let garbage = dir.path().join("libgarbage.so");
    std::fs::write(&garbage, b"\x7fELF this is not really an ELF file")?;
    let malformed = mapped_file(&garbage)?;
    let missing = Arc::new(MappedFile {
        id: FileId { dev: 0, ino: 1 },
        path: Arc::from("/gone/libmissing.so"),
        open_path: dir.path().join("libmissing.so"),
        build_id: None,
        handle: None,
    });
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    for (file, basename) in [(&malformed, "libgarbage.so"), (&missing, "libmissing.so")] {
        for offset in [0x10_u64, 0x20] {
            let frame = symbolizer.symbolize(&user_frame(file, offset));
            assert!(frame.unsymbolized);
            assert_eq!(
                &*frame.lines[0].function,
                format!("{basename}+0x{offset:x}")
            );
        }
    }
    let stats = symbolizer.stats();
    assert_eq!(stats.misses, 4);
    assert!(stats.errors >= 2, "{stats:?}");
    Ok(())
}

/// A file as blazesym maps it (shared, read-only), on the build's file system (page-out
/// reclaims file pages, not tmpfs ones), every page touched.
fn touched_shared_mapping(path: &Path, bytes: &[u8]) -> memmap2::Mmap {
    std::fs::write(path, bytes).expect("write");
    let file = std::fs::File::open(path).expect("open");
    // Written back, so its pages are clean and can be reclaimed.
    file.sync_all().expect("sync");
    // SAFETY: a test file nobody changes while it is mapped.
    let mapped = unsafe { memmap2::Mmap::map(&file) }.expect("map");
    let touched: u64 = mapped.iter().step_by(4096).map(|&b| u64::from(b)).sum();
    assert!(touched > 0);
    mapped
}

/// Releases cover every mapping of the process: tests that measure them take turns.
static PAGE_RELEASES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn page_release_turn() -> std::sync::MutexGuard<'static, ()> {
    PAGE_RELEASES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Bytes of `[start, start + length)` in the page cache (for a file mapping: whether mapped
/// or not).
fn cached_bytes(start: u64, length: u64) -> u64 {
    let mut cached = vec![0u8; length.div_ceil(4096) as usize];
    // SAFETY: one byte for each page of a range this test keeps mapped.
    let status = unsafe {
        libc::mincore(
            start as *mut libc::c_void,
            length as usize,
            cached.as_mut_ptr(),
        )
    };
    assert_eq!(status, 0, "mincore");
    cached.iter().filter(|page| **page & 1 != 0).count() as u64 * 4096
}

/// At least 90 % of `start..end` of this process's mappings is in the page cache.
fn assert_still_cached(start: u64, end: u64) {
    let cached = cached_bytes(start, end - start);
    assert!(
        cached >= (end - start) * 9 / 10,
        "{cached} of {} bytes still cached",
        end - start
    );
}

/// A copy of the C library named `name` in `dir`, which only the calling test maps; written
/// back, so its pages are clean.
fn libc_copy(dir: &Path, name: &str) -> TestResult<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let libc_path = maps
        .lines()
        .filter_map(crate::process::maps::parse_maps_line)
        .find(|entry| entry.pathname.contains("/libc.so"))
        .map(|entry| entry.pathname.to_owned())
        .ok_or("no libc mapped")?;
    let library = dir.join(name);
    std::fs::copy(&libc_path, &library)?;
    std::fs::File::open(&library)?.sync_all()?;
    Ok(library)
}

/// A directory on the build's file system (page-out reclaims file pages there, not on tmpfs).
fn build_fs_dir() -> TestResult<tempfile::TempDir> {
    let build_dir = std::env::current_exe()?;
    Ok(tempfile::tempdir_in(
        build_dir.parent().ok_or("no deps dir")?,
    )?)
}

/// The symbolizer's one mapping of `file`, its pages all read in, as (start, end).
fn own_mapping_all_read(symbolizer: &Symbolizer, file: &MappedFile) -> TestResult<(u64, u64)> {
    let ranges = own_mappings_of(&[file.id]).ok_or("maps")?;
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let (_, start, end) = ranges[0];
    assert_eq!(symbolizer.files[&file.id].own_mappings, [(file.id, start)]);
    // SAFETY: the symbolizer keeps the file mapped read-only until it is dropped.
    let mapped = unsafe { std::slice::from_raw_parts(start as *const u8, (end - start) as usize) };
    let touched: u64 = mapped.iter().step_by(4096).map(|&b| u64::from(b)).sum();
    assert!(touched > 0);
    Ok((start, end))
}

#[test]
fn the_symbolizers_own_mapping_is_given_back_and_its_pages_stay_cached() -> TestResult {
    use crate::test_support::resident_bytes_of_mapping;
    let _turn = page_release_turn();
    let dir = build_fs_dir()?;
    let library = libc_copy(dir.path(), "libc-copy.so")?;
    let file = mapped_file(&library)?;
    let malloc = symbol_named(&library, "malloc")?;

    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let frame = symbolizer.symbolize(&user_frame(&file, malloc.file_offset));
    assert!(!frame.unsymbolized, "{frame:?}");
    // blazesym's mapping of the file, told apart as it was made (the only one of the copy),
    // every page read, as lookups all over the tables do over time.
    let (start, end) = own_mapping_all_read(&symbolizer, &file)?;
    let resident_before = resident_bytes_of_mapping(start as *const u8);
    assert!(
        resident_before >= (end - start) * 9 / 10,
        "{resident_before}"
    );

    let released = symbolizer.release_file_pages();
    assert!(released >= end - start, "{released}");
    assert_eq!(symbolizer.stats().own_mapping_releases, 1);
    let resident_after = resident_bytes_of_mapping(start as *const u8);
    assert!(
        resident_after < resident_before / 4,
        "{resident_after} of {resident_before} bytes still resident"
    );
    // Out of the RSS, not out of the page cache: the next lookups read no disk (page-out
    // would have dropped these pages, which nothing else maps).
    assert_still_cached(start, end);
    let free = symbol_named(&library, "free")?;
    let frame = symbolizer.symbolize(&user_frame(&file, free.file_offset));
    assert!(!frame.unsymbolized, "{frame:?}");

    // A dropped resolver's mapping is no longer the symbolizer's to give back.
    symbolizer.options.max_resolver_bytes = 0;
    symbolizer.bound_resolvers(FileId { dev: 0, ino: 0 });
    assert!(symbolizer.files[&file.id].own_mappings.is_empty());
    assert!(own_mappings_of(&[file.id]).ok_or("maps")?.is_empty());
    Ok(())
}

#[test]
fn files_looked_up_since_the_last_release_keep_their_pages_within_the_band() -> TestResult {
    use crate::test_support::resident_bytes_of_mapping;
    let _turn = page_release_turn();
    let dir = build_fs_dir()?;
    let idle_library = libc_copy(dir.path(), "libc-idle.so")?;
    let busy_library = libc_copy(dir.path(), "libc-busy.so")?;
    let (idle, busy) = (mapped_file(&idle_library)?, mapped_file(&busy_library)?);
    let (malloc, free) = (
        symbol_named(&idle_library, "malloc")?,
        symbol_named(&idle_library, "free")?,
    );
    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    for file in [&idle, &busy] {
        let frame = symbolizer.symbolize(&user_frame(file, malloc.file_offset));
        assert!(!frame.unsymbolized, "{frame:?}");
    }
    let since = std::time::Instant::now();
    // Only `busy` is looked up after `since`.
    let frame = symbolizer.symbolize(&user_frame(&busy, free.file_offset));
    assert!(!frame.unsymbolized, "{frame:?}");
    let idle_range = own_mapping_all_read(&symbolizer, &idle)?;
    let busy_range = own_mapping_all_read(&symbolizer, &busy)?;
    let resident = |(start, _): (u64, u64)| resident_bytes_of_mapping(start as *const u8);
    let size = |(start, end): (u64, u64)| end - start;
    assert!(resident(idle_range) >= size(idle_range) * 9 / 10);
    assert!(resident(busy_range) >= size(busy_range) * 9 / 10);

    // Within the band (a floor this high is never reached): the file in use keeps its pages.
    symbolizer.file_pages.resident_after_full_release = u64::MAX / 2;
    let released = symbolizer.release_file_pages_beyond(Some(since));
    assert!(released >= size(idle_range), "{released}");
    assert!(resident(idle_range) < size(idle_range) / 4);
    assert!(resident(busy_range) >= size(busy_range) * 9 / 10);
    assert_eq!(
        symbolizer.file_pages.resident_after_full_release,
        u64::MAX / 2
    );

    // Beyond it (any RSS is above a floor of 0), the file in use gives its pages back too,
    // and the RSS left is the new floor.
    symbolizer.file_pages.resident_after_full_release = 0;
    let released = symbolizer.release_file_pages_beyond(Some(since));
    assert!(released >= size(busy_range), "{released}");
    assert!(resident(busy_range) < size(busy_range) / 4);
    assert!(symbolizer.file_pages.resident_after_full_release > 0);
    assert_still_cached(busy_range.0, busy_range.1);
    Ok(())
}

#[test]
fn a_separate_debug_files_mapping_is_given_back_and_its_pages_stay_cached() -> TestResult {
    let _turn = page_release_turn();
    // Debug info over the size releases skip (256 KiB), as a distribution's libc6-dbg has.
    let dir = FixtureDir::new()?;
    let (original, binary, debug_path) = split_by_build_id(&dir, &large_c_source(), false)?;
    let debug_root = dir.path().join("debug-root");
    // Written back, so that its pages are clean and page-out could drop them.
    std::fs::File::open(&debug_path)?.sync_all()?;
    let file = mapped_file(&binary)?;
    let debug_file = FileId::of(&std::fs::metadata(&debug_path)?);

    let mut symbolizer = Symbolizer::new(isolated_options(&debug_root));
    let beta = symbol_named(&original, "fixture_beta")?;
    let frame = symbolizer.symbolize(&user_frame(&file, beta.file_offset));
    assert_eq!(&*outer_line(&frame).function, "fixture_beta");
    // The lookup went to the debug file: blazesym's one mapping of it is told apart.
    let ranges = own_mappings_of(&[debug_file]).ok_or("maps")?;
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let (_, start, end) = ranges[0];
    assert!(end - start >= 256 << 10, "{} bytes", end - start);
    assert!(
        symbolizer.files[&file.id]
            .own_mappings
            .contains(&(debug_file, start)),
        "{:?}",
        symbolizer.files[&file.id].own_mappings
    );

    // SAFETY: the symbolizer keeps the debug file mapped read-only until it is dropped.
    let mapped = unsafe { std::slice::from_raw_parts(start as *const u8, (end - start) as usize) };
    let touched: u64 = mapped.iter().step_by(4096).map(|&b| u64::from(b)).sum();
    assert!(touched > 0);
    let releases_before = symbolizer.stats().own_mapping_releases;
    symbolizer.release_file_pages();
    assert!(symbolizer.stats().own_mapping_releases > releases_before);
    // Still in the page cache: page-out would have dropped these pages, which nothing else
    // maps, and every later lookup in the debug file would read them from disk again.
    assert_still_cached(start, end);
    let alpha = symbol_named(&original, "fixture_alpha")?;
    let frame = symbolizer.symbolize(&user_frame(&file, alpha.file_offset));
    assert_eq!(&*outer_line(&frame).function, "fixture_alpha");
    Ok(())
}

#[test]
fn file_pages_read_for_names_are_given_back_and_read_again() {
    use crate::test_support::resident_bytes_of_mapping;
    let _turn = page_release_turn();
    let build_dir = std::env::current_exe().expect("test binary");
    let dir = tempfile::tempdir_in(build_dir.parent().expect("deps dir")).expect("temp dir");
    let bytes: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
    let names = touched_shared_mapping(&dir.path().join("names.bin"), &bytes);
    // A file the agent also maps writable (like the store's) is left alone.
    let written = dir.path().join("written.bin");
    let read_only = touched_shared_mapping(&written, &bytes);
    let writable_file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&written)
        .expect("open for writing");
    // SAFETY: as above.
    let writable = unsafe { memmap2::MmapMut::map_mut(&writable_file) }.expect("map writable");
    let names_before = resident_bytes_of_mapping(names.as_ptr());
    let read_only_before = resident_bytes_of_mapping(read_only.as_ptr());
    assert!(names_before >= 3 << 20, "{names_before}");

    let mut symbolizer = Symbolizer::new(isolated_options(dir.path()));
    let released = symbolizer.release_file_pages();
    assert_eq!(symbolizer.stats().file_page_releases, 1);

    let names_after = resident_bytes_of_mapping(names.as_ptr());
    assert!(released >= 4 << 20, "{released}");
    assert!(
        names_after < names_before / 4,
        "{names_after} of {names_before} bytes still resident"
    );
    assert_eq!(
        resident_bytes_of_mapping(read_only.as_ptr()),
        read_only_before
    );
    // Read back a page at a time, without readahead.
    let flags = crate::test_support::flags_of_mapping(names.as_ptr());
    assert!(flags.iter().any(|flag| flag == "rr"), "{flags:?}");
    // Read again from the file, unchanged.
    assert!(names[..] == bytes[..]);
    assert!(writable[..] == bytes[..]);
}

/// The interner shares one copy of a string while it is asked for, and forgets the strings not
/// asked for during a generation: it stays within its bound however many new names arrive.
#[test]
fn interned_strings_are_shared_while_used_and_bounded() {
    let mut strings = StringInterner::new(8);
    let hot = strings.intern("hot_function");
    for n in 0..1_000 {
        strings.intern(&format!("cold_{n}"));
        // Asked for at every turn: never forgotten, always the same copy.
        assert!(Arc::ptr_eq(&hot, &strings.intern("hot_function")));
        assert!(strings.len() <= 8, "{} strings", strings.len());
    }
    let cold = strings.intern("cold_0");
    assert!(!Arc::ptr_eq(&cold, &strings.intern("cold_1")));
    assert!(Arc::ptr_eq(&cold, &strings.intern("cold_0")));
}
