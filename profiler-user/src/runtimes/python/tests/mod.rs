//! Unit tests that need no interpreter, plus the live interpreter matrix in `live`.
mod live;

use super::{
    code::{
        CodeCache, CodeError, linetable310_line, lnotab_line, locations_line, read_unicode,
        symbolize_code,
    },
    debug_offsets::{DebugOffsetsError, parse_debug_offsets, parse_header},
    detect::version_from_file_name,
    layout::{LAYOUT_TABLE, PY38, PY311, PY312, layout_for},
    memory::{MAX_READ_LEN, MemoryError, MemoryImage, ProcMemory, ProcessMemoryExt},
    walk::{ChainEnd, MAX_FRAMES, walk_frame_chain},
};
use crate::model::Pid;
use profiler_common::{CodeIdentity, name_word};

#[test]
fn layout_rows_are_unique_and_complete() {
    for (minor, row) in (8..=12).zip(LAYOUT_TABLE) {
        assert_eq!(row.python, (3, minor));
        assert_eq!(layout_for(3, minor), Some(row));
    }
    assert_eq!(layout_for(3, 7), None);
    assert_eq!(layout_for(3, 13), None, "3.13+ come from _Py_DebugOffsets");
    // Spot checks against docs/python-layouts.md §3.1 (the full rows were checked with gen_layouts.sh).
    assert_eq!(PY38.runtime_autotss_key, 1392 + 4);
    assert_eq!(PY311.code_bytecode, Some(184));
    assert_eq!(PY312.unicode_ascii_data, 40);
}

#[test]
fn lnotab_matches_cpython_addr2line() {
    // Lines 10 (bytes 0..6), 11 (6..10), 13 (10..): pairs (byte incr, line incr).
    let table = [6, 1, 4, 2];
    let line = |offset| lnotab_line(&table, 10, offset);
    assert_eq!(
        [line(0), line(5), line(6), line(9), line(10), line(100)],
        [10, 10, 11, 11, 13, 13]
    );
    // Negative line increments are signed bytes.
    assert_eq!(lnotab_line(&[2, 0xff], 10, 4), 9);
}

#[test]
fn linetable310_matches_cpython_addr2line() {
    // 0..4 line 5, 4..6 no line, 6..10 line 7.
    let table = [4, 0, 2, 0x80, 4, 2];
    let line = |offset| linetable310_line(&table, 5, offset);
    assert_eq!(line(0), Some(5));
    assert_eq!(line(3), Some(5));
    assert_eq!(line(4), None);
    assert_eq!(line(6), Some(7));
    assert_eq!(line(10), None, "past the end");
}

#[test]
fn locations_table_decodes_every_entry_kind() {
    let table = [
        // short form (code 0), 2 code units, one column byte: line 20
        0x80 | 1,
        0x05,
        // one-line form +1 (code 11), 1 unit, two column bytes: line 21
        0x80 | (11 << 3),
        1,
        2,
        // no-column form (code 13), 1 unit, signed varint -2 (raw 5): line 19
        0x80 | (13 << 3),
        5,
        // no location (code 15), 1 unit
        0x80 | (15 << 3),
        // long form (code 14), 3 units, line delta +70 (raw 140 = 0x4c | 0x40, 0x02), end
        // line, columns
        0x80 | (14 << 3) | 2,
        0x40 | (140 & 0x3f),
        140 >> 6,
        0,
        1,
        2,
    ];
    let line = |unit: i64| locations_line(&table, 20, unit * 2);
    assert_eq!(line(0), Some(20));
    assert_eq!(line(1), Some(20));
    assert_eq!(line(2), Some(21));
    assert_eq!(line(3), Some(19));
    assert_eq!(line(4), None);
    assert_eq!(line(5), Some(89));
    assert_eq!(line(7), Some(89));
    assert_eq!(line(8), None, "past the end");
    // Garbage never panics.
    for len in 0..table.len() {
        let _ = locations_line(&table[..len], 1, 100);
    }
    assert_eq!(locations_line(&[0xff, 0xff, 0xff], 1, 0), None);
    assert_eq!(
        locations_line(&[0xf0, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f], 1, 0),
        None
    );
}

#[test]
fn debug_offsets_reject_garbage() {
    assert_eq!(parse_header(b"notthis!"), Err(DebugOffsetsError::NoCookie));
    assert_eq!(parse_header(b""), Err(DebugOffsetsError::NoCookie));
    assert!(matches!(
        parse_header(b"xdebugpy\x00"),
        Err(DebugOffsetsError::Truncated { .. })
    ));
    let mut unknown = b"xdebugpy".to_vec();
    unknown.extend_from_slice(&0x030f_00a0u64.to_le_bytes());
    unknown.extend_from_slice(&0u64.to_le_bytes());
    unknown.resize(2048, 0xff);
    assert_eq!(
        parse_debug_offsets(&unknown),
        Err(DebugOffsetsError::UnknownVersion {
            version: 0x030f_00a0,
            major: 3,
            minor: 15
        })
    );
    let mut free_threaded = b"xdebugpy".to_vec();
    free_threaded.extend_from_slice(&0x030d_00f0u64.to_le_bytes());
    free_threaded.extend_from_slice(&1u64.to_le_bytes());
    assert!(parse_header(&free_threaded).expect("header").free_threaded);
    // A known version over garbage fields: an error naming the field, not a panic.
    let mut garbage = b"xdebugpy".to_vec();
    garbage.extend_from_slice(&0x030d_00f0u64.to_le_bytes());
    garbage.extend_from_slice(&0u64.to_le_bytes());
    garbage.resize(1024, 0xff);
    assert!(matches!(
        parse_debug_offsets(&garbage),
        Err(DebugOffsetsError::Implausible { .. })
    ));
    assert!(matches!(
        parse_debug_offsets(&garbage[..100]),
        Err(DebugOffsetsError::Truncated { .. })
    ));
}

/// A 3.14 `_Py_DebugOffsets` built from the values of Debian's 3.14 (docs/python-layouts.md §3.1, §4.2).
#[test]
fn debug_offsets_314_layout() {
    let bytes = debug_offsets_image(
        0x030e_0af0,
        false,
        &[
            (40, 808),  // runtime_state.interpreters_head
            (64, 7264), // interpreter_state.next (any plausible value)
            (72, 7344), // threads_head
            (192, 8),   // thread_state.next
            (208, 72),  // current_frame
            (216, 152), // thread_id
            (224, 160), // native_thread_id
            (256, 8),   // interpreter_frame.previous
            (264, 0),   // executable
            (272, 56),  // instr_ptr
            (288, 74),  // owner
            (320, 112), // code_object.filename
            (328, 120), // name
            (336, 128), // qualname
            (344, 136), // linetable
            (352, 68),  // firstlineno
            (384, 208), // co_code_adaptive
            (408, 8),   // pyobject.ob_type
            (600, 16),  // bytes_object.ob_size
            (608, 32),  // ob_sval
            (624, 32),  // unicode_object.state
            (632, 16),  // length
            (640, 40),  // asciiobject_size
        ],
    );
    let (header, layout) = parse_debug_offsets(&bytes).expect("3.14 parses");
    assert_eq!(header.version(), (3, 14, 10));
    assert_eq!(layout.runtime_interpreters_head, 808);
    assert_eq!(layout.interp_threads_head, 7344);
    assert_eq!(layout.code_bytecode, Some(208));
    assert_eq!(layout.stackref_tag_mask, 3);
    assert_eq!(layout.runtime_autotss_key, 2336 + 4);
    assert_eq!(
        layout.entry_marker,
        super::layout::EntryMarker::ShimOwner {
            offset: 74,
            value: 3
        }
    );
}

/// `_Py_DebugOffsets` of a free-threaded 3.14t build, with the values of the DWARF of a 3.14.7
/// `--disable-gil` build.
fn debug_offsets_314t() -> Vec<u8> {
    debug_offsets_image(
        0x030e_07f0,
        true,
        &[
            (40, 808),  // runtime_state.interpreters_head
            (64, 7272), // interpreter_state.next
            (72, 7344), // threads_head
            (192, 8),   // thread_state.next
            (208, 72),  // current_frame
            (216, 152), // thread_id
            (224, 160), // native_thread_id
            (256, 8),   // interpreter_frame.previous
            (264, 0),   // executable
            (272, 56),  // instr_ptr
            (288, 78),  // owner (after tlbc_index)
            (320, 128), // code_object.filename
            (328, 136), // name
            (336, 144), // qualname
            (344, 152), // linetable
            (352, 84),  // firstlineno
            (384, 232), // co_code_adaptive
            (392, 224), // co_tlbc
            (408, 24),  // pyobject.ob_type
            (600, 32),  // bytes_object.ob_size
            (608, 48),  // ob_sval
            (624, 48),  // unicode_object.state
            (632, 32),  // length
            (640, 56),  // asciiobject_size
        ],
    )
}

/// A `_Py_DebugOffsets` image: the header, then each (position, value).
fn debug_offsets_image(version_hex: u64, free_threaded: bool, fields: &[(usize, u64)]) -> Vec<u8> {
    let mut bytes = vec![0u8; 760];
    bytes[..8].copy_from_slice(b"xdebugpy");
    let mut put = |at: usize, value: u64| bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    put(8, version_hex);
    put(16, u64::from(free_threaded));
    for &(at, value) in fields {
        put(at, value);
    }
    bytes
}

#[test]
fn debug_offsets_of_a_free_threaded_build() {
    let bytes = debug_offsets_314t();
    let (header, layout) = parse_debug_offsets(&bytes).expect("3.14t parses");
    assert!(header.free_threaded);
    assert!(layout.free_threaded);
    assert_eq!(layout.object_type, 24);
    assert_eq!(layout.bytes_size, 32);
    assert_eq!(layout.code_version, Some(84 + 24));
    assert_eq!(layout.code_thread_bytecode, Some(224));
    assert_eq!(
        layout.unicode_kind_shift, 8,
        "3.14t's `interned` is a whole byte"
    );
    assert_eq!(layout.unicode_compact_data, 56 + 16);
    // A free-threaded flag over a GIL build's object header is a wrong table, not a layout.
    let mut wrong = bytes.clone();
    wrong[408..416].copy_from_slice(&8u64.to_le_bytes());
    assert!(matches!(
        parse_debug_offsets(&wrong),
        Err(DebugOffsetsError::Implausible {
            field: "pyobject.ob_type",
            ..
        })
    ));
    // With the GIL the same version has no per-thread bytecode and the 2-bit `interned`.
    let mut gil = bytes;
    gil[16..24].copy_from_slice(&0u64.to_le_bytes());
    for (at, value) in [(408, 8u64), (600, 16)] {
        gil[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }
    let (_, layout) = parse_debug_offsets(&gil).expect("3.14 parses");
    assert!(!layout.free_threaded);
    assert_eq!(layout.code_thread_bytecode, None);
    assert_eq!(layout.unicode_kind_shift, 2);
}

/// A 3.14t code object: the split reference count tells a live object from a freed one, and
/// an instruction pointer into another thread's copy of the bytecode (`co_tlbc`) gets that
/// copy's line, also from the low 32 bits BPF keeps.
#[test]
fn free_threaded_code_objects_and_per_thread_bytecode() {
    let (_, layout) = parse_debug_offsets(&debug_offsets_314t()).expect("3.14t parses");
    let layout = &layout;
    let (code, code_type, name, file, table, copies) = (
        0x4_0000_0000u64,
        0x500_000u64,
        0x410_000u64,
        0x420_000u64,
        0x430_000u64,
        0x440_000u64,
    );
    let bytecode = code + u64::from(layout.code_bytecode.expect("3.14t"));
    // Another thread's copy, more than 4 GiB away from the code object.
    let copy = 0x7f00_1234_5000u64;
    let object = |ref_local: u32, ref_shared: u64| {
        let mut object = vec![0u8; 256];
        let mut put = |at: u32, value: u64| {
            object[at as usize..at as usize + 8].copy_from_slice(&value.to_le_bytes())
        };
        put(0, 0x7f00_0000_1000); // ob_tid: the owning thread, an address
        put(16, ref_shared);
        put(layout.object_type, code_type);
        put(layout.bytes_size, 5); // ob_size: 5 code units
        put(layout.code_firstlineno, 41);
        put(layout.code_version.expect("co_version"), 7);
        put(layout.code_qualname.expect("qualname"), name);
        put(layout.code_filename, file);
        put(layout.code_line_table, table);
        put(layout.code_thread_bytecode.expect("co_tlbc"), copies);
        object[12..16].copy_from_slice(&ref_local.to_le_bytes());
        object
    };
    let mut image = MemoryImage::new();
    image.insert(code, object(1, 0));
    put_string(&mut image, layout, name, "Worker.spin");
    put_string(&mut image, layout, file, "/app/work.py");
    let mut bytes_object = vec![0u8; layout.bytes_data as usize];
    let size = layout.bytes_size as usize;
    bytes_object[size..size + 8].copy_from_slice(&4u64.to_le_bytes());
    // 2 units on line 41, then 3 units on line 43.
    bytes_object.extend_from_slice(&[0x80 | 1, 0, 0x80 | (12 << 3) | 2, 0]);
    image.insert(table, bytes_object);
    // _PyCodeArray { size: 3, entries: [co_code_adaptive, (unused), the other thread's copy] }
    let mut array = 3u64.to_le_bytes().to_vec();
    for entry in [bytecode, 0, copy] {
        array.extend_from_slice(&entry.to_le_bytes());
    }
    image.insert(copies, array);

    let line = |instruction: u64| {
        symbolize_code(&image, layout, code_type, code, instruction)
            .expect("symbolized")
            .line
    };
    assert_eq!(
        line(bytecode + 2 * 3),
        Some(43),
        "the first thread's bytecode"
    );
    assert_eq!(line(copy + 2 * 3), Some(43), "another thread's copy");
    assert_eq!(line(copy), Some(41));
    // What BPF records: the low 32 bits of instruction - code, added back to the code address.
    let recorded = (copy + 2 * 3).wrapping_sub(code) as u32;
    assert_eq!(line(code.wrapping_add(u64::from(recorded))), Some(43));
    // In no copy (past the end of every one): no line rather than a guess.
    assert_eq!(line(copy + 2 * 5), None);
    assert_eq!(line(0x7f00_9999_0000), None);

    // Alive through the shared count alone (another thread holds it).
    image.insert(code, object(0, 1 << 2));
    assert!(symbolize_code(&image, layout, code_type, code, bytecode).is_ok());
    // Dead: both counts zero, the shared word keeps its merged flag.
    image.insert(code, object(0, 0b11));
    assert!(matches!(
        symbolize_code(&image, layout, code_type, code, bytecode),
        Err(CodeError::Freed { .. })
    ));
}

#[test]
fn file_names_give_versions() {
    assert_eq!(
        version_from_file_name("/x/lib/libpython3.9.so.1.0"),
        Some((3, 9, false))
    );
    assert_eq!(
        version_from_file_name("/usr/bin/python3.11"),
        Some((3, 11, false))
    );
    assert_eq!(version_from_file_name("python3.13t"), Some((3, 13, true)));
    assert_eq!(
        version_from_file_name("libpython3.14t.so.1.0"),
        Some((3, 14, true))
    );
    assert_eq!(version_from_file_name("/usr/bin/python3"), None);
    assert_eq!(version_from_file_name("libc.so.6"), None);
}

#[test]
fn memory_errors_are_values() {
    let mut image = MemoryImage::new();
    image.insert(0x10_000, vec![1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(image.read_u64(0x10_000), Ok(0x0807_0605_0403_0201));
    assert!(matches!(
        image.read_u64(0x10_004),
        Err(MemoryError::Unreadable { .. })
    ));
    assert_eq!(image.read_u8(0), Err(MemoryError::BadAddress { addr: 0 }));
    assert_eq!(
        image.read_u8(u64::MAX),
        Err(MemoryError::BadAddress { addr: u64::MAX })
    );
    assert!(matches!(
        image.read_vec(0x10_000, MAX_READ_LEN + 1),
        Err(MemoryError::TooLarge { .. })
    ));

    let own = ProcMemory::open(Pid(std::process::id())).expect("/proc/self/mem");
    let value: u64 = 0x1234_5678_9abc_def0;
    let addr = std::ptr::from_ref(&value) as u64;
    assert_eq!(own.read_u64(addr), Ok(value));
    assert!(matches!(
        own.read_u64(0x1000),
        Err(MemoryError::Unreadable { .. })
    ));
    assert!(matches!(
        ProcMemory::open(Pid(u32::MAX)),
        Err(MemoryError::Open { .. })
    ));
}

/// A compact string object in `image`: `kind` 1/2/4 bytes per character.
fn put_string(image: &mut MemoryImage, layout: &super::PyLayout, addr: u64, text: &str) {
    let chars: Vec<u32> = text.chars().map(u32::from).collect();
    let ascii = text.is_ascii();
    let max = chars.iter().copied().max().unwrap_or(0);
    let kind: u32 = if max < 0x100 {
        1
    } else if max < 0x1_0000 {
        2
    } else {
        4
    };
    let data_offset = if ascii {
        layout.unicode_ascii_data
    } else {
        layout.unicode_compact_data
    } as usize;
    let mut bytes = vec![0u8; data_offset];
    let length = layout.unicode_length as usize;
    bytes[length..length + 8].copy_from_slice(&(chars.len() as u64).to_le_bytes());
    let shift = u32::from(layout.unicode_kind_shift);
    let state = (kind << shift) | (1 << (shift + 3)) | (u32::from(ascii) << (shift + 4));
    let at = layout.unicode_state as usize;
    bytes[at..at + 4].copy_from_slice(&state.to_le_bytes());
    for c in chars {
        bytes.extend_from_slice(&c.to_le_bytes()[..kind as usize]);
    }
    image.insert(addr, bytes);
}

#[test]
fn strings_of_every_kind() {
    for layout in [&PY38, &PY312] {
        let mut image = MemoryImage::new();
        for (i, text) in ["spin", "grüße", "σφαίρα", "emoji😀", ""]
            .iter()
            .enumerate()
        {
            let addr = 0x100_000 + i as u64 * 0x1000;
            put_string(&mut image, layout, addr, text);
            assert_eq!(read_unicode(&image, layout, addr).as_deref(), Ok(*text));
        }
        // Not compact, or an impossible kind: an error, not garbage text.
        let mut bad = vec![0u8; 80];
        bad[16] = 1;
        bad[32] = 3 << 2 | 1 << 5;
        image.insert(0x200_000, bad);
        assert!(matches!(
            read_unicode(&image, layout, 0x200_000),
            Err(CodeError::BadString { .. })
        ));
    }
}

/// A 3.12 code object in memory: symbolize it, then check the type guard and the cache.
#[test]
fn symbolizes_a_synthetic_code_object() {
    let layout = &PY312;
    let mut image = MemoryImage::new();
    let (code, code_type, name, file, table) =
        (0x400_000u64, 0x500_000u64, 0x410_000, 0x420_000, 0x430_000);
    let mut object = vec![0u8; 256];
    let mut put = |at: u32, value: u64| {
        object[at as usize..at as usize + 8].copy_from_slice(&value.to_le_bytes())
    };
    put(0, 1);
    put(layout.object_type, code_type);
    put(layout.code_firstlineno, 41);
    put(layout.code_version.expect("3.12 has co_version"), 7);
    put(layout.code_qualname.expect("3.12 has qualnames"), name);
    put(layout.code_filename, file);
    put(layout.code_line_table, table);
    image.insert(code, object);
    put_string(&mut image, layout, name, "Worker.spin");
    put_string(&mut image, layout, file, "/app/wörk.py");
    // Line table: 2 units on line 41, then 3 units on line 43 (one-line form +2).
    let mut bytes_object = vec![0u8; 32];
    bytes_object[16..24].copy_from_slice(&4u64.to_le_bytes());
    bytes_object.extend_from_slice(&[0x80 | 1, 0, 0x80 | (12 << 3) | 2, 0]);
    image.insert(table, bytes_object);

    let bytecode = code + u64::from(layout.code_bytecode.expect("3.12"));
    let info =
        symbolize_code(&image, layout, code_type, code, bytecode + 2 * 3).expect("symbolized");
    assert_eq!(&*info.qualname, "Worker.spin");
    assert_eq!(&*info.filename, "/app/wörk.py");
    assert_eq!(info.line, Some(43));
    assert_eq!(info.firstlineno, 41);
    // Before the first instruction (prev_instr = bytecode - 2): the first line.
    let info = symbolize_code(&image, layout, code_type, code, bytecode - 2).expect("symbolized");
    assert_eq!(info.line, Some(41));
    assert!(matches!(
        symbolize_code(&image, layout, code_type + 8, code, bytecode),
        Err(CodeError::NotCode { .. })
    ));

    // The fingerprint BPF would have recorded for it.
    let fingerprint = CodeIdentity {
        firstlineno: 41,
        version: 7,
        name,
        filename: file,
        line_table: table,
        ..CodeIdentity::default()
    }
    .fingerprint();
    let mut cache = CodeCache::new(4);
    for round in 0..3 {
        let read = cache
            .code_object(&image, layout, code_type, Pid(1), code, fingerprint)
            .expect("cached read");
        assert_eq!(&*read.qualname, "Worker.spin", "round {round}");
        // Any other fingerprint is another code object that lived at this address.
        assert!(matches!(
            cache.code_object(&image, layout, code_type, Pid(1), code, fingerprint ^ 1),
            Err(CodeError::Replaced { .. })
        ));
    }
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.replaced), (2, 4, 3));
    assert_eq!(cache.len(), 1, "a replaced object is never cached");
    cache.forget_process(Pid(1));
    assert!(cache.is_empty());

    // Freed: the allocator's free-list pointer (or 0) where the reference count was.
    for freed in [0u64, 0x7f12_3456_7000] {
        let mut object = image_bytes(&image, code, 256);
        object[..8].copy_from_slice(&freed.to_le_bytes());
        let mut freed_image = image.clone();
        freed_image.insert(code, object);
        assert!(matches!(
            CodeCache::new(4).code_object(
                &freed_image,
                layout,
                code_type,
                Pid(1),
                code,
                fingerprint
            ),
            Err(CodeError::Freed { .. })
        ));
    }
}

fn image_bytes(image: &MemoryImage, addr: u64, len: usize) -> Vec<u8> {
    image.read_vec(addr, len).expect("in the image")
}

/// Without `co_version` (≤3.11) a name that differs only in its middle or end, at the same
/// address with the same pointers, is still another fingerprint; what follows the name's end
/// is not part of it.
#[test]
fn fingerprints_without_a_version_see_the_whole_name() {
    let identity = |name: &str, padding: u8| {
        let mut data = name.as_bytes().to_vec();
        data.extend([padding; 8]);
        let byte_len = name.len();
        let mut head = [name_word(&data, 0), name_word(&data, 8)];
        // BPF masks what lies past the end; so does this.
        let keep = |word: u64, keep: usize| {
            if keep >= 8 {
                word
            } else {
                word & ((1u64 << (keep * 8)) - 1)
            }
        };
        head[0] = keep(head[0], byte_len);
        head[1] = keep(head[1], byte_len.saturating_sub(8));
        CodeIdentity {
            firstlineno: 1,
            version: 0,
            name: 0x1000,
            filename: 0x2000,
            line_table: 0x3000,
            name_length: byte_len as u64,
            name_head: head,
            name_tail: if byte_len > 16 {
                name_word(&data, byte_len - 8)
            } else {
                0
            },
        }
        .fingerprint()
    };
    let base = identity("handler_for_route_0001", 0);
    assert_ne!(base, identity("handler_for_route_0002", 0), "tail");
    assert_ne!(base, identity("handler_xor_route_0001", 0), "head");
    assert_ne!(base, identity("handler_for_route_00001", 0), "length");
    assert_eq!(
        identity("short", 0),
        identity("short", 0xaa),
        "bytes past the end"
    );
    assert_ne!(identity("short", 0), identity("shorT", 0));
    let with_version = |version| {
        CodeIdentity {
            version,
            name: 0x1000,
            ..CodeIdentity::default()
        }
        .fingerprint()
    };
    assert_ne!(with_version(7), with_version(8));
    assert_ne!(
        with_version(7),
        0,
        "0 is reserved for an unreadable code object"
    );
}

/// Frame chains that loop back or never end stop at the bounds.
#[test]
fn cyclic_and_endless_chains_are_bounded() {
    let layout = &PY311;
    let mut image = MemoryImage::new();
    // Two frames pointing at each other.
    let frame = |back: u64| {
        let mut bytes = vec![0u8; 80];
        bytes[32..40].copy_from_slice(&0x999_000u64.to_le_bytes());
        bytes[48..56].copy_from_slice(&back.to_le_bytes());
        bytes
    };
    image.insert(0x100_000, frame(0x200_000));
    image.insert(0x200_000, frame(0x100_000));
    let (frames, end) = walk_frame_chain(&image, layout, 0x100_000);
    assert_eq!(frames.len(), 2);
    assert_eq!(end, ChainEnd::Cycle);
    // A chain of distinct frames longer than the limit.
    let mut long = MemoryImage::new();
    let count = MAX_FRAMES as u64 + 10;
    for i in 0..count {
        long.insert(0x100_000 + i * 0x100, frame(0x100_000 + (i + 1) * 0x100));
    }
    let (frames, end) = walk_frame_chain(&long, layout, 0x100_000);
    assert_eq!(frames.len(), MAX_FRAMES);
    assert_eq!(end, ChainEnd::DepthLimit);
    // A dangling pointer ends the chain with the error.
    let (frames, end) = walk_frame_chain(&image, layout, 0x300_000);
    assert!(frames.is_empty());
    assert!(matches!(end, ChainEnd::Unreadable(_)));
}

mod hostile_memory {
    //! A process's memory is input: a frame or code object read while the interpreter changes
    //! it, or planted by the process, may hold any pointer. Walking and symbolizing must end
    //! with an error, never a panic (address arithmetic near `u64::MAX` once overflowed).
    use super::*;
    use proptest::prelude::*;

    /// Pointers that sit just below the top of the address space, where adding a field offset
    /// overflows, mixed with ordinary ones.
    fn pointer() -> impl Strategy<Value = u64> {
        prop_oneof![
            (0u64..0x1000).prop_map(|below| u64::MAX - below),
            Just(0x100_000u64),
            Just(0x200_000u64),
            any::<u64>(),
        ]
    }

    /// 512 bytes whose every 8-byte word is such a pointer.
    fn object() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(pointer(), 64)
            .prop_map(|words| words.iter().flat_map(|w| w.to_le_bytes()).collect())
    }

    proptest! {
        #[test]
        fn walking_and_symbolizing_hostile_frames_never_panics(
            frame in object(),
            code in object(),
            first in pointer(),
            instruction in pointer(),
        ) {
            let mut image = MemoryImage::new();
            image.insert(0x100_000, frame);
            image.insert(0x200_000, code);
            for layout in LAYOUT_TABLE {
                let (frames, _end) = walk_frame_chain(&image, layout, first);
                prop_assert!(frames.len() <= MAX_FRAMES);
                for raw in &frames {
                    let _ = symbolize_code(&image, layout, 0x200_000, raw.code_addr, instruction);
                }
                let _ = symbolize_code(&image, layout, u64::MAX - 7, u64::MAX - 3, instruction);
            }
        }
    }

    #[test]
    fn a_frame_pointing_at_the_top_of_the_address_space_ends_the_chain_as_unreadable() {
        for layout in LAYOUT_TABLE {
            let image = MemoryImage::new();
            let (frames, end) = walk_frame_chain(&image, layout, u64::MAX - 8);
            assert!(frames.is_empty());
            assert!(
                matches!(end, ChainEnd::Unreadable(_)),
                "{:?}: {end:?}",
                layout.python
            );
        }
    }
}
