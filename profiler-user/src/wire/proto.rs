//! The `perftools.profiles` messages of pprof's `profile.proto`, written by hand as prost structs
//! so the build needs neither `protoc` nor a build script. Field numbers follow profile.proto
//! exactly (docs/pyroscope-protocol.md §8.1); every `int64` "string" field is an index into
//! `Profile::string_table`.

#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    /// Index 0 must be "".
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    /// Collection start, nanoseconds since the Unix epoch.
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
    #[prost(int64, tag = "15")]
    pub doc_url: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    /// Leaf first.
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    /// One per `Profile::sample_type`.
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    /// At most one of `str` and `num` is set.
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// 0 when the mapping is unknown.
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    /// Innermost first; the last entry is the caller the others were inlined into.
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
    #[prost(int64, tag = "3")]
    pub column: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}

/// Proto3's JSON form of a profile (what a Connect JSON client decodes): lowerCamelCase names,
/// 64-bit integers as decimal strings, every field present.
pub fn profile_json(profile: &Profile) -> serde_json::Value {
    use serde_json::{Value, json};
    let text = |n: i64| Value::String(n.to_string());
    let unsigned = |n: u64| Value::String(n.to_string());
    let value_type = |t: &ValueType| json!({"type": text(t.r#type), "unit": text(t.unit)});
    json!({
        "sampleType": profile.sample_type.iter().map(value_type).collect::<Vec<_>>(),
        "sample": profile.sample.iter().map(|s| json!({
            "locationId": s.location_id.iter().map(|&id| unsigned(id)).collect::<Vec<_>>(),
            "value": s.value.iter().map(|&v| text(v)).collect::<Vec<_>>(),
            "label": s.label.iter().map(|l| json!({
                "key": text(l.key), "str": text(l.str), "num": text(l.num), "numUnit": text(l.num_unit),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "mapping": profile.mapping.iter().map(|m| json!({
            "id": unsigned(m.id),
            "memoryStart": unsigned(m.memory_start),
            "memoryLimit": unsigned(m.memory_limit),
            "fileOffset": unsigned(m.file_offset),
            "filename": text(m.filename),
            "buildId": text(m.build_id),
            "hasFunctions": m.has_functions,
            "hasFilenames": m.has_filenames,
            "hasLineNumbers": m.has_line_numbers,
            "hasInlineFrames": m.has_inline_frames,
        })).collect::<Vec<_>>(),
        "location": profile.location.iter().map(|l| json!({
            "id": unsigned(l.id),
            "mappingId": unsigned(l.mapping_id),
            "address": unsigned(l.address),
            "line": l.line.iter().map(|line| json!({
                "functionId": unsigned(line.function_id),
                "line": text(line.line),
                "column": text(line.column),
            })).collect::<Vec<_>>(),
            "isFolded": l.is_folded,
        })).collect::<Vec<_>>(),
        "function": profile.function.iter().map(|f| json!({
            "id": unsigned(f.id),
            "name": text(f.name),
            "systemName": text(f.system_name),
            "filename": text(f.filename),
            "startLine": text(f.start_line),
        })).collect::<Vec<_>>(),
        "stringTable": profile.string_table,
        "dropFrames": text(profile.drop_frames),
        "keepFrames": text(profile.keep_frames),
        "timeNanos": text(profile.time_nanos),
        "durationNanos": text(profile.duration_nanos),
        "periodType": profile.period_type.as_ref().map(value_type),
        "period": text(profile.period),
        "comment": profile.comment.iter().map(|&c| text(c)).collect::<Vec<_>>(),
        "defaultSampleType": text(profile.default_sample_type),
    })
}
