//! Bytes from the ring buffer → [`Sample`], validated against the ABI in profiler-common.
use std::sync::Arc;

use profiler_common::{
    MAX_KERNEL_FRAMES, MAX_PYTHON_FRAMES, MAX_USER_FRAMES, NO_FALLBACK_FRAME, PY_FRAME_ENTRY,
    PY_FRAME_FINGERPRINT_MASK, PyFrameRecord, SAMPLE_HEADER_BYTES, SAMPLE_IN_CUDA_SYNC,
    SAMPLE_KERNEL_TRUNCATED, SAMPLE_KNOWN_FLAGS, SAMPLE_PYTHON_TRUNCATED,
    SAMPLE_USER_LEAF_RETURN_ADDRESS, SAMPLE_USER_STACK_COPY, SAMPLE_USER_STACK_ERROR,
    SAMPLE_USER_TABLE_MISSING, SAMPLE_USER_TRUNCATED, SAMPLE_USER_UNKNOWN_MAPPING,
    STACK_COPY_BYTES, STACK_COPY_EXACT_PC, STACK_COPY_HEADER_BYTES, SampleHeader, StackCopyHeader,
    sample_record_bytes, stack_copy_record_bytes,
};

use crate::model::{Pid, PythonFrameRef, Sample, StackCopy, Tid};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("sample record has {actual} bytes, expected {expected}")]
    WrongSize { actual: usize, expected: usize },
    #[error("sample has unknown flag bits {0:#x}")]
    UnknownFlags(u32),
    #[error(
        "sample claims {kernel} kernel, {user} user and {python} Python frames (limits {MAX_KERNEL_FRAMES}/{MAX_USER_FRAMES}/{MAX_PYTHON_FRAMES})"
    )]
    TooManyFrames { kernel: u16, user: u16, python: u16 },
    #[error("sample claims a stack copy of {0} bytes (limit {STACK_COPY_BYTES})")]
    StackCopyTooLarge(u32),
}

/// Decodes one record: the header, then the user, kernel and Python frames it counts
/// (`profiler_common::sample_record_bytes`).
pub fn decode_sample(bytes: &[u8]) -> Result<Sample, DecodeError> {
    if bytes.len() < SAMPLE_HEADER_BYTES {
        return Err(DecodeError::WrongSize {
            actual: bytes.len(),
            expected: SAMPLE_HEADER_BYTES,
        });
    }
    // SAFETY: length checked; the header is plain old data and read unaligned.
    let header: SampleHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    if header.flags & !SAMPLE_KNOWN_FLAGS != 0 {
        return Err(DecodeError::UnknownFlags(
            header.flags & !SAMPLE_KNOWN_FLAGS,
        ));
    }
    let (kernel, user, python) = (
        header.kernel_frames as usize,
        header.user_frames as usize,
        header.python_frames as usize,
    );
    if kernel > MAX_KERNEL_FRAMES || user > MAX_USER_FRAMES || python > MAX_PYTHON_FRAMES {
        return Err(DecodeError::TooManyFrames {
            kernel: header.kernel_frames,
            user: header.user_frames,
            python: header.python_frames,
        });
    }
    let frames_end = sample_record_bytes(kernel, user, python);
    let has_copy = header.flags & SAMPLE_USER_STACK_COPY != 0;
    let copy_header = if has_copy {
        let header_bytes = bytes
            .get(frames_end..frames_end + STACK_COPY_HEADER_BYTES)
            .ok_or(DecodeError::WrongSize {
                actual: bytes.len(),
                expected: frames_end + STACK_COPY_HEADER_BYTES,
            })?;
        // SAFETY: exactly the header's bytes; plain old data read unaligned.
        let copy: StackCopyHeader =
            unsafe { std::ptr::read_unaligned(header_bytes.as_ptr().cast()) };
        if copy.bytes as usize > STACK_COPY_BYTES {
            return Err(DecodeError::StackCopyTooLarge(copy.bytes));
        }
        Some(copy)
    } else {
        None
    };
    let expected =
        frames_end + copy_header.map_or(0, |copy| stack_copy_record_bytes(copy.bytes as usize));
    if bytes.len() != expected {
        return Err(DecodeError::WrongSize {
            actual: bytes.len(),
            expected,
        });
    }
    let words = |offset: usize, count: usize| {
        bytes[offset..offset + count * 8]
            .chunks_exact(8)
            .map(|word| u64::from_ne_bytes(word.try_into().expect("8-byte chunk")))
    };
    let user_offset = SAMPLE_HEADER_BYTES;
    let kernel_offset = user_offset + user * 8;
    let python_offset = kernel_offset + kernel * 8;
    let comm_len = header
        .comm
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(header.comm.len());
    Ok(Sample {
        ktime_ns: header.ktime_ns,
        pid: Pid(header.pid),
        tid: Tid(header.tid),
        cpu: header.cpu,
        comm: Arc::from(String::from_utf8_lossy(&header.comm[..comm_len]).as_ref()),
        kernel_ips: words(kernel_offset, kernel).collect(),
        // Sized once: `take_while` gives no size hint, and collecting grew the vector four or
        // five times for an ordinary stack, at every sample.
        user_ips: {
            let mut ips = Vec::with_capacity(user);
            ips.extend(words(user_offset, user).take_while(|&ip| ip != 0));
            ips
        },
        python_frames: bytes[python_offset..frames_end]
            .chunks_exact(size_of::<PyFrameRecord>())
            .map(|record| {
                // SAFETY: exactly one record's bytes; plain old data read unaligned.
                let record: PyFrameRecord =
                    unsafe { std::ptr::read_unaligned(record.as_ptr().cast()) };
                PythonFrameRef {
                    code_addr: record.code,
                    instruction: record.instruction,
                    fingerprint: record.meta & PY_FRAME_FINGERPRINT_MASK,
                    entry: record.meta & PY_FRAME_ENTRY != 0,
                }
            })
            .collect(),
        kernel_truncated: header.flags & SAMPLE_KERNEL_TRUNCATED != 0,
        user_truncated: header.flags & SAMPLE_USER_TRUNCATED != 0,
        user_stack_error: header.flags & SAMPLE_USER_STACK_ERROR != 0,
        user_unknown_mapping: header.flags & SAMPLE_USER_UNKNOWN_MAPPING != 0,
        user_table_missing: header.flags & SAMPLE_USER_TABLE_MISSING != 0,
        user_leaf_is_return_address: header.flags & SAMPLE_USER_LEAF_RETURN_ADDRESS != 0,
        fallback_frame: (header.fallback_frame != NO_FALLBACK_FRAME)
            .then_some(header.fallback_frame as usize),
        python_truncated: header.flags & SAMPLE_PYTHON_TRUNCATED != 0,
        in_cuda_sync: header.flags & SAMPLE_IN_CUDA_SYNC != 0,
        stack_copy: copy_header.map(|copy| {
            let start = frames_end + STACK_COPY_HEADER_BYTES;
            Box::new(StackCopy {
                rip: copy.rip,
                rsp: copy.rsp,
                rbp: copy.rbp,
                exact_pc: copy.flags & STACK_COPY_EXACT_PC != 0,
                bytes: bytes[start..start + copy.bytes as usize].to_vec(),
            })
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use profiler_common::RawSample;

    fn bytes_of<T>(values: &[T]) -> &[u8] {
        // SAFETY: the ABI types are repr(C) plain old data without padding.
        unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) }
    }

    /// The bytes BPF sends: the header, then the used user, kernel and Python slots.
    fn encode(raw: &RawSample) -> Vec<u8> {
        let h = &raw.header;
        let user = (h.user_frames as usize).min(MAX_USER_FRAMES);
        let kernel = (h.kernel_frames as usize).min(MAX_KERNEL_FRAMES);
        let python = (h.python_frames as usize).min(MAX_PYTHON_FRAMES);
        let mut bytes = bytes_of(std::slice::from_ref(h)).to_vec();
        bytes.extend_from_slice(bytes_of(&raw.user_ips[..user]));
        bytes.extend_from_slice(bytes_of(&raw.kernel_ips[..kernel]));
        bytes.extend_from_slice(bytes_of(&raw.python[..python]));
        if h.flags & SAMPLE_USER_STACK_COPY != 0 {
            bytes.extend_from_slice(bytes_of(std::slice::from_ref(&raw.copy)));
            bytes.extend_from_slice(&raw.stack[..raw.copy.bytes as usize]);
        }
        bytes
    }

    fn raw_sample() -> RawSample {
        let mut comm = [0u8; 16];
        comm[..6].copy_from_slice(b"python");
        let mut raw = RawSample {
            header: SampleHeader {
                ktime_ns: 42,
                pid: 100,
                tid: 101,
                cpu: 1,
                flags: SAMPLE_USER_TRUNCATED,
                kernel_frames: 2,
                user_frames: 3,
                python_frames: 2,
                fallback_frame: NO_FALLBACK_FRAME,
                comm,
            },
            kernel_ips: [0; MAX_KERNEL_FRAMES],
            user_ips: [0; MAX_USER_FRAMES],
            python: [PyFrameRecord::default(); MAX_PYTHON_FRAMES],
            copy: StackCopyHeader::default(),
            stack: [0; STACK_COPY_BYTES + profiler_common::STACK_COPY_SLACK],
        };
        raw.python[0] = PyFrameRecord {
            code: 0x7f00_0000_1000,
            instruction: 24,
            meta: 17,
        };
        raw.python[1] = PyFrameRecord {
            code: 0x7f00_0000_2000,
            instruction: 8,
            meta: 3 | PY_FRAME_ENTRY,
        };
        raw.kernel_ips[..2].copy_from_slice(&[0xffff_ffff_8100_0000, 0xffff_ffff_8100_1000]);
        raw.user_ips[..3].copy_from_slice(&[0x401000, 0x401100, 0x401200]);
        raw
    }

    #[test]
    fn round_trips_a_sample() {
        let sample = decode_sample(&encode(&raw_sample())).unwrap();
        assert_eq!(sample.pid, Pid(100));
        assert_eq!(sample.tid, Tid(101));
        assert_eq!(&*sample.comm, "python");
        assert_eq!(
            sample.kernel_ips,
            vec![0xffff_ffff_8100_0000, 0xffff_ffff_8100_1000]
        );
        assert_eq!(sample.user_ips, vec![0x401000, 0x401100, 0x401200]);
        assert!(sample.user_truncated && !sample.kernel_truncated && !sample.user_stack_error);
        assert_eq!(
            sample.python_frames,
            vec![
                PythonFrameRef {
                    code_addr: 0x7f00_0000_1000,
                    instruction: 24,
                    fingerprint: 17,
                    entry: false
                },
                PythonFrameRef {
                    code_addr: 0x7f00_0000_2000,
                    instruction: 8,
                    fingerprint: 3,
                    entry: true
                },
            ]
        );
    }

    #[test]
    fn round_trips_a_stack_copy() {
        let mut raw = raw_sample();
        raw.header.flags |= SAMPLE_USER_STACK_COPY;
        raw.copy = StackCopyHeader {
            rip: 0x401200,
            rsp: 0x7ffc_0000_1000,
            rbp: 0x7ffc_0000_1100,
            flags: STACK_COPY_EXACT_PC,
            bytes: 24,
        };
        raw.stack[..24].copy_from_slice(bytes_of(&[1u64, 0x401300, 3]));
        let sample = decode_sample(&encode(&raw)).unwrap();
        assert_eq!(sample.user_ips, vec![0x401000, 0x401100, 0x401200]);
        assert_eq!(
            sample.python_frames.len(),
            2,
            "the copy is not read as Python frames"
        );
        let copy = sample.stack_copy.expect("copy decoded");
        assert_eq!(
            (copy.rip, copy.rsp, copy.exact_pc),
            (0x401200, 0x7ffc_0000_1000, true)
        );
        assert_eq!(copy.read(0x7ffc_0000_1008), Some(0x401300));
        assert_eq!(
            copy.read(0x7ffc_0000_1011),
            None,
            "the last word is not whole"
        );
        assert_eq!(copy.read(0x7ffc_0000_0ff8), None, "below the copy");
        // Lengths that disagree with the copy header, and a header claiming too much.
        let mut bytes = encode(&raw);
        bytes.pop();
        assert!(matches!(
            decode_sample(&bytes),
            Err(DecodeError::WrongSize { .. })
        ));
        raw.copy.bytes = STACK_COPY_BYTES as u32 + 8;
        let mut bytes = encode(&{
            let mut shorter = raw;
            shorter.copy.bytes = 0;
            shorter
        });
        let at = bytes.len() - STACK_COPY_HEADER_BYTES + 28;
        bytes[at..at + 4].copy_from_slice(&(STACK_COPY_BYTES as u32 + 8).to_le_bytes());
        assert_eq!(
            decode_sample(&bytes),
            Err(DecodeError::StackCopyTooLarge(STACK_COPY_BYTES as u32 + 8))
        );
    }

    #[test]
    fn rejects_short_records_unknown_flags_and_frame_counts() {
        let bytes = encode(&raw_sample());
        assert!(matches!(
            decode_sample(&bytes[..100]),
            Err(DecodeError::WrongSize { .. })
        ));
        let mut raw = raw_sample();
        raw.header.flags = 1 << 30;
        assert_eq!(
            decode_sample(&encode(&raw)),
            Err(DecodeError::UnknownFlags(1 << 30))
        );
        let mut raw = raw_sample();
        raw.header.user_frames = 5000;
        assert!(matches!(
            decode_sample(&encode(&raw)),
            Err(DecodeError::TooManyFrames { .. })
        ));
        // A record whose length disagrees with its user frame count.
        let mut raw = raw_sample();
        raw.header.user_frames = 4;
        let mut bytes = encode(&raw);
        bytes.truncate(bytes.len() - 8);
        assert!(matches!(
            decode_sample(&bytes),
            Err(DecodeError::WrongSize { .. })
        ));
        // A record whose length disagrees with its Python frame count.
        let mut bytes = encode(&raw_sample());
        bytes.truncate(bytes.len() - 16);
        assert!(matches!(
            decode_sample(&bytes),
            Err(DecodeError::WrongSize { .. })
        ));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for len in [
            0,
            1,
            47,
            SAMPLE_HEADER_BYTES,
            SAMPLE_HEADER_BYTES + 8,
            SAMPLE_HEADER_BYTES + 16,
            sample_record_bytes(2, 3, 2),
            sample_record_bytes(2, 3, 2) + 8,
            3000,
        ] {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let _ = decode_sample(&bytes);
        }
    }
}
