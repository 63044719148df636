//! Query results in the shapes clients expect: the FlameGraph levels encoding
//! (docs/pyroscope-protocol.md §7.4, §7.5), its diff form, and a pprof of a merged tree.
use std::{collections::HashMap, sync::Arc};

use crate::wire::api::{FlameGraph, FlameGraphDiff, Level};
use crate::{
    store::{ProfileType, query::MergedTree},
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

/// A merged tree as a pprof: one function and location per distinct name, one sample per node
/// with a self value.
pub fn pprof(
    tree: &MergedTree,
    profile_type: &ProfileType,
    start_ns: i64,
    end_ns: i64,
) -> proto::Profile {
    pprof_of_parts(&[(&[][..], tree)], profile_type, start_ns, end_ns, None)
}

/// Call trees with their labels (a series' labels each) as one pprof: one function and location
/// per distinct name over all of them, one sample per node with a self value, carrying its
/// tree's labels as string labels; `comment`, if any, goes into the profile's comments.
pub fn pprof_of_parts(
    parts: &[(&[(String, String)], &MergedTree)],
    profile_type: &ProfileType,
    start_ns: i64,
    end_ns: i64,
    comment: Option<&str>,
) -> proto::Profile {
    let mut strings = vec![String::new()];
    let mut string_ids: HashMap<String, i64> = HashMap::new();
    let mut string = |s: &str, strings: &mut Vec<String>| -> i64 {
        if s.is_empty() {
            return 0;
        }
        *string_ids.entry(s.to_owned()).or_insert_with(|| {
            strings.push(s.to_owned());
            strings.len() as i64 - 1
        })
    };
    let mut value_type = |t: &str, u: &str, strings: &mut Vec<String>| proto::ValueType {
        r#type: string(t, strings),
        unit: string(u, strings),
    };
    let sample_type = value_type(
        &profile_type.sample_type,
        &profile_type.sample_unit,
        &mut strings,
    );
    let period_type = value_type(
        &profile_type.period_type,
        &profile_type.period_unit,
        &mut strings,
    );
    // One function and location per distinct name, over every tree.
    let mut functions = Vec::new();
    let mut locations = Vec::new();
    let mut location_of_name: HashMap<Arc<str>, u64> = HashMap::new();
    let mut samples = Vec::new();
    for (labels, tree) in parts {
        let sample_labels: Vec<proto::Label> = labels
            .iter()
            .filter(|(name, _)| !name.starts_with("__"))
            .map(|(name, value)| proto::Label {
                key: string(name, &mut strings),
                str: string(value, &mut strings),
                ..Default::default()
            })
            .collect();
        let location_ids: Vec<u64> = tree
            .names
            .iter()
            .map(|name| {
                if let Some(&id) = location_of_name.get(name) {
                    return id;
                }
                let id = functions.len() as u64 + 1;
                let name_id = string(name, &mut strings);
                functions.push(proto::Function {
                    id,
                    name: name_id,
                    system_name: name_id,
                    ..Default::default()
                });
                locations.push(proto::Location {
                    id,
                    line: vec![proto::Line {
                        function_id: id,
                        line: 0,
                        column: 0,
                    }],
                    ..Default::default()
                });
                location_of_name.insert(name.clone(), id);
                id
            })
            .collect();
        for (idx, node) in tree.nodes.iter().enumerate().skip(1) {
            if node.self_value == 0 {
                continue;
            }
            let mut location_id = Vec::new();
            let mut current = idx as u32;
            while current != 0 {
                location_id.push(location_ids[tree.nodes[current as usize].name as usize]);
                current = tree.nodes[current as usize].parent;
            }
            samples.push(proto::Sample {
                location_id,
                value: vec![node.self_value],
                label: sample_labels.clone(),
            });
        }
    }
    let comment = comment
        .map(|text| string(text, &mut strings))
        .into_iter()
        .collect();
    proto::Profile {
        sample_type: vec![sample_type],
        sample: samples,
        location: locations,
        function: functions,
        string_table: strings,
        time_nanos: start_ns,
        duration_nanos: end_ns.saturating_sub(start_ns).max(0),
        period_type: Some(period_type),
        period: 1,
        comment,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::query::TreeNode;

    /// total(10) → a(6, self 1) → b(5); total → c(4, self 4).
    fn tree() -> MergedTree {
        let node = |name, parent, self_value, total, children: Vec<u32>| TreeNode {
            name,
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
                        .map(|&i| profiles[0].names[i as usize].as_str())
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
