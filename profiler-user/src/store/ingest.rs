//! Turning what clients send (pprof, folded stacks) into [`NewProfile`]s: decompression with a
//! size guard, pprof validation as Pyroscope does it (docs/pyroscope-protocol.md §5.2), one profile per
//! sample type and per distinct set of pprof sample string labels.
use std::io::Read;

use foldhash::{HashMap, HashMapExt};

use prost::Message;

use super::{
    NewLabelled, NewProfile, NewSpan, ProfileType,
    frames::{Frame, NO_STRING},
};
use crate::{
    model::{LabelValue, MAX_SAMPLE_VALUES, Profile, ProfileKind},
    wire::proto,
};

/// Why a payload was rejected. Display is one line for the client.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("the profile is larger than {limit} bytes after decompression")]
    TooLarge { limit: usize },
    #[error("the profile is not valid gzip: {0}")]
    Gzip(#[source] std::io::Error),
    #[error("malformed pprof: {0}")]
    PprofDecode(#[source] prost::DecodeError),
    /// A pprof that decodes but breaks its own rules (indexes out of range, no sample types).
    #[error("malformed pprof: {0}")]
    MalformedPprof(String),
    #[error("malformed folded profile at line {line}: {reason}")]
    MalformedFolded { line: usize, reason: &'static str },
    #[error("{0}")]
    InvalidLabels(String),
    #[error("unknown profile type `{0}` in the application name")]
    UnknownTextProfileType(String),
    #[error(
        "negative sample value {value} of sample type `{sample_type}`: sample values must be zero or positive"
    )]
    NegativeValue { value: i64, sample_type: String },
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Gunzips `bytes` if they start with the gzip magic, refusing to produce more than `limit`
/// bytes (a zip bomb stops at the limit instead of filling memory).
pub fn maybe_gunzip(bytes: &[u8], limit: usize) -> Result<std::borrow::Cow<'_, [u8]>, IngestError> {
    if !bytes.starts_with(&GZIP_MAGIC) {
        if bytes.len() > limit {
            return Err(IngestError::TooLarge { limit });
        }
        return Ok(std::borrow::Cow::Borrowed(bytes));
    }
    gunzip(bytes, limit).map(std::borrow::Cow::Owned)
}

/// Gunzips (all members) with an output limit.
pub fn gunzip(bytes: &[u8], limit: usize) -> Result<Vec<u8>, IngestError> {
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(bytes)
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(IngestError::Gzip)?;
    if out.len() > limit {
        return Err(IngestError::TooLarge { limit });
    }
    Ok(out)
}

/// Gzips bytes in memory (pprof files are stored gzipped).
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    // Writing into a Vec cannot fail.
    let _ = encoder.write_all(bytes);
    encoder.finish().unwrap_or_default()
}

/// Decodes a pprof payload, gzipped or not.
pub fn decode_pprof(bytes: &[u8], limit: usize) -> Result<proto::Profile, IngestError> {
    let raw = maybe_gunzip(bytes, limit)?;
    proto::Profile::decode(raw.as_ref()).map_err(IngestError::PprofDecode)
}

/// Label names and values as Pyroscope accepts them (docs/pyroscope-protocol.md §5.3).
pub fn validate_labels(labels: &[(String, String)]) -> Result<(), IngestError> {
    if labels.len() > 40 {
        return Err(IngestError::InvalidLabels(format!(
            "too many labels ({}, at most 40)",
            labels.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for (name, value) in labels {
        if name.is_empty() || name.len() > 1024 {
            return Err(IngestError::InvalidLabels(format!(
                "invalid label name `{}`",
                name.escape_debug()
            )));
        }
        if name
            .chars()
            .any(|c| c.is_control() || c == '"' || c == '{' || c == '}' || c == ',' || c == '=')
        {
            return Err(IngestError::InvalidLabels(format!(
                "label name `{}` contains a reserved character",
                name.escape_debug()
            )));
        }
        if value.len() > 2048 {
            return Err(IngestError::InvalidLabels(format!(
                "the value of label `{name}` is longer than 2048 bytes"
            )));
        }
        if !seen.insert(name.as_str()) {
            return Err(IngestError::InvalidLabels(format!(
                "label `{name}` given twice"
            )));
        }
    }
    if let Some((_, name)) = labels.iter().find(|(k, _)| k == "__name__")
        && (name.is_empty() || name.contains(':'))
    {
        return Err(IngestError::InvalidLabels(format!(
            "invalid profile name `{}`",
            name.escape_debug()
        )));
    }
    Ok(())
}

/// The `__name__` Pyroscope derives for a pprof sent to `/ingest` (docs/pyroscope-protocol.md §4.4).
pub fn derive_pprof_name(pprof: &proto::Profile) -> String {
    let string = |i: i64| {
        pprof
            .string_table
            .get(i as usize)
            .map_or("", String::as_str)
    };
    let types: Vec<&str> = pprof.sample_type.iter().map(|t| string(t.r#type)).collect();
    if types.contains(&"wall") {
        return "wall".into();
    }
    for t in &types {
        let t = if *t == "samples" { "cpu" } else { t };
        if t.contains("cpu") {
            return "process_cpu".into();
        }
        if t.contains("alloc_") || t.contains("inuse_") || t == "space" || t == "objects" {
            return "memory".into();
        }
        if t.contains("mutex_") {
            return "mutex".into();
        }
        if t.contains("block_") {
            return "block".into();
        }
        if t.contains("goroutines") {
            return "goroutines".into();
        }
    }
    types
        .last()
        .map_or_else(|| "unknown".into(), |t| t.to_string())
}

/// Splits a validated pprof into stored profiles: one per sample type and distinct set of sample
/// string labels. `name` is the profile's `__name__`; `default_time_ns` replaces a missing time.
pub fn profiles_from_pprof(
    pprof: &proto::Profile,
    name: &str,
    series_labels: &[(String, String)],
    default_time_ns: i64,
) -> Result<Vec<NewProfile>, IngestError> {
    validate_pprof(pprof)?;
    let string = |i: i64| pprof.string_table[i as usize].as_str();
    let malformed = |msg: String| IngestError::MalformedPprof(msg);

    // Strings, deduplicated, and each location's frames root first. Strings are keyed by
    // string-table index (no hashing or copying of the text per lookup); the module+address
    // labels of unsymbolized frames are the only owned keys.
    let mut names: Vec<String> = Vec::new();
    let mut frames: Vec<Frame> = Vec::new();
    let mut name_of_string: Vec<u32> = vec![u32::MAX; pprof.string_table.len()];
    let mut name_of_label: HashMap<String, u32> = HashMap::new();
    // The empty string is no string.
    let mut intern_string = |i: i64, names: &mut Vec<String>| -> u32 {
        if string(i).is_empty() {
            return NO_STRING;
        }
        let slot = &mut name_of_string[i as usize];
        if *slot == u32::MAX {
            names.push(string(i).to_owned());
            *slot = names.len() as u32 - 1;
        }
        *slot
    };
    let functions: HashMap<u64, &proto::Function> =
        pprof.function.iter().map(|f| (f.id, f)).collect();
    let mappings: HashMap<u64, &proto::Mapping> = pprof.mapping.iter().map(|m| (m.id, m)).collect();
    let mut locations: HashMap<u64, Vec<u32>> = HashMap::with_capacity(pprof.location.len());
    for location in &pprof.location {
        let mapping = mappings.get(&location.mapping_id);
        let object = mapping.map_or(NO_STRING, |m| intern_string(m.filename, &mut names));
        let build_id = mapping.map_or(NO_STRING, |m| intern_string(m.build_id, &mut names));
        let address = mapping.map_or(0, |m| {
            file_address(
                object,
                location.address,
                m.memory_start..m.memory_limit,
                m.file_offset,
            )
        });
        let mut location_frames = Vec::with_capacity(location.line.len().max(1));
        // Outermost first: each later line was inlined into the one before it.
        for (depth, line) in location.line.iter().rev().enumerate() {
            let function = functions.get(&line.function_id).ok_or_else(|| {
                malformed(format!(
                    "location {} refers to unknown function {}",
                    location.id, line.function_id
                ))
            })?;
            let name = if !string(function.name).is_empty() {
                intern_string(function.name, &mut names)
            } else if !string(function.system_name).is_empty() {
                intern_string(function.system_name, &mut names)
            } else {
                intern_label(&mut name_of_label, UNKNOWN_FUNCTION.to_owned(), &mut names)
            };
            let system_name = match intern_string(function.system_name, &mut names) {
                same if same == name => NO_STRING,
                other => other,
            };
            frames.push(Frame {
                name,
                system_name,
                file: intern_string(function.filename, &mut names),
                start_line: u32::try_from(function.start_line).unwrap_or(0),
                line: u32::try_from(line.line).unwrap_or(0),
                object,
                build_id,
                address,
                inlined: depth > 0,
            });
            location_frames.push(frames.len() as u32 - 1);
        }
        if location_frames.is_empty() {
            let module = mapping.map(|m| string(m.filename));
            let label = unsymbolized_label(module, location.address);
            let name = intern_label(&mut name_of_label, label, &mut names);
            frames.push(Frame {
                object,
                build_id,
                address,
                ..Frame::named(name)
            });
            location_frames.push(frames.len() as u32 - 1);
        }
        locations.insert(location.id, location_frames);
    }

    let time_ns = if pprof.time_nanos < 365 * 86_400 * 1_000_000_000 {
        default_time_ns
    } else {
        pprof.time_nanos
    };
    let value_type = |t: &proto::ValueType| (string(t.r#type), string(t.unit));
    let mut grouper = SampleGrouper::new(
        name,
        series_labels,
        ProfileHeader {
            sample_types: pprof.sample_type.iter().map(value_type).collect(),
            period_type: pprof.period_type.as_ref().map(value_type),
            time_ns,
            duration_ns: pprof.duration_nanos,
            period: pprof.period.max(0),
        },
    );
    for sample in &pprof.sample {
        let mut path = Vec::with_capacity(sample.location_id.len() * 2);
        for id in sample.location_id.iter().rev() {
            let frames = locations
                .get(id)
                .ok_or_else(|| malformed(format!("a sample refers to unknown location {id}")))?;
            path.extend_from_slice(frames);
        }
        grouper.add(
            path,
            sample
                .label
                .iter()
                .filter(|l| l.str != 0)
                .map(|l| (string(l.key), string(l.str))),
            sample
                .label
                .iter()
                .filter(|l| l.str == 0 && l.key != 0)
                .map(|l| (string(l.key), l.num)),
            &sample.value,
        );
    }
    grouper.finish(names, frames)
}

/// [`profiles_from_pprof`] of [`build_pprof`](crate::export::pprof::build_pprof)`(profile)`,
/// without building and reading back the pprof: the agent's own profiles go into the embedded
/// store this way, stored as they would be pushed (a test holds the two equal).
pub fn profiles_from_model(profile: &Profile) -> Result<Vec<NewProfile>, IngestError> {
    check_sample_count(profile.samples.len())?;
    let mut names = NameTable::default();
    let mut frames: Vec<Frame> = Vec::new();
    // Each profile frame's stored frames, root first, as a range of `frames`.
    let mut frames_of: Vec<std::ops::Range<u32>> = Vec::with_capacity(profile.frames.len());
    for frame in &profile.frames {
        let first = frames.len() as u32;
        let mapping = frame.mapping.as_deref();
        let object = mapping.map_or(NO_STRING, |m| names.intern(&m.filename));
        let build_id = mapping.map_or(NO_STRING, |m| {
            names.intern(m.build_id.as_deref().unwrap_or_default())
        });
        let address = mapping.map_or(0, |m| {
            file_address(object, frame.address, m.start..m.limit, m.file_offset)
        });
        for (depth, line) in frame.lines.iter().rev().enumerate() {
            // What build_pprof writes: the raw name, or the name again when there is none.
            let system_text = line.system_name.as_deref().unwrap_or(&line.function);
            let name_text = if !line.function.is_empty() {
                &*line.function
            } else if !system_text.is_empty() {
                system_text
            } else {
                UNKNOWN_FUNCTION
            };
            let name = names.intern(name_text);
            let system_name = match system_text == name_text {
                true => NO_STRING,
                false => names.intern(system_text),
            };
            frames.push(Frame {
                name,
                system_name,
                file: names.intern(line.file.as_deref().unwrap_or_default()),
                start_line: 0,
                line: line.line,
                object,
                build_id,
                address,
                inlined: depth > 0,
            });
        }
        if frame.lines.is_empty() {
            let module = mapping.map(|m| &*m.filename);
            let name = names.intern(&unsymbolized_label(module, frame.address));
            frames.push(Frame {
                object,
                build_id,
                address,
                ..Frame::named(name)
            });
        }
        frames_of.push(first..frames.len() as u32);
    }

    let is_cpu = profile.kind == ProfileKind::Cpu;
    let (sample_types, period_type, period) = match is_cpu {
        true => (
            CPU_SAMPLE_TYPES.to_vec(),
            CPU_SAMPLE_TYPES[1],
            profile.period_ns.max(0),
        ),
        false => (
            profile.kind.sample_types().to_vec(),
            profile.kind.period_type(),
            1,
        ),
    };
    let types = sample_types.len();
    let mut grouper = SampleGrouper::new(
        profile.kind.name(),
        &profile.series_labels,
        ProfileHeader {
            sample_types,
            period_type: Some(period_type),
            time_ns: profile.start_unix_ns,
            duration_ns: profile.duration_ns,
            period,
        },
    );
    let mut skipped_frame_refs = 0usize;
    for sample in &profile.samples {
        let mut path = Vec::with_capacity(sample.stack.len() * 2);
        for &index in sample.stack.iter().rev() {
            match frames_of.get(index as usize) {
                Some(range) => path.extend(range.clone()),
                None => skipped_frame_refs += 1,
            }
        }
        let count = i64::try_from(sample.count).unwrap_or(i64::MAX);
        let mut values = [0i64; MAX_SAMPLE_VALUES];
        if is_cpu {
            values[..2].copy_from_slice(&[count, count.saturating_mul(profile.period_ns)]);
        } else {
            let more = sample
                .more_values
                .iter()
                .map(|&v| i64::try_from(v).unwrap_or(i64::MAX));
            for (slot, value) in values.iter_mut().zip(std::iter::once(count).chain(more)) {
                *slot = value;
            }
        }
        // A pprof label with an empty string value reads as the number 0, and one with an
        // empty key as no number (pprof's string index 0 is both "" and "none").
        let strings = sample.labels.iter().filter_map(|(key, value)| match value {
            LabelValue::Str(text) if !text.is_empty() => Some((&**key, &**text)),
            _ => None,
        });
        let numbers = sample
            .labels
            .iter()
            .filter(|(key, _)| !key.is_empty())
            .filter_map(|(key, value)| match value {
                LabelValue::Num(num) => Some((&**key, *num)),
                LabelValue::Str(text) => text.is_empty().then_some((&**key, 0)),
            });
        grouper.add(path, strings, numbers, &values[..types]);
    }
    if skipped_frame_refs > 0 {
        // As build_pprof says it of the pushed profile.
        tracing::warn!(
            skipped_frame_refs,
            "store: stacks refer to frames that do not exist; skipped those frames"
        );
    }
    grouper.finish(names.names, frames)
}

/// pprof's sample types of a CPU profile: samples taken, and the CPU time they stand for.
const CPU_SAMPLE_TYPES: [(&str, &str); 2] = [("samples", "count"), ("cpu", "nanoseconds")];

/// The name of a frame line without a function name.
const UNKNOWN_FUNCTION: &str = "[unknown]";

/// An address as the offset in its mapping's object file, the same in every process (see
/// store::frames); 0 without an object or outside the mapping: such an address may differ in
/// every process and would make a new frame each time.
fn file_address(object: u32, address: u64, mapping: std::ops::Range<u64>, file_offset: u64) -> u64 {
    match object != NO_STRING && mapping.contains(&address) {
        true => (address - mapping.start).saturating_add(file_offset),
        false => 0,
    }
}

/// An unsymbolized frame's name: module and address, so distinct addresses stay apart.
fn unsymbolized_label(module_path: Option<&str>, address: u64) -> String {
    match module_path.filter(|path| !path.is_empty()) {
        Some(path) => {
            let module = path.rsplit('/').next().unwrap_or(path);
            format!("{module}+0x{address:x}")
        }
        None => format!("0x{address:x}"),
    }
}

/// Strings deduplicated by their text; the empty string is no string.
#[derive(Default)]
struct NameTable {
    names: Vec<String>,
    index: HashMap<String, u32>,
}

impl NameTable {
    fn intern(&mut self, text: &str) -> u32 {
        if text.is_empty() {
            return NO_STRING;
        }
        if let Some(&id) = self.index.get(text) {
            return id;
        }
        intern_label(&mut self.index, text.to_owned(), &mut self.names)
    }
}

/// What the stored profiles of one source share.
struct ProfileHeader<'a> {
    /// (type, unit) of each sample value.
    sample_types: Vec<(&'a str, &'a str)>,
    period_type: Option<(&'a str, &'a str)>,
    time_ns: i64,
    duration_ns: i64,
    period: i64,
}

/// Files samples into profiles: one per sample type and distinct set of sample string labels
/// (series labels win over sample labels of their name), with each sample's span and numeric
/// labels kept beside (docs/pyroscope-protocol.md §5.2).
struct SampleGrouper<'a> {
    name: &'a str,
    series_labels: &'a [(String, String)],
    header: ProfileHeader<'a>,
    out: Vec<NewProfile>,
    // Distinct sample label sets, and (sample type index, label set index) → position in `out`.
    label_sets: HashMap<Vec<(String, String)>, usize>,
    groups: HashMap<(usize, usize), usize>,
    labels: Vec<(String, String)>,
    // (position in `out`, span id) → position in that profile's spans.
    span_positions: HashMap<(usize, u64), usize>,
    // Numeric labels (`pid`, `tid`): per position in `out`, set → position in its groups.
    numeric: NumericLabels<'a>,
    numeric_positions: HashMap<usize, HashMap<NumericLabels<'a>, usize>>,
}

/// A sample's numeric labels, by key.
type NumericLabels<'a> = Vec<(&'a str, i64)>;

impl<'a> SampleGrouper<'a> {
    fn new(
        name: &'a str,
        series_labels: &'a [(String, String)],
        header: ProfileHeader<'a>,
    ) -> Self {
        SampleGrouper {
            name,
            series_labels,
            header,
            out: Vec::new(),
            label_sets: HashMap::new(),
            groups: HashMap::new(),
            labels: Vec::new(),
            span_positions: HashMap::new(),
            numeric: Vec::new(),
            numeric_positions: HashMap::new(),
        }
    }

    /// One sample: its frames root first, its labels with a string value and with a number,
    /// and one value per sample type.
    fn add(
        &mut self,
        mut path: Vec<u32>,
        strings: impl Iterator<Item = (&'a str, &'a str)>,
        numbers: impl Iterator<Item = (&'a str, i64)>,
        values: &[i64],
    ) {
        let mut span = SampleSpan::default();
        self.labels.clear();
        self.numeric.clear();
        self.numeric.extend(numbers);
        // By key name, one value per name, as the stored groups are.
        self.numeric.sort();
        self.numeric.dedup_by(|a, b| a.0 == b.0);
        for (key, value) in strings {
            match key {
                // Pyroscope reads a `profile_id` label as the span id (older SDKs' name).
                SPAN_ID_LABEL | "profile_id" => span.id = span.id.or(parse_span_id(value)),
                TRACE_ID_LABEL => span.trace_id = value,
                SPAN_NAME_LABEL => span.name = value,
                // Series labels win over sample labels of the same name.
                _ if self.series_labels.iter().any(|(s, _)| s == key) => {}
                _ => self.labels.push((key.to_owned(), value.to_owned())),
            }
        }
        self.labels.sort();
        self.labels.dedup_by(|a, b| a.0 == b.0);
        let label_set = match self.label_sets.get(self.labels.as_slice()) {
            Some(&index) => index,
            None => {
                let index = self.label_sets.len();
                self.label_sets.insert(self.labels.clone(), index);
                index
            }
        };
        let last_value = values.iter().rposition(|v| *v != 0);
        for (type_index, &value) in values.iter().enumerate() {
            if value == 0 {
                continue;
            }
            let position = match self.groups.get(&(type_index, label_set)) {
                Some(&position) => position,
                None => {
                    let position = self.new_profile(type_index);
                    self.groups.insert((type_index, label_set), position);
                    position
                }
            };
            let profile = &mut self.out[position];
            if !self.numeric.is_empty() {
                let groups = &mut profile.labelled;
                let positions = self.numeric_positions.entry(position).or_default();
                let index = match positions.get(self.numeric.as_slice()) {
                    Some(&index) => index,
                    None => {
                        groups.push(NewLabelled {
                            labels: self
                                .numeric
                                .iter()
                                .map(|&(key, num)| (key.to_owned(), num))
                                .collect(),
                            stacks: Vec::new(),
                        });
                        positions.insert(self.numeric.clone(), groups.len() - 1);
                        groups.len() - 1
                    }
                };
                groups[index].stacks.push((path.clone(), value));
            }
            if let Some(span_id) = span.id {
                let spans = &mut profile.spans;
                let index = *self
                    .span_positions
                    .entry((position, span_id))
                    .or_insert_with(|| {
                        spans.push(NewSpan {
                            span_id,
                            trace_id: span.trace_id.to_owned(),
                            span_name: span.name.to_owned(),
                            stacks: Vec::new(),
                        });
                        spans.len() - 1
                    });
                spans[index].stacks.push((path.clone(), value));
            }
            // The path is shared by the sample's values; the last one takes it.
            let path = if Some(type_index) == last_value {
                std::mem::take(&mut path)
            } else {
                path.clone()
            };
            profile.stacks.push((path, value));
        }
    }

    /// A new profile of sample type `type_index` with the current sample's labels.
    fn new_profile(&mut self, type_index: usize) -> usize {
        let (sample_type, sample_unit) = self.header.sample_types[type_index];
        let (period_type, period_unit) = self.header.period_type.unwrap_or_default();
        let mut labels = self.series_labels.to_vec();
        labels.extend(self.labels.iter().cloned());
        self.out.push(NewProfile {
            profile_type: Some(ProfileType {
                name: self.name.to_owned(),
                sample_type: sample_type.to_owned(),
                sample_unit: sample_unit.to_owned(),
                period_type: period_type.to_owned(),
                period_unit: period_unit.to_owned(),
            }),
            labels,
            time_ns: self.header.time_ns,
            duration_ns: self.header.duration_ns,
            period: self.header.period,
            names: Vec::new(),
            frames: Vec::new(),
            stacks: Vec::new(),
            spans: Vec::new(),
            labelled: Vec::new(),
        });
        self.out.len() - 1
    }

    /// The profiles, each with the strings and frames its stacks index.
    fn finish(
        self,
        names: Vec<String>,
        frames: Vec<Frame>,
    ) -> Result<Vec<NewProfile>, IngestError> {
        let mut out = self.out;
        if let Some((last, rest)) = out.split_last_mut() {
            for profile in rest {
                profile.names = names.clone();
                profile.frames = frames.clone();
            }
            last.names = names;
            last.frames = frames;
        }
        for profile in &out {
            validate_labels(&profile.labels)?;
        }
        Ok(out)
    }
}

/// The sample labels that tie a sample to a trace span (pyroscope-otel, otel-profiling-go).
/// They are kept with the sample, never as series labels: each request has its own.
pub const SPAN_ID_LABEL: &str = "span_id";
pub const SPAN_NAME_LABEL: &str = "span_name";
pub const TRACE_ID_LABEL: &str = "trace_id";

/// What a sample's labels say of its span.
#[derive(Default)]
struct SampleSpan<'a> {
    id: Option<u64>,
    trace_id: &'a str,
    name: &'a str,
}

/// A span id as SDKs write it: up to 16 hex digits (OpenTelemetry's 8 bytes). Zero, the
/// invalid span id, and anything else is no span.
pub fn parse_span_id(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(text, 16).ok().filter(|&id| id != 0)
}

/// The name id of an owned frame label, added to `names` when new.
fn intern_label(index: &mut HashMap<String, u32>, label: String, names: &mut Vec<String>) -> u32 {
    if let Some(&id) = index.get(&label) {
        return id;
    }
    names.push(label.clone());
    let id = names.len() as u32 - 1;
    index.insert(label, id);
    id
}

/// Most samples one profile may have.
const MAX_SAMPLES: usize = 64_000;

fn check_sample_count(samples: usize) -> Result<(), IngestError> {
    match samples > MAX_SAMPLES {
        true => Err(IngestError::MalformedPprof(format!(
            "{samples} samples, at most {MAX_SAMPLES}"
        ))),
        false => Ok(()),
    }
}

/// Structural checks before any use (docs/pyroscope-protocol.md §5.2); afterwards every index used is in range.
pub fn validate_pprof(pprof: &proto::Profile) -> Result<(), IngestError> {
    let malformed = |msg: String| Err(IngestError::MalformedPprof(msg));
    let strings = pprof.string_table.len() as i64;
    if pprof.string_table.first().is_none_or(|s| !s.is_empty()) {
        return malformed("string_table[0] must be the empty string".into());
    }
    if pprof.sample_type.is_empty() {
        return malformed("no sample_type".into());
    }
    let in_range = |i: i64| (0..strings).contains(&i);
    for t in pprof.sample_type.iter().chain(pprof.period_type.iter()) {
        if !in_range(t.r#type) || !in_range(t.unit) {
            return malformed("a sample type refers to a string out of range".into());
        }
        for part in [t.r#type, t.unit] {
            let s = &pprof.string_table[part as usize];
            if s.contains(':') {
                return malformed(format!("sample type `{}` contains ':'", s.escape_debug()));
            }
        }
    }
    check_sample_count(pprof.sample.len())?;
    for sample in &pprof.sample {
        if sample.value.len() != pprof.sample_type.len() {
            return malformed(format!(
                "a sample has {} values for {} sample types",
                sample.value.len(),
                pprof.sample_type.len()
            ));
        }
        if let Some((index, &value)) = sample.value.iter().enumerate().find(|(_, v)| **v < 0) {
            let sample_type = &pprof.string_table[pprof.sample_type[index].r#type as usize];
            return Err(IngestError::NegativeValue {
                value,
                sample_type: super::limits::quote(sample_type),
            });
        }
        for label in &sample.label {
            if !in_range(label.key) || !in_range(label.str) || !in_range(label.num_unit) {
                return malformed("a sample label refers to a string out of range".into());
            }
        }
    }
    for function in &pprof.function {
        if function.id == 0 {
            return malformed("function id 0".into());
        }
        if !in_range(function.name)
            || !in_range(function.system_name)
            || !in_range(function.filename)
        {
            return malformed(format!(
                "function {} refers to a string out of range",
                function.id
            ));
        }
    }
    for location in &pprof.location {
        if location.id == 0 {
            return malformed("location id 0".into());
        }
    }
    for mapping in &pprof.mapping {
        if !in_range(mapping.filename) || !in_range(mapping.build_id) {
            return malformed(format!(
                "mapping {} refers to a string out of range",
                mapping.id
            ));
        }
    }
    Ok(())
}

/// The profile type of a text upload (`folded`, `lines`) from the application name's suffix
/// (docs/pyroscope-protocol.md §4.4), and the service name without it. Returns the nanoseconds-per-sample factor too.
pub fn text_profile_type(
    app: &str,
    sample_rate: u32,
) -> Result<(String, ProfileType, i64), IngestError> {
    let (service, suffix) = match app.rsplit_once('.') {
        Some((service, suffix)) => (service, suffix),
        None => (app, ""),
    };
    let typed =
        |name: &str, sample_type: &str, sample_unit: &str, period_type: &str, period_unit: &str| {
            ProfileType {
                name: name.into(),
                sample_type: sample_type.into(),
                sample_unit: sample_unit.into(),
                period_type: period_type.into(),
                period_unit: period_unit.into(),
            }
        };
    let ns_per_sample = 1_000_000_000 / i64::from(sample_rate.max(1));
    let (profile_type, factor) = match suffix {
        "" | "cpu" | "itimer" => (
            typed("process_cpu", "cpu", "nanoseconds", "cpu", "nanoseconds"),
            ns_per_sample,
        ),
        "wall" => (
            typed("wall", "wall", "nanoseconds", "wall", "nanoseconds"),
            ns_per_sample,
        ),
        "inuse_objects" | "alloc_objects" => {
            (typed("memory", suffix, "count", "space", "bytes"), 1)
        }
        "inuse_space" | "alloc_space" | "bytes" => {
            (typed("memory", suffix, "bytes", "space", "bytes"), 1)
        }
        "goroutines" => (
            typed("goroutine", "goroutine", "count", "goroutine", "count"),
            1,
        ),
        "mutex_count" => (
            typed("mutex", "contentions", "count", "contentions", "count"),
            1,
        ),
        "mutex_duration" => (
            typed("mutex", "delay", "nanoseconds", "contentions", "count"),
            1,
        ),
        "block_count" => (
            typed("block", "contentions", "count", "contentions", "count"),
            1,
        ),
        "block_duration" => (
            typed("block", "delay", "nanoseconds", "contentions", "count"),
            1,
        ),
        other => return Err(IngestError::UnknownTextProfileType(other.to_owned())),
    };
    Ok((service.to_owned(), profile_type, factor))
}

/// Function names, and stacks as (indexes into the names, root first; value).
pub type NamedStacks = (Vec<String>, Vec<(Vec<u32>, i64)>);

/// Parses folded stacks (`a;b;c 12` per line; `lines` format: `a;b;c` = 1 each), root first.
pub fn parse_folded(
    text: &[u8],
    lines_format: bool,
    factor: i64,
) -> Result<NamedStacks, IngestError> {
    let text = std::str::from_utf8(text).map_err(|_| IngestError::MalformedFolded {
        line: 0,
        reason: "not UTF-8",
    })?;
    let mut names = Vec::new();
    let mut index: HashMap<&str, u32> = HashMap::new();
    let mut stacks = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let (stack, count) = if lines_format {
            (line, 1i64)
        } else {
            let (stack, count) = line.rsplit_once(' ').ok_or(IngestError::MalformedFolded {
                line: number + 1,
                reason: "expected `frame;frame;... count`",
            })?;
            let count: i64 = count
                .trim()
                .parse()
                .map_err(|_| IngestError::MalformedFolded {
                    line: number + 1,
                    reason: "the count is not an integer",
                })?;
            if count < 0 {
                return Err(IngestError::MalformedFolded {
                    line: number + 1,
                    reason: "negative count",
                });
            }
            (stack, count)
        };
        let path = stack
            .split(';')
            .filter(|frame| !frame.is_empty())
            .map(|frame| {
                *index.entry(frame).or_insert_with(|| {
                    names.push(frame.to_owned());
                    names.len() as u32 - 1
                })
            })
            .collect();
        stacks.push((path, count.saturating_mul(factor)));
    }
    Ok((names, stacks))
}

/// Parses an `/ingest` `from`/`until` value: unix seconds, ms, µs or ns by digit count,
/// `YYYYMMDD`... is not supported; `now` and `now-<n><s|m|h|d|w>`. Returns ns.
pub fn parse_time(text: &str, now_ns: i64) -> Option<i64> {
    let text = text.trim();
    if text == "now" || text.is_empty() {
        return Some(now_ns);
    }
    if let Some(offset) = text.strip_prefix("now-") {
        // The unit is required here (`now-90` is no time), unlike in flags.
        let (number, unit) = offset.split_at(offset.len().checked_sub(1)?);
        let seconds = i64::try_from(crate::units::unit_seconds(unit)?).ok()?;
        let n: i64 = number.parse().ok()?;
        return Some(now_ns - n.checked_mul(seconds)?.checked_mul(1_000_000_000)?);
    }
    let value: i64 = text.parse().ok()?;
    let digits = text.trim_start_matches('-').len();
    Some(match digits {
        0..=10 => value.checked_mul(1_000_000_000)?,
        11..=13 => value.checked_mul(1_000_000)?,
        14..=16 => value.checked_mul(1_000)?,
        _ => value,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::export::{pprof::build_pprof, test_fixture};

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn agent_pprof_splits_into_types_and_sample_label_sets() {
        let pprof = build_pprof(&test_fixture::profile());
        let labels = pairs(&[("service_name", "svc")]);
        let profiles = profiles_from_pprof(&pprof, "process_cpu", &labels, 5).unwrap();
        let ids: std::collections::BTreeSet<String> = profiles
            .iter()
            .map(|p| p.profile_type.as_ref().unwrap().id())
            .collect();
        assert!(
            ids.contains("process_cpu:cpu:nanoseconds:cpu:nanoseconds"),
            "{ids:?}"
        );
        let cpu: Vec<&NewProfile> = profiles
            .iter()
            .filter(|p| p.profile_type.as_ref().unwrap().sample_type == "cpu")
            .collect();
        // thread_name=worker, thread_name=other, and no label.
        assert_eq!(cpu.len(), 3, "{cpu:#?}");
        let total: i64 = cpu.iter().map(|p| p.total()).sum();
        assert_eq!(total, 11 * test_fixture::PERIOD_NS);
        let worker = cpu
            .iter()
            .find(|p| p.labels.contains(&("thread_name".into(), "worker".into())))
            .unwrap();
        // Root first, inlined function below the function it was inlined into.
        let stacks: Vec<Vec<&str>> = worker
            .stacks
            .iter()
            .map(|(path, _)| {
                path.iter()
                    .map(|&i| worker.names[worker.frames[i as usize].name as usize].as_str())
                    .collect()
            })
            .collect();
        assert!(
            stacks.contains(&vec!["myapp", "main", "outer_fn", "inner_helper"]),
            "{stacks:?}"
        );
        assert_eq!(worker.time_ns, test_fixture::START_UNIX_NS);
        assert_eq!(worker.period, test_fixture::PERIOD_NS);
        // Each frame keeps its file, line, object, build id and file offset.
        let frame_of = |name: &str| {
            worker
                .frames
                .iter()
                .find(|f| worker.names[f.name as usize] == name)
                .unwrap()
        };
        let text = |id: u32| (id != NO_STRING).then(|| worker.names[id as usize].as_str());
        let inner = frame_of("inner_helper");
        let outer = frame_of("outer_fn");
        assert_eq!(
            (text(inner.file), inner.line, inner.inlined, outer.inlined),
            (Some("src/lib.rs"), 42, true, false)
        );
        assert_eq!(text(outer.system_name), Some("_ZN5outer2fnE"));
        assert_eq!(text(inner.system_name), None);
        // 0x40_2000 in a mapping at 0x40_0000 with file offset 0x1000.
        assert_eq!((inner.address, outer.address), (0x3000, 0x3000));
        assert_eq!(
            (text(inner.object), text(inner.build_id)),
            (Some("/usr/bin/myapp"), Some("deadbeef00112233"))
        );
        // Without an object file, no address is kept (it would differ in every process).
        let kernel = frame_of("do_syscall_64");
        assert_eq!((kernel.address, text(kernel.object)), (0, None));
    }

    #[test]
    fn invalid_pprofs_are_rejected_with_reasons() {
        let good = build_pprof(&test_fixture::profile());
        let check = |mutate: &dyn Fn(&mut proto::Profile), expect: &str| {
            let mut p = good.clone();
            mutate(&mut p);
            let err = profiles_from_pprof(&p, "process_cpu", &[], 0)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expect), "{expect}: {err}");
        };
        check(&|p| p.string_table[0] = "x".into(), "string_table[0]");
        check(&|p| p.sample_type.clear(), "no sample_type");
        check(&|p| p.sample[0].value.push(1), "values for");
        check(&|p| p.function[0].name = 10_000, "out of range");
        check(&|p| p.location[0].id = 0, "location id 0");
        check(&|p| p.sample[0].location_id.push(999), "unknown location");
        check(
            &|p| p.location[1].line[0].function_id = 999,
            "unknown function",
        );
    }

    #[test]
    fn gzip_is_sniffed_and_bounded() {
        use std::io::Write;
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(&vec![0u8; 1 << 20]).unwrap();
        let bomb = encoder.finish().unwrap();
        assert!(bomb.len() < 10_000);
        assert!(matches!(
            maybe_gunzip(&bomb, 1000),
            Err(IngestError::TooLarge { limit: 1000 })
        ));
        assert_eq!(maybe_gunzip(&bomb, 2 << 20).unwrap().len(), 1 << 20);
        assert_eq!(maybe_gunzip(b"plain", 10).unwrap().as_ref(), b"plain");
        assert!(matches!(
            maybe_gunzip(&[0x1f, 0x8b, 1, 2, 3], 10),
            Err(IngestError::Gzip(_))
        ));
    }

    #[test]
    fn folded_and_names() {
        let (names, stacks) =
            parse_folded(b"main;work 3\nmain;idle 1\n\nmain;work 2\n", false, 10).unwrap();
        assert_eq!(names, vec!["main", "work", "idle"]);
        assert_eq!(
            stacks,
            vec![(vec![0, 1], 30), (vec![0, 2], 10), (vec![0, 1], 20)]
        );
        assert!(parse_folded(b"main;work x\n", false, 1).is_err());
        assert!(parse_folded(b"main;work\n", false, 1).is_err());
        assert_eq!(
            parse_folded(b"a;b\n", true, 7).unwrap().1,
            vec![(vec![0, 1], 7)]
        );
        let (service, t, factor) = text_profile_type("my-app.cpu", 100).unwrap();
        assert_eq!(
            (service.as_str(), t.id().as_str(), factor),
            (
                "my-app",
                "process_cpu:cpu:nanoseconds:cpu:nanoseconds",
                10_000_000
            )
        );
        assert!(text_profile_type("my.app", 100).is_err());
    }

    #[test]
    fn times_parse_by_digit_count() {
        let now = 1_700_000_000_000_000_000;
        assert_eq!(parse_time("1700000000", 0), Some(now));
        assert_eq!(parse_time("1700000000000", 0), Some(now));
        assert_eq!(parse_time("1700000000000000", 0), Some(now));
        assert_eq!(parse_time("1700000000000000000", 0), Some(now));
        assert_eq!(parse_time("now-1m", now), Some(now - 60_000_000_000));
        assert_eq!(parse_time("yesterday", now), None);
    }

    #[test]
    fn label_validation() {
        assert!(validate_labels(&pairs(&[("a", "b"), ("a", "c")])).is_err());
        assert!(validate_labels(&pairs(&[("a{", "b")])).is_err());
        assert!(validate_labels(&pairs(&[("__name__", "x:y")])).is_err());
        assert!(validate_labels(&pairs(&[("service_name", "s"), ("env", "p")])).is_ok());
    }

    proptest! {
        // Arbitrary bytes, raw or gzipped: an error or profiles, never a panic.
        #[test]
        fn pprof_ingest_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), gzip in any::<bool>()) {
            let payload = if gzip {
                use std::io::Write;
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(&bytes).unwrap();
                e.finish().unwrap()
            } else { bytes };
            if let Ok(pprof) = decode_pprof(&payload, 1 << 20) {
                let _ = profiles_from_pprof(&pprof, "process_cpu", &[], 0);
                let _ = derive_pprof_name(&pprof);
            }
        }

        // Structurally valid protobuf with random indexes and ids.
        #[test]
        fn random_pprof_structures_never_panic(
            strings in 0usize..5, types in 0usize..3,
            samples in proptest::collection::vec((proptest::collection::vec(0u64..6, 0..4), proptest::collection::vec(-5i64..5, 0..3), -2i64..6), 0..6),
            locations in proptest::collection::vec((0u64..6, proptest::collection::vec(0u64..4, 0..3)), 0..6),
            functions in proptest::collection::vec((0u64..4, -1i64..6), 0..4),
        ) {
            let pprof = proto::Profile {
                string_table: (0..strings).map(|i| if i == 0 { String::new() } else { format!("s{i}") }).collect(),
                sample_type: (0..types).map(|i| proto::ValueType { r#type: i as i64, unit: 1 }).collect(),
                sample: samples.into_iter().map(|(location_id, value, key)| proto::Sample {
                    location_id, value, label: vec![proto::Label { key, str: 1, num: 0, num_unit: 0 }],
                }).collect(),
                location: locations.into_iter().map(|(id, functions)| proto::Location {
                    id, line: functions.into_iter().map(|function_id| proto::Line { function_id, line: 0, column: 0 }).collect(), ..Default::default()
                }).collect(),
                function: functions.into_iter().map(|(id, name)| proto::Function { id, name, ..Default::default() }).collect(),
                ..Default::default()
            };
            let _ = profiles_from_pprof(&pprof, "process_cpu", &[], 0);
            let _ = derive_pprof_name(&pprof);
        }

        #[test]
        fn folded_never_panics(text in ".{0,200}") {
            let _ = parse_folded(text.as_bytes(), false, 3);
            let _ = parse_folded(text.as_bytes(), true, 3);
        }
    }

    /// A stored frame with its strings in place of indexes.
    type ResolvedFrame = (
        Option<String>,
        Option<String>,
        Option<String>,
        u32,
        u32,
        Option<String>,
        Option<String>,
        u64,
        bool,
    );
    type ResolvedStacks = Vec<(Vec<ResolvedFrame>, i64)>;

    /// What a stored profile says, with strings in place of indexes: two conversions may number
    /// the same strings differently.
    #[derive(Debug, PartialEq)]
    struct Resolved {
        profile_type: Option<ProfileType>,
        labels: Vec<(String, String)>,
        times: (i64, i64, i64),
        frames: Vec<ResolvedFrame>,
        stacks: ResolvedStacks,
        spans: Vec<(u64, String, String, ResolvedStacks)>,
        labelled: Vec<(Vec<(String, i64)>, ResolvedStacks)>,
    }

    fn resolve(profile: &NewProfile) -> Resolved {
        let text = |id: u32| (id != NO_STRING).then(|| profile.names[id as usize].clone());
        let frame = |f: &Frame| {
            (
                text(f.name),
                text(f.system_name),
                text(f.file),
                f.start_line,
                f.line,
                text(f.object),
                text(f.build_id),
                f.address,
                f.inlined,
            )
        };
        let stacks = |stacks: &[(Vec<u32>, i64)]| -> ResolvedStacks {
            stacks
                .iter()
                .map(|(path, value)| {
                    let path = path.iter().map(|&i| frame(&profile.frames[i as usize]));
                    (path.collect(), *value)
                })
                .collect()
        };
        Resolved {
            profile_type: profile.profile_type.clone(),
            labels: profile.labels.clone(),
            times: (profile.time_ns, profile.duration_ns, profile.period),
            frames: profile.frames.iter().map(frame).collect(),
            stacks: stacks(&profile.stacks),
            spans: profile
                .spans
                .iter()
                .map(|s| {
                    let (id, trace, name) = (s.span_id, s.trace_id.clone(), s.span_name.clone());
                    (id, trace, name, stacks(&s.stacks))
                })
                .collect(),
            labelled: profile
                .labelled
                .iter()
                .map(|l| (l.labels.clone(), stacks(&l.stacks)))
                .collect(),
        }
    }

    /// The agent's profile stored directly is stored as its pushed pprof would be, or refused
    /// with the same error.
    fn assert_stored_as_pushed(profile: &Profile) {
        let direct = profiles_from_model(profile);
        let pushed = profiles_from_pprof(
            &build_pprof(profile),
            profile.kind.name(),
            &profile.series_labels,
            profile.start_unix_ns,
        );
        match (direct, pushed) {
            (Ok(direct), Ok(pushed)) => {
                let direct: Vec<Resolved> = direct.iter().map(resolve).collect();
                let pushed: Vec<Resolved> = pushed.iter().map(resolve).collect();
                assert_eq!(direct, pushed);
            }
            (Err(direct), Err(pushed)) => assert_eq!(direct.to_string(), pushed.to_string()),
            (direct, pushed) => panic!("direct {direct:?}, pushed {pushed:?}"),
        }
    }

    #[test]
    fn the_agents_profile_is_stored_directly_as_pushed() {
        let profile = test_fixture::profile();
        assert!(!profiles_from_model(&profile).unwrap().is_empty());
        assert_stored_as_pushed(&profile);
        let mut too_many = profile;
        too_many.samples = vec![too_many.samples[0].clone(); MAX_SAMPLES + 1];
        assert!(profiles_from_model(&too_many).is_err());
        assert_stored_as_pushed(&too_many);
    }

    mod model_profiles {
        use std::sync::Arc;

        use proptest::prelude::*;

        use crate::model::{
            FrameKind, FrameLine, LabelValue, MappingInfo, Profile, ProfileKind, ProfileSample,
            SymbolizedFrame,
        };

        /// Few texts, so that names, files, objects and labels collide.
        fn text() -> impl Strategy<Value = Arc<str>> {
            prop::sample::select(vec![
                "",
                "main",
                "helper",
                "[unknown]",
                "/usr/lib/libc.so.6",
                "lib",
                "1f",
                "0",
            ])
            .prop_map(Arc::from)
        }

        fn line() -> impl Strategy<Value = FrameLine> {
            (
                text(),
                prop::option::of(text()),
                prop::option::of(text()),
                0u32..4,
            )
                .prop_map(|(function, system_name, file, line)| FrameLine {
                    function,
                    system_name,
                    file,
                    line,
                })
        }

        fn mapping() -> impl Strategy<Value = Option<Arc<MappingInfo>>> {
            prop::option::of((0u64..3, 1u64..3, 0u64..3, text(), prop::option::of(text())))
                .prop_map(|mapping| {
                    mapping.map(|(start, pages, offset, filename, build_id)| {
                        Arc::new(MappingInfo {
                            start: start * 0x1000,
                            limit: (start + pages) * 0x1000,
                            file_offset: offset * 0x1000,
                            filename,
                            build_id,
                        })
                    })
                })
        }

        fn frame() -> impl Strategy<Value = SymbolizedFrame> {
            (
                0u64..0x5000,
                mapping(),
                prop::collection::vec(line(), 0..3),
                any::<bool>(),
            )
                .prop_map(|(address, mapping, lines, unsymbolized)| SymbolizedFrame {
                    kind: FrameKind::Native,
                    address,
                    mapping,
                    lines,
                    unsymbolized,
                })
        }

        fn label() -> impl Strategy<Value = (Arc<str>, LabelValue)> {
            let key = prop::sample::select(vec![
                "",
                "thread_name",
                "span_id",
                "profile_id",
                "trace_id",
                "span_name",
                "service_name",
                "pid",
                "tid",
            ]);
            let value = prop_oneof![
                text().prop_map(LabelValue::Str),
                (-2i64..3).prop_map(LabelValue::Num),
            ];
            (key.prop_map(Arc::from), value)
        }

        fn sample() -> impl Strategy<Value = ProfileSample> {
            (
                prop::collection::vec(0u32..8, 0..6),
                0u64..3,
                prop::collection::vec(0u64..3, 0..5),
                prop::collection::vec(label(), 0..4),
            )
                .prop_map(|(stack, count, more_values, labels)| ProfileSample {
                    stack,
                    count,
                    more_values,
                    labels,
                })
        }

        pub fn profile() -> impl Strategy<Value = Profile> {
            let kinds = vec![
                ProfileKind::Cpu,
                ProfileKind::CudaLaunch,
                ProfileKind::CudaAlloc,
                ProfileKind::OffCpu,
            ];
            let series = prop::sample::select(vec![
                vec![],
                vec![("service_name", "svc")],
                vec![("service_name", "svc"), ("thread_name", "main")],
            ]);
            (
                prop::sample::select(kinds),
                series,
                prop::sample::select(vec![0i64, 1_700_000_000_000_000_000]),
                0i64..3,
                prop::collection::vec(frame(), 0..6),
                prop::collection::vec(sample(), 0..6),
            )
                .prop_map(|(kind, series, start, periods, frames, samples)| Profile {
                    kind,
                    series_labels: series
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                    start_unix_ns: start,
                    duration_ns: 15_000_000_000,
                    period_ns: periods * 10_000_000,
                    frames,
                    samples,
                })
        }
    }

    proptest! {
        #[test]
        fn any_agent_profile_is_stored_directly_as_pushed(profile in model_profiles::profile()) {
            assert_stored_as_pushed(&profile);
        }
    }
}
