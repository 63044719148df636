#!/usr/bin/env python3
"""Writes the hand-made CFI inputs of eh_frame/ (the gcc seed is copied from a build).

Sections are read by the tests as if they were at address 0x2000 (text 0x1000, .plt
0x1020..0x1060). Pointers use DW_EH_PE_absptr, so FDE addresses are absolute.
`ok-*` must build, `err-*` must be rejected.
"""
import struct
from pathlib import Path

OUT = Path(__file__).parent / "eh_frame"


def uleb(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def sleb(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if (value == 0 and not byte & 0x40) or (value == -1 and byte & 0x40):
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def pad(body):
    while (len(body) + 4) % 8:
        body += b"\x00"  # DW_CFA_nop
    return body


CIE_INITIAL = b"\x0c\x07\x08" + b"\x90\x01"  # def_cfa rsp+8; rip at cfa-8


def eh_cie(augmentation=b"zR", initial=CIE_INITIAL):
    body = struct.pack("<I", 0) + b"\x01" + augmentation + b"\x00"
    body += uleb(1) + sleb(-8) + uleb(16)
    body += uleb(1) + b"\x00"  # augmentation data: R = absptr
    body += initial
    body = pad(body)
    return struct.pack("<I", len(body)) + body


def eh_fde(section_offset, cie_offset, start, length, program=b""):
    # The CIE pointer is the distance from the pointer field back to the CIE.
    cie_pointer = section_offset + 4 - cie_offset
    body = struct.pack("<IQQ", cie_pointer, start, length) + uleb(0) + program
    body = pad(body)
    return struct.pack("<I", len(body)) + body


def eh_section(entries):
    """entries: list of ('cie', kwargs) / ('fde', cie_index, start, length, program)."""
    data = bytearray()
    cie_offsets = []
    for entry in entries:
        if entry[0] == "cie":
            cie_offsets.append(len(data))
            data += eh_cie(**entry[1])
        elif entry[0] == "raw":
            data += entry[1]
        else:
            _, cie, start, length, program = entry
            data += eh_fde(len(data), cie_offsets[cie], start, length, program)
    return bytes(data)


def advance(delta):
    return bytes([0x40 | delta]) if delta < 64 else b"\x02" + bytes([delta])


def def_cfa_offset(offset):
    return b"\x0e" + uleb(offset)


PLT_EXPRESSION = bytes([0x77, 8, 0x80, 0, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])


def def_cfa_expression(expression):
    return b"\x0f" + uleb(len(expression)) + expression


files = {
    "ok-overlapping-fdes.eh_frame": eh_section(
        [
            ("cie", {}),
            ("fde", 0, 0x1100, 0x100, advance(4) + def_cfa_offset(16)),
            # Starts inside the first and ends after it: only 0x1200.. is used.
            ("fde", 0, 0x1180, 0x100, advance(1) + def_cfa_offset(32) + advance(0x7F) + def_cfa_offset(48)),
            # Entirely inside the first: ignored.
            ("fde", 0, 0x1110, 0x10, def_cfa_offset(64)),
            # Duplicate start of the first: the first in section order wins.
            ("fde", 0, 0x1100, 0x20, def_cfa_offset(80)),
        ]
    ),
    "ok-advance-past-end.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, advance(0x20) + def_cfa_offset(16) + advance(8) + def_cfa_offset(24))]
    ),
    "ok-unsupported-rules.eh_frame": eh_section(
        [
            ("cie", {}),
            # CFA = *(rsp + 0): an expression the unwinder cannot run.
            ("fde", 0, 0x1000, 0x10, def_cfa_expression(b"\x77\x00\x06") + advance(4)
             + b"\x0c\x03\x08"  # def_cfa rbx+8
             + advance(4) + b"\x0c\x07" + uleb(40000)  # offset beyond i16
             + advance(4) + b"\x0c\x07\x10" + b"\x09\x06\x03"),  # rbp in rbx (register rule)
            ("fde", 0, 0x1040, 0x20, def_cfa_expression(PLT_EXPRESSION)),
        ]
    ),
    "ok-signal-frame.eh_frame": eh_section(
        [("cie", {"augmentation": b"zRS"}), ("fde", 0, 0x1000, 0x9, def_cfa_expression(b"\x77\xa0\x01\x06"))]
    ),
    "ok-terminator-then-garbage.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, b""), ("raw", b"\x00\x00\x00\x00" + b"\xde\xad\xbe\xef" * 4)]
    ),
    "ok-outermost-frame.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, b"\x07\x10" + advance(4) + def_cfa_offset(16))]  # undefined rip
    ),
    # The middle FDE's program has an unknown opcode: only its range loses its CFI.
    "ok-one-malformed-fde.eh_frame": eh_section(
        [
            ("cie", {}),
            ("fde", 0, 0x1000, 0x10, advance(4) + def_cfa_offset(16)),
            ("fde", 0, 0x1010, 0x10, b"\x3f"),
            ("fde", 0, 0x1080, 0x10, advance(2) + def_cfa_offset(24)),
        ]
    ),
    "err-remember-state-overflow.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, b"\x0a" * 16)]
    ),
    "err-restore-state-underflow.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, b"\x0b" * 2)]
    ),
    "err-range-beyond-48-bits.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0xFFFF_FFFF_0000_0000, 0x10, b"")]
    ),
    "err-range-wraps.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0xFFFF_FFFF_FFFF_FFF0, b"")]
    ),
    "err-span-too-many-pages.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, b""), ("fde", 0, 0xFF_0000_0000, 0x10, b"")]
    ),
    "err-truncated-fde.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, def_cfa_offset(16))]
    )[:-6],
    "err-unknown-cfa-opcode.eh_frame": eh_section(
        [("cie", {}), ("fde", 0, 0x1000, 0x10, b"\x3f")]
    ),
}

# An FDE whose CIE pointer points at itself.
self_pointing = bytearray(eh_section([("cie", {}), ("fde", 0, 0x1000, 0x10, b"")]))
cie_len = struct.unpack_from("<I", self_pointing, 0)[0] + 4
struct.pack_into("<I", self_pointing, cie_len + 4, 4)  # back to the FDE itself
files["err-cie-pointer-to-self.eh_frame"] = bytes(self_pointing)

# .debug_frame: CIE id 0xffffffff, pointers are section offsets and absolute addresses.
cie = pad(struct.pack("<I", 0xFFFFFFFF) + b"\x01\x00" + uleb(1) + sleb(-8) + uleb(16) + CIE_INITIAL)
cie = struct.pack("<I", len(cie)) + cie
fde = pad(struct.pack("<IQQ", 0, 0x1000, 0x20) + advance(1) + def_cfa_offset(16) + b"\x86\x02")
fde = struct.pack("<I", len(fde)) + fde
files["ok-debug_frame-basic.debug_frame"] = cie + fde

for name, data in files.items():
    (OUT / name).write_bytes(data)
    print(f"{name}: {len(data)} bytes")
