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

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn varint(&mut self) -> Result<u64, CorruptProfile> {
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

    proptest! {
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
