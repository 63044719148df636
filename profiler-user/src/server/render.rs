//! Query results in the shapes clients expect: the FlameGraph levels encoding
//! (docs/pyroscope-protocol.md §7.4, §7.5), its diff form, and a pprof of a merged tree.
use std::{collections::HashMap, sync::Arc};

use crate::wire::api::{FlameGraph, FlameGraphDiff, Level};
use crate::{
    store::{
        ProfileType,
        query::{MAX_LABEL_GROUPS, MergedTree, Period},
    },
    wire::proto,
};

/// Server default for `max_nodes`, as Pyroscope's.
pub const DEFAULT_MAX_NODES: usize = 8192;

/// The smallest total a node needs to be drawn so at most `max_nodes` nodes are; smaller
/// siblings are folded into one `other` node.
fn min_total(totals: impl Iterator<Item = i64>, max_nodes: usize) -> i64 {
    let mut totals: Vec<i64> = totals.map(i64::saturating_abs).collect();
    if max_nodes == 0 || totals.len() <= max_nodes {
        return 0;
    }
    let (_, nth, _) = totals.select_nth_unstable_by(max_nodes - 1, |a, b| b.cmp(a));
    *nth
}

struct NamesTable {
    names: Vec<String>,
    index: HashMap<String, i64>,
}

impl NamesTable {
    fn new() -> NamesTable {
        NamesTable {
            names: vec!["total".into()],
            index: HashMap::from([("total".into(), 0)]),
        }
    }

    fn id(&mut self, name: &str) -> i64 {
        if let Some(&id) = self.index.get(name) {
            return id;
        }
        self.names.push(name.to_owned());
        self.index
            .insert(name.to_owned(), self.names.len() as i64 - 1);
        self.names.len() as i64 - 1
    }
}

/// Levels as absolute (x, total, self, name) before delta encoding.
type RawLevels = Vec<Vec<[i64; 4]>>;

fn delta_encode(raw: RawLevels, width: usize) -> Vec<Level> {
    raw.into_iter()
        .map(|level| {
            let mut values = Vec::with_capacity(level.len() * width);
            let mut previous_end = 0;
            for [x, total, self_value, name] in level {
                values.extend_from_slice(&[
                    x.saturating_sub(previous_end),
                    total,
                    self_value,
                    name,
                ]);
                previous_end = x.saturating_add(total);
            }
            Level { values }
        })
        .collect()
}

/// A merged tree as a flame graph: children sorted by name, self value left of the children.
/// Pyroscope's tree bytes (`format=TREE` of SelectMergeStacktraces): every node in depth-first
/// pre-order as uvarint(name length), name, uvarint(self), uvarint(children), under a nameless
/// virtual root. Children whose total is below the `max_nodes` largest are summed into an
/// `other` child, as the flame graph does. Negative values (diffs) do not occur in a merge.
pub fn tree_bytes(tree: &MergedTree, max_nodes: usize) -> Vec<u8> {
    /// What the depth-first walk writes next.
    enum Entry {
        Node(u32),
        /// The summed small children of a node: a leaf.
        Other(i64),
    }
    let threshold = min_total(tree.nodes.iter().skip(1).map(|n| n.total), max_nodes);
    let mut out = Vec::new();
    if tree.nodes.is_empty() {
        return out;
    }
    let write = |out: &mut Vec<u8>, name: &str, self_value: i64, children: usize| {
        prost::encoding::encode_varint(name.len() as u64, out);
        out.extend_from_slice(name.as_bytes());
        prost::encoding::encode_varint(self_value.max(0) as u64, out);
        prost::encoding::encode_varint(children as u64, out);
    };
    let mut stack = vec![Entry::Node(0)];
    while let Some(entry) = stack.pop() {
        let node_id = match entry {
            Entry::Other(value) => {
                write(&mut out, "other", value, 0);
                continue;
            }
            Entry::Node(id) => id,
        };
        let node = &tree.nodes[node_id as usize];
        let mut children = Vec::new();
        let mut other = 0i64;
        for &child in &node.children {
            match tree.nodes[child as usize].total {
                total if total <= 0 => {}
                total if total >= threshold => children.push(child),
                total => other = other.saturating_add(total),
            }
        }
        // Node 0 is the merge's root: the format's nameless virtual root.
        let (name, self_value) = match node_id {
            0 => ("", 0),
            _ => (tree.name_of(node_id), node.self_value),
        };
        write(
            &mut out,
            name,
            self_value,
            children.len() + usize::from(other > 0),
        );
        if other > 0 {
            stack.push(Entry::Other(other));
        }
        stack.extend(children.iter().rev().map(|&c| Entry::Node(c)));
    }
    out
}

pub fn flamegraph(tree: &MergedTree, max_nodes: usize) -> FlameGraph {
    let threshold = min_total(tree.nodes.iter().skip(1).map(|n| n.total), max_nodes);
    let mut names = NamesTable::new();
    let mut levels: RawLevels = Vec::new();
    let mut max_self = 0;
    // (node or None for `other`, depth, x, total, self)
    let mut stack: Vec<(Option<u32>, usize, i64, i64, i64)> = Vec::new();
    if let Some(root) = tree.nodes.first() {
        stack.push((Some(0), 0, 0, root.total, root.self_value));
    }
    while let Some((node, depth, x, total, self_value)) = stack.pop() {
        if levels.len() <= depth {
            levels.push(Vec::new());
        }
        let name = match node {
            Some(n) => names.id(tree.name_of(n)),
            None => names.id("other"),
        };
        levels[depth].push([x, total, self_value, name]);
        max_self = max_self.max(self_value);
        let Some(node) = node else { continue };
        let mut children: Vec<u32> = tree.nodes[node as usize].children.clone();
        children.sort_by(|a, b| tree.name_of(*a).cmp(tree.name_of(*b)));
        let mut next_x = x.saturating_add(self_value);
        let mut placed = Vec::new();
        let mut other = 0i64;
        for child in children {
            let child_node = &tree.nodes[child as usize];
            if child_node.total == 0 {
                continue;
            }
            if child_node.total.unsigned_abs() < threshold.unsigned_abs() {
                other = other.saturating_add(child_node.total);
                continue;
            }
            placed.push((
                Some(child),
                depth + 1,
                next_x,
                child_node.total,
                child_node.self_value,
            ));
            next_x = next_x.saturating_add(child_node.total);
        }
        if other != 0 {
            placed.push((None, depth + 1, next_x, other, other));
        }
        // Depth-first, leftmost child first, so each level stays sorted by x.
        stack.extend(placed.into_iter().rev());
    }
    FlameGraph {
        names: names.names,
        levels: delta_encode(levels, 4),
        total: tree.total(),
        max_self,
    }
}

/// Two trees merged by name path, each node carrying both sides.
#[derive(Default)]
struct DiffNode {
    name: String,
    left: (i64, i64),
    right: (i64, i64),
    children: Vec<usize>,
}

fn merge_into(
    diff: &mut Vec<DiffNode>,
    index: &mut HashMap<(usize, String), usize>,
    tree: &MergedTree,
    left: bool,
) {
    let mut mapped = vec![0usize; tree.nodes.len()];
    for (idx, node) in tree.nodes.iter().enumerate() {
        let target = if idx == 0 {
            0
        } else {
            let parent = mapped[node.parent as usize];
            let name = tree.name_of(idx as u32).to_owned();
            *index.entry((parent, name.clone())).or_insert_with(|| {
                diff.push(DiffNode {
                    name,
                    ..DiffNode::default()
                });
                let id = diff.len() - 1;
                diff[parent].children.push(id);
                id
            })
        };
        mapped[idx] = target;
        let side = if left {
            &mut diff[target].left
        } else {
            &mut diff[target].right
        };
        side.0 = side.0.saturating_add(node.total);
        side.1 = side.1.saturating_add(node.self_value);
    }
}

/// The diff flame graph of two merged trees (7-tuples, both x columns delta-encoded).
pub fn flamegraph_diff(left: &MergedTree, right: &MergedTree, max_nodes: usize) -> FlameGraphDiff {
    let mut nodes = vec![DiffNode {
        name: "total".into(),
        ..DiffNode::default()
    }];
    let mut index = HashMap::new();
    merge_into(&mut nodes, &mut index, left, true);
    merge_into(&mut nodes, &mut index, right, false);
    let threshold = min_total(
        nodes.iter().skip(1).map(|n| n.left.0.max(n.right.0)),
        max_nodes,
    );
    let mut names = NamesTable::new();
    // [x_left, total_left, self_left, x_right, total_right, self_right, name] per level.
    let mut levels: Vec<Vec<[i64; 7]>> = Vec::new();
    let mut max_self = 0;
    // (node, depth, x_left, x_right)
    let mut stack = vec![(Some(0usize), 0usize, 0i64, 0i64, (0i64, 0i64), (0i64, 0i64))];
    stack[0].4 = nodes[0].left;
    stack[0].5 = nodes[0].right;
    while let Some((node, depth, xl, xr, left_values, right_values)) = stack.pop() {
        if levels.len() <= depth {
            levels.push(Vec::new());
        }
        let name = names.id(node.map_or("other", |n| nodes[n].name.as_str()));
        levels[depth].push([
            xl,
            left_values.0,
            left_values.1,
            xr,
            right_values.0,
            right_values.1,
            name,
        ]);
        max_self = max_self.max(left_values.1).max(right_values.1);
        let Some(node) = node else { continue };
        let mut children = nodes[node].children.clone();
        children.sort_by(|a, b| nodes[*a].name.cmp(&nodes[*b].name));
        let (mut next_l, mut next_r) = (
            xl.saturating_add(left_values.1),
            xr.saturating_add(right_values.1),
        );
        let mut placed = Vec::new();
        let (mut other_l, mut other_r) = (0i64, 0i64);
        for child in children {
            let c = &nodes[child];
            if c.left.0.max(c.right.0) < threshold {
                other_l = other_l.saturating_add(c.left.0);
                other_r = other_r.saturating_add(c.right.0);
                continue;
            }
            placed.push((Some(child), depth + 1, next_l, next_r, c.left, c.right));
            next_l = next_l.saturating_add(c.left.0);
            next_r = next_r.saturating_add(c.right.0);
        }
        if other_l != 0 || other_r != 0 {
            placed.push((
                None,
                depth + 1,
                next_l,
                next_r,
                (other_l, other_l),
                (other_r, other_r),
            ));
        }
        stack.extend(placed.into_iter().rev());
    }
    let levels = levels
        .into_iter()
        .map(|level| {
            let mut values = Vec::with_capacity(level.len() * 7);
            let (mut end_l, mut end_r) = (0, 0);
            for [xl, tl, sl, xr, tr, sr, name] in level {
                values.extend_from_slice(&[
                    xl.saturating_sub(end_l),
                    tl,
                    sl,
                    xr.saturating_sub(end_r),
                    tr,
                    sr,
                    name,
                ]);
                end_l = xl.saturating_add(tl);
                end_r = xr.saturating_add(tr);
            }
            Level { values }
        })
        .collect();
    FlameGraphDiff {
        names: names.names,
        levels,
        total: nodes[0].left.0.saturating_add(nodes[0].right.0),
        max_self,
        left_ticks: nodes[0].left.0,
        right_ticks: nodes[0].right.0,
    }
}

/// A merged tree as a pprof (see [`pprof_of_parts`]).
pub fn pprof(
    tree: &MergedTree,
    profile_type: &ProfileType,
    start_ns: i64,
    end_ns: i64,
) -> proto::Profile {
    pprof_of_parts(&[(&[][..], tree)], profile_type, start_ns, end_ns, None)
}

/// Call trees with their labels (a series' labels each) as one pprof: one sample per node with
/// a self value, carrying its tree's labels as string labels. Trees merged by frame
/// ([`Store::merge_with_frames`](crate::store::Store::merge_with_frames)) give their
/// functions with file and lines, locations with addresses and inlined lines, mappings with
/// build ids; trees merged by name give one function and location per name. The period is
/// the profiles' own. `comment`, if any, goes into the profile's comments.
pub fn pprof_of_parts(
    parts: &[(&[(String, String)], &MergedTree)],
    profile_type: &ProfileType,
    start_ns: i64,
    end_ns: i64,
    comment: Option<&str>,
) -> proto::Profile {
    let mut out = PprofBuilder::default();
    out.strings.push(String::new());
    let sample_type = out.value_type(&profile_type.sample_type, &profile_type.sample_unit);
    let period_type = out.value_type(&profile_type.period_type, &profile_type.period_unit);
    let mut samples = Vec::new();
    for (labels, tree) in parts {
        let sample_labels: Vec<proto::Label> = labels
            .iter()
            .filter(|(name, _)| !name.starts_with("__"))
            .map(|(name, value)| proto::Label {
                key: out.string(name),
                str: out.string(value),
                ..Default::default()
            })
            .collect();
        // Numeric labels (`pid`, `tid`) of each group, as pprof labels.
        let groups: Vec<Vec<proto::Label>> = tree
            .label_groups
            .iter()
            .map(|set| {
                set.iter()
                    .map(|(key, num)| proto::Label {
                        key: out.string(key),
                        num: *num,
                        ..Default::default()
                    })
                    .collect()
            })
            .collect();
        let mut labelled = tree.labelled.iter().peekable();
        // Per node: the location that ends (leaf side) at it and the node above that location.
        let mut location_of: Vec<Option<(u64, u32)>> = vec![None; tree.nodes.len()];
        for (idx, node) in tree.nodes.iter().enumerate().skip(1) {
            // The node's samples with numeric labels (sorted by node), then the rest.
            let mut values: Vec<(i64, Option<&[proto::Label]>)> = Vec::new();
            let mut rest = node.self_value;
            // Skipped: the root's (its samples have no stack, as in the unlabelled case).
            while labelled.next_if(|(n, _, _)| (*n as usize) < idx).is_some() {}
            while let Some(&(_, group, value)) = labelled.next_if(|(n, _, _)| *n as usize == idx) {
                if let Some(labels) = groups.get(group as usize) {
                    values.push((value, Some(labels)));
                    rest = rest.saturating_sub(value);
                }
            }
            if rest != 0 {
                values.push((rest, None));
            }
            if values.is_empty() {
                continue;
            }
            let mut location_id = Vec::new();
            let mut current = idx as u32;
            while current != 0 {
                let (location, above) = match location_of[current as usize] {
                    Some(known) => known,
                    None => {
                        let found = out.location(tree, current);
                        location_of[current as usize] = Some(found);
                        found
                    }
                };
                location_id.push(location);
                current = above;
            }
            for (value, numeric) in values {
                let mut label = sample_labels.clone();
                label.extend(numeric.unwrap_or_default().iter().cloned());
                samples.push(proto::Sample {
                    location_id: location_id.clone(),
                    value: vec![value],
                    label,
                });
            }
        }
    }
    let period = parts
        .iter()
        .fold(Period::Unknown, |period, (_, tree)| period.and(tree.period));
    let mut comments: Vec<String> = comment.into_iter().map(str::to_owned).collect();
    if parts.iter().any(|(_, tree)| tree.label_groups_capped) {
        comments.push(format!(
            "some samples lack their pid and tid: the selection has more than {MAX_LABEL_GROUPS} \
             sets of them"
        ));
    }
    let period = match period {
        Period::Known(period) => period,
        Period::Unknown => 0,
        Period::Mixed => {
            comments.push("period 0: profiles with different sampling periods were merged".into());
            0
        }
    };
    let comment = comments.into_iter().map(|text| out.string(&text)).collect();
    let PprofBuilder {
        strings,
        functions,
        locations,
        mappings,
        ..
    } = out;
    proto::Profile {
        sample_type: vec![sample_type],
        sample: samples,
        mapping: mappings,
        location: locations,
        function: functions,
        string_table: strings,
        time_nanos: start_ns,
        duration_nanos: end_ns.saturating_sub(start_ns).max(0),
        period_type: Some(period_type),
        period,
        comment,
        ..Default::default()
    }
}

/// A pprof location's identity: mapping id, address, and its lines as (function id, line),
/// innermost first.
type LocationKey = (u64, u64, Vec<(u64, i64)>);

/// Shapes a pprof for Go's profile-guided optimization, as Pyroscope's `GoPGO` stack-trace
/// selector asks: each sample keeps its `keep_locations` leaf-most locations (all with 0), and
/// with `aggregate_callees` its leaf location's innermost line number is dropped, so the
/// samples of one callee aggregate whatever line they were at (their callers keep theirs).
/// Samples made identical are merged.
pub fn apply_go_pgo(profile: &mut proto::Profile, keep_locations: u32, aggregate_callees: bool) {
    let keep = usize::try_from(keep_locations).unwrap_or(usize::MAX);
    // A location's identity, to find the one a leaf becomes without its line number.
    let key_of = |location: &proto::Location| -> LocationKey {
        (
            location.mapping_id,
            location.address,
            location
                .line
                .iter()
                .map(|l| (l.function_id, l.line))
                .collect(),
        )
    };
    let mut by_key: HashMap<LocationKey, u64> = profile
        .location
        .iter()
        .map(|location| (key_of(location), location.id))
        .collect();
    let index_of: HashMap<u64, usize> = profile
        .location
        .iter()
        .enumerate()
        .map(|(index, location)| (location.id, index))
        .collect();
    // Leaf location id → the same without its innermost line number.
    let mut as_leaf: HashMap<u64, u64> = HashMap::new();
    // (locations, labels as (key, str, num, unit)) → index in `samples`.
    type SampleKey = (Vec<u64>, Vec<(i64, i64, i64, i64)>);
    let mut merged: HashMap<SampleKey, usize> = HashMap::new();
    let mut samples: Vec<proto::Sample> = Vec::new();
    for mut sample in std::mem::take(&mut profile.sample) {
        if keep > 0 {
            sample.location_id.truncate(keep);
        }
        if aggregate_callees && let Some(leaf) = sample.location_id.first_mut() {
            let id = *leaf;
            *leaf = *as_leaf.entry(id).or_insert_with(|| {
                let Some(&index) = index_of.get(&id) else {
                    return id;
                };
                let mut location = profile.location[index].clone();
                match location.line.first_mut() {
                    Some(line) if line.line != 0 => line.line = 0,
                    _ => return id,
                }
                let next_id = profile.location.len() as u64 + 1;
                *by_key.entry(key_of(&location)).or_insert_with(|| {
                    location.id = next_id;
                    profile.location.push(location);
                    next_id
                })
            });
        }
        let labels = sample
            .label
            .iter()
            .map(|l| (l.key, l.str, l.num, l.num_unit));
        let key = (sample.location_id.clone(), labels.collect());
        match merged.get(&key) {
            Some(&index) => {
                let into = &mut samples[index].value;
                for (sum, value) in into.iter_mut().zip(&sample.value) {
                    *sum = sum.saturating_add(*value);
                }
            }
            None => {
                merged.insert(key, samples.len());
                samples.push(sample);
            }
        }
    }
    profile.sample = samples;
}

/// The tables of a pprof being written, each entry once.
#[derive(Default)]
struct PprofBuilder {
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<proto::Function>,
    /// (name, system name, file, start line) → function id.
    function_ids: HashMap<(i64, i64, i64, i64), u64>,
    locations: Vec<proto::Location>,
    location_ids: HashMap<LocationKey, u64>,
    mappings: Vec<proto::Mapping>,
    /// (file, build id) → mapping id.
    mapping_ids: HashMap<(i64, i64), u64>,
}

impl PprofBuilder {
    fn string(&mut self, s: &str) -> i64 {
        if s.is_empty() {
            return 0;
        }
        if let Some(&id) = self.string_ids.get(s) {
            return id;
        }
        self.strings.push(s.to_owned());
        let id = self.strings.len() as i64 - 1;
        self.string_ids.insert(s.to_owned(), id);
        id
    }

    fn optional(&mut self, s: Option<&Arc<str>>) -> i64 {
        s.map_or(0, |s| self.string(s))
    }

    fn value_type(&mut self, r#type: &str, unit: &str) -> proto::ValueType {
        proto::ValueType {
            r#type: self.string(r#type),
            unit: self.string(unit),
        }
    }

    fn function(
        &mut self,
        name: &str,
        system_name: Option<&Arc<str>>,
        file: i64,
        start: u32,
    ) -> u64 {
        let name = self.string(name);
        // Like Go's runtime, repeat the name when there is no distinct raw name.
        let system_name = system_name.map_or(name, |s| self.string(s));
        let key = (name, system_name, file, i64::from(start));
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        self.functions.push(proto::Function {
            id,
            name,
            system_name,
            filename: file,
            start_line: i64::from(start),
        });
        self.function_ids.insert(key, id);
        id
    }

    /// The location whose innermost line is `node`'s frame: with the frames it was inlined
    /// into (its ancestors while `inlined`); returns its id and the node above it.
    fn location(&mut self, tree: &MergedTree, node: u32) -> (u64, u32) {
        let tree_node = &tree.nodes[node as usize];
        let Some(frame) = tree.frames.get(tree_node.frame as usize) else {
            // Merged by name: the name is all there is.
            let name = &tree.names[tree_node.name as usize];
            let function = self.function(name, None, 0, 0);
            return (
                self.location_of(0, 0, vec![(function, 0)]),
                tree_node.parent,
            );
        };
        let mut lines = Vec::new();
        let mut has_lines = false;
        let (mut current, mut outermost) = (node, frame);
        loop {
            let file = self.optional(outermost.file.as_ref());
            let function = self.function(
                &outermost.name,
                outermost.system_name.as_ref(),
                file,
                outermost.start_line,
            );
            lines.push((function, i64::from(outermost.line)));
            has_lines |= outermost.line != 0;
            let parent = tree.nodes[current as usize].parent;
            match tree.frames.get(tree.nodes[parent as usize].frame as usize) {
                Some(caller) if outermost.inlined && parent != 0 => {
                    (current, outermost) = (parent, caller);
                }
                _ => break,
            }
        }
        let mapping = match &outermost.object {
            Some(object) => {
                let key = (
                    self.string(object),
                    self.optional(outermost.build_id.as_ref()),
                );
                let id = match self.mapping_ids.get(&key) {
                    Some(&id) => id,
                    None => {
                        let id = self.mappings.len() as u64 + 1;
                        // Addresses are offsets in the file: the mapping starts at 0.
                        self.mappings.push(proto::Mapping {
                            id,
                            filename: key.0,
                            build_id: key.1,
                            ..Default::default()
                        });
                        self.mapping_ids.insert(key, id);
                        id
                    }
                };
                let mapping = &mut self.mappings[id as usize - 1];
                mapping.memory_limit = mapping
                    .memory_limit
                    .max(outermost.address.saturating_add(1));
                mapping.has_functions = true;
                mapping.has_filenames |= outermost.file.is_some();
                mapping.has_line_numbers |= has_lines;
                mapping.has_inline_frames |= lines.len() > 1;
                id
            }
            None => 0,
        };
        let parent = tree.nodes[current as usize].parent;
        (self.location_of(mapping, outermost.address, lines), parent)
    }

    fn location_of(&mut self, mapping_id: u64, address: u64, lines: Vec<(u64, i64)>) -> u64 {
        let key = (mapping_id, address, lines);
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(proto::Location {
            id,
            mapping_id,
            address,
            line: key
                .2
                .iter()
                .map(|&(function_id, line)| proto::Line {
                    function_id,
                    line,
                    column: 0,
                })
                .collect(),
            is_folded: false,
        });
        self.location_ids.insert(key, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::query::{NO_FRAME, TreeNode};

    /// total(10) → a(6, self 1) → b(5); total → c(4, self 4).
    fn tree() -> MergedTree {
        let node = |name, parent, self_value, total, children: Vec<u32>| TreeNode {
            name,
            frame: NO_FRAME,
            parent,
            self_value,
            total,
            children,
        };
        MergedTree {
            names: vec!["total".into(), "a".into(), "b".into(), "c".into()],
            nodes: vec![
                node(0, u32::MAX, 0, 10, vec![3, 1]),
                node(1, 0, 1, 6, vec![2]),
                node(2, 1, 5, 5, vec![]),
                node(3, 0, 4, 4, vec![]),
            ],
            frames: Vec::new(),
            period: Period::Unknown,
            ..Default::default()
        }
    }

    #[test]
    fn flamegraph_levels_follow_the_pyroscope_encoding() {
        let graph = flamegraph(&tree(), 100);
        assert_eq!(graph.names, vec!["total", "a", "b", "c"]);
        assert_eq!(graph.total, 10);
        assert_eq!(graph.max_self, 5);
        let levels: Vec<Vec<i64>> = graph.levels.iter().map(|l| l.values.clone()).collect();
        assert_eq!(
            levels,
            vec![
                vec![0, 10, 0, 0],
                // a at x=0 (6 wide), c right after it.
                vec![0, 6, 1, 1, 0, 4, 4, 3],
                // b at x = 0 + a's self (1).
                vec![1, 5, 5, 2],
            ]
        );
    }

    #[test]
    fn small_nodes_fold_into_other() {
        let graph = flamegraph(&tree(), 2);
        // a (6) and b (5) are the two largest; c (4) becomes `other`.
        assert!(
            graph.names.contains(&"other".to_owned()),
            "{:?}",
            graph.names
        );
        assert!(!graph.names.contains(&"c".to_owned()));
        assert_eq!(
            graph.levels[1]
                .values
                .iter()
                .skip(1)
                .step_by(4)
                .sum::<i64>(),
            10
        );
    }

    #[test]
    fn diff_carries_both_sides() {
        let mut right = tree();
        right.nodes[3].self_value = 8;
        right.nodes[3].total = 8;
        right.nodes[0].total = 14;
        let diff = flamegraph_diff(&tree(), &right, 100);
        assert_eq!(
            (diff.left_ticks, diff.right_ticks, diff.total),
            (10, 14, 24)
        );
        let c = diff.names.iter().position(|n| n == "c").unwrap() as i64;
        let level1 = &diff.levels[1].values;
        let c_tuple = level1.chunks(7).find(|t| t[6] == c).unwrap();
        assert_eq!((c_tuple[1], c_tuple[4]), (4, 8));
    }

    /// A pprof's samples as (stack of locations leaf first, value) summed per stack, each
    /// location as (object, build id, address in the object, lines as (name, system name, file,
    /// start line, line)).
    type Location = (String, String, u64, Vec<(String, String, String, i64, i64)>);

    /// A stack and the sample's numeric labels (key, value), sorted.
    type LabelledStack = (Vec<Location>, Vec<(String, i64)>);

    /// ... keyed also by the sample's numeric labels.
    fn stacks_of(pprof: &proto::Profile, sample_type: &str) -> HashMap<LabelledStack, i64> {
        let text = |i: i64| pprof.string_table[i as usize].clone();
        let value = pprof
            .sample_type
            .iter()
            .position(|t| text(t.r#type) == sample_type)
            .unwrap();
        let location = |id: u64| {
            let location = pprof.location.iter().find(|l| l.id == id).unwrap();
            let mapping = pprof.mapping.iter().find(|m| m.id == location.mapping_id);
            let address = mapping.map_or(0, |m| location.address - m.memory_start + m.file_offset);
            let lines = location
                .line
                .iter()
                .map(|line| {
                    let f = pprof
                        .function
                        .iter()
                        .find(|f| f.id == line.function_id)
                        .unwrap();
                    (
                        text(f.name),
                        text(f.system_name),
                        text(f.filename),
                        f.start_line,
                        line.line,
                    )
                })
                .collect();
            (
                mapping.map_or(String::new(), |m| text(m.filename)),
                mapping.map_or(String::new(), |m| text(m.build_id)),
                address,
                lines,
            )
        };
        let mut out = HashMap::new();
        for sample in &pprof.sample {
            let stack = sample.location_id.iter().map(|&id| location(id)).collect();
            let mut numeric: Vec<(String, i64)> = sample
                .label
                .iter()
                .filter(|l| l.str == 0)
                .map(|l| (text(l.key), l.num))
                .collect();
            numeric.sort();
            *out.entry((stack, numeric)).or_default() += sample.value[value];
        }
        out
    }

    #[test]
    fn a_stored_agent_profile_downloads_with_everything_it_had() {
        let original = crate::export::pprof::build_pprof(&crate::export::test_fixture::profile());
        let dir = tempfile::tempdir().unwrap();
        let store =
            crate::store::Store::open(crate::store::StoreSettings::new(dir.path())).unwrap();
        let labels = vec![("service_name".to_owned(), "app".to_owned())];
        let profiles =
            crate::store::ingest::profiles_from_pprof(&original, "process_cpu", &labels, 0)
                .unwrap();
        store.ingest(&profiles).unwrap();
        let profile_type =
            ProfileType::parse("process_cpu:cpu:nanoseconds:cpu:nanoseconds").unwrap();
        let selection = crate::store::query::Selection::new(
            profile_type.id(),
            crate::store::selector::Selector::parse("{}").unwrap(),
            0,
            i64::MAX,
        );
        let tree = store.merge_with_frames(&selection).unwrap();
        let downloaded = pprof(&tree, &profile_type, 0, 1);
        crate::store::ingest::validate_pprof(&downloaded).unwrap();

        let expected = stacks_of(&original, "cpu");
        let got = stacks_of(&downloaded, "cpu");
        assert_eq!(got, expected);
        assert_eq!(downloaded.period, crate::export::test_fixture::PERIOD_NS);
        // The inlined function and the one it was inlined into are one location, as sent.
        assert!(
            downloaded.location.iter().any(|l| l.line.len() == 2),
            "{:?}",
            downloaded.location
        );
        let app = downloaded
            .mapping
            .iter()
            .find(|m| downloaded.string_table[m.filename as usize] == "/usr/bin/myapp")
            .unwrap();
        assert_eq!(
            downloaded.string_table[app.build_id as usize],
            "deadbeef00112233"
        );
        assert!(
            app.has_functions && app.has_filenames && app.has_line_numbers && app.has_inline_frames
        );

        // A merge by name (the flame graph's) still has one node per name path.
        let by_name = store.merge(&selection).unwrap();
        let mains = by_name
            .nodes
            .iter()
            .filter(|n| by_name.names[n.name as usize].as_ref() == "main")
            .count();
        assert_eq!(mains, 1, "main at lines 10 and 12 is one flame graph node");
        assert!(
            tree.nodes
                .iter()
                .filter(|n| tree.names[n.name as usize].as_ref() == "main")
                .count()
                == 2
        );
    }

    #[test]
    fn go_pgo_keeps_leaf_locations_and_drops_the_leaf_line() {
        use crate::{
            export::{pprof::build_pprof, test_fixture::*},
            model::ProfileSample,
        };
        let sample = |stack: Vec<u32>, count| ProfileSample {
            stack,
            count,
            more_values: Vec::new(),
            labels: Vec::new(),
        };
        let mut model = profile();
        // The first two differ only above their leaf location.
        model.samples = vec![
            sample(vec![INLINED, MAIN, ROOT], 5),
            sample(vec![INLINED, MAIN_OTHER_LINE, ROOT], 2),
            sample(vec![ODD_NAME, MAIN, ROOT], 1),
        ];
        let totals = |pprof: &proto::Profile| -> Vec<i64> {
            (0..pprof.sample_type.len())
                .map(|i| pprof.sample.iter().map(|s| s.value[i]).sum())
                .collect()
        };
        let original = build_pprof(&model);
        let location = |pprof: &proto::Profile, id: u64| {
            pprof.location.iter().find(|l| l.id == id).unwrap().clone()
        };

        let mut pgo = original.clone();
        apply_go_pgo(&mut pgo, 1, true);
        crate::store::ingest::validate_pprof(&pgo).unwrap();
        assert_eq!(totals(&pgo), totals(&original));
        assert_eq!(pgo.sample.len(), 2, "the two inlined samples merge");
        for sample in &pgo.sample {
            assert_eq!(sample.location_id.len(), 1);
            let leaf = location(&pgo, sample.location_id[0]);
            assert_eq!(leaf.line[0].line, 0, "{leaf:?}");
            // The line of the function the leaf was inlined into stays.
            if leaf.line.len() == 2 {
                assert_eq!(leaf.line[1].line, 7);
            }
        }
        // The callers' location of line 10 is untouched for other uses.
        assert!(
            pgo.location
                .iter()
                .any(|l| l.line.iter().any(|line| line.line == 10))
        );

        let mut callers = original.clone();
        apply_go_pgo(&mut callers, 2, false);
        assert_eq!(totals(&callers), totals(&original));
        assert_eq!(callers.sample.len(), 3);
        for sample in &callers.sample {
            assert_eq!(sample.location_id.len(), 2);
            let leaf = location(&callers, sample.location_id[0]);
            assert_ne!(leaf.line[0].line, 0);
        }
    }

    #[test]
    fn pprof_round_trips_the_stacks() {
        let profile_type =
            ProfileType::parse("process_cpu:cpu:nanoseconds:cpu:nanoseconds").unwrap();
        let pprof = pprof(&tree(), &profile_type, 1, 2);
        crate::store::ingest::validate_pprof(&pprof).unwrap();
        let profiles =
            crate::store::ingest::profiles_from_pprof(&pprof, "process_cpu", &[], 5).unwrap();
        let stacks: Vec<(Vec<&str>, i64)> = profiles[0]
            .stacks
            .iter()
            .map(|(p, v)| {
                (
                    p.iter()
                        .map(|&i| {
                            let frame = profiles[0].frames[i as usize];
                            profiles[0].names[frame.name as usize].as_str()
                        })
                        .collect(),
                    *v,
                )
            })
            .collect();
        assert_eq!(
            stacks,
            vec![(vec!["a"], 1), (vec!["a", "b"], 5), (vec!["c"], 4)]
        );
    }
}
