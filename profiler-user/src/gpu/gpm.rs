//! DCGM's profiling fields without DCGM: NVML's GPM API (GPU Performance Monitoring, Hopper and
//! newer) reads the same SM, tensor-pipe, DRAM, PCIe and NVLink counters DCGM does. A GPM
//! metric is a rate between two samples of a GPU (or of one MIG GPU instance), so each target
//! keeps its previous sample, and a new pair is only used once at least [`MIN_SPACING`] apart
//! (NVML's advice: shorter windows are noise, and some drivers refuse them).
//!
//! Values are exported under dcgm-exporter's names and units: activity fields as ratios 0-1
//! (GPM gives percentages), traffic in bytes per second (GPM gives MiB/s). A GPU or driver
//! without GPM gets none of these fields; the reason is kept for `/api/gpu` and logged once.
use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use nvml_wrapper::{
    Device, GpmSample, Nvml, enums::gpm::GpmMetricId, error::NvmlError, gpm::gpm_metrics_get,
};

use super::nvml::DeviceValue;

/// The shortest window GPM metrics are computed over.
pub const MIN_SPACING: Duration = Duration::from_millis(100);

/// One exported field: the GPM metric it comes from, dcgm-exporter's name and help, and the
/// factor from GPM's unit to DCGM's.
pub struct GpmField {
    pub metric: GpmMetricId,
    pub name: &'static str,
    pub help: &'static str,
    pub scale: f64,
}

const PERCENT: f64 = 0.01;
const MIB: f64 = 1_048_576.0;

/// Every field exported, in dcgm-exporter's names (its `dcp-metrics-included.csv`).
pub const GPM_FIELDS: &[GpmField] = &[
    GpmField {
        metric: GpmMetricId::GraphicsUtil,
        name: "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        help: "Ratio of time the graphics engine is active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::SmUtil,
        name: "DCGM_FI_PROF_SM_ACTIVE",
        help: "The ratio of cycles an SM has at least 1 warp assigned.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::SmOccupancy,
        name: "DCGM_FI_PROF_SM_OCCUPANCY",
        help: "The ratio of number of warps resident on an SM.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::AnyTensorUtil,
        name: "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        help: "Ratio of cycles the tensor (HMMA) pipe is active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::HmmaTensorUtil,
        name: "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE",
        help: "Ratio of cycles the HMMA tensor pipe is active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::ImmaTensorUtil,
        name: "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE",
        help: "Ratio of cycles the IMMA tensor pipe is active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::DfmaTensorUtil,
        name: "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE",
        help: "Ratio of cycles the DFMA tensor pipe is active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::DramBwUtil,
        name: "DCGM_FI_PROF_DRAM_ACTIVE",
        help: "Ratio of cycles the device memory interface is active sending or receiving data.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::Fp64Util,
        name: "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        help: "Ratio of cycles the fp64 pipes are active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::Fp32Util,
        name: "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        help: "Ratio of cycles the fp32 pipes are active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::Fp16Util,
        name: "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        help: "Ratio of cycles the fp16 pipes are active.",
        scale: PERCENT,
    },
    GpmField {
        metric: GpmMetricId::PcieTxPerSec,
        name: "DCGM_FI_PROF_PCIE_TX_BYTES",
        help: "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        scale: MIB,
    },
    GpmField {
        metric: GpmMetricId::PcieRxPerSec,
        name: "DCGM_FI_PROF_PCIE_RX_BYTES",
        help: "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        scale: MIB,
    },
    GpmField {
        metric: GpmMetricId::NvlinkTotalTxPerSec,
        name: "DCGM_FI_PROF_NVLINK_TX_BYTES",
        help: "The rate of data transmitted over NVLink, not including protocol headers, in bytes per second.",
        scale: MIB,
    },
    GpmField {
        metric: GpmMetricId::NvlinkTotalRxPerSec,
        name: "DCGM_FI_PROF_NVLINK_RX_BYTES",
        help: "The rate of data received over NVLink, not including protocol headers, in bytes per second.",
        scale: MIB,
    },
];

/// What one GPU's GPM reading gave: the fields (each with the MIG GPU instance it belongs to,
/// `None` for the whole GPU), or why there are none.
#[derive(Debug, Default)]
pub struct GpmReading {
    pub values: Vec<DeviceValue>,
    pub unavailable: Option<String>,
}

/// The previous sample of each target (GPU index, MIG GPU instance) and what is known of each
/// GPU's support. Lives on the NVML thread, as long as the `Nvml` it samples.
#[derive(Default)]
pub struct GpmSampler<'nvml> {
    previous: HashMap<(u32, Option<u32>), (GpmSample<'nvml>, Instant)>,
    unsupported: HashMap<u32, String>,
}

impl<'nvml> GpmSampler<'nvml> {
    /// Samples GPU `index` (each of its GPU instances in MIG mode) and returns the fields over
    /// the window since the previous sample, none on the first call.
    pub fn read(&mut self, nvml: &'nvml Nvml, device: &Device<'nvml>, index: u32) -> GpmReading {
        if let Some(reason) = self.unsupported.get(&index) {
            return GpmReading {
                values: Vec::new(),
                unavailable: Some(reason.clone()),
            };
        }
        if let Err(reason) = support(device) {
            tracing::info!(gpu = index, "DCGM profiling fields are off: {reason}");
            self.unsupported.insert(index, reason.clone());
            return GpmReading {
                values: Vec::new(),
                unavailable: Some(reason),
            };
        }
        let mut reading = GpmReading::default();
        for target in targets(device) {
            let instance = target.as_ref().map(|(id, _)| *id);
            let profile = target.and_then(|(_, profile)| profile);
            let sample = match instance {
                None => device.gpm_sample(),
                Some(id) => device.gpm_mig_sample(id),
            };
            let sample = match sample {
                Ok(sample) => sample,
                Err(err) => {
                    tracing::debug!(gpu = index, ?instance, "GPM sample: {err}");
                    continue;
                }
            };
            let now = Instant::now();
            let key = (index, instance);
            match self.previous.remove(&key) {
                // Too close to the previous one: keep the older sample for a longer window.
                Some((older, at)) if now.duration_since(at) < MIN_SPACING => {
                    self.previous.insert(key, (older, at));
                }
                Some((older, _)) => {
                    reading.values.extend(metrics(
                        nvml,
                        &older,
                        &sample,
                        (instance, profile.as_deref()),
                        index,
                    ));
                    self.previous.insert(key, (sample, now));
                }
                None => {
                    self.previous.insert(key, (sample, now));
                }
            }
        }
        reading
    }
}

/// Whether the GPU and driver offer GPM, or why not.
fn support(device: &Device<'_>) -> Result<(), String> {
    match device.gpm_support() {
        Ok(true) => Ok(()),
        Ok(false) => Err("this GPU has no GPM (Hopper or newer is needed)".into()),
        Err(NvmlError::FailedToLoadSymbol(symbol)) => Err(format!(
            "the NVML library has no GPM ({symbol} is missing: driver older than R520)"
        )),
        Err(NvmlError::NotSupported) => {
            Err("GPM is not supported on this GPU or driver (Hopper or newer is needed)".into())
        }
        Err(err) => Err(format!("GPM support query failed: {err}")),
    }
}

/// What to sample on a GPU: the whole GPU, or in MIG mode each of its GPU instances (the
/// whole GPU is not sampled then, as DCGM reports MIG GPUs per instance), with the instance's
/// profile name when the driver gives one.
fn targets(device: &Device<'_>) -> Vec<Option<(u32, Option<String>)>> {
    let mig = device.mig_mode().is_ok_and(|mode| mode.current == 1);
    if !mig {
        return vec![None];
    }
    let count = device.mig_device_count().unwrap_or(0);
    (0..count)
        .filter_map(|i| device.mig_device_by_index(i).ok())
        .filter_map(|mig_device| {
            let id = gpu_instance_id(device.nvml(), &mig_device)?;
            let profile = mig_device
                .name()
                .ok()
                .and_then(|name| mig_profile(&name).map(str::to_owned));
            Some(Some((id, profile)))
        })
        .collect()
}

/// The profile in a MIG device's name (`NVIDIA H100 80GB HBM3 MIG 1g.10gb` → `1g.10gb`), as
/// dcgm-exporter's `GPU_I_PROFILE` has it.
fn mig_profile(name: &str) -> Option<&str> {
    let (_, profile) = name.rsplit_once(" MIG ")?;
    let profile = profile.trim();
    (!profile.is_empty() && !profile.contains(' ')).then_some(profile)
}

/// The GPU instance id of a MIG device handle (nvml-wrapper has no wrapper for it).
fn gpu_instance_id(nvml: &Nvml, mig_device: &Device<'_>) -> Option<u32> {
    let get = nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref().ok()?;
    let mut id = 0;
    // SAFETY: the handle comes from `nvmlDeviceGetMigDeviceHandleByIndex` of the same library,
    // and `id` is a valid out-pointer for the call.
    let status = unsafe { get(mig_device.handle(), &mut id) };
    (status == 0).then_some(id)
}

fn metrics<'nvml>(
    nvml: &'nvml Nvml,
    older: &GpmSample<'nvml>,
    newer: &GpmSample<'nvml>,
    (instance, profile): (Option<u32>, Option<&str>),
    index: u32,
) -> Vec<DeviceValue> {
    let ids: Vec<GpmMetricId> = GPM_FIELDS.iter().map(|f| f.metric).collect();
    let results = match gpm_metrics_get(nvml, older, newer, &ids) {
        Ok(results) => results,
        Err(err) => {
            tracing::debug!(gpu = index, ?instance, "GPM metrics: {err}");
            return Vec::new();
        }
    };
    GPM_FIELDS
        .iter()
        .zip(results)
        // A metric this GPU lacks (e.g. NVLink on a PCIe card) is left out.
        .filter_map(|(field, result)| {
            let value = result.ok()?.value;
            value.is_finite().then_some(DeviceValue {
                name: field.name,
                help: field.help,
                kind: "gauge",
                value: value * field.scale,
                gpu_instance: instance,
                gpu_instance_profile: profile.map(str::to_owned),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::mig_profile;

    #[test]
    fn a_mig_device_name_gives_its_profile() {
        assert_eq!(
            mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb"),
            Some("1g.10gb")
        );
        assert_eq!(
            mig_profile("NVIDIA A100-SXM4-40GB MIG 3g.20gb "),
            Some("3g.20gb")
        );
        assert_eq!(mig_profile("NVIDIA H100 80GB HBM3"), None);
        assert_eq!(mig_profile("NVIDIA H100 MIG "), None);
    }
}
