//! CUDA calls that returned an error: their codes named (`cudaError_t` for the runtime,
//! `CUresult` for the driver, from NVIDIA's headers) and counted by function and code, so a
//! missing driver shows as errors rather than as work.
use std::collections::BTreeMap;

use profiler_common::CALL_FIRST_DRIVER;

use super::discovery::function_name;

/// Distinct (function, code) pairs counted; calls beyond are counted under `other`.
pub const MAX_FAILED_KINDS: usize = 512;

/// The name of error `code` of a call (`call`: the record's cookie), or `error <code>` for a
/// code not listed here (shown as a number, never guessed).
pub fn error_name(call: u32, code: u64) -> String {
    let code = code as u32;
    let known = if call & 0xff < CALL_FIRST_DRIVER {
        runtime_error(code)
    } else {
        driver_error(code)
    };
    known.map_or_else(|| format!("error {code}"), str::to_owned)
}

/// `cudaError_t` values (driver_types.h) that runtime calls return in practice.
fn runtime_error(code: u32) -> Option<&'static str> {
    Some(match code {
        1 => "cudaErrorInvalidValue",
        2 => "cudaErrorMemoryAllocation",
        3 => "cudaErrorInitializationError",
        4 => "cudaErrorCudartUnloading",
        9 => "cudaErrorInvalidConfiguration",
        13 => "cudaErrorInvalidSymbol",
        21 => "cudaErrorInvalidMemcpyDirection",
        34 => "cudaErrorStubLibrary",
        35 => "cudaErrorInsufficientDriver",
        36 => "cudaErrorCallRequiresNewerDriver",
        46 => "cudaErrorDevicesUnavailable",
        52 => "cudaErrorMissingConfiguration",
        98 => "cudaErrorInvalidDeviceFunction",
        100 => "cudaErrorNoDevice",
        101 => "cudaErrorInvalidDevice",
        200 => "cudaErrorInvalidKernelImage",
        201 => "cudaErrorDeviceUninitialized",
        209 => "cudaErrorNoKernelImageForDevice",
        400 => "cudaErrorInvalidResourceHandle",
        500 => "cudaErrorSymbolNotFound",
        600 => "cudaErrorNotReady",
        700 => "cudaErrorIllegalAddress",
        701 => "cudaErrorLaunchOutOfResources",
        702 => "cudaErrorLaunchTimeout",
        719 => "cudaErrorLaunchFailure",
        803 => "cudaErrorSystemDriverMismatch",
        999 => "cudaErrorUnknown",
        _ => return None,
    })
}

/// `CUresult` values (cuda.h) that driver calls return in practice.
fn driver_error(code: u32) -> Option<&'static str> {
    Some(match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// Failed calls counted by (function, error name); bounded by [`MAX_FAILED_KINDS`].
#[derive(Debug, Default, Clone)]
pub struct FailedCalls {
    counts: BTreeMap<(&'static str, String), u64>,
}

impl FailedCalls {
    /// Counts one failed call; returns the error's name.
    pub fn count(&mut self, call: u32, code: u64) -> String {
        let error = error_name(call, code);
        let mut key = (function_name(call), error.clone());
        if !self.counts.contains_key(&key) && self.counts.len() >= MAX_FAILED_KINDS {
            key = ("other", "other".to_owned());
        }
        *self.counts.entry(key).or_default() += 1;
        error
    }

    /// (function, error, calls), in order.
    pub fn counts(&self) -> impl Iterator<Item = (&'static str, &str, u64)> {
        self.counts
            .iter()
            .map(|((function, error), calls)| (*function, error.as_str(), *calls))
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::discovery::PROBED_FUNCTIONS;
    use profiler_common::{CALL_DRV_ALLOC, CALL_RT_LAUNCH};

    /// The cookie of a probed function, as discovery gives it.
    fn cookie_of(name: &str) -> u32 {
        let index = PROBED_FUNCTIONS
            .iter()
            .position(|(n, _)| *n == name)
            .expect("probed");
        PROBED_FUNCTIONS[index].1 | ((index as u32) << 8)
    }

    #[test]
    fn codes_are_named_by_api_and_unknown_ones_shown_as_numbers() {
        assert_eq!(
            error_name(CALL_RT_LAUNCH, 35),
            "cudaErrorInsufficientDriver"
        );
        assert_eq!(error_name(CALL_DRV_ALLOC, 2), "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(error_name(CALL_RT_LAUNCH, 4242), "error 4242");
    }

    #[test]
    fn failed_calls_are_counted_by_function_and_code_within_a_bound() {
        let mut failed = FailedCalls::default();
        for _ in 0..3 {
            failed.count(CALL_RT_LAUNCH, 35);
        }
        assert_eq!(cookie_of("cuMemAlloc_v2") & 0xff, CALL_DRV_ALLOC);
        failed.count(cookie_of("cuMemAlloc_v2"), 2);
        let counts: Vec<_> = failed.counts().collect();
        assert!(counts.contains(&("cudaLaunchKernel", "cudaErrorInsufficientDriver", 3)));
        assert!(counts.contains(&("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY", 1)));
        for code in 0..(MAX_FAILED_KINDS as u64 + 10) {
            failed.count(CALL_RT_LAUNCH, 10_000 + code);
        }
        assert!(failed.counts().count() <= MAX_FAILED_KINDS + 1);
        assert_eq!(failed.total(), 4 + MAX_FAILED_KINDS as u64 + 10);
    }
}
