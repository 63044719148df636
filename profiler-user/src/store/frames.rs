//! Frames as the store keeps them: a function name with where its code is — source file and
//! line, the object file with its build id, the address in that file — and whether it was
//! inlined into its caller. Stack nodes are keyed by frame, so a download gives back what the
//! pprof that was pushed said; flame graphs merge sibling frames of one name.
//!
//! Addresses are kept as offsets in their object file (`address − mapping start + file
//! offset`): the same code has the same frame in every process of a service, whatever the
//! address-space layout. A frame without an object file keeps no address (a Python code
//! object's or JIT code's address differs in each process and would make a new frame per
//! process).
//!
//! A frame block (one per write that added frames) is a list of frames, each as varints:
//! name, system name, file, object and build id (string id + 1, 0 for none; the name always
//! present), start line, line, address, and 1 when inlined else 0.

use super::codec::{CorruptProfile, Reader, put_varint};

/// "No string": a frame field that is absent.
pub const NO_STRING: u32 = u32::MAX;

/// One frame; its strings are ids in a string table (a [`super::NewProfile`]'s `names`, or the
/// store's names once stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub name: u32,
    /// The raw (mangled) name when it differs from `name`, else [`NO_STRING`].
    pub system_name: u32,
    pub file: u32,
    /// The function's first line, 0 when unknown.
    pub start_line: u32,
    /// The line of this frame, 0 when unknown.
    pub line: u32,
    /// The object file the code is in (the pprof mapping's file name).
    pub object: u32,
    pub build_id: u32,
    /// Offset in `object`; 0 when unknown or without an object.
    pub address: u64,
    /// Inlined into its parent frame: both are lines of one pprof location.
    pub inlined: bool,
}

impl Frame {
    /// A frame that is only a name (folded stacks, markers such as `[truncated]`).
    pub fn named(name: u32) -> Frame {
        Frame {
            name,
            system_name: NO_STRING,
            file: NO_STRING,
            start_line: 0,
            line: 0,
            object: NO_STRING,
            build_id: NO_STRING,
            address: 0,
            inlined: false,
        }
    }

    /// The same frame with its strings translated by `string` (which returns `None` for an id
    /// it does not know); `None` when its name is unknown.
    pub fn translated(&self, string: impl Fn(u32) -> Option<u32>) -> Option<Frame> {
        let optional = |id: u32| {
            if id == NO_STRING {
                NO_STRING
            } else {
                string(id).unwrap_or(NO_STRING)
            }
        };
        Some(Frame {
            name: string(self.name)?,
            system_name: optional(self.system_name),
            file: optional(self.file),
            object: optional(self.object),
            build_id: optional(self.build_id),
            ..*self
        })
    }
}

fn put_string(out: &mut Vec<u8>, id: u32) {
    put_varint(
        out,
        if id == NO_STRING {
            0
        } else {
            u64::from(id) + 1
        },
    );
}

/// Encodes a block of frames (see the module's layout).
pub fn encode_frames(frames: &[Frame]) -> Vec<u8> {
    let mut out = Vec::with_capacity(frames.len() * 8);
    for frame in frames {
        put_varint(&mut out, u64::from(frame.name));
        for id in [frame.system_name, frame.file, frame.object, frame.build_id] {
            put_string(&mut out, id);
        }
        put_varint(&mut out, u64::from(frame.start_line));
        put_varint(&mut out, u64::from(frame.line));
        put_varint(&mut out, frame.address);
        out.push(u8::from(frame.inlined));
    }
    out
}

/// Calls `add` with every frame of an encoded block.
pub fn decode_frames(bytes: &[u8], mut add: impl FnMut(Frame)) -> Result<(), CorruptProfile> {
    let mut reader = Reader::new(bytes);
    let small = |value: u64| u32::try_from(value).map_err(|_| CorruptProfile("frame out of range"));
    let string = |value: u64| match value {
        0 => Ok(NO_STRING),
        id => u32::try_from(id - 1)
            .ok()
            .filter(|&id| id != NO_STRING)
            .ok_or(CorruptProfile("frame string out of range")),
    };
    while !reader.at_end() {
        let name = small(reader.varint()?)?;
        if name == NO_STRING {
            return Err(CorruptProfile("frame string out of range"));
        }
        let system_name = string(reader.varint()?)?;
        let file = string(reader.varint()?)?;
        let object = string(reader.varint()?)?;
        let build_id = string(reader.varint()?)?;
        let start_line = small(reader.varint()?)?;
        let line = small(reader.varint()?)?;
        let address = reader.varint()?;
        let inlined = match reader.take(1)?[0] {
            0 => false,
            1 => true,
            _ => return Err(CorruptProfile("frame flag out of range")),
        };
        add(Frame {
            name,
            system_name,
            file,
            start_line,
            line,
            object,
            build_id,
            address,
            inlined,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn frame() -> impl Strategy<Value = Frame> {
        let string = prop_oneof![Just(NO_STRING), 0u32..NO_STRING];
        (
            0u32..NO_STRING,
            string.clone(),
            string.clone(),
            string.clone(),
            string,
            any::<(u32, u32, u64, bool)>(),
        )
            .prop_map(
                |(
                    name,
                    system_name,
                    file,
                    object,
                    build_id,
                    (start_line, line, address, inlined),
                )| Frame {
                    name,
                    system_name,
                    file,
                    start_line,
                    line,
                    object,
                    build_id,
                    address,
                    inlined,
                },
            )
    }

    #[test]
    fn a_named_frame_takes_a_few_bytes() {
        let bytes = encode_frames(&[Frame::named(5)]);
        assert_eq!(bytes, [5, 0, 0, 0, 0, 0, 0, 0, 0]);
        let mut decoded = Vec::new();
        decode_frames(&bytes, |f| decoded.push(f)).unwrap();
        assert_eq!(decoded, [Frame::named(5)]);
    }

    #[test]
    fn translation_keeps_what_is_known() {
        let frame = Frame {
            system_name: 1,
            file: 7,
            line: 12,
            address: 0x1234,
            ..Frame::named(0)
        };
        let translated = frame.translated(|id| (id < 5).then_some(id + 100)).unwrap();
        assert_eq!(
            (translated.name, translated.system_name, translated.file),
            (100, 101, NO_STRING)
        );
        assert_eq!((translated.line, translated.address), (12, 0x1234));
        assert_eq!(frame.translated(|_| None), None);
    }

    proptest! {
        #[test]
        fn frames_round_trip(frames in proptest::collection::vec(frame(), 0..20)) {
            let bytes = encode_frames(&frames);
            let mut decoded = Vec::new();
            decode_frames(&bytes, |f| decoded.push(f)).unwrap();
            prop_assert_eq!(&decoded, &frames);
            if !bytes.is_empty() {
                let truncated = decode_frames(&bytes[..bytes.len() - 1], |_| {});
                prop_assert!(truncated.is_err());
            }
        }

        #[test]
        fn arbitrary_frame_blocks_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = decode_frames(&bytes, |_| {});
        }
    }
}
