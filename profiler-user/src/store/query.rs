//! Reading the store: merged call trees, time series of totals, label names and values.
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt};
use rusqlite::{Connection, OptionalExtension};

use super::{
    Catalog, SeriesInfo, Store, StoreError, codec,
    frames::{self, Frame, NO_STRING},
    selector::Selector,
};

/// Sealed names read from disk at once (a power of two): the aligned run around the one asked.
const SEALED_NAMES_READ_TOGETHER: u32 = 256;

/// The frames and names a query reads: the catalog's current generations from memory, sealed
/// ones from disk (their frame block, their row of `names`), each read once per query.
pub(super) struct CatalogReader<'a> {
    catalog: &'a Catalog,
    conn: &'a Connection,
    sealed_frames: HashMap<u32, Frame>,
    sealed_names: HashMap<u32, Arc<str>>,
}

impl<'a> CatalogReader<'a> {
    pub(super) fn new(catalog: &'a Catalog, conn: &'a Connection) -> Self {
        CatalogReader {
            catalog,
            conn,
            sealed_frames: HashMap::new(),
            sealed_names: HashMap::new(),
        }
    }

    /// Frame `id`; `None` for an id never given out.
    fn frame(&mut self, id: u32) -> Result<Option<Frame>, StoreError> {
        if id >= self.catalog.sealed_frames {
            return Ok(self.catalog.frame(id));
        }
        if let Some(frame) = self.sealed_frames.get(&id) {
            return Ok(Some(*frame));
        }
        // The block that holds it: the last one starting at or before it.
        let block: Option<(i64, Vec<u8>)> = self
            .conn
            .prepare_cached(
                "SELECT first_id, frames FROM frame_blocks WHERE first_id <= ? \
                 ORDER BY first_id DESC LIMIT 1",
            )?
            .query_row([i64::from(id)], |row| Ok((row.get(0)?, row.get(1)?)))
            .optional()?;
        let Some((first, block)) = block else {
            return Ok(None);
        };
        let mut next = first as u32;
        let cache = &mut self.sealed_frames;
        frames::decode_frames(&block, |frame| {
            cache.insert(next, frame);
            next = next.wrapping_add(1);
        })?;
        Ok(self.sealed_frames.get(&id).copied())
    }

    /// Name `id`; `None` for an id never given out.
    fn name(&mut self, id: u32) -> Result<Option<Arc<str>>, StoreError> {
        if id >= self.catalog.sealed_names {
            return Ok(self.catalog.name(id).cloned());
        }
        if let Some(name) = self.sealed_names.get(&id) {
            return Ok(Some(name.clone()));
        }
        // Its neighbours too: a write's names have consecutive ids, and its frames use them.
        let first = id & !(SEALED_NAMES_READ_TOGETHER - 1);
        let end = (first + SEALED_NAMES_READ_TOGETHER).min(self.catalog.sealed_names);
        let mut stmt = self
            .conn
            .prepare_cached("SELECT id, name FROM names WHERE id >= ? AND id < ?")?;
        let mut rows = stmt.query([i64::from(first), i64::from(end)])?;
        while let Some(row) = rows.next()? {
            let (read, name): (u32, String) = (row.get(0)?, row.get(1)?);
            self.sealed_names.entry(read).or_insert_with(|| name.into());
        }
        Ok(self.sealed_names.get(&id).cloned())
    }

    /// The function name of frame `id`.
    fn name_of_frame(&mut self, id: u32) -> Result<Option<Arc<str>>, StoreError> {
        match self.frame(id)? {
            Some(frame) => self.name(frame.name),
            None => Ok(None),
        }
    }
}

/// Which profiles a query reads: one profile type, a label selector, a time range (ns, inclusive).
#[derive(Clone, Debug)]
pub struct Selection {
    pub profile_type: String,
    pub selector: Selector,
    pub start_ns: i64,
    pub end_ns: i64,
    /// Only stacks that start (root first) with these function names count, as Pyroscope's
    /// `stack_trace_selector.call_site` selects them; empty: every stack.
    pub call_site: Vec<String>,
    /// Only samples of the spans it selects count (`SelectMergeSpanProfile`, span and trace
    /// id selectors); `None`: every sample, with or without a span.
    pub spans: Option<SpanSelection>,
}

/// Which spans' samples a selection reads: a span counts when its id is in `span_ids` and its
/// trace id in `trace_ids`, each list checked only when given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpanSelection {
    /// Sorted, no duplicates.
    pub span_ids: Option<Vec<u64>>,
    /// Lower case, sorted, no duplicates.
    pub trace_ids: Option<Vec<String>>,
}

impl SpanSelection {
    fn selects(&self, span: codec::SpanHeader<'_>) -> bool {
        self.span_ids
            .as_ref()
            .is_none_or(|ids| ids.binary_search(&span.span_id).is_ok())
            && self.trace_ids.as_ref().is_none_or(|ids| {
                ids.binary_search_by(|id| cmp_ignoring_case(id, span.trace_id))
                    .is_ok()
            })
    }
}

fn cmp_ignoring_case(lower: &str, other: &str) -> std::cmp::Ordering {
    lower
        .bytes()
        .cmp(other.bytes().map(|b| b.to_ascii_lowercase()))
}

impl Selection {
    /// Every stack of `profile_type` matching `selector` in `[start_ns, end_ns]`.
    pub fn new(profile_type: String, selector: Selector, start_ns: i64, end_ns: i64) -> Self {
        Selection {
            profile_type,
            selector,
            start_ns,
            end_ns,
            call_site: Vec::new(),
            spans: None,
        }
    }

    /// Only the samples of `span_ids` (duplicates allowed); with span ids selected already,
    /// only those in both lists.
    pub fn with_spans(mut self, mut span_ids: Vec<u64>) -> Self {
        let spans = self.spans.get_or_insert_with(SpanSelection::default);
        if let Some(before) = &spans.span_ids {
            span_ids.retain(|id| before.binary_search(id).is_ok());
        }
        span_ids.sort_unstable();
        span_ids.dedup();
        spans.span_ids = Some(span_ids);
        self
    }

    /// Only the samples of spans of these traces (hex, any case; duplicates allowed).
    pub fn with_traces(mut self, trace_ids: &[String]) -> Self {
        let mut trace_ids: Vec<String> =
            trace_ids.iter().map(|id| id.to_ascii_lowercase()).collect();
        trace_ids.sort_unstable();
        trace_ids.dedup();
        self.spans
            .get_or_insert_with(SpanSelection::default)
            .trace_ids = Some(trace_ids);
        self
    }
}

/// One stored profile as a query reads it: all its stacks, or the samples of the selected
/// spans only.
#[derive(Clone, Copy)]
pub(crate) struct ProfileEntries<'a> {
    blob: &'a [u8],
    spans: Option<&'a SpanSelection>,
}

impl ProfileEntries<'_> {
    /// Calls `add(node, value)` for every selected entry.
    pub(crate) fn for_each(&self, add: impl FnMut(u32, i64)) -> Result<(), codec::CorruptProfile> {
        match self.spans {
            None => codec::decode(self.blob, add),
            Some(spans) => codec::decode_spans(self.blob, |span| spans.selects(span), add),
        }
    }

    /// Bytes stored (the stacks, or the whole span blob).
    pub(crate) fn stored_bytes(&self) -> usize {
        self.blob.len()
    }
}

/// Calls `f` with the time and entries of every profile of series `series_id` in the
/// selection's time range, oldest first (with a span selection, only profiles with spans).
fn for_each_profile(
    conn: &rusqlite::Connection,
    selection: &Selection,
    series_id: i64,
    f: impl FnMut(i64, ProfileEntries<'_>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    for_each_profile_with_extras(conn, selection, series_id, false, |_| Ok(()), f)
}

/// What [`for_each_profile_with_extras`] reads besides the entries.
#[derive(Clone, Copy)]
struct ProfileExtras<'a> {
    /// The sampling period, 0 when unknown.
    period: i64,
    /// The numeric-label blob ([`codec::encode_labelled`]), when asked for and present.
    labelled: Option<&'a [u8]>,
}

/// [`for_each_profile`], also giving `extras` each profile's period and, `with_labelled`,
/// its numeric-label blob.
fn for_each_profile_with_extras(
    conn: &rusqlite::Connection,
    selection: &Selection,
    series_id: i64,
    with_labelled: bool,
    mut extras: impl FnMut(ProfileExtras<'_>) -> Result<(), StoreError>,
    mut f: impl FnMut(i64, ProfileEntries<'_>) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut stmt = conn.prepare_cached(match (selection.spans.is_some(), with_labelled) {
        (true, _) => {
            "SELECT time_ns, spans, period, NULL FROM profiles WHERE series_id = ? \
             AND time_ns >= ? AND time_ns <= ? AND spans IS NOT NULL ORDER BY time_ns"
        }
        (false, false) => {
            "SELECT time_ns, stacks, period, NULL FROM profiles WHERE series_id = ? \
             AND time_ns >= ? AND time_ns <= ? ORDER BY time_ns"
        }
        (false, true) => {
            "SELECT time_ns, stacks, period, labelled FROM profiles WHERE series_id = ? \
             AND time_ns >= ? AND time_ns <= ? ORDER BY time_ns"
        }
    })?;
    let mut rows = stmt.query(rusqlite::params![
        series_id,
        selection.start_ns,
        selection.end_ns
    ])?;
    while let Some(row) = rows.next()? {
        let time_ns: i64 = row.get(0)?;
        let blob = row.get_ref(1)?.as_blob().map_err(rusqlite::Error::from)?;
        let labelled = row
            .get_ref(3)?
            .as_blob_or_null()
            .map_err(rusqlite::Error::from)?;
        extras(ProfileExtras {
            period: row.get::<_, Option<i64>>(2)?.unwrap_or(0),
            labelled,
        })?;
        f(
            time_ns,
            ProfileEntries {
                blob,
                spans: selection.spans.as_ref(),
            },
        )?;
    }
    Ok(())
}

/// Which nodes of a stack space lie at or below a call site (root-first function names): a
/// node is in when the names of its path from the root start with the whole call site. Names
/// are compared as text: a name has a new id in each generation of the catalog. Parents come
/// before their children in a space, so one pass decides every node.
fn nodes_under_call_site(
    reader: &mut CatalogReader<'_>,
    nodes: &[(u32, u32)],
    call_site: &[String],
) -> Result<Vec<bool>, StoreError> {
    // Per node: how many names of the call site its path matches so far; `None`: it left it.
    let mut matched: Vec<Option<usize>> = vec![None; nodes.len()];
    let mut under = vec![false; nodes.len()];
    if nodes.is_empty() {
        return Ok(under);
    }
    matched[0] = Some(0);
    under[0] = call_site.is_empty();
    for idx in 1..nodes.len() {
        let (parent, frame) = nodes[idx];
        let parent = parent as usize;
        if under.get(parent).copied().unwrap_or(false) {
            under[idx] = true;
            continue;
        }
        let Some(depth) = matched.get(parent).copied().flatten() else {
            continue;
        };
        let Some(wanted) = call_site.get(depth) else {
            continue;
        };
        if reader
            .name_of_frame(frame)?
            .is_some_and(|name| *name == **wanted)
        {
            matched[idx] = Some(depth + 1);
            under[idx] = depth + 1 == call_site.len();
        }
    }
    Ok(under)
}

/// What a selection reads ([`Store::analyze`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryAnalysis {
    pub series: u64,
    /// Stack spaces (the store's unit of shared stacks) the series use.
    pub spaces: u64,
    pub profiles: u64,
    /// Stacks with a value, over the profiles read.
    pub stack_entries: u64,
    pub profile_bytes: u64,
    /// Bytes of every stored profile in the time range, of any series.
    pub bytes_in_range: u64,
}

/// A series and the (time ns, total) of its selected profiles.
pub type SeriesTotals = (SeriesInfo, Vec<(i64, i64)>);

/// A merged call tree: node 0 is the root (`total`), parents come before their children.
/// Siblings are merged by name, or, for downloads ([`Store::merge_with_frames`]), only when
/// they are the same frame (name, file, line, object, address).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MergedTree {
    pub names: Vec<Arc<str>>,
    pub nodes: Vec<TreeNode>,
    /// The frames of the nodes, when merged by frame; else empty.
    pub frames: Vec<FrameDetail>,
    pub period: Period,
    /// When merged by frame: the part of nodes' self values that had numeric labels (the
    /// agent's `pid`, `tid`), as (node, index in `label_groups`, value), sorted.
    pub labelled: Vec<(u32, u32, i64)>,
    pub label_groups: Vec<Vec<(Arc<str>, i64)>>,
    /// More than [`MAX_LABEL_GROUPS`] sets were met: the further ones are not in `labelled`.
    pub label_groups_capped: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeNode {
    /// Index into `MergedTree::names`.
    pub name: u32,
    /// Index into `MergedTree::frames`; [`NO_FRAME`] when merged by name, and for the root.
    pub frame: u32,
    pub parent: u32,
    pub self_value: i64,
    pub total: i64,
    pub children: Vec<u32>,
}

/// A [`TreeNode`] without a frame.
pub const NO_FRAME: u32 = u32::MAX;

/// Distinct sets of numeric labels a download keeps apart; samples of further sets keep only
/// their series labels (and the download says so).
pub const MAX_LABEL_GROUPS: usize = 10_000;

/// The numeric-label sets met while merging, each once.
#[derive(Default)]
struct LabelGroups {
    sets: Vec<Vec<(Arc<str>, i64)>>,
    ids: HashMap<Vec<(Arc<str>, i64)>, u32>,
    capped: bool,
}

impl LabelGroups {
    /// Adds a profile's numeric-label blob: each group's entries into `values` by (node,
    /// index of its set).
    fn read(
        &mut self,
        blob: &[u8],
        values: &mut HashMap<(u32, u32), i64>,
    ) -> Result<(), StoreError> {
        // The group whose entries follow, set by the first closure and read by the second.
        let current: std::cell::Cell<Option<u32>> = std::cell::Cell::new(None);
        codec::decode_labelled(
            blob,
            |labels| {
                let set: Vec<(Arc<str>, i64)> =
                    labels.iter().map(|&(k, v)| (Arc::from(k), v)).collect();
                current.set(match self.ids.get(&set) {
                    Some(&id) => Some(id),
                    None if self.sets.len() < MAX_LABEL_GROUPS => {
                        let id = self.sets.len() as u32;
                        self.ids.insert(set.clone(), id);
                        self.sets.push(set);
                        Some(id)
                    }
                    None => {
                        self.capped = true;
                        None
                    }
                });
            },
            |node, value| {
                if let Some(group) = current.get() {
                    let sum = values.entry((node, group)).or_default();
                    *sum = sum.saturating_add(value);
                }
            },
        )?;
        Ok(())
    }
}

/// A frame with its strings, as a download shows it ([`super::frames`] says what is kept).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FrameDetail {
    pub name: Arc<str>,
    /// The raw (mangled) name when it differs from `name`.
    pub system_name: Option<Arc<str>>,
    pub file: Option<Arc<str>>,
    pub start_line: u32,
    pub line: u32,
    /// The object file of the code and its build id.
    pub object: Option<Arc<str>>,
    pub build_id: Option<Arc<str>>,
    /// Offset in `object`; 0 when unknown.
    pub address: u64,
    /// Inlined into its parent node's frame: both are lines of one pprof location.
    pub inlined: bool,
}

/// The sampling period of the profiles a tree was merged from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Period {
    /// No profile said (folded text, stores from before periods were kept).
    #[default]
    Unknown,
    /// Every profile that said had this one.
    Known(i64),
    /// Profiles with different periods were merged.
    Mixed,
}

impl Period {
    /// The period of a merge of profiles with `self` and with `other`.
    pub fn and(self, other: Period) -> Period {
        match (self, other) {
            (Period::Unknown, other) | (other, Period::Unknown) => other,
            (Period::Known(a), Period::Known(b)) if a == b => Period::Known(a),
            _ => Period::Mixed,
        }
    }

    fn of(period: i64) -> Period {
        if period > 0 {
            Period::Known(period)
        } else {
            Period::Unknown
        }
    }
}

impl MergedTree {
    fn new() -> MergedTree {
        MergedTree {
            names: vec!["total".into()],
            nodes: vec![TreeNode {
                name: 0,
                frame: NO_FRAME,
                parent: u32::MAX,
                self_value: 0,
                total: 0,
                children: Vec::new(),
            }],
            frames: Vec::new(),
            period: Period::Unknown,
            labelled: Vec::new(),
            label_groups: Vec::new(),
            label_groups_capped: false,
        }
    }

    pub fn total(&self) -> i64 {
        self.nodes.first().map_or(0, |n| n.total)
    }

    pub fn name_of(&self, node: u32) -> &str {
        &self.names[self.nodes[node as usize].name as usize]
    }

    /// Function names root first, for the stack ending at `node` (without the root).
    pub fn path(&self, mut node: u32) -> Vec<&str> {
        let mut out = Vec::new();
        while node != 0 {
            out.push(self.name_of(node));
            node = self.nodes[node as usize].parent;
        }
        out.reverse();
        out
    }

    /// Every stack with a self value, as root-first names joined by `;`, for tests and tools.
    pub fn folded(&self) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = (1..self.nodes.len() as u32)
            .filter(|&n| self.nodes[n as usize].self_value != 0)
            .map(|n| (self.path(n).join(";"), self.nodes[n as usize].self_value))
            .collect();
        out.sort();
        out
    }
}

/// How a [`TreeBuilder`] merges siblings.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MergeBy {
    Name,
    Frame,
}

/// Builds a [`MergedTree`] from several stack spaces, merging nodes with the same path of
/// names (or of frames). Names and frames are merged by what they say, not by id: the same
/// string or frame has a new id in each generation of the catalog.
struct TreeBuilder {
    tree: MergedTree,
    merge_by: MergeBy,
    /// Store name id → index in the tree's names.
    name_ids: HashMap<u32, u32>,
    /// Name → index in the tree's names.
    name_indexes: HashMap<Arc<str>, u32>,
    /// Store frame id → index in the tree's frames, when merging by frame.
    frame_ids: HashMap<u32, u32>,
    /// Frame → index in the tree's frames, when merging by frame.
    frame_indexes: HashMap<FrameDetail, u32>,
    /// (parent, name or frame index) → child.
    children: HashMap<(u32, u32), u32>,
}

impl TreeBuilder {
    fn new(merge_by: MergeBy) -> TreeBuilder {
        TreeBuilder {
            tree: MergedTree::new(),
            merge_by,
            name_ids: HashMap::new(),
            name_indexes: HashMap::new(),
            frame_ids: HashMap::new(),
            frame_indexes: HashMap::new(),
            children: HashMap::new(),
        }
    }

    /// The child of `parent` for the store's frame `frame_id`; `None` for an unknown frame.
    fn child(
        &mut self,
        reader: &mut CatalogReader<'_>,
        parent: u32,
        frame_id: u32,
    ) -> Result<Option<u32>, StoreError> {
        let Some(frame) = reader.frame(frame_id)? else {
            return Ok(None);
        };
        let name_id = match self.name_ids.get(&frame.name) {
            Some(&id) => id,
            None => {
                let Some(name) = reader.name(frame.name)? else {
                    return Ok(None);
                };
                let next = self.tree.names.len() as u32;
                let id = *self.name_indexes.entry(name.clone()).or_insert(next);
                if id == next {
                    self.tree.names.push(name);
                }
                self.name_ids.insert(frame.name, id);
                id
            }
        };
        let frame_index = match self.merge_by {
            MergeBy::Name => NO_FRAME,
            MergeBy::Frame => match self.frame_ids.get(&frame_id) {
                Some(&index) => index,
                None => {
                    let mut optional = |id: u32| {
                        if id == NO_STRING {
                            Ok(None)
                        } else {
                            reader.name(id)
                        }
                    };
                    let Frame {
                        start_line,
                        line,
                        address,
                        inlined,
                        ..
                    } = frame;
                    let detail = FrameDetail {
                        name: self.tree.names[name_id as usize].clone(),
                        system_name: optional(frame.system_name)?,
                        file: optional(frame.file)?,
                        start_line,
                        line,
                        object: optional(frame.object)?,
                        build_id: optional(frame.build_id)?,
                        address,
                        inlined,
                    };
                    let next = self.tree.frames.len() as u32;
                    let index = match self.frame_indexes.get(&detail) {
                        Some(&index) => index,
                        None => {
                            self.frame_indexes.insert(detail.clone(), next);
                            self.tree.frames.push(detail);
                            next
                        }
                    };
                    self.frame_ids.insert(frame_id, index);
                    index
                }
            },
        };
        let key = match self.merge_by {
            MergeBy::Name => name_id,
            MergeBy::Frame => frame_index,
        };
        Ok(Some(*self.children.entry((parent, key)).or_insert_with(
            || {
                let id = self.tree.nodes.len() as u32;
                self.tree.nodes.push(TreeNode {
                    name: name_id,
                    frame: frame_index,
                    parent,
                    self_value: 0,
                    total: 0,
                    children: Vec::new(),
                });
                self.tree.nodes[parent as usize].children.push(id);
                id
            },
        )))
    }

    fn finish(mut self) -> MergedTree {
        let nodes = &mut self.tree.nodes;
        for node in nodes.iter_mut() {
            node.total = node.self_value;
        }
        for idx in (1..nodes.len()).rev() {
            let (parent, total) = (nodes[idx].parent as usize, nodes[idx].total);
            // Saturating: stored values come from clients and may be extreme.
            nodes[parent].total = nodes[parent].total.saturating_add(total);
        }
        self.tree
    }
}

/// Wall-clock time, as Pyroscope's `wall` profiles read: time on a CPU and time off it.
pub const WALL_TYPE: &str = "wall:wall:nanoseconds:wall:nanoseconds";
/// The two profiles a service's wall view is made of when it has no `wall` profile of its own.
pub const CPU_NANOSECONDS_TYPE: &str = "process_cpu:cpu:nanoseconds:cpu:nanoseconds";
pub const OFF_CPU_TYPE: &str = "off_cpu:off_cpu:nanoseconds:off_cpu:nanoseconds";

fn service_of(series: &SeriesInfo) -> Option<&str> {
    series
        .labels
        .iter()
        .find(|(name, _)| name == "service_name")
        .map(|(_, value)| value.as_str())
}

/// The series a `wall` selection reads among `series`: every stored `wall` series, and for a
/// service that has off-CPU profiles and no `wall` profile of its own, its CPU time
/// (`process_cpu` in nanoseconds) and its off-CPU time, which add up to the wall-clock time
/// of its threads (each thread is either running or switched out).
pub fn wall_series(series: Vec<SeriesInfo>) -> Vec<SeriesInfo> {
    use std::collections::HashSet;
    let own_wall: HashSet<String> = series
        .iter()
        .filter(|s| s.profile_type == WALL_TYPE)
        .filter_map(|s| service_of(s).map(str::to_owned))
        .collect();
    let off_cpu: HashSet<String> = series
        .iter()
        .filter(|s| s.profile_type == OFF_CPU_TYPE)
        .filter_map(|s| service_of(s).map(str::to_owned))
        .collect();
    series
        .into_iter()
        .filter(|s| {
            s.profile_type == WALL_TYPE
                || ((s.profile_type == CPU_NANOSECONDS_TYPE || s.profile_type == OFF_CPU_TYPE)
                    && service_of(s)
                        .is_some_and(|name| off_cpu.contains(name) && !own_wall.contains(name)))
        })
        .collect()
}

impl Store {
    /// The series a selection reads (for [`WALL_TYPE`], see [`wall_series`]).
    pub fn select_series(&self, selection: &Selection) -> Vec<SeriesInfo> {
        let in_range = self.series(Some((selection.start_ns, selection.end_ns)));
        let of_type = if selection.profile_type == WALL_TYPE {
            wall_series(in_range)
        } else {
            in_range
                .into_iter()
                .filter(|s| s.profile_type == selection.profile_type)
                .collect()
        };
        of_type
            .into_iter()
            .filter(|s| selection.selector.matches(&s.labels))
            .collect()
    }

    /// Sums every selected profile into one call tree, merged by name.
    pub fn merge(&self, selection: &Selection) -> Result<MergedTree, StoreError> {
        self.merge_of(selection, &self.select_series(selection), MergeBy::Name)
    }

    /// [`Self::merge`] keeping every frame apart (file, line, object, address), for downloads.
    pub fn merge_with_frames(&self, selection: &Selection) -> Result<MergedTree, StoreError> {
        self.merge_of(selection, &self.select_series(selection), MergeBy::Frame)
    }

    /// The selected profiles merged per series, keeping every frame apart: each series with a
    /// non-empty call tree of its own; `None` when more than `max_series` series are selected.
    pub fn merge_each_series(
        &self,
        selection: &Selection,
        max_series: usize,
    ) -> Result<Option<Vec<(SeriesInfo, MergedTree)>>, StoreError> {
        let series = self.select_series(selection);
        if series.len() > max_series {
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(series.len());
        for s in series {
            let tree = self.merge_of(selection, std::slice::from_ref(&s), MergeBy::Frame)?;
            if tree.total() != 0 {
                parts.push((s, tree));
            }
        }
        Ok(Some(parts))
    }

    /// Sums the selected profiles of `series` into one call tree.
    fn merge_of(
        &self,
        selection: &Selection,
        series: &[SeriesInfo],
        merge_by: MergeBy,
    ) -> Result<MergedTree, StoreError> {
        let mut by_space: HashMap<i64, Vec<i64>> = HashMap::new();
        for s in series {
            by_space.entry(s.space).or_default().push(s.id);
        }
        self.check_query_size(by_space.keys())?;
        // Self values per node, one dense vector per stack space.
        let mut sums: Vec<(i64, Vec<i64>)> = Vec::with_capacity(by_space.len());
        let mut period = Period::Unknown;
        // Merged by frame (downloads): the samples with numeric labels too, per space.
        let with_labelled = merge_by == MergeBy::Frame && selection.spans.is_none();
        let mut groups = LabelGroups::default();
        let mut labelled: HashMap<i64, HashMap<(u32, u32), i64>> = HashMap::new();
        self.with_reader(|conn| {
            for (space, series_ids) in &by_space {
                let mut values = vec![0i64; 1024];
                let space_labelled = labelled.entry(*space).or_default();
                for &id in series_ids {
                    let read_extras = |extras: ProfileExtras<'_>| {
                        period = period.and(Period::of(extras.period));
                        if let Some(blob) = extras.labelled {
                            groups.read(blob, space_labelled)?;
                        }
                        Ok(())
                    };
                    for_each_profile_with_extras(
                        conn,
                        selection,
                        id,
                        with_labelled,
                        read_extras,
                        |_, entries| {
                            Ok(entries.for_each(|node, value| {
                                let node = node as usize;
                                if node >= values.len() {
                                    values.resize((node + 1).next_power_of_two(), 0);
                                }
                                values[node] = values[node].saturating_add(value);
                            })?)
                        },
                    )?;
                }
                sums.push((*space, values));
            }
            Ok(())
        })?;

        let mut labelled_out: HashMap<(u32, u32), i64> = HashMap::new();
        let builder = self.with_reader(|conn| {
            let catalog = self.read_catalog();
            let mut reader = CatalogReader::new(&catalog, conn);
            let call_site =
                (!selection.call_site.is_empty()).then_some(selection.call_site.as_slice());
            let mut builder = TreeBuilder::new(merge_by);
            builder.tree.period = period;
            sums.sort_by_key(|(space, _)| *space);
            for (space_id, mut values) in sums {
                let Some(space) = catalog.spaces.get(&space_id) else {
                    continue;
                };
                // Sealed generations are read from disk (under the catalog's read lock: a write
                // waits for this query rather than seal more meanwhile).
                let nodes = space.all_nodes(conn, space_id)?;
                values.resize(nodes.len().max(values.len()), 0);
                let under = call_site
                    .map(|call_site| nodes_under_call_site(&mut reader, &nodes, call_site))
                    .transpose()?;
                if let Some(under) = &under {
                    for (value, under) in values.iter_mut().zip(under) {
                        if !under {
                            *value = 0;
                        }
                    }
                }
                // Subtree totals (children have larger ids than parents), to skip empty branches.
                let mut totals = values.clone();
                for idx in (1..nodes.len()).rev() {
                    let parent = nodes[idx].0 as usize;
                    totals[parent] = totals[parent].saturating_add(totals[idx]);
                }
                let mut mapped = vec![u32::MAX; nodes.len()];
                mapped[0] = 0;
                for idx in 1..nodes.len() {
                    if totals[idx] == 0 {
                        continue;
                    }
                    let (parent, frame) = nodes[idx];
                    let parent_out = mapped[parent as usize];
                    if parent_out == u32::MAX {
                        continue;
                    }
                    let Some(out) = builder.child(&mut reader, parent_out, frame)? else {
                        continue;
                    };
                    mapped[idx] = out;
                    let node = &mut builder.tree.nodes[out as usize];
                    node.self_value = node.self_value.saturating_add(values[idx]);
                }
                let root = &mut builder.tree.nodes[0];
                root.self_value = root.self_value.saturating_add(values[0]);
                for ((node, group), value) in labelled.remove(&space_id).unwrap_or_default() {
                    let node = node as usize;
                    let counted = under.as_ref().is_none_or(|u| u.get(node) == Some(&true));
                    match mapped.get(node) {
                        Some(&out) if out != u32::MAX && counted => {
                            let sum = labelled_out.entry((out, group)).or_default();
                            *sum = sum.saturating_add(value);
                        }
                        _ => {}
                    }
                }
            }
            Ok(builder)
        })?;
        let mut tree = builder.finish();
        tree.labelled = labelled_out
            .into_iter()
            .map(|((node, group), value)| (node, group, value))
            .collect();
        tree.labelled.sort_unstable();
        tree.label_groups = groups.sets;
        tree.label_groups_capped = groups.capped;
        Ok(tree)
    }

    /// What a selection reads: its series, stack spaces, profiles, stack entries and bytes,
    /// and the bytes of every profile in its time range (`AnalyzeQuery`).
    pub fn analyze(&self, selection: &Selection) -> Result<QueryAnalysis, StoreError> {
        let series = self.select_series(selection);
        let spaces: std::collections::HashSet<i64> = series.iter().map(|s| s.space).collect();
        self.with_reader(|conn| {
            let mut analysis = QueryAnalysis {
                series: series.len() as u64,
                spaces: spaces.len() as u64,
                ..QueryAnalysis::default()
            };
            for s in &series {
                for_each_profile(conn, selection, s.id, |_, entries| {
                    analysis.profiles += 1;
                    analysis.profile_bytes += entries.stored_bytes() as u64;
                    Ok(entries.for_each(|_, _| analysis.stack_entries += 1)?)
                })?;
            }
            analysis.bytes_in_range = conn.query_row(
                "SELECT COALESCE(SUM(LENGTH(stacks)), 0) FROM profiles \
                 WHERE time_ns >= ? AND time_ns <= ?",
                rusqlite::params![selection.start_ns, selection.end_ns],
                |row| row.get::<_, i64>(0),
            )? as u64;
            Ok(analysis)
        })
    }

    /// (time ns, total) of every selected profile, per series.
    pub fn totals(&self, selection: &Selection) -> Result<Vec<SeriesTotals>, StoreError> {
        if !selection.call_site.is_empty() || selection.spans.is_some() {
            return self.totals_of_entries(selection);
        }
        let series = self.select_series(selection);
        self.with_reader(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT time_ns, total FROM profiles WHERE series_id = ? AND time_ns >= ? AND time_ns <= ? \
                 ORDER BY time_ns",
            )?;
            let mut out = Vec::with_capacity(series.len());
            for s in series {
                let points = stmt
                    .query_map(rusqlite::params![s.id, selection.start_ns, selection.end_ns], |row| {
                        Ok((row.get(0)?, row.get(1)?))
                    })?
                    .collect::<Result<Vec<_>, _>>()?;
                out.push((s, points));
            }
            Ok(out)
        })
    }

    /// [`Self::totals`] counting only the stacks under the selection's call site, or of its
    /// spans: each profile's entries are read (the stored total covers every stack).
    fn totals_of_entries(&self, selection: &Selection) -> Result<Vec<SeriesTotals>, StoreError> {
        let series = self.select_series(selection);
        // Per stack space: which of its nodes count; read again when a profile has a node
        // added since (ingested meanwhile).
        let mut under: HashMap<i64, Vec<bool>> = HashMap::new();
        let nodes_under = |conn: &rusqlite::Connection, space_id: i64| {
            let catalog = self.read_catalog();
            match catalog.spaces.get(&space_id) {
                Some(space) if !selection.call_site.is_empty() => {
                    let nodes = space.all_nodes(conn, space_id)?;
                    let mut reader = CatalogReader::new(&catalog, conn);
                    nodes_under_call_site(&mut reader, &nodes, &selection.call_site)
                }
                _ => Ok(Vec::new()),
            }
        };
        self.with_reader(|conn| {
            let mut out = Vec::with_capacity(series.len());
            let mut values: Vec<(u32, i64)> = Vec::new();
            for s in series {
                let mut points = Vec::new();
                for_each_profile(conn, selection, s.id, |time_ns, entries| {
                    if selection.call_site.is_empty() {
                        let mut total = 0i64;
                        entries.for_each(|_, value| total = total.saturating_add(value))?;
                        points.push((time_ns, total));
                        return Ok(());
                    }
                    values.clear();
                    entries.for_each(|node, value| values.push((node, value)))?;
                    let highest = values.iter().map(|&(node, _)| node as usize).max();
                    let space_under = match under.entry(s.space) {
                        std::collections::hash_map::Entry::Occupied(known) => known.into_mut(),
                        std::collections::hash_map::Entry::Vacant(new) => {
                            new.insert(nodes_under(conn, s.space)?)
                        }
                    };
                    if highest.is_some_and(|node| node >= space_under.len()) {
                        *space_under = nodes_under(conn, s.space)?;
                    }
                    let total = values
                        .iter()
                        .filter(|&&(node, _)| space_under.get(node as usize) == Some(&true))
                        .fold(0i64, |total, &(_, value)| total.saturating_add(value));
                    points.push((time_ns, total));
                    Ok(())
                })?;
                out.push((s, points));
            }
            Ok(out)
        })
    }

    /// Distinct label names of the series matching any of `selectors` (all series when empty).
    pub fn label_names(&self, selectors: &[Selector], range: Option<(i64, i64)>) -> Vec<String> {
        let mut names: Vec<String> = self
            .matching(selectors, range)
            .flat_map(|s| s.labels.into_iter().map(|(k, _)| k))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Distinct values of label `name` among the series matching any of `selectors`.
    pub fn label_values(
        &self,
        name: &str,
        selectors: &[Selector],
        range: Option<(i64, i64)>,
    ) -> Vec<String> {
        let mut values: Vec<String> = self
            .matching(selectors, range)
            .filter_map(|s| {
                s.labels
                    .into_iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v)
            })
            .collect();
        values.sort();
        values.dedup();
        values
    }

    /// Distinct values of a span's sample label (`span_id` as 16 hex digits, `span_name`,
    /// `trace_id`) in the profiles of the series matching any of `selectors`: these are kept
    /// with the samples, not as series labels, so their values are read from the profiles.
    pub fn span_label_values(
        &self,
        name: &str,
        selectors: &[Selector],
        range: Option<(i64, i64)>,
    ) -> Result<Vec<String>, StoreError> {
        use super::ingest::{SPAN_ID_LABEL, SPAN_NAME_LABEL, TRACE_ID_LABEL};
        if ![SPAN_ID_LABEL, SPAN_NAME_LABEL, TRACE_ID_LABEL].contains(&name) {
            return Ok(Vec::new());
        }
        let series: Vec<SeriesInfo> = self.matching(selectors, range).collect();
        let (start_ns, end_ns) = range.unwrap_or((i64::MIN, i64::MAX));
        let mut values = std::collections::BTreeSet::new();
        self.with_reader(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT spans FROM profiles WHERE series_id = ? AND time_ns >= ? \
                 AND time_ns <= ? AND spans IS NOT NULL",
            )?;
            for s in &series {
                let mut rows = stmt.query(rusqlite::params![s.id, start_ns, end_ns])?;
                while let Some(row) = rows.next()? {
                    let blob = row.get_ref(0)?.as_blob().map_err(rusqlite::Error::from)?;
                    codec::decode_spans(
                        blob,
                        |span| {
                            let value = match name {
                                SPAN_ID_LABEL => format!("{:016x}", span.span_id),
                                SPAN_NAME_LABEL => span.span_name.to_owned(),
                                _ => span.trace_id.to_owned(),
                            };
                            if !value.is_empty() {
                                values.insert(value);
                            }
                            false
                        },
                        |_, _| {},
                    )?;
                }
            }
            Ok(())
        })?;
        Ok(values.into_iter().collect())
    }

    fn matching<'a>(
        &self,
        selectors: &'a [Selector],
        range: Option<(i64, i64)>,
    ) -> impl Iterator<Item = SeriesInfo> + 'a {
        self.series(range).into_iter().filter(move |s| {
            selectors.is_empty() || selectors.iter().any(|sel| sel.matches(&s.labels))
        })
    }
}
