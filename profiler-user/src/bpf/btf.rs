//! Field offsets from the kernel's BTF (`/sys/kernel/btf/vmlinux`).
//!
//! The agent needs a single offset (`task_struct.thread.fsbase`), so it scans the type section
//! once for the structs on the path instead of building the whole type graph, which for a
//! distribution kernel's 5 MiB of BTF cost a third of the agent's start-up CPU. The format is
//! the kernel's `Documentation/bpf/btf.rst`: a header, then `btf_type` records (12 bytes plus a
//! kind-specific tail), then the string section.

/// Why an offset could not be found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("not BTF data (bad magic or header)")]
    BadHeader,
    #[error("BTF type section is truncated or malformed at byte {0}")]
    Malformed(usize),
    #[error("BTF type of unknown kind {kind} at byte {at}")]
    UnknownKind { kind: u32, at: usize },
    #[error("no struct {0} in the BTF")]
    NoStruct(String),
    #[error("{owner} has no member {member}")]
    NoMember { owner: String, member: String },
    #[error("{owner}.{member} is not a struct")]
    NotAStruct { owner: String, member: String },
    #[error("{owner}.{member} is a bit field")]
    BitField { owner: String, member: String },
}

const MAGIC: u16 = 0xeb9f;
const HEADER_BYTES: usize = 24;
const TYPE_BYTES: usize = 12;

const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;
const MAX_KIND: u32 = 19;

/// One `btf_type` record: where it starts and its fixed fields.
#[derive(Clone, Copy)]
struct TypeRecord {
    at: usize,
    name_off: u32,
    kind: u32,
    kind_flag: bool,
    vlen: usize,
    /// `size` or `type`, depending on the kind.
    size_or_type: u32,
}

/// A kernel BTF blob, scanned once: type records are found by offset, decoded on demand.
pub struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    little_endian: bool,
    /// Byte offset in `types` of type id `i + 1` (id 0 is `void`).
    offsets: Vec<usize>,
}

impl<'a> Btf<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, BtfError> {
        let magic_le = bytes.get(..2).map(|m| u16::from_le_bytes([m[0], m[1]]));
        let little_endian = match magic_le {
            Some(MAGIC) => true,
            Some(m) if m.swap_bytes() == MAGIC => false,
            _ => return Err(BtfError::BadHeader),
        };
        let word = |at: usize| read_u32(bytes, at, little_endian).ok_or(BtfError::BadHeader);
        let header_len = word(4)? as usize;
        if header_len < HEADER_BYTES {
            return Err(BtfError::BadHeader);
        }
        let section = |offset_field: usize, length_field: usize| {
            let start = header_len
                .checked_add(word(offset_field)? as usize)
                .ok_or(BtfError::BadHeader)?;
            let end = start
                .checked_add(word(length_field)? as usize)
                .ok_or(BtfError::BadHeader)?;
            bytes.get(start..end).ok_or(BtfError::BadHeader)
        };
        let mut btf = Btf {
            types: section(8, 12)?,
            strings: section(16, 20)?,
            little_endian,
            offsets: Vec::new(),
        };
        let mut at = 0;
        while at < btf.types.len() {
            let record = btf.record(at)?;
            btf.offsets.push(at);
            at = record
                .at
                .checked_add(TYPE_BYTES + tail_bytes(record)?)
                .ok_or(BtfError::Malformed(at))?;
        }
        Ok(btf)
    }

    fn u32_at(&self, at: usize) -> Result<u32, BtfError> {
        read_u32(self.types, at, self.little_endian).ok_or(BtfError::Malformed(at))
    }

    fn record(&self, at: usize) -> Result<TypeRecord, BtfError> {
        let info = self.u32_at(at + 4)?;
        let record = TypeRecord {
            at,
            name_off: self.u32_at(at)?,
            kind: (info >> 24) & 0x1f,
            kind_flag: info >> 31 != 0,
            vlen: (info & 0xffff) as usize,
            size_or_type: self.u32_at(at + 8)?,
        };
        if record.kind == 0 || record.kind > MAX_KIND {
            return Err(BtfError::UnknownKind {
                kind: record.kind,
                at,
            });
        }
        Ok(record)
    }

    fn by_id(&self, id: u32) -> Result<TypeRecord, BtfError> {
        let at = (id as usize)
            .checked_sub(1)
            .and_then(|index| self.offsets.get(index))
            .ok_or(BtfError::Malformed(0))?;
        self.record(*at)
    }

    fn name(&self, offset: u32) -> &'a [u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        &rest[..end]
    }

    /// The struct behind `id`, through typedefs and qualifiers.
    fn resolve_struct(&self, mut id: u32) -> Result<Option<TypeRecord>, BtfError> {
        // A chain longer than the type count is a loop.
        for _ in 0..=self.offsets.len() {
            let record = self.by_id(id)?;
            match record.kind {
                KIND_STRUCT | KIND_UNION => return Ok(Some(record)),
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = record.size_or_type;
                }
                _ => return Ok(None),
            }
        }
        Err(BtfError::Malformed(0))
    }

    /// The member `name` of `owner`, also inside anonymous struct and union members (as C
    /// sees it): its type id, bit offset from `owner`'s start, and bit-field size.
    fn member(&self, owner: TypeRecord, name: &str) -> Result<Option<(u32, u32, u32)>, BtfError> {
        self.member_within(owner, name, 0)
    }

    fn member_within(
        &self,
        owner: TypeRecord,
        name: &str,
        depth: usize,
    ) -> Result<Option<(u32, u32, u32)>, BtfError> {
        // Nesting deeper than a handful of anonymous levels is malformed (or a loop).
        if depth > 16 {
            return Err(BtfError::Malformed(owner.at));
        }
        let mut anonymous = Vec::new();
        for index in 0..owner.vlen {
            let at = owner.at + TYPE_BYTES + index * 12;
            let (name_off, type_id, raw) =
                (self.u32_at(at)?, self.u32_at(at + 4)?, self.u32_at(at + 8)?);
            // With the kind flag set, the top 8 bits hold a bit-field size.
            let (bit_offset, bitfield) = if owner.kind_flag {
                (raw & 0x00ff_ffff, raw >> 24)
            } else {
                (raw, 0)
            };
            let member_name = self.name(name_off);
            if member_name == name.as_bytes() {
                return Ok(Some((type_id, bit_offset, bitfield)));
            }
            if member_name.is_empty() {
                anonymous.push((type_id, bit_offset));
            }
        }
        for (type_id, base) in anonymous {
            if let Some(inner) = self.resolve_struct(type_id)?
                && let Some((id, offset, bitfield)) = self.member_within(inner, name, depth + 1)?
            {
                let offset = base
                    .checked_add(offset)
                    .ok_or(BtfError::Malformed(owner.at))?;
                return Ok(Some((id, offset, bitfield)));
            }
        }
        Ok(None)
    }
}

/// Bytes after the 12-byte record, by kind.
fn tail_bytes(record: TypeRecord) -> Result<usize, BtfError> {
    let per_entry = match record.kind {
        KIND_INT | KIND_VAR | KIND_DECL_TAG => return Ok(4),
        KIND_ARRAY => return Ok(12),
        KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12,
        KIND_ENUM | KIND_FUNC_PROTO => 8,
        _ => 0,
    };
    record
        .vlen
        .checked_mul(per_entry)
        .ok_or(BtfError::Malformed(record.at))
}

fn read_u32(bytes: &[u8], at: usize, little_endian: bool) -> Option<u32> {
    let word: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(if little_endian {
        u32::from_le_bytes(word)
    } else {
        u32::from_be_bytes(word)
    })
}

impl Btf<'_> {
    /// Byte offset of `path` (members, outermost first) inside struct `root`, e.g.
    /// `("task_struct", &["thread", "fsbase"])`.
    pub fn member_offset(&self, root: &str, path: &[&str]) -> Result<u32, BtfError> {
        // The first complete definition (forward declarations are a different kind).
        let mut owner = (0..self.offsets.len())
            .map(|index| self.record(self.offsets[index]))
            .find(|record| {
                record.as_ref().is_ok_and(|r| {
                    r.kind == KIND_STRUCT && r.vlen > 0 && self.name(r.name_off) == root.as_bytes()
                })
            })
            .transpose()?
            .ok_or_else(|| BtfError::NoStruct(root.into()))?;
        let mut owner_name = root.to_string();
        let mut bits = 0u32;
        for (depth, member) in path.iter().enumerate() {
            let (type_id, bit_offset, bitfield) =
                self.member(owner, member)?
                    .ok_or_else(|| BtfError::NoMember {
                        owner: owner_name.clone(),
                        member: member.to_string(),
                    })?;
            if bitfield != 0 || bit_offset % 8 != 0 {
                return Err(BtfError::BitField {
                    owner: owner_name,
                    member: member.to_string(),
                });
            }
            bits = bits
                .checked_add(bit_offset)
                .ok_or(BtfError::Malformed(owner.at))?;
            if depth + 1 < path.len() {
                owner = self
                    .resolve_struct(type_id)?
                    .ok_or_else(|| BtfError::NotAStruct {
                        owner: owner_name.clone(),
                        member: member.to_string(),
                    })?;
                owner_name = format!("{owner_name}.{member}");
            }
        }
        Ok(bits / 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member_offset(btf_bytes: &[u8], root: &str, path: &[&str]) -> Result<u32, BtfError> {
        Btf::parse(btf_bytes)?.member_offset(root, path)
    }

    const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

    /// btfparse (a full BTF type graph, dev-dependency only) as the oracle.
    fn oracle(bytes: &[u8], root: &str, path: &str) -> u32 {
        struct Bytes<'a>(&'a [u8]);
        impl btfparse::Readable for Bytes<'_> {
            fn read(&self, offset: u64, buffer: &mut [u8]) -> btfparse::Result<()> {
                let start = offset as usize;
                buffer.copy_from_slice(&self.0[start..start + buffer.len()]);
                Ok(())
            }
        }
        let types = btfparse::TypeInformation::new(&Bytes(bytes)).expect("oracle parses");
        let id = types.id_of(root).expect("oracle finds the struct");
        match types.offset_of(id, path).expect("oracle finds the member") {
            (_, btfparse::Offset::ByteOffset(offset)) => offset,
            (_, other) => panic!("oracle: {other:?}"),
        }
    }

    #[test]
    fn kernel_offsets_match_a_full_btf_parser() {
        let bytes = std::fs::read(VMLINUX).expect("this kernel has BTF");
        for (root, path) in [
            ("task_struct", &["thread", "fsbase"][..]),
            ("task_struct", &["pid"][..]),
            ("task_struct", &["tgid"][..]),
            ("task_struct", &["comm"][..]),
            ("mm_struct", &["exe_file"][..]),
        ] {
            assert_eq!(
                member_offset(&bytes, root, path),
                Ok(oracle(&bytes, root, &path.join("."))),
                "{root}.{}",
                path.join(".")
            );
        }
        assert_eq!(
            member_offset(&bytes, "task_struct", &["no_such_member"]),
            Err(BtfError::NoMember {
                owner: "task_struct".into(),
                member: "no_such_member".into()
            })
        );
        assert_eq!(
            member_offset(&bytes, "no_such_struct", &["x"]),
            Err(BtfError::NoStruct("no_such_struct".into()))
        );
        assert!(matches!(
            member_offset(&bytes, "task_struct", &["pid", "x"]),
            Err(BtfError::NotAStruct { .. })
        ));
    }

    #[test]
    fn damaged_btf_is_an_error_not_a_panic() {
        let good = std::fs::read(VMLINUX).expect("this kernel has BTF");
        assert_eq!(
            member_offset(&[], "task_struct", &["pid"]),
            Err(BtfError::BadHeader)
        );
        assert_eq!(
            member_offset(&good[..20], "task_struct", &["pid"]),
            Err(BtfError::BadHeader)
        );
        // Every prefix length class, and bytes flipped all over the type section.
        for len in [24, 25, 100, good.len() / 3, good.len() - 1] {
            let _ = member_offset(&good[..len], "task_struct", &["thread", "fsbase"]);
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..50 {
            let mut bytes = good.clone();
            for _ in 0..8 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let at = (state as usize) % bytes.len();
                bytes[at] = (state >> 32) as u8;
            }
            let _ = member_offset(&bytes, "task_struct", &["thread", "fsbase"]);
        }
    }
}
