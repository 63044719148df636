//! Builds a pprof `Profile` (perftools.profiles) from an aggregated [`Profile`].
//!
//! Layout: one Location per entry of `Profile::frames` (already deduplicated upstream, so the
//! location id is simply index + 1), one Mapping per distinct [`MappingInfo`], one Function per
//! distinct (name, system_name, filename).
use std::{io::Write, sync::Arc};

// Every frame and string of every profile is looked up here, once per interval and per output:
// SipHash was a tenth of the exporter thread's CPU on a busy host.
use foldhash::HashMap;

use flate2::{Compression, write::GzEncoder};
use prost::Message;

use crate::model::{FrameLine, LabelValue, MappingInfo, Profile, ProfileKind, SymbolizedFrame};
use crate::wire::proto;

/// Builds the pprof message. Never panics: stack indexes out of range are skipped.
pub fn build_pprof(profile: &Profile) -> proto::Profile {
    let mut builder = PprofBuilder::default();
    builder.build(profile)
}

/// Builds the pprof message and returns it serialized and gzipped, as pprof files are stored.
pub fn encode_pprof_gz(profile: &Profile) -> Vec<u8> {
    let encoded = build_pprof(profile).encode_to_vec();
    let mut encoder = GzEncoder::new(
        Vec::with_capacity(encoded.len() / 4),
        Compression::default(),
    );
    // Writing into a Vec cannot fail, so neither can compression.
    encoder
        .write_all(&encoded)
        .expect("gzip into memory cannot fail");
    encoder.finish().expect("gzip into memory cannot fail")
}

#[derive(Default)]
struct StringTable {
    strings: Vec<String>,
    index_of: HashMap<String, i64>,
}

impl StringTable {
    fn intern(&mut self, s: &str) -> i64 {
        if self.strings.is_empty() {
            // pprof requires string_table[0] == "".
            self.strings.push(String::new());
            self.index_of.insert(String::new(), 0);
        }
        if let Some(&index) = self.index_of.get(s) {
            return index;
        }
        let index = self.strings.len() as i64;
        self.strings.push(s.to_owned());
        self.index_of.insert(s.to_owned(), index);
        index
    }

    fn into_strings(mut self) -> Vec<String> {
        self.intern("");
        self.strings
    }
}

/// A function's identity in pprof terms: (name, system_name, filename) string indexes.
type FunctionKey = (i64, i64, i64);

#[derive(Default)]
struct PprofBuilder {
    strings: StringTable,
    mapping_ids: HashMap<Arc<MappingInfo>, u64>,
    mappings: Vec<proto::Mapping>,
    function_ids: HashMap<FunctionKey, u64>,
    functions: Vec<proto::Function>,
}

impl PprofBuilder {
    fn build(&mut self, profile: &Profile) -> proto::Profile {
        // Interned first so string_table[0] == "" even for an empty profile.
        self.strings.intern("");
        let samples_count = proto::ValueType {
            r#type: self.strings.intern("samples"),
            unit: self.strings.intern("count"),
        };
        let cpu_nanoseconds = proto::ValueType {
            r#type: self.strings.intern("cpu"),
            unit: self.strings.intern("nanoseconds"),
        };
        let default_sample_type = cpu_nanoseconds.r#type;
        let is_cpu = profile.kind == ProfileKind::Cpu;
        let mut value_type = |(kind, unit): (&str, &str)| proto::ValueType {
            r#type: self.strings.intern(kind),
            unit: self.strings.intern(unit),
        };
        let measured: Vec<proto::ValueType> = profile
            .kind
            .sample_types()
            .iter()
            .map(|&t| value_type(t))
            .collect();
        let measured_period = value_type(profile.kind.period_type());

        let location = profile
            .frames
            .iter()
            .enumerate()
            .map(|(index, frame)| self.location(location_id(index), frame))
            .collect();

        let mut skipped_frame_refs = 0usize;
        let sample = profile
            .samples
            .iter()
            .map(|sample| {
                let location_id: Vec<u64> = sample
                    .stack
                    .iter()
                    .filter_map(|&frame_index| {
                        let index = usize::try_from(frame_index).ok()?;
                        (index < profile.frames.len()).then(|| location_id(index))
                    })
                    .collect();
                skipped_frame_refs += sample.stack.len() - location_id.len();
                let count = i64::try_from(sample.count).unwrap_or(i64::MAX);
                proto::Sample {
                    location_id,
                    value: if is_cpu {
                        vec![count, count.saturating_mul(profile.period_ns)]
                    } else {
                        // One value per sample type, whatever the sample carries.
                        std::iter::once(count)
                            .chain(
                                sample
                                    .more_values
                                    .iter()
                                    .map(|&v| i64::try_from(v).unwrap_or(i64::MAX)),
                            )
                            .chain(std::iter::repeat(0))
                            .take(measured.len())
                            .collect()
                    },
                    label: sample
                        .labels
                        .iter()
                        .map(|(key, value)| self.label(key, value))
                        .collect(),
                }
            })
            .collect();

        if skipped_frame_refs > 0 {
            tracing::warn!(
                skipped_frame_refs,
                "pprof export: stacks refer to frames that do not exist; skipped those frames"
            );
        }

        // Series labels travel beside the profile; comments make a downloaded file self-describing.
        let comment = profile
            .series_labels
            .iter()
            .map(|(key, value)| self.strings.intern(&format!("{key}={value}")))
            .collect();

        let (sample_type, period_type, period, default_sample_type) = if is_cpu {
            (
                vec![samples_count, cpu_nanoseconds.clone()],
                cpu_nanoseconds,
                profile.period_ns,
                default_sample_type,
            )
        } else {
            let default = measured[0].r#type;
            (measured, measured_period, 1, default)
        };
        proto::Profile {
            sample_type,
            sample,
            mapping: std::mem::take(&mut self.mappings),
            location,
            function: std::mem::take(&mut self.functions),
            string_table: std::mem::take(&mut self.strings).into_strings(),
            drop_frames: 0,
            keep_frames: 0,
            time_nanos: profile.start_unix_ns,
            duration_nanos: profile.duration_ns,
            period_type: Some(period_type),
            period,
            comment,
            default_sample_type,
            doc_url: 0,
        }
    }

    fn location(&mut self, id: u64, frame: &SymbolizedFrame) -> proto::Location {
        let mapping_id = frame
            .mapping
            .as_ref()
            .map_or(0, |mapping| self.mapping_id(mapping, frame));
        proto::Location {
            id,
            mapping_id,
            address: frame.address,
            // Same order as pprof: innermost first, last = the caller the others were inlined into.
            line: frame
                .lines
                .iter()
                .map(|line| proto::Line {
                    function_id: self.function_id(line),
                    line: i64::from(line.line),
                    column: 0,
                })
                .collect(),
            is_folded: false,
        }
    }

    fn mapping_id(&mut self, info: &Arc<MappingInfo>, frame: &SymbolizedFrame) -> u64 {
        let index = match self.mapping_ids.get(info) {
            Some(&id) => (id - 1) as usize,
            None => {
                let id = self.mappings.len() as u64 + 1;
                let filename = self.strings.intern(&info.filename);
                let build_id = info
                    .build_id
                    .as_deref()
                    .map_or(0, |build_id| self.strings.intern(build_id));
                self.mappings.push(proto::Mapping {
                    id,
                    memory_start: info.start,
                    memory_limit: info.limit,
                    file_offset: info.file_offset,
                    filename,
                    build_id,
                    ..Default::default()
                });
                self.mapping_ids.insert(Arc::clone(info), id);
                self.mappings.len() - 1
            }
        };
        // The has_* flags describe what symbolization achieved for any frame in the mapping.
        let mapping = &mut self.mappings[index];
        if !frame.unsymbolized {
            mapping.has_functions = true;
            mapping.has_line_numbers |= frame.lines.iter().any(|line| line.line != 0);
            mapping.has_inline_frames |= frame.lines.len() > 1;
        }
        mapping.id
    }

    fn function_id(&mut self, line: &FrameLine) -> u64 {
        let name = self.strings.intern(&line.function);
        // Like Go's runtime, repeat the name when there is no distinct raw name.
        let system_name = match &line.system_name {
            Some(system_name) => self.strings.intern(system_name),
            None => name,
        };
        let filename = line
            .file
            .as_deref()
            .map_or(0, |file| self.strings.intern(file));
        let key = (name, system_name, filename);
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        self.functions.push(proto::Function {
            id,
            name,
            system_name,
            filename,
            start_line: 0,
        });
        self.function_ids.insert(key, id);
        id
    }

    fn label(&mut self, key: &str, value: &LabelValue) -> proto::Label {
        let key = self.strings.intern(key);
        match value {
            LabelValue::Str(value) => proto::Label {
                key,
                str: self.strings.intern(value),
                ..Default::default()
            },
            LabelValue::Num(num) => proto::Label {
                key,
                num: *num,
                ..Default::default()
            },
        }
    }
}

fn location_id(frame_index: usize) -> u64 {
    frame_index as u64 + 1
}

#[cfg(test)]
mod tests {
    use std::{
        collections::{HashMap, HashSet},
        io::Read,
        path::Path,
        process::Command,
    };

    use super::*;
    use crate::export::test_fixture::{self, *};
    use crate::model::ProfileSample;

    fn decode_gz(bytes: &[u8]) -> proto::Profile {
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .expect("valid gzip");
        proto::Profile::decode(raw.as_slice()).expect("valid pprof protobuf")
    }

    fn roundtrip(profile: &Profile) -> proto::Profile {
        decode_gz(&encode_pprof_gz(profile))
    }

    fn string(pprof: &proto::Profile, index: i64) -> &str {
        let index = usize::try_from(index).expect("non-negative string index");
        pprof
            .string_table
            .get(index)
            .expect("string index in range")
    }

    fn location(pprof: &proto::Profile, id: u64) -> &proto::Location {
        pprof
            .location
            .iter()
            .find(|l| l.id == id)
            .expect("location exists")
    }

    fn function(pprof: &proto::Profile, id: u64) -> &proto::Function {
        pprof
            .function
            .iter()
            .find(|f| f.id == id)
            .expect("function exists")
    }

    fn mapping(pprof: &proto::Profile, id: u64) -> &proto::Mapping {
        pprof
            .mapping
            .iter()
            .find(|m| m.id == id)
            .expect("mapping exists")
    }

    /// Function names of a sample, leaf first, inlined functions innermost first.
    fn sample_function_names(pprof: &proto::Profile, sample: &proto::Sample) -> Vec<String> {
        sample
            .location_id
            .iter()
            .flat_map(|&id| &location(pprof, id).line)
            .map(|line| string(pprof, function(pprof, line.function_id).name).to_owned())
            .collect()
    }

    /// The same names computed straight from the model, to compare against.
    fn model_function_names(profile: &Profile, sample: &ProfileSample) -> Vec<String> {
        sample
            .stack
            .iter()
            .flat_map(|&index| &profile.frames[index as usize].lines)
            .map(|line| line.function.to_string())
            .collect()
    }

    fn assert_unique_non_zero(ids: impl IntoIterator<Item = u64>, what: &str) {
        let mut seen = HashSet::new();
        for id in ids {
            assert_ne!(id, 0, "{what} id 0");
            assert!(seen.insert(id), "duplicate {what} id {id}");
        }
    }

    #[test]
    fn string_table_starts_empty_and_interns_each_string_once() {
        for profile in [test_fixture::profile(), Profile::default()] {
            let pprof = roundtrip(&profile);
            assert_eq!(pprof.string_table.first().map(String::as_str), Some(""));
            let distinct: HashSet<&String> = pprof.string_table.iter().collect();
            assert_eq!(
                distinct.len(),
                pprof.string_table.len(),
                "{:?}",
                pprof.string_table
            );
        }
    }

    #[test]
    fn ids_are_unique_non_zero_and_every_reference_resolves() {
        let pprof = roundtrip(&test_fixture::profile());
        assert_unique_non_zero(pprof.mapping.iter().map(|m| m.id), "mapping");
        assert_unique_non_zero(pprof.location.iter().map(|l| l.id), "location");
        assert_unique_non_zero(pprof.function.iter().map(|f| f.id), "function");
        let string_count = pprof.string_table.len() as i64;
        let in_table = |index: i64| (0..string_count).contains(&index);
        for loc in &pprof.location {
            assert!(loc.mapping_id == 0 || pprof.mapping.iter().any(|m| m.id == loc.mapping_id));
            for line in &loc.line {
                assert!(pprof.function.iter().any(|f| f.id == line.function_id));
            }
        }
        for sample in &pprof.sample {
            for id in &sample.location_id {
                assert!(pprof.location.iter().any(|l| l.id == *id), "location {id}");
            }
            for label in &sample.label {
                assert!(in_table(label.key) && in_table(label.str) && in_table(label.num_unit));
            }
        }
        for f in &pprof.function {
            assert!(in_table(f.name) && in_table(f.system_name) && in_table(f.filename));
        }
        for m in &pprof.mapping {
            assert!(in_table(m.filename) && in_table(m.build_id));
        }
    }

    #[test]
    fn header_fields_describe_cpu_time() {
        let pprof = roundtrip(&test_fixture::profile());
        let type_unit = |vt: &proto::ValueType| {
            format!("{}/{}", string(&pprof, vt.r#type), string(&pprof, vt.unit))
        };
        let sample_types: Vec<String> = pprof.sample_type.iter().map(type_unit).collect();
        assert_eq!(sample_types, ["samples/count", "cpu/nanoseconds"]);
        assert_eq!(
            pprof.period_type.as_ref().map(type_unit).as_deref(),
            Some("cpu/nanoseconds")
        );
        assert_eq!(pprof.period, PERIOD_NS);
        assert_eq!(pprof.time_nanos, START_UNIX_NS);
        assert_eq!(pprof.duration_nanos, DURATION_NS);
        assert_eq!(string(&pprof, pprof.default_sample_type), "cpu");
        let comments: Vec<&str> = pprof.comment.iter().map(|&c| string(&pprof, c)).collect();
        assert_eq!(comments, ["host=node-1", "service_name=my app/v1"]);
    }

    #[test]
    fn samples_carry_values_labels_and_leaf_first_stacks() {
        let profile = test_fixture::profile();
        let pprof = roundtrip(&profile);
        assert_eq!(pprof.sample.len(), profile.samples.len());
        for (sample, model) in pprof.sample.iter().zip(&profile.samples) {
            let count = model.count as i64;
            assert_eq!(sample.value, [count, count * PERIOD_NS]);
            let expected_ids: Vec<u64> = model.stack.iter().map(|&i| u64::from(i) + 1).collect();
            assert_eq!(sample.location_id, expected_ids);
            assert_eq!(
                sample_function_names(&pprof, sample),
                model_function_names(&profile, model)
            );
        }
        assert_eq!(
            sample_function_names(&pprof, &pprof.sample[0]),
            ["do_syscall_64", "libfoo.so+0x1234", "main", "myapp"]
        );

        let labels: Vec<(&str, &str, i64)> = pprof.sample[0]
            .label
            .iter()
            .map(|l| (string(&pprof, l.key), string(&pprof, l.str), l.num))
            .collect();
        assert_eq!(labels, [("thread_name", "worker", 0), ("tid", "", 42)]);
        assert_eq!(pprof.sample[0].label[1].num_unit, 0);
        assert!(pprof.sample[3].label.is_empty());
    }

    #[test]
    fn inlined_lines_keep_innermost_first_order() {
        let pprof = roundtrip(&test_fixture::profile());
        let inlined = location(&pprof, u64::from(INLINED) + 1);
        assert_eq!(inlined.address, 0x40_2000);
        let lines: Vec<(&str, &str, &str, i64)> = inlined
            .line
            .iter()
            .map(|line| {
                let f = function(&pprof, line.function_id);
                (
                    string(&pprof, f.name),
                    string(&pprof, f.system_name),
                    string(&pprof, f.filename),
                    line.line,
                )
            })
            .collect();
        assert_eq!(
            lines,
            [
                ("inner_helper", "inner_helper", "src/lib.rs", 42),
                ("outer_fn", "_ZN5outer2fnE", "src/lib.rs", 7),
            ]
        );
    }

    #[test]
    fn functions_are_shared_between_locations() {
        let pprof = roundtrip(&test_fixture::profile());
        let main = location(&pprof, u64::from(MAIN) + 1);
        let main_other_line = location(&pprof, u64::from(MAIN_OTHER_LINE) + 1);
        assert_eq!(
            main.line[0].function_id,
            main_other_line.line[0].function_id
        );
        assert_eq!((main.line[0].line, main_other_line.line[0].line), (10, 12));
        let names: Vec<&str> = pprof
            .function
            .iter()
            .map(|f| string(&pprof, f.name))
            .collect();
        let distinct: HashSet<&&str> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        assert_eq!(names.len(), 7, "{names:?}");
    }

    #[test]
    fn mappings_are_deduplicated_with_symbolization_flags() {
        let pprof = roundtrip(&test_fixture::profile());
        assert_eq!(pprof.mapping.len(), 2);
        let mapping_of = |frame: u32| location(&pprof, u64::from(frame) + 1).mapping_id;

        let app = mapping(&pprof, mapping_of(MAIN));
        assert_eq!(mapping_of(INLINED), app.id);
        assert_eq!(mapping_of(ODD_NAME), app.id);
        let expected = app_mapping();
        assert_eq!(
            (app.memory_start, app.memory_limit, app.file_offset),
            (expected.start, expected.limit, expected.file_offset)
        );
        assert_eq!(string(&pprof, app.filename), "/usr/bin/myapp");
        assert_eq!(string(&pprof, app.build_id), "deadbeef00112233");
        assert!(app.has_functions && app.has_line_numbers && app.has_inline_frames);

        let libfoo = mapping(&pprof, mapping_of(LIBFOO_UNSYMBOLIZED));
        assert_eq!(string(&pprof, libfoo.filename), "/usr/lib/libfoo.so");
        assert_eq!(libfoo.build_id, 0);
        assert!(
            !libfoo.has_functions,
            "only an unsymbolized frame lives there"
        );
        assert_eq!(
            location(&pprof, u64::from(LIBFOO_UNSYMBOLIZED) + 1).address,
            0x7f00_0000_1234
        );

        assert_eq!(mapping_of(KERNEL), 0);
        assert_eq!(mapping_of(ROOT), 0);
    }

    #[test]
    fn memory_profiles_have_every_sample_type_and_space_as_period() {
        let mut profile = test_fixture::profile();
        profile.kind = ProfileKind::CudaAlloc;
        profile.samples[0].more_values = vec![2, 7, 1];
        // A sample carrying fewer values than the kind's types gets zeros.
        profile.samples[1].more_values = Vec::new();
        let pprof = roundtrip(&profile);
        let type_unit = |vt: &proto::ValueType| {
            format!("{}/{}", string(&pprof, vt.r#type), string(&pprof, vt.unit))
        };
        let sample_types: Vec<String> = pprof.sample_type.iter().map(type_unit).collect();
        assert_eq!(
            sample_types,
            [
                "alloc_space/bytes",
                "alloc_objects/count",
                "inuse_space/bytes",
                "inuse_objects/count"
            ]
        );
        assert_eq!(string(&pprof, pprof.default_sample_type), "alloc_space");
        assert_eq!(
            pprof.period_type.as_ref().map(type_unit).as_deref(),
            Some("space/bytes")
        );
        assert_eq!(pprof.sample[0].value, [3, 2, 7, 1]);
        assert_eq!(pprof.sample[1].value, [5, 0, 0, 0]);

        profile.kind = ProfileKind::CudaLaunch;
        let pprof = roundtrip(&profile);
        assert_eq!(pprof.sample_type.len(), 1);
        assert_eq!(pprof.sample[0].value, [3], "one value for one sample type");
    }

    #[test]
    fn bad_input_does_not_panic() {
        let mut profile = test_fixture::profile();
        profile.samples.push(ProfileSample {
            stack: vec![u32::MAX, KERNEL, 1000],
            count: u64::MAX,
            more_values: Vec::new(),
            labels: Vec::new(),
        });
        profile.period_ns = i64::MAX;
        let pprof = roundtrip(&profile);
        let last = pprof.sample.last().expect("sample kept");
        assert_eq!(last.location_id, [u64::from(KERNEL) + 1]);
        assert_eq!(last.value, [i64::MAX, i64::MAX]);
    }

    /// Decodes our output with an independent implementation (npm `pprof-format`).
    #[test]
    fn independent_decoder_agrees() {
        let js_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/js");
        let required = std::env::var("PROFILER_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1");
        if !js_dir.join("node_modules/pprof-format").is_dir() {
            assert!(
                !required,
                "tests/js/node_modules/pprof-format is missing: run `cargo xtask test` (it runs `npm ci` in tests/js)"
            );
            eprintln!(
                "skipped: independent pprof decoder check (tests/js/node_modules/pprof-format missing; `cargo xtask test` installs it)"
            );
            return;
        }

        let profile = test_fixture::profile();
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("profile.pb.gz");
        std::fs::write(&file, encode_pprof_gz(&profile)).expect("write profile");
        let output = match Command::new("node")
            .arg(js_dir.join("check_pprof.mjs"))
            .arg(&file)
            .output()
        {
            Ok(output) => output,
            Err(error) if !required => {
                eprintln!("skipped: independent pprof decoder check (cannot run node: {error})");
                return;
            }
            Err(error) => panic!("cannot run node: {error}; run `cargo xtask test`"),
        };
        assert!(
            output.status.success(),
            "check_pprof.mjs failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let summary: serde_json::Value =
            serde_json::from_slice(&output.stdout).expect("check_pprof.mjs prints JSON");

        assert_eq!(
            summary["sampleTypes"],
            serde_json::json!(["samples/count", "cpu/nanoseconds"])
        );
        assert_eq!(summary["periodType"], "cpu/nanoseconds");
        assert_eq!(summary["period"], PERIOD_NS);
        assert_eq!(
            summary["timeNanos"],
            START_UNIX_NS.to_string(),
            "beyond 2^53: a string"
        );
        assert_eq!(summary["durationNanos"], DURATION_NS);
        assert_eq!(summary["defaultSampleType"], "cpu");
        let total = profile.total_samples() as i64;
        assert_eq!(
            summary["totals"],
            serde_json::json!([total, total * PERIOD_NS])
        );

        let samples = summary["samples"].as_array().expect("samples array");
        assert_eq!(samples.len(), profile.samples.len());
        for (decoded, model) in samples.iter().zip(&profile.samples) {
            assert_eq!(
                decoded["functions"],
                serde_json::json!(model_function_names(&profile, model))
            );
            let count = model.count as i64;
            assert_eq!(
                decoded["values"],
                serde_json::json!([count, count * PERIOD_NS])
            );
            let expected_labels: HashMap<String, serde_json::Value> = model
                .labels
                .iter()
                .map(|(key, value)| {
                    let value = match value {
                        LabelValue::Str(s) => serde_json::json!(s.as_ref()),
                        LabelValue::Num(n) => serde_json::json!(n),
                    };
                    (key.to_string(), value)
                })
                .collect();
            assert_eq!(decoded["labels"], serde_json::json!(expected_labels));
        }
    }
}
