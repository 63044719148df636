//! Stage ④: counts identical stacks per series over one time window.
//!
//! A series is what Pyroscope would store separately: in per-service mode its labels are the
//! process's `service_name`, `host`, `executable` and container/pod/unit; in single mode (one
//! `profiler record` file) all processes share one profile and `service_name` becomes a
//! per-sample label instead. Per-sample labels are kept low-cardinality: `pid` and `tid` are
//! numeric, and `thread_name` is dropped from a series that has too many distinct thread names.
use std::sync::Arc;

// Every sample goes through these maps: a fast hash for keys that are our own data.
use foldhash::{HashMap, HashMapExt, HashSet};

use crate::model::{
    LabelValue, ProcessInfo, Profile, ProfileKind, ProfileSample, Sample, SampleValues,
    SymbolizedFrame,
};

/// How processes are grouped into profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grouping {
    /// One profile for everything (`profiler record`).
    Single,
    /// One profile per series label set (`profiler agent`).
    PerService,
}

#[derive(Clone, Debug)]
pub struct AggregatorSettings {
    pub grouping: Grouping,
    pub period_ns: i64,
    /// Value of the `host` series label.
    pub host: String,
    /// A series with more distinct thread names than this gets no `thread_name` label.
    pub max_thread_names: usize,
    /// What the added values measure.
    pub kind: ProfileKind,
    /// Where the GPU a process uses is known (NVML), for the `gpu` series label.
    pub gpus: Option<Arc<crate::gpu::nvml::GpuBoard>>,
}

/// Name of the synthetic frame that marks a stack cut short by the depth limit or an error.
pub const TRUNCATED_FRAME: &str = "[truncated]";

/// A frame of a stack being counted, the same frame as another only when it is the same `Arc`
/// (the symbolizer hands out one per distinct frame). Compared and hashed by address, which no
/// other frame can take while the key holds it: a stack is keyed without a lookup per frame
/// (mapping each frame to a window-wide id was 2 % of the agent's CPU on the host suite).
#[derive(Clone, Debug)]
struct HeldFrame(Arc<SymbolizedFrame>);

impl PartialEq for HeldFrame {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for HeldFrame {}

impl std::hash::Hash for HeldFrame {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Arc::as_ptr(&self.0).hash(state);
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct StackKey {
    stack: Vec<HeldFrame>,
    pid: u32,
    tid: u32,
    thread_name: Arc<str>,
    service_name: Option<Arc<str>>,
    /// A label of the call itself (a failed CUDA call's `cuda_error`).
    call_label: Option<(&'static str, Arc<str>)>,
}

#[derive(Debug, Default)]
struct SeriesData {
    counts: HashMap<StackKey, SampleValues>,
    thread_names: HashSet<Arc<str>>,
}

type SeriesLabels = Vec<(String, String)>;

/// What all samples of one process share within a window, worked out at its first sample.
struct ProcessSeries {
    /// Held so that no other process can take the address that keys this entry meanwhile.
    _process: Option<Arc<ProcessInfo>>,
    series: usize,
    root_frame: Arc<SymbolizedFrame>,
    service_name: Option<Arc<str>>,
}

pub struct Aggregator {
    settings: AggregatorSettings,
    window_start_unix_ns: i64,
    series: Vec<(SeriesLabels, SeriesData)>,
    series_ids: HashMap<SeriesLabels, usize>,
    /// By the address of the process's snapshot (a new snapshot after exec or pid reuse is a
    /// new entry); cleared with every window, so label changes (a GPU taken) apply at the next.
    processes: HashMap<usize, ProcessSeries>,
    root_frames: HashMap<Arc<str>, Arc<SymbolizedFrame>>,
    truncated_frame: Arc<SymbolizedFrame>,
    samples_in_window: u64,
}

/// A frame that is no code address: a marker, a kernel name, a copy direction.
pub fn synthetic_frame(name: &str) -> Arc<SymbolizedFrame> {
    SymbolizedFrame::synthetic(name)
}

impl Aggregator {
    pub fn new(settings: AggregatorSettings, window_start_unix_ns: i64) -> Self {
        Aggregator {
            settings,
            window_start_unix_ns,
            series: Vec::new(),
            series_ids: HashMap::new(),
            processes: HashMap::new(),
            root_frames: HashMap::new(),
            truncated_frame: synthetic_frame(TRUNCATED_FRAME),
            samples_in_window: 0,
        }
    }

    pub fn samples_in_window(&self) -> u64 {
        self.samples_in_window
    }

    fn series_labels(&self, process: Option<&ProcessInfo>, sample: &Sample) -> SeriesLabels {
        let mut labels = vec![("host".to_string(), self.settings.host.clone())];
        if self.settings.grouping == Grouping::PerService {
            labels.push(("service_name".into(), service_name(process, sample)));
            if let Some(process) = process {
                let l = &process.labels;
                if !l.executable.is_empty() {
                    labels.push(("executable".into(), l.executable.clone()));
                }
                if let Some(gpu) = self
                    .settings
                    .gpus
                    .as_ref()
                    .and_then(|b| b.gpu_of(process.pid.0))
                {
                    labels.push(("gpu".into(), gpu.to_string()));
                }
                for (name, value) in [
                    ("container_id", &l.container_id),
                    ("pod_uid", &l.pod_uid),
                    ("systemd_unit", &l.systemd_unit),
                    ("namespace", &l.namespace),
                    ("pod", &l.pod),
                    ("container", &l.container),
                ] {
                    if let Some(value) = value {
                        labels.push((name.into(), value.clone()));
                    }
                }
            }
        }
        labels.sort();
        labels
    }

    /// The series, root frame and per-sample service name of `process`'s samples (of the
    /// sample's own comm when the process is unknown).
    fn process_series(
        &mut self,
        process: Option<&Arc<ProcessInfo>>,
        sample: &Sample,
    ) -> ProcessSeries {
        let info = process.map(|p| &**p);
        let labels = self.series_labels(info, sample);
        let series = match self.series_ids.get(&labels) {
            Some(&id) => id,
            None => {
                self.series.push((labels.clone(), SeriesData::default()));
                self.series_ids.insert(labels, self.series.len() - 1);
                self.series.len() - 1
            }
        };
        let comm = info.map_or_else(|| sample.comm.clone(), |p| p.comm.clone());
        let root = self
            .root_frames
            .entry(comm.clone())
            .or_insert_with(|| synthetic_frame(&comm))
            .clone();
        ProcessSeries {
            _process: process.cloned(),
            series,
            root_frame: root,
            service_name: (self.settings.grouping == Grouping::Single)
                .then(|| Arc::<str>::from(service_name(info, sample))),
        }
    }

    /// Adds one sample whose frames (innermost first) are already symbolized.
    pub fn add(
        &mut self,
        process: Option<&Arc<ProcessInfo>>,
        sample: &Sample,
        frames: &[Arc<SymbolizedFrame>],
        truncated: bool,
    ) {
        self.add_value(process, sample, frames, truncated, 1);
    }

    /// Adds `value` (in the unit of the kind's primary sample type) for one stack.
    pub fn add_value(
        &mut self,
        process: Option<&Arc<ProcessInfo>>,
        sample: &Sample,
        frames: &[Arc<SymbolizedFrame>],
        truncated: bool,
        value: u64,
    ) {
        self.add_values(process, sample, frames, truncated, &[value]);
    }

    /// Adds `values`, in the order of the kind's sample types (missing ones are 0).
    pub fn add_values(
        &mut self,
        process: Option<&Arc<ProcessInfo>>,
        sample: &Sample,
        frames: &[Arc<SymbolizedFrame>],
        truncated: bool,
        values: &[u64],
    ) {
        self.add_labelled_values(process, sample, frames, truncated, values, None);
    }

    /// [`Aggregator::add_values`] with a per-sample label of the event itself.
    pub fn add_labelled_values(
        &mut self,
        process: Option<&Arc<ProcessInfo>>,
        sample: &Sample,
        frames: &[Arc<SymbolizedFrame>],
        truncated: bool,
        values: &[u64],
        call_label: Option<(&'static str, Arc<str>)>,
    ) {
        self.samples_in_window += 1;
        let mut stack: Vec<HeldFrame> = Vec::with_capacity(frames.len() + 2);
        stack.extend(frames.iter().cloned().map(HeldFrame));
        if truncated {
            stack.push(HeldFrame(self.truncated_frame.clone()));
        }
        let (series, root_frame, service_name) = match process {
            Some(process) => {
                let key = Arc::as_ptr(process) as usize;
                let entry = match self.processes.get(&key) {
                    Some(entry) => entry,
                    None => {
                        let entry = self.process_series(Some(process), sample);
                        self.processes.entry(key).or_insert(entry)
                    }
                };
                (
                    entry.series,
                    entry.root_frame.clone(),
                    entry.service_name.clone(),
                )
            }
            None => {
                let entry = self.process_series(None, sample);
                (entry.series, entry.root_frame, entry.service_name)
            }
        };
        stack.push(HeldFrame(root_frame));
        let data = &mut self.series[series].1;
        if data.thread_names.len() <= self.settings.max_thread_names {
            data.thread_names.insert(sample.comm.clone());
        }
        let key = StackKey {
            stack,
            pid: sample.pid.0,
            tid: sample.tid.0,
            thread_name: sample.comm.clone(),
            service_name,
            call_label,
        };
        let sums = data.counts.entry(key).or_default();
        for (sum, value) in sums.iter_mut().zip(values) {
            *sum = sum.saturating_add(*value);
        }
    }

    /// Ends the window at `end_unix_ns`: returns one profile per series and starts a new window.
    pub fn flush(&mut self, end_unix_ns: i64) -> Vec<Profile> {
        let start = self.window_start_unix_ns;
        self.window_start_unix_ns = end_unix_ns;
        self.samples_in_window = 0;
        self.series_ids.clear();
        self.processes.clear();
        let mut profiles: Vec<Profile> = std::mem::take(&mut self.series)
            .into_iter()
            .map(|(series_labels, data)| {
                let keep_thread_names = data.thread_names.len() <= self.settings.max_thread_names;
                build_profile(
                    series_labels,
                    data,
                    keep_thread_names,
                    Window {
                        start_unix_ns: start,
                        duration_ns: end_unix_ns - start,
                        period_ns: self.settings.period_ns,
                    },
                    self.settings.kind,
                )
            })
            .collect();
        profiles.sort_by(|a, b| a.series_labels.cmp(&b.series_labels));
        // Synthetic root frames are cheap but unbounded over time (one per process name).
        if self.root_frames.len() > 10_000 {
            self.root_frames.clear();
        }
        profiles
    }
}

/// A process nothing is known of (gone from /proc, no exec or fork event): its main thread's
/// name is its program's unless it renamed itself; another thread's name is the thread's
/// (`tokio-runtime-w`, `http`), never the program's, so the service is OpenTelemetry's name for
/// a service nobody named.
pub const UNKNOWN_SERVICE: &str = "unknown_service";

fn service_name(process: Option<&ProcessInfo>, sample: &Sample) -> String {
    match process {
        Some(p) if !p.labels.service_name.is_empty() => p.labels.service_name.clone(),
        Some(p) => p.comm.to_string(),
        None if sample.tid.0 == sample.pid.0 => sample.comm.to_string(),
        None => UNKNOWN_SERVICE.to_string(),
    }
}

type SampleLabels = Vec<(Arc<str>, LabelValue)>;

/// The time a profile covers.
struct Window {
    start_unix_ns: i64,
    duration_ns: i64,
    period_ns: i64,
}

fn build_profile(
    series_labels: Vec<(String, String)>,
    data: SeriesData,
    keep_thread_names: bool,
    window: Window,
    kind: ProfileKind,
) -> Profile {
    // Indexed per profile, so a profile only carries the frames its own samples use.
    let mut local_ids: HashMap<HeldFrame, u32> = HashMap::new();
    let mut frames = Vec::new();
    let mut merged: HashMap<(Vec<u32>, SampleLabels), SampleValues> = HashMap::new();
    for (key, values) in data.counts {
        let stack = key
            .stack
            .into_iter()
            .map(|frame| {
                *local_ids.entry(frame).or_insert_with_key(|frame| {
                    frames.push((*frame.0).clone());
                    (frames.len() - 1) as u32
                })
            })
            .collect();
        let mut labels: SampleLabels = vec![
            ("pid".into(), LabelValue::Num(i64::from(key.pid))),
            ("tid".into(), LabelValue::Num(i64::from(key.tid))),
        ];
        if keep_thread_names {
            labels.push(("thread_name".into(), LabelValue::Str(key.thread_name)));
        }
        if let Some(service) = key.service_name {
            labels.push(("service_name".into(), LabelValue::Str(service)));
        }
        if let Some((name, value)) = key.call_label {
            labels.push((name.into(), LabelValue::Str(value)));
        }
        let sums = merged.entry((stack, labels)).or_default();
        for (sum, value) in sums.iter_mut().zip(values) {
            *sum = sum.saturating_add(value);
        }
    }
    let value_count = kind.sample_types().len();
    let mut samples: Vec<ProfileSample> = merged
        .into_iter()
        .map(|((stack, labels), values)| ProfileSample {
            stack,
            count: values[0],
            more_values: values[1..value_count].to_vec(),
            labels,
        })
        .collect();
    samples.sort_by(|a, b| (&a.stack, &a.labels).cmp(&(&b.stack, &b.labels)));
    Profile {
        kind,
        series_labels,
        start_unix_ns: window.start_unix_ns,
        duration_ns: window.duration_ns,
        period_ns: window.period_ns,
        frames,
        samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Pid, ProcessLabels, Tid};

    fn settings(grouping: Grouping) -> AggregatorSettings {
        AggregatorSettings {
            grouping,
            period_ns: 10_000_000,
            host: "h1".into(),
            max_thread_names: 2,
            kind: ProfileKind::Cpu,
            gpus: None,
        }
    }

    fn process(pid: u32, service: &str) -> Arc<ProcessInfo> {
        Arc::new(ProcessInfo {
            pid: Pid(pid),
            start_time: 1,
            comm: format!("{service}-bin").into(),
            labels: ProcessLabels {
                service_name: service.into(),
                executable: format!("/usr/bin/{service}"),
                systemd_unit: Some(format!("{service}.service")),
                ..Default::default()
            },
            mappings: vec![],
            is_kernel_thread: false,
        })
    }

    fn sample(pid: u32, tid: u32, thread: &str) -> Sample {
        Sample {
            ktime_ns: 0,
            pid: Pid(pid),
            tid: Tid(tid),
            cpu: 0,
            comm: thread.into(),
            kernel_ips: vec![],
            user_ips: vec![],
            ..Default::default()
        }
    }

    fn names(profile: &Profile, sample: &ProfileSample) -> Vec<String> {
        sample
            .stack
            .iter()
            .map(|&i| profile.frames[i as usize].lines[0].function.to_string())
            .collect()
    }

    #[test]
    fn a_new_snapshot_of_a_pid_gets_its_own_series_and_root_within_a_window() {
        let mut agg = Aggregator::new(settings(Grouping::PerService), 1_000);
        let main = synthetic_frame("main");
        // The same pid before and after exec: two snapshots, two programs.
        let (before, after) = (process(10, "launcher"), process(10, "trainer"));
        for snapshot in [&before, &after, &before, &after, &after] {
            agg.add(
                Some(snapshot),
                &sample(10, 10, "t"),
                std::slice::from_ref(&main),
                false,
            );
        }
        let profiles = agg.flush(2_000);
        let by_service = |service: &str| {
            profiles
                .iter()
                .find(|p| p.series_label("service_name") == Some(service))
                .unwrap_or_else(|| panic!("no {service} series"))
        };
        let launcher = by_service("launcher");
        let trainer = by_service("trainer");
        assert_eq!(launcher.samples[0].count, 2);
        assert_eq!(trainer.samples[0].count, 3);
        assert_eq!(names(trainer, &trainer.samples[0]), ["main", "trainer-bin"]);
        // A later window starts from scratch (labels worked out again).
        agg.add(Some(&before), &sample(10, 10, "t"), &[main], false);
        let next = agg.flush(3_000);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].series_label("service_name"), Some("launcher"));
    }

    #[test]
    fn per_service_profiles_with_series_labels_and_root_frames() {
        let mut agg = Aggregator::new(settings(Grouping::PerService), 1_000);
        let leaf = synthetic_frame("work");
        let main = synthetic_frame("main");
        let (api, db) = (process(10, "api"), process(20, "db"));
        for _ in 0..3 {
            agg.add(
                Some(&api),
                &sample(10, 11, "worker"),
                &[leaf.clone(), main.clone()],
                false,
            );
        }
        agg.add(
            Some(&db),
            &sample(20, 20, "db"),
            std::slice::from_ref(&main),
            true,
        );
        assert_eq!(agg.samples_in_window(), 4);
        let profiles = agg.flush(2_000);
        assert_eq!(profiles.len(), 2);
        let api_profile = profiles
            .iter()
            .find(|p| p.series_label("service_name") == Some("api"))
            .unwrap();
        assert_eq!(api_profile.series_label("host"), Some("h1"));
        assert_eq!(api_profile.series_label("executable"), Some("/usr/bin/api"));
        assert_eq!(
            api_profile.series_label("systemd_unit"),
            Some("api.service")
        );
        assert_eq!(
            (api_profile.start_unix_ns, api_profile.duration_ns),
            (1_000, 1_000)
        );
        assert_eq!(api_profile.samples.len(), 1);
        assert_eq!(api_profile.samples[0].count, 3);
        assert_eq!(
            names(api_profile, &api_profile.samples[0]),
            ["work", "main", "api-bin"]
        );
        assert_eq!(api_profile.frames.len(), 3, "only frames this series uses");
        let db_profile = profiles
            .iter()
            .find(|p| p.series_label("service_name") == Some("db"))
            .unwrap();
        assert_eq!(
            names(db_profile, &db_profile.samples[0]),
            ["main", TRUNCATED_FRAME, "db-bin"]
        );
        assert!(
            agg.flush(3_000).is_empty(),
            "a flush starts a new, empty window"
        );
    }

    #[test]
    fn single_grouping_puts_service_name_on_samples() {
        let mut agg = Aggregator::new(settings(Grouping::Single), 0);
        let f = synthetic_frame("f");
        agg.add(
            Some(&process(10, "api")),
            &sample(10, 10, "api"),
            std::slice::from_ref(&f),
            false,
        );
        agg.add(
            None,
            &sample(30, 30, "gone"),
            std::slice::from_ref(&f),
            false,
        );
        agg.add(None, &sample(40, 41, "http"), &[f], false);
        let profiles = agg.flush(10);
        assert_eq!(profiles.len(), 1);
        let p = &profiles[0];
        assert_eq!(
            p.series_labels,
            vec![("host".to_string(), "h1".to_string())]
        );
        let services: HashSet<_> = p
            .samples
            .iter()
            .flat_map(|s| {
                s.labels
                    .iter()
                    .filter(|(k, _)| &**k == "service_name")
                    .map(|(_, v)| v.clone())
            })
            .collect();
        assert!(services.contains(&LabelValue::Str("api".into())));
        assert!(
            services.contains(&LabelValue::Str("gone".into())),
            "vanished process named by its main thread's comm"
        );
        assert!(
            services.contains(&LabelValue::Str(UNKNOWN_SERVICE.into()))
                && !services.contains(&LabelValue::Str("http".into())),
            "a thread's name is not a service: {services:?}"
        );
        let gone = p
            .samples
            .iter()
            .find(|s| s.labels.contains(&("pid".into(), LabelValue::Num(30))))
            .unwrap();
        assert_eq!(names(p, gone), ["f", "gone"]);
    }

    #[test]
    fn multi_valued_kinds_sum_every_value_per_stack() {
        let mut agg = Aggregator::new(
            AggregatorSettings {
                kind: ProfileKind::CudaAlloc,
                ..settings(Grouping::PerService)
            },
            0,
        );
        let (api, caller) = (synthetic_frame("cudaMalloc"), synthetic_frame("train"));
        let frames = [api, caller];
        let api_process = process(10, "api");
        // Two allocations in the window, then what is still in use at its end.
        for _ in 0..2 {
            agg.add_values(
                Some(&api_process),
                &sample(10, 11, "w"),
                &frames,
                false,
                &[100, 1, 0, 0],
            );
        }
        agg.add_values(
            Some(&api_process),
            &sample(10, 11, "w"),
            &frames,
            false,
            &[0, 0, 100, 1],
        );
        let profiles = agg.flush(10);
        assert_eq!(profiles.len(), 1);
        assert_eq!(profiles[0].kind, ProfileKind::CudaAlloc);
        let samples = &profiles[0].samples;
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].count, 200);
        assert_eq!(samples[0].more_values, [2, 100, 1]);

        // Single-valued kinds carry no further values; `add_value` fills the primary one.
        let mut cpu = Aggregator::new(settings(Grouping::PerService), 0);
        cpu.add_value(Some(&api_process), &sample(10, 11, "w"), &frames, false, 3);
        let profiles = cpu.flush(10);
        assert_eq!(profiles[0].samples[0].count, 3);
        assert!(profiles[0].samples[0].more_values.is_empty());
    }

    #[test]
    fn thread_names_dropped_when_too_many() {
        let mut agg = Aggregator::new(settings(Grouping::PerService), 0);
        let f = synthetic_frame("f");
        let api = process(10, "api");
        for (tid, name) in [(11, "a"), (12, "b"), (13, "c")] {
            agg.add(
                Some(&api),
                &sample(10, tid, name),
                std::slice::from_ref(&f),
                false,
            );
        }
        let profiles = agg.flush(10);
        assert!(
            profiles[0]
                .samples
                .iter()
                .all(|s| s.labels.iter().all(|(k, _)| &**k != "thread_name"))
        );
        assert_eq!(profiles[0].total_samples(), 3);

        let mut agg = Aggregator::new(settings(Grouping::PerService), 0);
        agg.add(
            Some(&api),
            &sample(10, 11, "a"),
            std::slice::from_ref(&f),
            false,
        );
        agg.add(Some(&api), &sample(10, 12, "b"), &[f], false);
        let profiles = agg.flush(10);
        assert!(
            profiles[0]
                .samples
                .iter()
                .all(|s| s.labels.iter().any(|(k, _)| &**k == "thread_name"))
        );
    }
}
