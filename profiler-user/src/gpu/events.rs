//! Records of the CUDA probes → [`CudaRecord`], and what they mean for the profiles: which
//! profile kind an event adds to, the frames it ends with, and the kernel names learned.
use std::{collections::HashMap, sync::Arc};

use profiler_common::{
    CALL_DRV_ALLOC, CALL_DRV_GRAPH_LAUNCH, CALL_DRV_LAUNCH, CALL_DRV_LAUNCH_EX, CALL_DRV_MEMCPY,
    CALL_DRV_MEMCPY_DTOD, CALL_DRV_MEMCPY_DTOH, CALL_DRV_MEMCPY_HTOD, CALL_DRV_SYNC,
    CALL_RT_GRAPH_LAUNCH, CALL_RT_LAUNCH, CALL_RT_LAUNCH_EXC, CALL_RT_LAUNCH_HANDLE,
    CALL_RT_MALLOC, CALL_RT_MEMCPY, CALL_RT_SYNC, CUDA_EVENT_HAS_STACK, CUDA_EVENT_HEADER_BYTES,
    CUDA_EVENT_KNOWN_FLAGS, CUDA_EVENT_NAME, CudaEventHeader, KERNEL_NAME_BYTES,
    MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_HOST_TO_DEVICE, MEMCPY_HOST_TO_HOST,
};

use crate::{
    model::{Pid, ProfileKind, Sample},
    sampling::{DecodeError, decode_sample},
};

/// One decoded record of the `CUDA_EVENTS` ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaRecord {
    /// A reported call; `stack` is present when the thread's stack budget allowed one.
    Call {
        header: CudaEventHeader,
        stack: Option<Sample>,
    },
    /// A handle learned at the return of `__cudaGetKernel` (stub in `header.aux`) or
    /// `cuModuleGetFunction` / `cuLibraryGetKernel` (`name`).
    Name {
        header: CudaEventHeader,
        name: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CudaDecodeError {
    #[error("CUDA record has {0} bytes, fewer than its header")]
    Short(usize),
    #[error("CUDA record has unknown flag bits {0:#x}")]
    UnknownFlags(u32),
    #[error("CUDA record's stack: {0}")]
    Stack(#[from] DecodeError),
}

pub fn decode_cuda_record(bytes: &[u8]) -> Result<CudaRecord, CudaDecodeError> {
    if bytes.len() < CUDA_EVENT_HEADER_BYTES {
        return Err(CudaDecodeError::Short(bytes.len()));
    }
    // SAFETY: length checked; plain old data read unaligned.
    let header: CudaEventHeader = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    if header.flags & !CUDA_EVENT_KNOWN_FLAGS != 0 {
        return Err(CudaDecodeError::UnknownFlags(
            header.flags & !CUDA_EVENT_KNOWN_FLAGS,
        ));
    }
    let rest = &bytes[CUDA_EVENT_HEADER_BYTES..];
    if header.flags & CUDA_EVENT_NAME != 0 {
        let raw = &rest[..rest.len().min(KERNEL_NAME_BYTES)];
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        return Ok(CudaRecord::Name {
            header,
            name: String::from_utf8_lossy(&raw[..end]).into_owned(),
        });
    }
    let stack = if header.flags & CUDA_EVENT_HAS_STACK != 0 {
        Some(decode_sample(rest)?)
    } else {
        None
    };
    Ok(CudaRecord::Call { header, stack })
}

/// The profile a call adds to, or `None` for calls that only mark state (frees are counted in
/// self-metrics, not profiled).
pub fn profile_kind(call: u32) -> Option<ProfileKind> {
    match call & 0xff {
        CALL_RT_LAUNCH
        | CALL_RT_LAUNCH_EXC
        | CALL_RT_LAUNCH_HANDLE
        | CALL_DRV_LAUNCH
        | CALL_DRV_LAUNCH_EX
        | CALL_RT_GRAPH_LAUNCH
        | CALL_DRV_GRAPH_LAUNCH => Some(ProfileKind::CudaLaunch),
        CALL_RT_SYNC | CALL_DRV_SYNC => Some(ProfileKind::CudaSync),
        CALL_RT_MEMCPY | CALL_DRV_MEMCPY | CALL_DRV_MEMCPY_HTOD | CALL_DRV_MEMCPY_DTOH
        | CALL_DRV_MEMCPY_DTOD => Some(ProfileKind::CudaMemcpy),
        CALL_RT_MALLOC | CALL_DRV_ALLOC => Some(ProfileKind::CudaAlloc),
        _ => None,
    }
}

/// The frame naming a copy's direction (`cudaMemcpyKind`).
pub fn direction_frame(kind: u64) -> &'static str {
    match kind as u32 {
        MEMCPY_HOST_TO_HOST => "[host to host]",
        MEMCPY_HOST_TO_DEVICE => "[host to device]",
        MEMCPY_DEVICE_TO_HOST => "[device to host]",
        MEMCPY_DEVICE_TO_DEVICE => "[device to device]",
        _ => "[direction from addresses]",
    }
}

/// How a launch's kernel is to be named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelRef {
    /// Symbolize this host stub address in the process.
    Stub(u64),
    /// A name learned from the driver.
    Named(Arc<str>),
    /// Nothing known: shown as `kernel@0x…`.
    Unknown(u64),
    /// A graph launch: its kernels are not visible to launch probes.
    Graph(u64),
}

/// Handle → name maps learned per process. Bounded: cleared when it grows past its limit
/// (names are learned again when modules are reloaded; until then launches show handles).
#[derive(Debug, Default)]
pub struct KernelNames {
    stubs: HashMap<(Pid, u64), u64>,
    names: HashMap<(Pid, u64), Arc<str>>,
}

const MAX_NAMES: usize = 200_000;

impl KernelNames {
    pub fn learn(&mut self, header: &CudaEventHeader, name: &str) {
        if self.stubs.len() + self.names.len() > MAX_NAMES {
            self.stubs.clear();
            self.names.clear();
        }
        let key = (Pid(header.pid), header.handle);
        if !name.is_empty() {
            self.names.insert(key, name.into());
        } else if header.aux != 0 {
            self.stubs.insert(key, header.aux);
        }
    }

    pub fn forget_process(&mut self, pid: Pid) {
        self.stubs.retain(|(p, _), _| *p != pid);
        self.names.retain(|(p, _), _| *p != pid);
    }

    /// How to name the kernel of a launch event.
    pub fn kernel(&self, header: &CudaEventHeader) -> KernelRef {
        let key = (Pid(header.pid), header.handle);
        match header.call & 0xff {
            CALL_RT_LAUNCH | CALL_RT_LAUNCH_EXC => KernelRef::Stub(header.handle),
            CALL_RT_GRAPH_LAUNCH | CALL_DRV_GRAPH_LAUNCH => KernelRef::Graph(header.handle),
            _ => {
                if let Some(stub) = self.stubs.get(&key) {
                    KernelRef::Stub(*stub)
                } else if let Some(name) = self.names.get(&key) {
                    KernelRef::Named(name.clone())
                } else {
                    KernelRef::Unknown(header.handle)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use profiler_common::{CALL_DRV_GET_FUNCTION, CALL_RT_GET_KERNEL};

    fn header(call: u32, handle: u64, aux: u64) -> CudaEventHeader {
        CudaEventHeader {
            pid: 7,
            tid: 7,
            call,
            handle,
            aux,
            ..Default::default()
        }
    }

    #[test]
    fn header_only_and_name_records_decode() {
        let h = header(CALL_RT_MEMCPY, 0, 1);
        let bytes =
            unsafe { std::slice::from_raw_parts((&h as *const CudaEventHeader).cast::<u8>(), 48) };
        assert_eq!(
            decode_cuda_record(bytes),
            Ok(CudaRecord::Call {
                header: h,
                stack: None
            })
        );
        let mut named = bytes.to_vec();
        named[44] = CUDA_EVENT_NAME as u8;
        named.extend_from_slice(b"triton_poi_fused_add_0\0garbage");
        match decode_cuda_record(&named) {
            Ok(CudaRecord::Name { name, .. }) => assert_eq!(name, "triton_poi_fused_add_0"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decode_cuda_record(&bytes[..10]),
            Err(CudaDecodeError::Short(10))
        );
        let mut bad = bytes.to_vec();
        bad[47] = 0x80;
        assert!(matches!(
            decode_cuda_record(&bad),
            Err(CudaDecodeError::UnknownFlags(_))
        ));
    }

    #[test]
    fn kernels_are_named_by_stub_learned_name_or_handle() {
        let mut names = KernelNames::default();
        assert_eq!(
            names.kernel(&header(CALL_RT_LAUNCH, 0x1000, 0)),
            KernelRef::Stub(0x1000)
        );
        assert_eq!(
            names.kernel(&header(CALL_DRV_LAUNCH, 0xabc, 0)),
            KernelRef::Unknown(0xabc)
        );
        names.learn(&header(CALL_DRV_GET_FUNCTION, 0xabc, 0), "gemm");
        assert_eq!(
            names.kernel(&header(CALL_DRV_LAUNCH, 0xabc, 0)),
            KernelRef::Named("gemm".into())
        );
        names.learn(&header(CALL_RT_GET_KERNEL, 0x55, 0x2000), "");
        assert_eq!(
            names.kernel(&header(CALL_RT_LAUNCH_HANDLE, 0x55, 0)),
            KernelRef::Stub(0x2000)
        );
        names.forget_process(Pid(7));
        assert_eq!(
            names.kernel(&header(CALL_DRV_LAUNCH, 0xabc, 0)),
            KernelRef::Unknown(0xabc)
        );
        assert_eq!(
            profile_kind(CALL_RT_SYNC | (3 << 8)),
            Some(ProfileKind::CudaSync)
        );
    }
}
