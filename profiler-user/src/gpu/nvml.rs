//! NVIDIA's counters through NVML (nvml-wrapper, which opens `libnvidia-ml.so.1` with dlopen):
//! polled on a thread, kept in a [`GpuBoard`] that `/metrics` renders with dcgm-exporter's names
//! and labels (so existing GPU dashboards work) and `/api/gpu` serves as a time series.
//!
//! DCGM's profiling fields (SM active, tensor pipes, DRAM, PCIe, NVLink) come from NVML's GPM
//! API on Hopper and newer ([`super::gpm`]), per GPU or per MIG GPU instance.
//!
//! Without a driver the agent runs as usual: the reason is logged once and `gpu_available` is
//! 0. A reading a GPU does not support (`NotSupported`, or a function the library lacks) is left
//! out, never an error; a missing function is logged once.
use std::{
    collections::{HashMap, HashSet, VecDeque},
    fmt::Write as _,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use nvml_wrapper::{
    Device, Nvml,
    enum_wrappers::device::{Clock, EccCounter, MemoryError, PcieUtilCounter, TemperatureSensor},
    enums::device::UsedGpuMemory,
    error::NvmlError,
};
use serde::Serialize;

use super::gpm::GpmSampler;
use crate::{
    model::Pid,
    process::{LabelledProcess, read_identity},
};

/// How long the in-memory history covers.
pub const HISTORY: Duration = Duration::from_secs(24 * 3600);
/// Most points `/api/gpu` returns per GPU.
pub const MAX_API_POINTS: usize = 1000;

/// One metric of one GPU: dcgm-exporter's name and the value in its unit.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceValue {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: &'static str,
    pub value: f64,
    /// The MIG GPU instance the value is of (`GPU_I_ID`), `None` for the whole GPU.
    pub gpu_instance: Option<u32>,
    /// That instance's profile (`GPU_I_PROFILE`, e.g. `3g.40gb`), when the driver names it.
    pub gpu_instance_profile: Option<String>,
}

/// One poll of one GPU.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceReading {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub values: Vec<DeviceValue>,
    pub util: Option<u32>,
    pub mem_util: Option<u32>,
    pub mem_used_bytes: Option<u64>,
    pub mem_total_bytes: Option<u64>,
    /// Why this GPU has no DCGM profiling fields (GPM), if it has none.
    pub profiling_unavailable: Option<String>,
}

/// A process using a GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessReading {
    pub pid: u32,
    pub comm: String,
    /// The process's `service_name` and Kubernetes names, as its profiles have them (empty
    /// when unknown or outside a pod).
    pub service_name: String,
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub gpu: u32,
    pub uuid: String,
    pub memory_bytes: Option<u64>,
    pub sm_util_percent: Option<u32>,
}

/// One point of a GPU's history, as `/api/gpu` returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HistoryPoint {
    pub t: i64,
    pub util: u32,
    pub mem_util: u32,
    pub mem_used_bytes: u64,
    pub mem_total_bytes: u64,
}

/// One point of a service's GPU use, summed over its processes on every GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ServicePoint {
    pub t: i64,
    /// Sum of its processes' SM utilization, in percent of one GPU (over 100 with several).
    pub sm_util: u32,
    pub mem_used_bytes: u64,
}

/// Services whose GPU history is kept; the one updated longest ago goes beyond.
pub const MAX_GPU_SERVICES: usize = 256;

#[derive(Debug, Default)]
struct GpuHistory {
    index: u32,
    uuid: String,
    name: String,
    points: VecDeque<HistoryPoint>,
}

#[derive(Debug, Default)]
struct BoardState {
    available: bool,
    reason: Option<String>,
    hostname: String,
    devices: Vec<DeviceReading>,
    processes: Vec<ProcessReading>,
    history: Vec<GpuHistory>,
    history_capacity: usize,
    /// Per service name: its points, newest last.
    services: HashMap<String, VecDeque<ServicePoint>>,
    poll_stats: PollStats,
}

/// What polling NVML has cost: polls made and the CPU time they used (NVML, GPM and /proc
/// reads, on the polling thread).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PollStats {
    pub polls: u64,
    pub cpu_time: Duration,
}

/// The latest NVML readings and a bounded history, shared by the poller and the server.
#[derive(Debug, Default)]
pub struct GpuBoard {
    state: Mutex<BoardState>,
}

#[derive(Serialize)]
struct ApiGpu<'a> {
    index: u32,
    uuid: &'a str,
    name: &'a str,
    /// The DCGM profiling fields (GPM): whether this GPU has them, and why not.
    profiling: ApiProfiling<'a>,
    points: Vec<HistoryPoint>,
}

#[derive(Serialize)]
struct ApiProfiling<'a> {
    available: bool,
    reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ApiService<'a> {
    name: &'a str,
    points: Vec<ServicePoint>,
}

#[derive(Serialize)]
struct ApiResponse<'a> {
    available: bool,
    reason: Option<&'a str>,
    gpus: Vec<ApiGpu<'a>>,
    /// The asked-for service's GPU use, when it had any in the history.
    #[serde(skip_serializing_if = "Option::is_none")]
    service: Option<ApiService<'a>>,
    /// Every service with GPU use in the range, busiest first: the services overview.
    services: Vec<ApiServiceSummary<'a>>,
}

/// A service's GPU use over a range, as the services overview shows it.
#[derive(Serialize)]
struct ApiServiceSummary<'a> {
    name: &'a str,
    /// Mean over the range's polls of its processes' summed SM utilization (percent of one GPU).
    sm_util: f64,
    /// The most GPU memory its processes held at one poll.
    max_mem_used_bytes: u64,
}

/// A per-process metric: name, help, and how to read it.
type ProcessMetric = (
    &'static str,
    &'static str,
    fn(&ProcessReading) -> Option<u64>,
);

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl GpuBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// NVML cannot be used: `reason` says why (shown on `/api/gpu`).
    pub fn set_unavailable(&self, reason: String) {
        let mut state = self.lock();
        state.available = false;
        state.reason = Some(reason);
    }

    /// Records one poll at `t_ms` (Unix milliseconds).
    pub fn update(
        &self,
        hostname: &str,
        t_ms: i64,
        devices: Vec<DeviceReading>,
        processes: Vec<ProcessReading>,
        history_capacity: usize,
    ) {
        let mut state = self.lock();
        state.available = true;
        state.reason = None;
        state.hostname = hostname.to_string();
        state.history_capacity = history_capacity.max(1);
        for device in &devices {
            let capacity = state.history_capacity;
            let position = state
                .history
                .iter()
                .position(|h| h.uuid == device.uuid && h.index == device.index);
            let history = match position {
                Some(i) => &mut state.history[i],
                None => {
                    state.history.push(GpuHistory {
                        index: device.index,
                        uuid: device.uuid.clone(),
                        name: device.name.clone(),
                        points: VecDeque::new(),
                    });
                    state.history.last_mut().expect("just pushed")
                }
            };
            if let (Some(util), Some(mem_util)) = (device.util, device.mem_util) {
                while history.points.len() >= capacity {
                    history.points.pop_front();
                }
                history.points.push_back(HistoryPoint {
                    t: t_ms,
                    util,
                    mem_util,
                    mem_used_bytes: device.mem_used_bytes.unwrap_or(0),
                    mem_total_bytes: device.mem_total_bytes.unwrap_or(0),
                });
            }
        }
        let mut by_service: HashMap<&str, ServicePoint> = HashMap::new();
        for process in &processes {
            if process.service_name.is_empty() {
                continue;
            }
            let point = by_service
                .entry(&process.service_name)
                .or_insert(ServicePoint {
                    t: t_ms,
                    sm_util: 0,
                    mem_used_bytes: 0,
                });
            point.sm_util += process.sm_util_percent.unwrap_or(0);
            point.mem_used_bytes += process.memory_bytes.unwrap_or(0);
        }
        let capacity = state.history_capacity;
        for (service, point) in by_service {
            if !state.services.contains_key(service) && state.services.len() >= MAX_GPU_SERVICES {
                let stalest = state
                    .services
                    .iter()
                    .min_by_key(|(_, points)| points.back().map_or(i64::MIN, |p| p.t))
                    .map(|(name, _)| name.clone());
                if let Some(stalest) = stalest {
                    state.services.remove(&stalest);
                }
            }
            let points = state.services.entry(service.to_owned()).or_default();
            while points.len() >= capacity {
                points.pop_front();
            }
            points.push_back(point);
        }
        state.devices = devices;
        state.processes = processes;
    }

    /// Polls made so far and their cost.
    pub fn poll_stats(&self) -> PollStats {
        self.lock().poll_stats
    }

    fn add_poll(&self, cpu_time: Duration) {
        let mut state = self.lock();
        state.poll_stats.polls += 1;
        state.poll_stats.cpu_time += cpu_time;
    }

    /// The GPU index a process uses, for the `gpu` label of its profiles.
    pub fn gpu_of(&self, pid: u32) -> Option<u32> {
        self.lock()
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .map(|p| p.gpu)
    }

    /// The Prometheus text for `/metrics`: dcgm-exporter names and labels per GPU, our own
    /// names per process, and `gpu_available`.
    pub fn render_prometheus(&self) -> String {
        let state = self.lock();
        let mut text = String::new();
        let _ = writeln!(
            text,
            "# HELP gpu_available 1 when NVML answers, 0 when no NVIDIA driver or GPU is usable."
        );
        let _ = writeln!(text, "# TYPE gpu_available gauge");
        let _ = writeln!(text, "gpu_available {}", u8::from(state.available));
        let hostname = escape_label(&state.hostname);
        let mut by_name: Vec<(&DeviceValue, &DeviceReading)> = state
            .devices
            .iter()
            .flat_map(|d| d.values.iter().map(move |v| (v, d)))
            .collect();
        by_name.sort_by_key(|(v, d)| (v.name, d.index, v.gpu_instance));
        let mut last = "";
        for (value, device) in by_name {
            if value.name != last {
                let _ = writeln!(text, "# HELP {} {}", value.name, value.help);
                let _ = writeln!(text, "# TYPE {} {}", value.name, value.kind);
                last = value.name;
            }
            // dcgm-exporter labels a MIG instance's fields with its profile and instance id.
            let profile = value
                .gpu_instance_profile
                .as_deref()
                .map(|profile| format!(",GPU_I_PROFILE=\"{}\"", escape_label(profile)))
                .unwrap_or_default();
            let instance = value
                .gpu_instance
                .map(|id| format!("{profile},GPU_I_ID=\"{id}\""))
                .unwrap_or_default();
            let _ = writeln!(
                text,
                "{}{{gpu=\"{}\",UUID=\"{}\",device=\"nvidia{}\",modelName=\"{}\",Hostname=\"{}\"{instance}}} {}",
                value.name,
                device.index,
                escape_label(&device.uuid),
                device.index,
                escape_label(&device.name),
                hostname,
                value.value
            );
        }
        let process_metrics: [ProcessMetric; 2] = [
            (
                "gpu_process_memory_used_bytes",
                "GPU memory used by the process, from NVML.",
                |p| p.memory_bytes,
            ),
            (
                "gpu_process_sm_utilization_percent",
                "Share of the GPU's SMs the process used over NVML's last sample period.",
                |p| p.sm_util_percent.map(u64::from),
            ),
        ];
        for (name, help, get) in process_metrics {
            let mut header = false;
            for process in &state.processes {
                let Some(value) = get(process) else { continue };
                if !header {
                    let _ = writeln!(text, "# HELP {name} {help}");
                    let _ = writeln!(text, "# TYPE {name} gauge");
                    header = true;
                }
                // dcgm-exporter's Kubernetes labels, where the process is in a pod.
                let mut kubernetes = String::new();
                for (label, value) in [
                    ("namespace", &process.namespace),
                    ("pod", &process.pod),
                    ("container", &process.container),
                ] {
                    if !value.is_empty() {
                        let _ = write!(kubernetes, ",{label}=\"{}\"", escape_label(value));
                    }
                }
                let _ = writeln!(
                    text,
                    "{name}{{pid=\"{}\",comm=\"{}\",service_name=\"{}\"{kubernetes},gpu=\"{}\",UUID=\"{}\",Hostname=\"{}\"}} {value}",
                    process.pid,
                    escape_label(&process.comm),
                    escape_label(&process.service_name),
                    process.gpu,
                    escape_label(&process.uuid),
                    hostname
                );
            }
        }
        text
    }

    /// The `/api/gpu` answer for `[from_ms, until_ms]`, at most [`MAX_API_POINTS`] per GPU
    /// (averaged buckets when there are more), with `service`'s own use when asked for.
    pub fn api_json(&self, from_ms: i64, until_ms: i64, service: Option<&str>) -> String {
        let state = self.lock();
        let gpus = state
            .history
            .iter()
            .map(|h| {
                let reason = state
                    .devices
                    .iter()
                    .find(|d| d.uuid == h.uuid && d.index == h.index)
                    .and_then(|d| d.profiling_unavailable.as_deref());
                let points: Vec<HistoryPoint> = h
                    .points
                    .iter()
                    .filter(|p| p.t >= from_ms && p.t <= until_ms)
                    .copied()
                    .collect();
                ApiGpu {
                    index: h.index,
                    uuid: &h.uuid,
                    name: &h.name,
                    profiling: ApiProfiling {
                        available: reason.is_none(),
                        reason,
                    },
                    points: downsample(&points, MAX_API_POINTS),
                }
            })
            .collect();
        let service = service.and_then(|name| {
            let (name, points) = state.services.get_key_value(name)?;
            let points: Vec<ServicePoint> = points
                .iter()
                .filter(|p| p.t >= from_ms && p.t <= until_ms)
                .copied()
                .collect();
            Some(ApiService {
                name,
                points: downsample_service(&points, MAX_API_POINTS),
            })
        });
        let mut services: Vec<ApiServiceSummary> = state
            .services
            .iter()
            .filter_map(|(name, points)| {
                let in_range: Vec<&ServicePoint> = points
                    .iter()
                    .filter(|p| p.t >= from_ms && p.t <= until_ms)
                    .collect();
                if in_range.is_empty() {
                    return None;
                }
                let sum: u64 = in_range.iter().map(|p| u64::from(p.sm_util)).sum();
                Some(ApiServiceSummary {
                    name,
                    sm_util: sum as f64 / in_range.len() as f64,
                    max_mem_used_bytes: in_range
                        .iter()
                        .map(|p| p.mem_used_bytes)
                        .max()
                        .unwrap_or(0),
                })
            })
            .collect();
        services.sort_by(|a, b| b.sm_util.total_cmp(&a.sm_util).then(a.name.cmp(b.name)));
        let response = ApiResponse {
            available: state.available,
            reason: state.reason.as_deref(),
            gpus,
            service,
            services,
        };
        serde_json::to_string(&response).unwrap_or_else(|_| "{}".into())
    }
}

/// Averages consecutive service points into at most `max` buckets.
fn downsample_service(points: &[ServicePoint], max: usize) -> Vec<ServicePoint> {
    if points.len() <= max || max == 0 {
        return points.to_vec();
    }
    points
        .chunks(points.len().div_ceil(max))
        .map(|chunk| {
            let n = chunk.len() as u64;
            ServicePoint {
                t: chunk[0].t,
                sm_util: (chunk.iter().map(|p| u64::from(p.sm_util)).sum::<u64>() / n) as u32,
                mem_used_bytes: chunk.iter().map(|p| p.mem_used_bytes).sum::<u64>() / n,
            }
        })
        .collect()
}

/// Averages consecutive points into at most `max` buckets.
pub fn downsample(points: &[HistoryPoint], max: usize) -> Vec<HistoryPoint> {
    if points.len() <= max || max == 0 {
        return points.to_vec();
    }
    let per_bucket = points.len().div_ceil(max);
    points
        .chunks(per_bucket)
        .map(|chunk| {
            let n = chunk.len() as u64;
            let sum = |f: fn(&HistoryPoint) -> u64| chunk.iter().map(f).sum::<u64>() / n;
            HistoryPoint {
                t: chunk[0].t,
                util: sum(|p| u64::from(p.util)) as u32,
                mem_util: sum(|p| u64::from(p.mem_util)) as u32,
                mem_used_bytes: sum(|p| p.mem_used_bytes),
                mem_total_bytes: sum(|p| p.mem_total_bytes),
            }
        })
        .collect()
}

/// A reading, or `None` when this GPU or driver does not offer it. A function the NVML
/// library lacks is reported once (the other readings go on).
fn reading<T>(what: &str, result: Result<T, NvmlError>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(NvmlError::NotSupported) => None,
        Err(NvmlError::FailedToLoadSymbol(symbol)) => {
            static REPORTED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
            let mut reported = REPORTED.lock().unwrap_or_else(|p| p.into_inner());
            if reported
                .get_or_insert_with(HashSet::new)
                .insert(symbol.clone())
            {
                tracing::warn!(
                    "NVML {what} is left out: the NVML library lacks the function ({symbol})"
                );
            }
            None
        }
        Err(err) => {
            tracing::debug!("NVML {what}: {err}");
            None
        }
    }
}

fn value(name: &'static str, help: &'static str, kind: &'static str, v: f64) -> DeviceValue {
    DeviceValue {
        name,
        help,
        kind,
        value: v,
        gpu_instance: None,
        gpu_instance_profile: None,
    }
}

fn read_device(device: &Device<'_>, index: u32) -> DeviceReading {
    let mut out = DeviceReading {
        index,
        uuid: reading("uuid", device.uuid()).unwrap_or_default(),
        name: reading("name", device.name()).unwrap_or_default(),
        ..DeviceReading::default()
    };
    let values = &mut out.values;
    if let Some(u) = reading("utilization", device.utilization_rates()) {
        out.util = Some(u.gpu);
        out.mem_util = Some(u.memory);
        values.push(value(
            "DCGM_FI_DEV_GPU_UTIL",
            "GPU utilization (in %).",
            "gauge",
            u.gpu.into(),
        ));
        values.push(value(
            "DCGM_FI_DEV_MEM_COPY_UTIL",
            "Memory utilization (in %).",
            "gauge",
            u.memory.into(),
        ));
    }
    if let Some(m) = reading("memory", device.memory_info()) {
        out.mem_used_bytes = Some(m.used);
        out.mem_total_bytes = Some(m.total);
        let mib = |b: u64| (b >> 20) as f64;
        values.push(value(
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            "gauge",
            mib(m.used),
        ));
        values.push(value(
            "DCGM_FI_DEV_FB_FREE",
            "Framebuffer memory free (in MiB).",
            "gauge",
            mib(m.free),
        ));
        values.push(value(
            "DCGM_FI_DEV_FB_RESERVED",
            "Framebuffer memory reserved (in MiB).",
            "gauge",
            mib(m.reserved),
        ));
    }
    if let Some(t) = reading("temperature", device.temperature(TemperatureSensor::Gpu)) {
        values.push(value(
            "DCGM_FI_DEV_GPU_TEMP",
            "GPU temperature (in C).",
            "gauge",
            t.into(),
        ));
    }
    if let Some(mw) = reading("power", device.power_usage()) {
        values.push(value(
            "DCGM_FI_DEV_POWER_USAGE",
            "Power draw (in W).",
            "gauge",
            f64::from(mw) / 1000.0,
        ));
    }
    if let Some(mj) = reading("energy", device.total_energy_consumption()) {
        values.push(value(
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            "Total energy consumption since boot (in mJ).",
            "counter",
            mj as f64,
        ));
    }
    if let Some(mhz) = reading("SM clock", device.clock_info(Clock::SM)) {
        values.push(value(
            "DCGM_FI_DEV_SM_CLOCK",
            "SM clock frequency (in MHz).",
            "gauge",
            mhz.into(),
        ));
    }
    if let Some(mhz) = reading("memory clock", device.clock_info(Clock::Memory)) {
        values.push(value(
            "DCGM_FI_DEV_MEM_CLOCK",
            "Memory clock frequency (in MHz).",
            "gauge",
            mhz.into(),
        ));
    }
    if let Some(kb) = reading("PCIe TX", device.pcie_throughput(PcieUtilCounter::Send)) {
        values.push(value(
            "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
            "PCIe transmit throughput (in KB/s).",
            "gauge",
            kb.into(),
        ));
    }
    if let Some(kb) = reading("PCIe RX", device.pcie_throughput(PcieUtilCounter::Receive)) {
        values.push(value(
            "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
            "PCIe receive throughput (in KB/s).",
            "gauge",
            kb.into(),
        ));
    }
    if let Some(reasons) = reading("throttle reasons", device.current_throttle_reasons()) {
        values.push(value(
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            "Current clock throttle reasons (bitmask).",
            "gauge",
            reasons.bits() as f64,
        ));
    }
    for (name, help, error, counter) in [
        (
            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
            "Single-bit volatile ECC errors.",
            MemoryError::Corrected,
            EccCounter::Volatile,
        ),
        (
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            "Double-bit volatile ECC errors.",
            MemoryError::Uncorrected,
            EccCounter::Volatile,
        ),
        (
            "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
            "Single-bit persistent ECC errors.",
            MemoryError::Corrected,
            EccCounter::Aggregate,
        ),
        (
            "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
            "Double-bit persistent ECC errors.",
            MemoryError::Uncorrected,
            EccCounter::Aggregate,
        ),
    ] {
        if let Some(count) = reading("ECC", device.total_ecc_errors(error, counter)) {
            values.push(value(name, help, "counter", count as f64));
        }
    }
    out
}

/// How long a process's labels are trusted before /proc is read again.
const LABELS_FRESH_FOR: Duration = Duration::from_secs(30);
/// Processes whose labels are remembered; all are forgotten beyond.
const MAX_LABELLED_PROCESSES: usize = 4096;

/// The labels of the processes NVML reports, read from /proc as the profiler reads them for
/// profiles (so a GPU process's metrics carry its profiles' `service_name`).
#[derive(Default)]
struct ProcessLabeller {
    known: HashMap<u32, (Instant, Option<LabelledProcess>)>,
}

impl ProcessLabeller {
    /// A reading of `pid` on GPU `gpu` with its names filled in.
    fn reading(&mut self, pid: u32, gpu: u32, uuid: &str, host: &str) -> ProcessReading {
        let now = Instant::now();
        if self.known.len() >= MAX_LABELLED_PROCESSES {
            self.known.clear();
        }
        let entry = self.known.entry(pid).or_insert((now, None));
        if entry.1.is_none() || now.duration_since(entry.0) > LABELS_FRESH_FOR {
            let dir = std::path::Path::new("/proc").join(pid.to_string());
            *entry = (now, read_identity(Pid(pid), &dir, host).ok());
        }
        let mut reading = ProcessReading {
            pid,
            gpu,
            uuid: uuid.to_owned(),
            ..ProcessReading::default()
        };
        if let Some(process) = &entry.1 {
            reading.comm = process.comm.clone();
            reading.service_name = process.labels.service_name.clone();
            reading.namespace = process.labels.namespace.clone().unwrap_or_default();
            reading.pod = process.labels.pod.clone().unwrap_or_default();
            reading.container = process.labels.container.clone().unwrap_or_default();
        }
        reading
    }
}

/// Polls NVML every `interval` until `stop`; never fails the agent.
pub struct NvmlPoller {
    thread: Option<std::thread::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

impl NvmlPoller {
    pub fn spawn(
        library: Option<PathBuf>,
        interval: Duration,
        hostname: String,
        board: Arc<GpuBoard>,
    ) -> NvmlPoller {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("nvml".into())
                .spawn(move || poll(library, interval, hostname, board, stop))
                .ok()
        };
        NvmlPoller { thread, stop }
    }

    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn open(library: Option<&PathBuf>) -> Result<Nvml, NvmlError> {
    match library {
        Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
        None => Nvml::init(),
    }
}

fn poll(
    library: Option<PathBuf>,
    interval: Duration,
    hostname: String,
    board: Arc<GpuBoard>,
    stop: Arc<AtomicBool>,
) {
    let nvml = match open(library.as_ref()) {
        Ok(nvml) => nvml,
        Err(err) => {
            let reason = format!(
                "NVML is unavailable ({}): {err}",
                library
                    .as_ref()
                    .map_or("libnvidia-ml.so.1".into(), |p| p.display().to_string())
            );
            tracing::warn!("{reason}; GPU metrics are off, profiling goes on");
            board.set_unavailable(reason);
            return;
        }
    };
    let capacity = (HISTORY.as_secs_f64() / interval.as_secs_f64().max(0.001)).ceil() as usize;
    let mut last_seen: HashMap<u32, u64> = HashMap::new();
    let mut gpm = GpmSampler::default();
    let mut labeller = ProcessLabeller::default();
    tracing::info!(
        gpus = reading("device count", nvml.device_count()).unwrap_or(0),
        "NVML polling started"
    );
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let cpu_before = crate::model::thread_cpu_time();
        let count = reading("device count", nvml.device_count()).unwrap_or(0);
        let mut devices = Vec::new();
        let mut processes = Vec::new();
        for index in 0..count {
            let Some(device) = reading("device", nvml.device_by_index(index)) else {
                continue;
            };
            let mut reading_now = read_device(&device, index);
            let profiling = gpm.read(&nvml, &device, index);
            reading_now.values.extend(profiling.values);
            reading_now.profiling_unavailable = profiling.unavailable;
            let mut by_pid: HashMap<u32, ProcessReading> = HashMap::new();
            for process in
                reading("processes", device.running_compute_processes()).unwrap_or_default()
            {
                let entry = by_pid.entry(process.pid).or_insert_with(|| {
                    labeller.reading(process.pid, index, &reading_now.uuid, &hostname)
                });
                if let UsedGpuMemory::Used(bytes) = process.used_gpu_memory {
                    entry.memory_bytes = Some(bytes);
                }
            }
            let since = last_seen.get(&index).copied().unwrap_or(0);
            // An idle GPU answers NotFound: no samples, not an error.
            let samples = match device.process_utilization_stats(since) {
                Ok(samples) => samples,
                Err(NvmlError::NotFound) => Vec::new(),
                Err(err) => reading::<Vec<_>>("process utilization", Err(err)).unwrap_or_default(),
            };
            for sample in samples {
                last_seen.insert(index, sample.timestamp.max(since));
                let entry = by_pid.entry(sample.pid).or_insert_with(|| {
                    labeller.reading(sample.pid, index, &reading_now.uuid, &hostname)
                });
                entry.sm_util_percent = Some(sample.sm_util);
            }
            let mut list: Vec<ProcessReading> = by_pid.into_values().collect();
            list.sort_by_key(|p| p.pid);
            processes.extend(list);
            devices.push(reading_now);
        }
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        board.update(&hostname, now_ms, devices, processes, capacity);
        board.add_poll(crate::model::thread_cpu_time().saturating_sub(cpu_before));
        let deadline = started + interval;
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50).min(interval));
        }
    }
    // No nvmlShutdown: on an H100 with driver 580, the shutdown of an NVML that read GPM while
    // CUDA processes ran jumped to an unmapped address (SIGSEGV in the "nvml" thread, 3 of 3
    // stops). The agent is exiting; the driver releases the handle with the process.
    drop(gpm);
    std::mem::forget(nvml);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t: i64, util: u32) -> HistoryPoint {
        HistoryPoint {
            t,
            util,
            mem_util: util / 2,
            mem_used_bytes: 100,
            mem_total_bytes: 1000,
        }
    }

    #[test]
    fn downsampling_keeps_at_most_max_points_and_averages() {
        let points: Vec<_> = (0..2500).map(|i| point(i, (i % 2) as u32 * 100)).collect();
        let out = downsample(&points, 1000);
        assert!(out.len() <= 1000, "{}", out.len());
        assert_eq!(out[0].t, 0);
        assert_eq!(out[0].util, 33, "0,100,0 averaged");
        assert_eq!(downsample(&points[..10], 1000).len(), 10);
    }

    /// A service's GPU use is its processes' summed over GPUs, kept per poll and bounded.
    #[test]
    fn services_get_their_own_gpu_history() {
        let board = GpuBoard::default();
        let process = |pid, gpu, service: &str, sm, bytes| ProcessReading {
            pid,
            gpu,
            service_name: service.into(),
            sm_util_percent: Some(sm),
            memory_bytes: Some(bytes),
            ..ProcessReading::default()
        };
        for t in 0..4 {
            board.update(
                "host",
                t,
                Vec::new(),
                vec![
                    process(1, 0, "api", 30, 100),
                    process(2, 1, "api", 20, 50),
                    process(3, 0, "batch", 90, 7),
                    process(4, 0, "", 5, 1),
                ],
                3,
            );
        }
        let json: serde_json::Value =
            serde_json::from_str(&board.api_json(0, 10, Some("api"))).unwrap();
        let points = json["service"]["points"].as_array().expect("points");
        assert_eq!(json["service"]["name"], "api");
        assert_eq!(points.len(), 3, "bounded by the history capacity");
        assert_eq!(points[0]["t"], 1);
        assert_eq!(points[0]["sm_util"], 50);
        assert_eq!(points[0]["mem_used_bytes"], 150);
        // The overview's summary: every service in the range, busiest first.
        let services = json["services"].as_array().expect("services");
        let summary: Vec<(&str, f64, u64)> = services
            .iter()
            .map(|s| {
                (
                    s["name"].as_str().unwrap(),
                    s["sm_util"].as_f64().unwrap(),
                    s["max_mem_used_bytes"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(summary, vec![("batch", 90.0, 7), ("api", 50.0, 150)]);
        let json: serde_json::Value = serde_json::from_str(&board.api_json(2, 2, None)).unwrap();
        assert_eq!(json["services"].as_array().map(Vec::len), Some(2), "{json}");
        let json: serde_json::Value =
            serde_json::from_str(&board.api_json(100, 200, None)).unwrap();
        assert_eq!(json["services"], serde_json::json!([]), "none in the range");
        let json: serde_json::Value =
            serde_json::from_str(&board.api_json(0, 10, Some("unknown"))).unwrap();
        assert!(json.get("service").is_none(), "{json}");
        for n in 0..(MAX_GPU_SERVICES + 5) {
            board.update(
                "host",
                10 + n as i64,
                Vec::new(),
                vec![process(9, 0, &format!("s{n}"), 1, 1)],
                3,
            );
        }
        assert!(board.lock().services.len() <= MAX_GPU_SERVICES);
    }

    #[test]
    fn board_keeps_bounded_history_and_renders_dcgm_names() {
        let board = GpuBoard::default();
        let device = DeviceReading {
            index: 0,
            uuid: "GPU-1".into(),
            name: "Test \"GPU\"".into(),
            values: vec![value(
                "DCGM_FI_DEV_GPU_UTIL",
                "GPU utilization (in %).",
                "gauge",
                41.0,
            )],
            util: Some(41),
            mem_util: Some(20),
            mem_used_bytes: Some(1),
            mem_total_bytes: Some(2),
            profiling_unavailable: None,
        };
        for t in 0..5 {
            board.update("host", t, vec![device.clone()], Vec::new(), 3);
        }
        let json: serde_json::Value = serde_json::from_str(&board.api_json(0, 10, None)).unwrap();
        assert_eq!(json["available"], true);
        assert_eq!(json["gpus"][0]["points"].as_array().unwrap().len(), 3);
        assert_eq!(json["gpus"][0]["points"][0]["t"], 2);
        let text = board.render_prometheus();
        assert!(text.contains("gpu_available 1"), "{text}");
        assert!(
            text.contains(
                "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-1\",device=\"nvidia0\",modelName=\"Test \\\"GPU\\\"\",Hostname=\"host\"} 41"
            ),
            "{text}"
        );
        // A MIG instance's field carries its GPU instance id; a GPU without GPM says why.
        let mut with_mig = device.clone();
        with_mig.values.push(DeviceValue {
            gpu_instance: Some(3),
            gpu_instance_profile: Some("1g.10gb".into()),
            ..value("DCGM_FI_PROF_SM_ACTIVE", "SM active.", "gauge", 0.25)
        });
        let mut without_gpm = device.clone();
        without_gpm.index = 1;
        without_gpm.uuid = "GPU-2".into();
        without_gpm.profiling_unavailable = Some("this GPU has no GPM".into());
        board.update("host", 6, vec![with_mig, without_gpm], Vec::new(), 3);
        let text = board.render_prometheus();
        assert!(
            text.contains("DCGM_FI_PROF_SM_ACTIVE{gpu=\"0\",UUID=\"GPU-1\",device=\"nvidia0\",modelName=\"Test \\\"GPU\\\"\",Hostname=\"host\",GPU_I_PROFILE=\"1g.10gb\",GPU_I_ID=\"3\"} 0.25"),
            "{text}"
        );
        let json: serde_json::Value = serde_json::from_str(&board.api_json(0, 10, None)).unwrap();
        assert_eq!(json["gpus"][0]["profiling"]["available"], true, "{json}");
        assert_eq!(json["gpus"][1]["profiling"]["available"], false, "{json}");
        assert_eq!(
            json["gpus"][1]["profiling"]["reason"],
            "this GPU has no GPM"
        );
        board.set_unavailable("no driver".into());
        let json: serde_json::Value = serde_json::from_str(&board.api_json(0, 10, None)).unwrap();
        assert_eq!(json["available"], false);
        assert_eq!(json["reason"], "no driver");
    }
}
