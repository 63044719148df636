//! Wires the stages together for `profiler record` and `profiler agent`.
//!
//! Threads: the sample reader (ring buffer → channel, never blocks), the pipeline (this thread:
//! process snapshots, unwinding, symbolization, aggregation; it owns the !Send blazesym
//! symbolizer), and in agent mode an exporter thread so a slow output never stalls sampling.
use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crossbeam_channel::{Receiver, RecvTimeoutError, TrySendError};

use crate::{
    aggregation::{Aggregator, AggregatorSettings, Grouping},
    bpf::{
        BpfError, EventRing, KernelPythonMaps, KernelUnwindMaps, LifecycleEvent, Sampler,
        SamplerSettings,
    },
    config::{AgentConfig, RecordConfig, SamplingConfig},
    export::{
        self, DirectorySink, ExportError, ProfileSink,
        push::{PushError, Pusher},
    },
    model::{Pid, ProcessInfo, Profile, Sample},
    process::ProcessRegistry,
    runtimes::python::PythonTracker,
    sampling::SampleReader,
    self_metrics::{SelfMetrics, process_cpu_time, process_rss},
    server::serve::{ServeError, Serving},
    store::sink::StoreSink,
    symbolization::{Symbolizer, SymbolizerOptions},
    unwinding::{ProcessSource, Unwinder, native::NativeTables},
};

/// Samples buffered between the reader and the pipeline (about 10 s of 64 busy CPUs at 100 Hz).
const SAMPLE_QUEUE: usize = 65_536;
/// Profiles buffered between the pipeline and the exporter.
const EXPORT_QUEUE: usize = 1_024;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Bpf(#[from] BpfError),
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error("no such process: {0}")]
    NoSuchProcess(u32),
    #[error("cannot write {path}: {message}")]
    OutputNotWritable { path: String, message: String },
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Push(#[from] PushError),
}

/// What a finished recording produced.
#[derive(Debug)]
pub struct RecordSummary {
    pub profile: Profile,
    pub metrics: SelfMetrics,
}

impl ProcessSource for ProcessRegistry {
    fn lookup(&mut self, pid: Pid) -> Option<Arc<ProcessInfo>> {
        ProcessRegistry::lookup(self, pid)
    }

    fn refresh_for_address(&mut self, pid: Pid, addr: u64) -> Option<Arc<ProcessInfo>> {
        ProcessRegistry::refresh_for_address(self, pid, addr)
    }
}

/// Process snapshots → unwinding → symbolization → aggregation, for one sample at a time.
struct Pipeline {
    processes: ProcessRegistry,
    unwinder: Unwinder,
    native_tables: NativeTables<KernelUnwindMaps>,
    python: PythonTracker<KernelPythonMaps>,
    events: EventRing,
    symbolizer: Symbolizer,
    aggregator: Aggregator,
    samples_processed: u64,
}

impl Pipeline {
    fn new(
        grouping: Grouping,
        sampling: &SamplingConfig,
        start_unix_ns: i64,
        unwind_maps: KernelUnwindMaps,
        python_maps: KernelPythonMaps,
        events: EventRing,
    ) -> Self {
        let host = hostname();
        Pipeline {
            processes: ProcessRegistry::new("/proc".into(), host.clone()),
            unwinder: Unwinder::default(),
            native_tables: NativeTables::new(unwind_maps, sampling.cache_dir.as_deref()),
            python: PythonTracker::new(python_maps, "/proc".into(), sampling.python_frames),
            events,
            symbolizer: Symbolizer::new(SymbolizerOptions {
                source_lines: sampling.source_lines,
                ..SymbolizerOptions::default()
            }),
            aggregator: Aggregator::new(
                AggregatorSettings {
                    grouping,
                    period_ns: sampling.period_ns(),
                    host,
                    max_thread_names: 64,
                },
                start_unix_ns,
            ),
            samples_processed: 0,
        }
    }

    fn handle(&mut self, sample: &Sample) {
        let (mut stack, process) = self.unwinder.unwind(sample, &mut self.processes);
        if let Some(process) = &process {
            // The first sample of a process (or of a new snapshot after exec/dlopen) registers
            // its mappings, so BPF unwinds its next samples from the tables.
            self.native_tables.sync(process);
            if sample.user_table_missing {
                self.native_tables.reload_missing(process);
            }
            self.python.sync(process);
        }
        self.python.interleave(sample, &mut stack);
        let frames = self.symbolizer.symbolize_stack(&stack);
        self.aggregator
            .add(process.as_deref(), sample, &frames, stack.truncated);
        self.samples_processed += 1;
    }

    /// Registers the given processes before sampling starts, so even their first samples are
    /// unwound from tables.
    fn register_known(&mut self, pids: &[u32]) {
        for &pid in pids {
            if let Some(process) = self.processes.lookup(Pid(pid)) {
                self.native_tables
                    .sync_waiting(&process, Duration::from_secs(10));
                self.python.sync(&process);
            }
        }
    }

    /// Places finished unwind tables and follows exits and execs.
    fn poll_events(&mut self) {
        self.native_tables.poll_builds();
        for event in self.events.drain() {
            match event {
                LifecycleEvent::Exited(pid) => {
                    self.native_tables.unregister(Pid(pid));
                    self.python.forget(Pid(pid));
                    self.symbolizer.forget_process(Pid(pid));
                }
                LifecycleEvent::Execed(pid) => {
                    // A new program: its next sample takes a new snapshot and registration.
                    self.native_tables.unregister(Pid(pid));
                    self.python.forget(Pid(pid));
                    self.symbolizer.forget_process(Pid(pid));
                    self.processes.forget(Pid(pid));
                }
            }
        }
    }

    fn metrics(&self, sampler: Option<&Sampler>, reader: Option<&SampleReader>) -> SelfMetrics {
        let symbols = self.symbolizer.stats();
        let registry = self.processes.stats();
        let (rss, peak) = process_rss();
        let mut metrics = SelfMetrics {
            samples_processed: self.samples_processed,
            truncated_stacks: self.unwinder.stats.truncated_stacks,
            unmapped_frames: self.unwinder.stats.unmapped_frames,
            unknown_processes: self.unwinder.stats.unknown_processes,
            frames_symbolized: symbols.frames_symbolized,
            symbolization_misses: symbols.misses,
            symbolization_errors: symbols.errors,
            symbol_cache_entries: symbols.cache_entries as u64,
            processes_tracked: self.processes.len() as u64,
            open_files: registry.open_files,
            agent_cpu: process_cpu_time(),
            agent_rss_bytes: rss,
            agent_peak_rss_bytes: peak,
            native_tables: self.native_tables.stats(),
            python: self.python.stats(),
            ..SelfMetrics::default()
        };
        if let Some(sampler) = sampler {
            metrics.bpf = sampler.stats();
            (metrics.bpf_run_time_ns, metrics.bpf_run_count) = sampler.program_run_stats();
            (metrics.pid_filter_entries, metrics.pid_filter_capacity) = sampler.pid_filter_fill();
        }
        if let Some(reader) = reader {
            reader.stats.add_to(&mut metrics);
        }
        metrics
    }
}

fn sampler_settings(sampling: &SamplingConfig) -> SamplerSettings {
    SamplerSettings {
        frequency_hz: sampling.frequency_hz,
        pids: sampling.pids.clone(),
        unwind_table_bytes: sampling.unwind_table_bytes,
    }
}

fn unix_now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn check_pids_exist(pids: &[u32]) -> Result<(), AgentError> {
    match pids
        .iter()
        .find(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    {
        Some(&pid) => Err(AgentError::NoSuchProcess(pid)),
        None => Ok(()),
    }
}

/// Fails early, before sampling, when `path` cannot be created.
fn check_writable_file(path: &Path) -> Result<(), AgentError> {
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let probe = dir.join(format!(
        ".{}.probe-{}",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let not_writable = |err: std::io::Error| AgentError::OutputNotWritable {
        path: path.display().to_string(),
        message: err.to_string(),
    };
    if path.is_dir() {
        return Err(not_writable(std::io::Error::from(
            std::io::ErrorKind::IsADirectory,
        )));
    }
    std::fs::File::create(&probe).map_err(not_writable)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn check_writable_dir(dir: &Path) -> Result<(), AgentError> {
    let not_writable = |err: std::io::Error| AgentError::OutputNotWritable {
        path: dir.display().to_string(),
        message: err.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(not_writable)?;
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(not_writable)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Runs the pipeline on samples from `rx` until `until` returns true; calls `on_tick` about
/// every 100 ms with the pipeline so the caller can flush.
fn pump(
    pipeline: &mut Pipeline,
    rx: &Receiver<Sample>,
    mut until: impl FnMut(&mut Pipeline) -> bool,
) {
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(sample) => {
                pipeline.handle(&sample);
                // Drain whatever else is queued before checking the clock again.
                for sample in rx.try_iter().take(4096) {
                    pipeline.handle(&sample);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        pipeline.poll_events();
        if until(pipeline) {
            return;
        }
    }
}

/// `profiler record`: samples for `config.duration` (or until `stop`), writes one profile.
pub fn record(config: &RecordConfig, stop: &AtomicBool) -> Result<RecordSummary, AgentError> {
    Sampler::preflight()?;
    check_pids_exist(&config.sampling.pids)?;
    check_writable_file(&config.output)?;
    let start_unix_ns = unix_now_ns();
    let (mut sampler, parts) = Sampler::load(&sampler_settings(&config.sampling))?;
    let mut pipeline = Pipeline::new(
        Grouping::Single,
        &config.sampling,
        start_unix_ns,
        parts.unwind_maps,
        parts.python_maps,
        parts.events,
    );
    pipeline.register_known(&config.sampling.pids);
    sampler.attach()?;
    let (reader, rx) = SampleReader::spawn(parts.samples, SAMPLE_QUEUE);
    let started = Instant::now();
    pump(&mut pipeline, &rx, |_| {
        started.elapsed() >= config.duration || stop.load(Ordering::Relaxed)
    });

    // Detach first so no sample is taken after the window, then take everything in flight.
    let bpf_stats = sampler.stats();
    let bpf_run_stats = sampler.program_run_stats();
    let duration_ns = started.elapsed().as_nanos() as i64;
    drop(sampler);
    let reader_stats = reader.stats.clone();
    reader.stop();
    for sample in rx.try_iter() {
        pipeline.handle(&sample);
    }
    let mut profiles = pipeline.aggregator.flush(start_unix_ns + duration_ns);
    let mut profile = profiles.pop().unwrap_or_else(|| Profile {
        series_labels: vec![("host".into(), hostname())],
        start_unix_ns,
        duration_ns,
        period_ns: config.sampling.period_ns(),
        ..Profile::default()
    });
    profile.duration_ns = duration_ns;

    let bytes = export::render(&profile, config.format);
    export::write_atomically(&config.output, &bytes)?;

    let mut metrics = pipeline.metrics(None, None);
    metrics.bpf = bpf_stats;
    (metrics.bpf_run_time_ns, metrics.bpf_run_count) = bpf_run_stats;
    reader_stats.add_to(&mut metrics);
    metrics.profiles_written = 1;
    metrics.log("recording finished");
    tracing::info!(path = %config.output.display(), samples = profile.total_samples(), "profile written");
    Ok(RecordSummary { profile, metrics })
}

/// The exporter thread and its queue: the pipeline hands over each interval's profiles without
/// waiting; a full queue drops the batch and counts it.
struct Exporter {
    queue: Option<crossbeam_channel::Sender<Vec<Profile>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    counters: Arc<ExportCounters>,
    /// Sends what the push sink queued, on its own thread.
    pusher: Option<Pusher>,
}

impl Exporter {
    fn spawn(mut sink: impl ProfileSink + Send + 'static, pusher: Option<Pusher>) -> Exporter {
        let (queue, batches) = crossbeam_channel::bounded::<Vec<Profile>>(EXPORT_QUEUE);
        let counters = Arc::new(ExportCounters::default());
        let thread = {
            let counters = counters.clone();
            std::thread::Builder::new()
                .name("exporter".into())
                .spawn(move || {
                    for profile in batches.into_iter().flatten() {
                        match sink.write(&profile) {
                            Ok(()) => counters.written.fetch_add(1, Ordering::Relaxed),
                            Err(err) => {
                                tracing::warn!("{err}");
                                counters.errors.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    }
                })
                .expect("spawning the exporter thread")
        };
        Exporter {
            queue: Some(queue),
            thread: Some(thread),
            counters,
            pusher,
        }
    }

    fn submit(&self, profiles: Vec<Profile>) {
        let count = profiles.len() as u64;
        let Some(queue) = &self.queue else { return };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = queue.try_send(profiles)
        {
            self.counters.errors.fetch_add(count, Ordering::Relaxed);
            tracing::warn!(
                profiles = count,
                "the output is not keeping up; dropped this interval's profiles"
            );
        }
    }

    /// Waits until everything submitted has been written (and pushed, or spooled, as far as
    /// the receiver allows).
    fn finish(&mut self) {
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Some(pusher) = self.pusher.take() {
            pusher.finish();
        }
    }

    fn add_to(&self, metrics: &mut SelfMetrics) {
        metrics.profiles_written = self.counters.written.load(Ordering::Relaxed);
        metrics.export_errors = self.counters.errors.load(Ordering::Relaxed);
        if let Some(pusher) = &self.pusher {
            pusher.add_to(metrics);
        }
    }
}

/// Ends the current window: hands its profiles to the exporter and logs the agent's health.
fn flush_interval(
    pipeline: &mut Pipeline,
    exporter: &Exporter,
    sampler: Option<&Sampler>,
    reader: Option<&SampleReader>,
) -> SelfMetrics {
    exporter.submit(pipeline.aggregator.flush(unix_now_ns()));
    pipeline.processes.evict_exited();
    let mut metrics = pipeline.metrics(sampler, reader);
    exporter.add_to(&mut metrics);
    metrics.log("interval");
    metrics
}

/// Every output of the agent, written in turn by the exporter thread.
struct Outputs(Vec<Box<dyn ProfileSink + Send>>);

impl ProfileSink for Outputs {
    fn write(&mut self, profile: &Profile) -> Result<(), ExportError> {
        let mut result = Ok(());
        for sink in &mut self.0 {
            // One failing output must not starve the others.
            if let Err(err) = sink.write(profile) {
                result = Err(err);
            }
        }
        result
    }
}

/// `profiler agent`: samples until `stop`, writing one profile per service every interval.
pub fn run_agent(config: &AgentConfig, stop: Arc<AtomicBool>) -> Result<(), AgentError> {
    Sampler::preflight()?;
    check_pids_exist(&config.sampling.pids)?;
    let mut outputs: Vec<Box<dyn ProfileSink + Send>> = Vec::new();
    if let Some(dir) = &config.output_dir {
        check_writable_dir(dir)?;
        outputs.push(Box::new(DirectorySink::new(dir.clone())));
    }
    let serving = Serving::start(&config.serve)?;
    if let Some(store) = &serving.store {
        outputs.push(Box::new(StoreSink::new(store.clone())));
    }
    let pusher = match &config.push {
        Some(push) => {
            let (pusher, sink) = Pusher::start(push)?;
            outputs.push(Box::new(sink));
            Some(pusher)
        }
        None => None,
    };
    let mut exporter = Exporter::spawn(Outputs(outputs), pusher);
    let (mut sampler, parts) = Sampler::load(&sampler_settings(&config.sampling))?;
    let mut pipeline = Pipeline::new(
        Grouping::PerService,
        &config.sampling,
        unix_now_ns(),
        parts.unwind_maps,
        parts.python_maps,
        parts.events,
    );
    pipeline.register_known(&config.sampling.pids);
    sampler.attach()?;
    let (reader, rx) = SampleReader::spawn(parts.samples, SAMPLE_QUEUE);
    tracing::info!(
        interval_s = config.interval.as_secs_f64(),
        output_dir = ?config.output_dir,
        store = ?config.serve.store.as_ref().map(|s| &s.data_dir),
        pyroscope = ?config.push.as_ref().map(|p| &p.url),
        url = %format!("http://{}/", serving.local_addr()),
        "agent running"
    );
    let mut next_flush = Instant::now() + config.interval;
    pump(&mut pipeline, &rx, |pipeline| {
        let now = Instant::now();
        if now >= next_flush {
            // After a stall (start-up, a slow table build) start the next window from now
            // instead of flushing a burst of empty catch-up windows.
            next_flush = (next_flush + config.interval).max(now + config.interval / 2);
            let metrics = flush_interval(pipeline, &exporter, Some(&sampler), Some(&reader));
            serving.health.publish(metrics);
        }
        stop.load(Ordering::Relaxed)
    });

    tracing::info!("stopping: flushing the current interval");
    let bpf_stats = sampler.stats();
    let bpf_run_stats = sampler.program_run_stats();
    drop(sampler);
    let reader_stats = reader.stats.clone();
    reader.stop();
    for sample in rx.try_iter() {
        pipeline.handle(&sample);
    }
    exporter.submit(pipeline.aggregator.flush(unix_now_ns()));
    exporter.finish();
    let mut metrics = pipeline.metrics(None, None);
    metrics.bpf = bpf_stats;
    (metrics.bpf_run_time_ns, metrics.bpf_run_count) = bpf_run_stats;
    reader_stats.add_to(&mut metrics);
    exporter.add_to(&mut metrics);
    metrics.log("agent stopped");
    serving.shutdown();
    Ok(())
}

#[derive(Debug, Default)]
struct ExportCounters {
    written: std::sync::atomic::AtomicU64,
    errors: std::sync::atomic::AtomicU64,
}
