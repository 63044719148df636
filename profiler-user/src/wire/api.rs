//! The Pyroscope API messages (packages `types.v1`, `push.v1`, `querier.v1`), written by hand
//! as prost structs with field numbers from docs/pyroscope-protocol.md §3.2 and §7.2, and serde for the
//! Connect JSON codec (protobuf canonical JSON: lowerCamelCase names, snake_case accepted,
//! 64-bit integers as strings, numbers accepted, bytes as base64, enums by name or number).
#![allow(clippy::derive_partial_eq_without_eq)]

use serde::{Deserialize, Serialize};

/// Serde helpers for the canonical JSON forms protobuf uses.
mod json {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum IntOrString {
        Int(i64),
        Float(f64),
        Text(String),
    }

    fn to_i64<E: Error>(value: IntOrString) -> Result<i64, E> {
        match value {
            IntOrString::Int(v) => Ok(v),
            IntOrString::Float(v) if v.fract() == 0.0 => Ok(v as i64),
            IntOrString::Float(v) => Err(E::custom(format!("{v} is not an integer"))),
            IntOrString::Text(s) => s
                .parse()
                .map_err(|_| E::custom(format!("`{s}` is not an integer"))),
        }
    }

    pub mod i64_string {
        use super::*;
        pub fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(v)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
            Option::<IntOrString>::deserialize(d)?.map_or(Ok(0), to_i64)
        }
    }

    /// proto3 JSON writes uint64 as a decimal string.
    pub mod u64_string {
        use super::*;
        pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(v)
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
            let value = Option::<IntOrString>::deserialize(d)?.map_or(Ok(0), to_i64)?;
            u64::try_from(value).map_err(|_| Error::custom(format!("{value} is negative")))
        }
    }

    pub mod opt_i64_string {
        use super::*;
        pub fn serialize<S: Serializer>(v: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(v) => s.collect_str(v),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
            Option::<IntOrString>::deserialize(d)?
                .map(to_i64)
                .transpose()
        }
    }

    pub mod vec_i64_string {
        use serde::ser::SerializeSeq;

        use super::*;
        pub fn serialize<S: Serializer>(v: &[i64], s: S) -> Result<S::Ok, S::Error> {
            let mut seq = s.serialize_seq(Some(v.len()))?;
            for item in v {
                seq.serialize_element(&item.to_string())?;
            }
            seq.end()
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
            Option::<Vec<IntOrString>>::deserialize(d)?
                .unwrap_or_default()
                .into_iter()
                .map(to_i64)
                .collect()
        }
    }

    pub mod bytes_base64 {
        use super::*;
        pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
            let text = Option::<String>::deserialize(d)?.unwrap_or_default();
            // Canonical JSON allows standard and URL-safe alphabets, with or without padding.
            let trimmed = text.trim_end_matches('=');
            base64::engine::general_purpose::STANDARD_NO_PAD
                .decode(trimmed)
                .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(trimmed))
                .map_err(|e| D::Error::custom(format!("invalid base64: {e}")))
        }
    }

    /// `null` → default, for every field (proto3 JSON allows null for any field).
    pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: Default + Deserialize<'de>,
    {
        Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
    }

    /// An enum given by name (any of `names`, index = value) or number.
    pub fn enum_value<'de, D: Deserializer<'de>>(
        d: D,
        names: &[&str],
    ) -> Result<Option<i32>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum NameOrNumber {
            Number(i32),
            Name(String),
        }
        match Option::<NameOrNumber>::deserialize(d)? {
            None => Ok(None),
            Some(NameOrNumber::Number(n)) => Ok(Some(n)),
            Some(NameOrNumber::Name(name)) => names
                .iter()
                .position(|n| *n == name)
                .map(|i| Some(i as i32))
                .ok_or_else(|| D::Error::custom(format!("unknown enum value `{name}`"))),
        }
    }

    pub mod profile_format {
        use super::*;
        pub const NAMES: [&str; 5] = [
            "PROFILE_FORMAT_UNSPECIFIED",
            "PROFILE_FORMAT_FLAMEGRAPH",
            "PROFILE_FORMAT_TREE",
            "PROFILE_FORMAT_DOT",
            "PROFILE_FORMAT_PPROF",
        ];
        pub fn serialize<S: Serializer>(v: &i32, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(
                NAMES
                    .get(*v as usize)
                    .unwrap_or(&"PROFILE_FORMAT_UNSPECIFIED"),
            )
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
            Ok(enum_value(d, &NAMES)?.unwrap_or(0))
        }
    }

    pub mod aggregation {
        use super::*;
        pub const NAMES: [&str; 2] = [
            "TIME_SERIES_AGGREGATION_TYPE_SUM",
            "TIME_SERIES_AGGREGATION_TYPE_AVERAGE",
        ];
        pub fn serialize<S: Serializer>(v: &Option<i32>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(v) => s.serialize_str(NAMES.get(*v as usize).unwrap_or(&NAMES[0])),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i32>, D::Error> {
            enum_value(d, &NAMES)
        }
    }
}

// ---- types.v1 ----

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct LabelPair {
    #[prost(string, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub name: String,
    #[prost(string, tag = "2")]
    #[serde(deserialize_with = "json::null_default")]
    pub value: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ProfileType {
    #[prost(string, tag = "1")]
    #[serde(rename = "ID")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "4")]
    #[serde(rename = "sampleType", alias = "sample_type")]
    pub sample_type: String,
    #[prost(string, tag = "5")]
    #[serde(rename = "sampleUnit", alias = "sample_unit")]
    pub sample_unit: String,
    #[prost(string, tag = "6")]
    #[serde(rename = "periodType", alias = "period_type")]
    pub period_type: String,
    #[prost(string, tag = "7")]
    #[serde(rename = "periodUnit", alias = "period_unit")]
    pub period_unit: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Labels {
    #[prost(message, repeated, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub labels: Vec<LabelPair>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Point {
    #[prost(double, tag = "1")]
    pub value: f64,
    /// Milliseconds since the epoch.
    #[prost(int64, tag = "2")]
    #[serde(with = "json::i64_string")]
    pub timestamp: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Series {
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<LabelPair>,
    #[prost(message, repeated, tag = "2")]
    pub points: Vec<Point>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct LabelNamesRequest {
    #[prost(string, repeated, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub matchers: Vec<String>,
    #[prost(int64, tag = "2")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct LabelNamesResponse {
    #[prost(string, repeated, tag = "1")]
    pub names: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct LabelValuesRequest {
    #[prost(string, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub name: String,
    #[prost(string, repeated, tag = "2")]
    #[serde(deserialize_with = "json::null_default")]
    pub matchers: Vec<String>,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "4")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct LabelValuesResponse {
    #[prost(string, repeated, tag = "1")]
    pub names: Vec<String>,
}

// ---- push.v1 ----

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct PushRequest {
    #[prost(message, repeated, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub series: Vec<RawProfileSeries>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct RawProfileSeries {
    #[prost(message, repeated, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub labels: Vec<LabelPair>,
    #[prost(message, repeated, tag = "2")]
    #[serde(deserialize_with = "json::null_default")]
    pub samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    #[serde(
        rename = "rawProfile",
        alias = "raw_profile",
        with = "json::bytes_base64"
    )]
    pub raw_profile: Vec<u8>,
    #[prost(string, tag = "2")]
    #[serde(rename = "ID", deserialize_with = "json::null_default")]
    pub id: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct PushResponse {}

// ---- querier.v1 ----

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ProfileTypesRequest {
    #[prost(int64, tag = "1")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "2")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct ProfileTypesResponse {
    #[prost(message, repeated, tag = "1")]
    #[serde(rename = "profileTypes")]
    pub profile_types: Vec<ProfileType>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SeriesRequest {
    #[prost(string, repeated, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub matchers: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    #[serde(
        rename = "labelNames",
        alias = "label_names",
        deserialize_with = "json::null_default"
    )]
    pub label_names: Vec<String>,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "4")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SeriesResponse {
    #[prost(message, repeated, tag = "2")]
    #[serde(rename = "labelsSet")]
    pub labels_set: Vec<Labels>,
}

/// `types.v1.StackTraceSelector`: which stacks a query counts.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct StackTraceSelector {
    /// Root first: only stacks that start with these functions are counted.
    #[prost(message, repeated, tag = "1")]
    #[serde(
        rename = "callSite",
        alias = "call_site",
        deserialize_with = "json::null_default"
    )]
    pub call_site: Vec<Location>,
    /// A profile shaped for Go's profile-guided optimization (then `call_site` is ignored).
    #[prost(message, optional, tag = "2")]
    #[serde(
        rename = "goPgo",
        alias = "go_pgo",
        skip_serializing_if = "Option::is_none"
    )]
    pub go_pgo: Option<GoPgo>,
}

/// `types.v1.Location`: a function, by name.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Location {
    #[prost(string, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub name: String,
}

/// `types.v1.GoPGO`.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct GoPgo {
    #[prost(uint32, tag = "1")]
    #[serde(
        rename = "keepLocations",
        alias = "keep_locations",
        deserialize_with = "json::null_default"
    )]
    pub keep_locations: u32,
    #[prost(bool, tag = "2")]
    #[serde(
        rename = "aggregateCallees",
        alias = "aggregate_callees",
        deserialize_with = "json::null_default"
    )]
    pub aggregate_callees: bool,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectMergeStacktracesRequest {
    #[prost(string, tag = "1")]
    #[serde(
        rename = "profileTypeID",
        alias = "profile_typeID",
        deserialize_with = "json::null_default"
    )]
    pub profile_type_id: String,
    #[prost(string, tag = "2")]
    #[serde(
        rename = "labelSelector",
        alias = "label_selector",
        deserialize_with = "json::null_default"
    )]
    pub label_selector: String,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "4")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
    #[prost(int64, optional, tag = "5")]
    #[serde(
        rename = "maxNodes",
        alias = "max_nodes",
        with = "json::opt_i64_string"
    )]
    pub max_nodes: Option<i64>,
    #[prost(int32, tag = "6")]
    #[serde(with = "json::profile_format")]
    pub format: i32,
    #[prost(message, optional, tag = "7")]
    #[serde(
        rename = "stackTraceSelector",
        alias = "stack_trace_selector",
        skip_serializing_if = "Option::is_none"
    )]
    pub stack_trace_selector: Option<StackTraceSelector>,
    /// Profile UUIDs (the store keeps none: a non-empty list is refused).
    #[prost(string, repeated, tag = "8")]
    #[serde(
        rename = "profileIdSelector",
        alias = "profile_id_selector",
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "json::null_default"
    )]
    pub profile_id_selector: Vec<String>,
    /// Only samples of spans of these traces (hex trace ids).
    #[prost(string, repeated, tag = "10")]
    #[serde(
        rename = "traceIdSelector",
        alias = "trace_id_selector",
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "json::null_default"
    )]
    pub trace_id_selector: Vec<String>,
    /// Only samples of these spans (hex span ids).
    #[prost(string, repeated, tag = "11")]
    #[serde(
        rename = "spanSelector",
        alias = "span_selector",
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "json::null_default"
    )]
    pub span_selector: Vec<String>,
}

/// `querier.v1.SelectMergeSpanProfileRequest`: the merged samples of a set of trace spans.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectMergeSpanProfileRequest {
    #[prost(string, tag = "1")]
    #[serde(
        rename = "profileTypeID",
        alias = "profile_typeID",
        deserialize_with = "json::null_default"
    )]
    pub profile_type_id: String,
    #[prost(string, tag = "2")]
    #[serde(
        rename = "labelSelector",
        alias = "label_selector",
        deserialize_with = "json::null_default"
    )]
    pub label_selector: String,
    /// Span ids as 16 hex digits.
    #[prost(string, repeated, tag = "3")]
    #[serde(
        rename = "spanSelector",
        alias = "span_selector",
        deserialize_with = "json::null_default"
    )]
    pub span_selector: Vec<String>,
    #[prost(int64, tag = "4")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "5")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
    #[prost(int64, optional, tag = "6")]
    #[serde(
        rename = "maxNodes",
        alias = "max_nodes",
        with = "json::opt_i64_string"
    )]
    pub max_nodes: Option<i64>,
    #[prost(int32, tag = "7")]
    #[serde(with = "json::profile_format")]
    pub format: i32,
}

/// `querier.v1.SelectMergeSpanProfileResponse` has the fields of
/// [`SelectMergeStacktracesResponse`] under the same numbers.
pub type SelectMergeSpanProfileResponse = SelectMergeStacktracesResponse;

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Level {
    #[prost(int64, repeated, tag = "1")]
    #[serde(with = "json::vec_i64_string")]
    pub values: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct FlameGraph {
    #[prost(string, repeated, tag = "1")]
    pub names: Vec<String>,
    #[prost(message, repeated, tag = "2")]
    pub levels: Vec<Level>,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub total: i64,
    #[prost(int64, tag = "4")]
    #[serde(rename = "maxSelf", alias = "max_self", with = "json::i64_string")]
    pub max_self: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectMergeStacktracesResponse {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flamegraph: Option<FlameGraph>,
    /// Pyroscope's tree bytes, for `format=TREE` (base64 in JSON).
    #[prost(bytes = "vec", tag = "2")]
    #[serde(skip_serializing_if = "Vec::is_empty", with = "json::bytes_base64")]
    pub tree: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectMergeProfileRequest {
    #[prost(string, tag = "1")]
    #[serde(
        rename = "profileTypeID",
        alias = "profile_typeID",
        deserialize_with = "json::null_default"
    )]
    pub profile_type_id: String,
    #[prost(string, tag = "2")]
    #[serde(
        rename = "labelSelector",
        alias = "label_selector",
        deserialize_with = "json::null_default"
    )]
    pub label_selector: String,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "4")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
    #[prost(int64, optional, tag = "5")]
    #[serde(
        rename = "maxNodes",
        alias = "max_nodes",
        with = "json::opt_i64_string"
    )]
    pub max_nodes: Option<i64>,
    #[prost(message, optional, tag = "6")]
    #[serde(
        rename = "stackTraceSelector",
        alias = "stack_trace_selector",
        skip_serializing_if = "Option::is_none"
    )]
    pub stack_trace_selector: Option<StackTraceSelector>,
    /// Profile UUIDs (the store keeps none: a non-empty list is refused).
    #[prost(string, repeated, tag = "7")]
    #[serde(
        rename = "profileIdSelector",
        alias = "profile_id_selector",
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "json::null_default"
    )]
    pub profile_id_selector: Vec<String>,
    /// Only samples of spans of these traces (hex trace ids).
    #[prost(string, repeated, tag = "8")]
    #[serde(
        rename = "traceIdSelector",
        alias = "trace_id_selector",
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "json::null_default"
    )]
    pub trace_id_selector: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectSeriesRequest {
    #[prost(string, tag = "1")]
    #[serde(
        rename = "profileTypeID",
        alias = "profile_typeID",
        deserialize_with = "json::null_default"
    )]
    pub profile_type_id: String,
    #[prost(string, tag = "2")]
    #[serde(
        rename = "labelSelector",
        alias = "label_selector",
        deserialize_with = "json::null_default"
    )]
    pub label_selector: String,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "4")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
    #[prost(string, repeated, tag = "5")]
    #[serde(
        rename = "groupBy",
        alias = "group_by",
        deserialize_with = "json::null_default"
    )]
    pub group_by: Vec<String>,
    /// Seconds.
    #[prost(double, tag = "6")]
    #[serde(deserialize_with = "json::null_default")]
    pub step: f64,
    #[prost(int32, optional, tag = "7")]
    #[serde(with = "json::aggregation")]
    pub aggregation: Option<i32>,
    #[prost(message, optional, tag = "8")]
    #[serde(
        rename = "stackTraceSelector",
        alias = "stack_trace_selector",
        skip_serializing_if = "Option::is_none"
    )]
    pub stack_trace_selector: Option<StackTraceSelector>,
    #[prost(int64, optional, tag = "9")]
    #[serde(with = "json::opt_i64_string")]
    pub limit: Option<i64>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SelectSeriesResponse {
    #[prost(message, repeated, tag = "1")]
    pub series: Vec<Series>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct DiffRequest {
    #[prost(message, optional, tag = "1")]
    pub left: Option<SelectMergeStacktracesRequest>,
    #[prost(message, optional, tag = "2")]
    pub right: Option<SelectMergeStacktracesRequest>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct FlameGraphDiff {
    #[prost(string, repeated, tag = "1")]
    pub names: Vec<String>,
    #[prost(message, repeated, tag = "2")]
    pub levels: Vec<Level>,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub total: i64,
    #[prost(int64, tag = "4")]
    #[serde(rename = "maxSelf", alias = "max_self", with = "json::i64_string")]
    pub max_self: i64,
    #[prost(int64, tag = "5")]
    #[serde(rename = "leftTicks", alias = "left_ticks", with = "json::i64_string")]
    pub left_ticks: i64,
    #[prost(int64, tag = "6")]
    #[serde(
        rename = "rightTicks",
        alias = "right_ticks",
        with = "json::i64_string"
    )]
    pub right_ticks: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct DiffResponse {
    #[prost(message, optional, tag = "1")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flamegraph: Option<FlameGraphDiff>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
pub struct GetProfileStatsRequest {}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct GetProfileStatsResponse {
    #[prost(bool, tag = "1")]
    #[serde(rename = "dataIngested", alias = "data_ingested")]
    pub data_ingested: bool,
    #[prost(int64, tag = "2")]
    #[serde(
        rename = "oldestProfileTime",
        alias = "oldest_profile_time",
        with = "json::i64_string"
    )]
    pub oldest_profile_time: i64,
    #[prost(int64, tag = "3")]
    #[serde(
        rename = "newestProfileTime",
        alias = "newest_profile_time",
        with = "json::i64_string"
    )]
    pub newest_profile_time: i64,
}

// settings.v1.SettingsService: per-tenant key/value settings Grafana's apps keep (Profiles
// Drilldown stores its user preferences there).

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct Setting {
    #[prost(string, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub name: String,
    #[prost(string, tag = "2")]
    #[serde(deserialize_with = "json::null_default")]
    pub value: String,
    /// Milliseconds since the epoch (the field is `modifiedAt` in the .proto too).
    #[prost(int64, tag = "3")]
    #[serde(
        rename = "modifiedAt",
        alias = "modified_at",
        with = "json::i64_string"
    )]
    pub modified_at: i64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct GetSettingsRequest {}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct GetSettingsResponse {
    #[prost(message, repeated, tag = "1")]
    #[serde(deserialize_with = "json::null_default")]
    pub settings: Vec<Setting>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SetSettingsRequest {
    #[prost(message, optional, tag = "1")]
    pub setting: Option<Setting>,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct SetSettingsResponse {
    #[prost(message, optional, tag = "1")]
    pub setting: Option<Setting>,
}

/// `querier.v1.AnalyzeQueryRequest`: what a query would read.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct AnalyzeQueryRequest {
    /// Milliseconds since the epoch.
    #[prost(int64, tag = "2")]
    #[serde(with = "json::i64_string")]
    pub start: i64,
    #[prost(int64, tag = "3")]
    #[serde(with = "json::i64_string")]
    pub end: i64,
    /// `<profile type>{selector}`.
    #[prost(string, tag = "4")]
    pub query: String,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct AnalyzeQueryResponse {
    #[prost(message, repeated, tag = "1")]
    #[serde(rename = "queryScopes", alias = "query_scopes")]
    pub query_scopes: Vec<QueryScope>,
    #[prost(message, optional, tag = "2")]
    #[serde(rename = "queryImpact", alias = "query_impact")]
    pub query_impact: Option<QueryImpact>,
}

/// One kind of component that serves part of a query and what it reads.
#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct QueryScope {
    #[prost(string, tag = "1")]
    #[serde(rename = "componentType", alias = "component_type")]
    pub component_type: String,
    #[prost(uint64, tag = "2")]
    #[serde(
        rename = "componentCount",
        alias = "component_count",
        with = "json::u64_string"
    )]
    pub component_count: u64,
    #[prost(uint64, tag = "3")]
    #[serde(
        rename = "blockCount",
        alias = "block_count",
        with = "json::u64_string"
    )]
    pub block_count: u64,
    #[prost(uint64, tag = "4")]
    #[serde(
        rename = "seriesCount",
        alias = "series_count",
        with = "json::u64_string"
    )]
    pub series_count: u64,
    #[prost(uint64, tag = "5")]
    #[serde(
        rename = "profileCount",
        alias = "profile_count",
        with = "json::u64_string"
    )]
    pub profile_count: u64,
    #[prost(uint64, tag = "6")]
    #[serde(
        rename = "sampleCount",
        alias = "sample_count",
        with = "json::u64_string"
    )]
    pub sample_count: u64,
    #[prost(uint64, tag = "7")]
    #[serde(
        rename = "indexBytes",
        alias = "index_bytes",
        with = "json::u64_string"
    )]
    pub index_bytes: u64,
    #[prost(uint64, tag = "8")]
    #[serde(
        rename = "profileBytes",
        alias = "profile_bytes",
        with = "json::u64_string"
    )]
    pub profile_bytes: u64,
    #[prost(uint64, tag = "9")]
    #[serde(
        rename = "symbolBytes",
        alias = "symbol_bytes",
        with = "json::u64_string"
    )]
    pub symbol_bytes: u64,
}

#[derive(Clone, PartialEq, prost::Message, Serialize, Deserialize)]
#[serde(default)]
pub struct QueryImpact {
    #[prost(uint64, tag = "2")]
    #[serde(
        rename = "totalBytesInTimeRange",
        alias = "total_bytes_in_time_range",
        with = "json::u64_string"
    )]
    pub total_bytes_in_time_range: u64,
    #[prost(uint64, tag = "3")]
    #[serde(
        rename = "totalQueriedSeries",
        alias = "total_queried_series",
        with = "json::u64_string"
    )]
    pub total_queried_series: u64,
    #[prost(bool, tag = "4")]
    #[serde(rename = "deduplicationNeeded", alias = "deduplication_needed")]
    pub deduplication_needed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_both_ways() {
        let request: SelectMergeStacktracesRequest = serde_json::from_str(
            r#"{"profile_typeID":"process_cpu:cpu:nanoseconds:cpu:nanoseconds","labelSelector":"{}",
                "start":"1000","end":2000,"maxNodes":"16","format":"PROFILE_FORMAT_FLAMEGRAPH"}"#,
        )
        .unwrap();
        assert_eq!(request.start, 1000);
        assert_eq!(request.end, 2000);
        assert_eq!(request.max_nodes, Some(16));
        assert_eq!(request.format, 1);
        let json = serde_json::to_value(&request).unwrap();
        assert_eq!(
            json["profileTypeID"],
            "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
        );
        assert_eq!(json["start"], "1000");

        let push: PushRequest = serde_json::from_str(
            r#"{"series":[{"labels":[{"name":"service_name","value":"a"}],"samples":[{"ID":"x","rawProfile":"AQID"}]}]}"#,
        )
        .unwrap();
        assert_eq!(push.series[0].samples[0].raw_profile, vec![1, 2, 3]);
        assert!(
            serde_json::from_str::<PushRequest>(
                r#"{"series":[{"samples":[{"rawProfile":"!!"}]}]}"#
            )
            .is_err()
        );
        let empty: SelectSeriesRequest = serde_json::from_str("{}").unwrap();
        assert_eq!(empty.aggregation, None);
    }
}
