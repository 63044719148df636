//! The on-disk encoding of one stored profile: a sorted list of (stack node, value) pairs.
//!
//! Layout: varint count, varint scale, then per entry varint (node − previous node) and zigzag
//! varint (value / scale). Node ids are sorted so their deltas are small, and CPU values are all
//! multiples of the sampling period, so dividing by their common divisor turns nanoseconds back
//! into sample counts that fit one byte. A 2,000-stack profile takes about 5 KB.
//!
//! A stack space's call-tree nodes are stored the same way, in blocks: each write stores the
//! nodes it added as one blob of (node − parent, name id) varint pairs, which costs one row
//! instead of one per node when a new service's first profiles add tens of thousands of nodes.
//!
//! A profile's samples with numeric labels (the agent's `pid` and `tid`, [`LabelledEntries`])
//! are a third blob: varint scale (the common divisor of all its values), the label keys
//! (varint count, then each as varint length and UTF-8), varint group count, then per group
//! its labels (varint count, then per label its key's index and its value as zigzag varint)
//! and its entries (varint count, then per entry varint node − previous node and zigzag
//! varint value / scale). A thread's few samples cost a few bytes more than in the stacks.
//!
//! A profile's span samples (pushed with a `span_id` sample label, [`SpanEntries`]) are a
//! second blob beside its stacks: varint span count, then per span its id (8 bytes, little
//! endian), its trace id and name (varint length, UTF-8), and its entries as one [`encode`]d
//! list behind a varint length, so a query skips the spans it did not select without decoding
//! them.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("stored profile is corrupt: {0}")]
pub struct CorruptProfile(pub(crate) &'static str);

/// Encodes `(node, value)` pairs; `entries` must be sorted by node with no duplicates.
pub fn encode(entries: &[(u32, i64)]) -> Vec<u8> {
    let scale = entries
        .iter()
        .fold(0u64, |acc, &(_, value)| gcd(acc, value.unsigned_abs()))
        .max(1);
    let mut out = Vec::with_capacity(entries.len() * 3 + 10);
    put_varint(&mut out, entries.len() as u64);
    put_varint(&mut out, scale);
    let mut previous = 0u32;
    for &(node, value) in entries {
        put_varint(&mut out, u64::from(node - previous));
        previous = node;
        // Division is exact: scale divides every value.
        let scaled = value / scale as i64;
        put_varint(&mut out, ((scaled << 1) ^ (scaled >> 63)) as u64);
    }
    out
}

/// Calls `add(node, value)` for every entry of an encoded profile.
pub fn decode(bytes: &[u8], mut add: impl FnMut(u32, i64)) -> Result<(), CorruptProfile> {
    let mut reader = Reader { bytes, pos: 0 };
    let count = reader.varint()?;
    let scale = reader.varint()? as i64;
    let mut node = 0u64;
    for _ in 0..count {
        node = node
            .checked_add(reader.varint()?)
            .ok_or(CorruptProfile("node id out of range"))?;
        let zigzag = reader.varint()?;
        let value = ((zigzag >> 1) as i64) ^ -((zigzag & 1) as i64);
        let node = u32::try_from(node).map_err(|_| CorruptProfile("node id out of range"))?;
        add(node, value.saturating_mul(scale));
    }
    Ok(())
}

/// Encodes call-tree nodes `(parent, name id)` numbered from `first`; every parent must be
/// smaller than its node's number.
pub fn encode_nodes(first: usize, nodes: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(nodes.len() * 4);
    for (offset, &(parent, name)) in nodes.iter().enumerate() {
        let idx = (first + offset) as u64;
        put_varint(&mut out, idx - u64::from(parent));
        put_varint(&mut out, u64::from(name));
    }
    out
}

/// Calls `add(parent, name id)` for every node of a block whose first node is `first`.
pub fn decode_nodes(
    first: usize,
    bytes: &[u8],
    mut add: impl FnMut(u32, u32),
) -> Result<(), CorruptProfile> {
    let mut reader = Reader { bytes, pos: 0 };
    let mut idx = first as u64;
    while reader.pos < bytes.len() {
        let back = reader.varint()?;
        let parent = idx
            .checked_sub(back)
            .filter(|_| back > 0)
            .and_then(|p| u32::try_from(p).ok())
            .ok_or(CorruptProfile("node parent out of range"))?;
        let name = u32::try_from(reader.varint()?)
            .map_err(|_| CorruptProfile("node name out of range"))?;
        add(parent, name);
        idx += 1;
    }
    Ok(())
}

/// The samples of one span in a stored profile: ids and names as the client pushed them
/// (`span_id` parsed from hex), entries sorted by node with no duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpanEntries {
    pub span_id: u64,
    pub trace_id: String,
    pub span_name: String,
    pub entries: Vec<(u32, i64)>,
}

/// A span as a query sees it before deciding whether to read its entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanHeader<'a> {
    pub span_id: u64,
    pub trace_id: &'a str,
    pub span_name: &'a str,
}

/// Encodes the spans of one profile (see the module's layout).
pub fn encode_spans(spans: &[SpanEntries]) -> Vec<u8> {
    let mut out = Vec::new();
    put_varint(&mut out, spans.len() as u64);
    for span in spans {
        out.extend_from_slice(&span.span_id.to_le_bytes());
        for text in [&span.trace_id, &span.span_name] {
            put_varint(&mut out, text.len() as u64);
            out.extend_from_slice(text.as_bytes());
        }
        let entries = encode(&span.entries);
        put_varint(&mut out, entries.len() as u64);
        out.extend_from_slice(&entries);
    }
    out
}

/// Reads every span of an encoded span blob: `select` sees each span's header, and the
/// entries of the spans it accepts go to `add(node, value)`; the others are skipped unread.
pub fn decode_spans(
    bytes: &[u8],
    mut select: impl FnMut(SpanHeader<'_>) -> bool,
    mut add: impl FnMut(u32, i64),
) -> Result<(), CorruptProfile> {
    let mut reader = Reader { bytes, pos: 0 };
    let count = reader.varint()?;
    for _ in 0..count {
        let id = reader.take(8)?;
        let span_id = u64::from_le_bytes(id.try_into().map_err(|_| CorruptProfile("truncated"))?);
        let trace_len = reader.length()?;
        let trace_id = reader.text(trace_len)?;
        let name_len = reader.length()?;
        let span_name = reader.text(name_len)?;
        let entries_len = reader.length()?;
        let entries = reader.take(entries_len)?;
        if select(SpanHeader {
            span_id,
            trace_id,
            span_name,
        }) {
            decode(entries, &mut add)?;
        }
    }
    Ok(())
}

/// The samples of a profile that carry one set of numeric labels (pprof labels with `num`),
/// entries sorted by node with no duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelledEntries {
    pub labels: Vec<(String, i64)>,
    pub entries: Vec<(u32, i64)>,
}

/// Encodes the numeric-label groups of one profile (see the module's layout).
pub fn encode_labelled(groups: &[LabelledEntries]) -> Vec<u8> {
    let scale = groups
        .iter()
        .flat_map(|group| &group.entries)
        .fold(0u64, |acc, &(_, value)| gcd(acc, value.unsigned_abs()))
        .max(1);
    let mut keys: Vec<&str> = groups
        .iter()
        .flat_map(|group| group.labels.iter().map(|(key, _)| key.as_str()))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let mut out = Vec::new();
    put_varint(&mut out, scale);
    put_varint(&mut out, keys.len() as u64);
    for key in &keys {
        put_varint(&mut out, key.len() as u64);
        out.extend_from_slice(key.as_bytes());
    }
    put_varint(&mut out, groups.len() as u64);
    let zigzag = |value: i64| ((value << 1) ^ (value >> 63)) as u64;
    for group in groups {
        put_varint(&mut out, group.labels.len() as u64);
        for (key, value) in &group.labels {
            let index = keys.binary_search(&key.as_str()).unwrap_or_default();
            put_varint(&mut out, index as u64);
            put_varint(&mut out, zigzag(*value));
        }
        put_varint(&mut out, group.entries.len() as u64);
        let mut previous = 0u32;
        for &(node, value) in &group.entries {
            put_varint(&mut out, u64::from(node - previous));
            previous = node;
            // Exact: scale divides every value.
            put_varint(&mut out, zigzag(value / scale as i64));
        }
    }
    out
}

/// Calls `group(labels)` for each group of an encoded numeric-label blob, then `add(node,
/// value)` for each of its entries.
pub fn decode_labelled(
    bytes: &[u8],
    mut group: impl FnMut(&[(&str, i64)]),
    mut add: impl FnMut(u32, i64),
) -> Result<(), CorruptProfile> {
    let mut reader = Reader::new(bytes);
    let unzigzag = |value: u64| ((value >> 1) as i64) ^ -((value & 1) as i64);
    let scale = reader.varint()? as i64;
    let key_count = reader.varint()?;
    let mut keys: Vec<&str> = Vec::new();
    for _ in 0..key_count {
        let len = reader.length()?;
        keys.push(reader.text(len)?);
    }
    let count = reader.varint()?;
    let mut labels: Vec<(&str, i64)> = Vec::new();
    for _ in 0..count {
        labels.clear();
        for _ in 0..reader.varint()? {
            let key = usize::try_from(reader.varint()?)
                .ok()
                .and_then(|index| keys.get(index))
                .ok_or(CorruptProfile("label key out of range"))?;
            labels.push((key, unzigzag(reader.varint()?)));
        }
        group(&labels);
        let mut node = 0u64;
        for _ in 0..reader.varint()? {
            node = node
                .checked_add(reader.varint()?)
                .ok_or(CorruptProfile("node id out of range"))?;
            let node = u32::try_from(node).map_err(|_| CorruptProfile("node id out of range"))?;
            add(node, unzigzag(reader.varint()?).saturating_mul(scale));
        }
    }
    Ok(())
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, pos: 0 }
    }

    pub(crate) fn at_end(&self) -> bool {
        self.pos >= self.bytes.len()
    }

    pub(crate) fn take(&mut self, len: usize) -> Result<&'a [u8], CorruptProfile> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len())
            .ok_or(CorruptProfile("truncated"))?;
        let slice = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(slice)
    }

    fn length(&mut self) -> Result<usize, CorruptProfile> {
        usize::try_from(self.varint()?).map_err(|_| CorruptProfile("length out of range"))
    }

    fn text(&mut self, len: usize) -> Result<&'a str, CorruptProfile> {
        std::str::from_utf8(self.take(len)?).map_err(|_| CorruptProfile("span text is not UTF-8"))
    }

    pub(crate) fn varint(&mut self) -> Result<u64, CorruptProfile> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .bytes
                .get(self.pos)
                .ok_or(CorruptProfile("truncated"))?;
            self.pos += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(CorruptProfile("varint too long"))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn cpu_values_shrink_to_sample_counts() {
        let entries = vec![(1, 10_000_000), (2, 30_000_000), (300, 10_000_000)];
        let bytes = encode(&entries);
        // count, scale (4 bytes), 3 × (delta, count) with the 298 delta taking two bytes.
        assert_eq!(bytes.len(), 1 + 4 + 2 + 2 + 3);
        let mut decoded = Vec::new();
        decode(&bytes, |n, v| decoded.push((n, v))).unwrap();
        assert_eq!(decoded, entries);
    }

    #[test]
    fn truncated_input_is_an_error() {
        let bytes = encode(&[(5, 7), (9, -3)]);
        for len in 0..bytes.len() {
            assert!(decode(&bytes[..len], |_, _| {}).is_err(), "prefix {len}");
        }
    }

    #[test]
    fn node_blocks_round_trip_and_reject_forward_parents() {
        let nodes = vec![(0, 7), (5, 3), (6, 300_000)];
        let bytes = encode_nodes(5, &nodes);
        let mut decoded = Vec::new();
        decode_nodes(5, &bytes, |p, n| decoded.push((p, n))).unwrap();
        assert_eq!(decoded, nodes);
        // The same bytes read as starting at node 0 would give the first node parent -5.
        assert!(decode_nodes(0, &bytes, |_, _| {}).is_err());
        // A node that is its own parent.
        assert!(decode_nodes(3, &[0, 1], |_, _| {}).is_err());
        assert!(decode_nodes(3, &bytes[..bytes.len() - 1], |_, _| {}).is_err());
    }

    #[test]
    fn spans_round_trip_and_unselected_spans_are_skipped() {
        let spans = vec![
            SpanEntries {
                span_id: 0x9a51_7183_f26a_089d,
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                span_name: "GET /slow".into(),
                entries: vec![(3, 10), (8, 20)],
            },
            SpanEntries {
                span_id: 7,
                trace_id: String::new(),
                span_name: "fast".into(),
                entries: vec![(4, 5)],
            },
        ];
        let bytes = encode_spans(&spans);
        let mut seen = Vec::new();
        let mut added = Vec::new();
        decode_spans(
            &bytes,
            |span| {
                seen.push((
                    span.span_id,
                    span.trace_id.to_owned(),
                    span.span_name.to_owned(),
                ));
                span.span_id == 7
            },
            |node, value| added.push((node, value)),
        )
        .unwrap();
        assert_eq!(added, vec![(4, 5)]);
        assert_eq!(
            seen,
            spans
                .iter()
                .map(|s| (s.span_id, s.trace_id.clone(), s.span_name.clone()))
                .collect::<Vec<_>>()
        );
        for len in 0..bytes.len() {
            assert!(
                decode_spans(&bytes[..len], |_| true, |_, _| {}).is_err(),
                "prefix {len}"
            );
        }
    }

    #[test]
    fn labelled_groups_round_trip() {
        let groups = vec![
            LabelledEntries {
                labels: vec![("pid".into(), 4321), ("tid".into(), 4322)],
                entries: vec![(3, 10), (8, 20)],
            },
            LabelledEntries {
                labels: vec![("bytes".into(), -7)],
                entries: vec![(4, 5)],
            },
        ];
        let bytes = encode_labelled(&groups);
        let decoded: std::cell::RefCell<Vec<LabelledEntries>> = Default::default();
        decode_labelled(
            &bytes,
            |labels| {
                decoded.borrow_mut().push(LabelledEntries {
                    labels: labels.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                    entries: Vec::new(),
                })
            },
            |node, value| {
                let mut decoded = decoded.borrow_mut();
                decoded.last_mut().unwrap().entries.push((node, value));
            },
        )
        .unwrap();
        assert_eq!(decoded.into_inner(), groups);
        for len in 0..bytes.len() {
            assert!(
                decode_labelled(&bytes[..len], |_| {}, |_, _| {}).is_err(),
                "prefix {len}"
            );
        }
    }

    proptest! {
        #[test]
        fn arbitrary_labelled_blobs_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = decode_labelled(&bytes, |_| {}, |_, _| {});
        }

        #[test]
        fn arbitrary_span_blobs_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = decode_spans(&bytes, |_| true, |_, _| {});
        }

        #[test]
        fn round_trips(mut entries in proptest::collection::btree_map(0u32..1_000_000, any::<i64>(), 0..50)) {
            let entries: Vec<(u32, i64)> = std::mem::take(&mut entries).into_iter().collect();
            let mut decoded = Vec::new();
            decode(&encode(&entries), |n, v| decoded.push((n, v))).unwrap();
            prop_assert_eq!(decoded, entries);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&bytes, |_, _| {});
        }
    }
}
