//! The modules of the eBPF crate form no import cycle: `sampler` (the perf-event and lifecycle
//! programs) uses `cuda`, `python` and `user_stack`, which use `shared` (the maps and helpers
//! all programs share), which uses no module of the crate. Read from the sources, so a new
//! `use crate::…` that closes a loop fails here, not in a review. The same for profiler-user:
//! its modules import only the layers below them (docs/architecture.md).
use std::collections::{BTreeMap, BTreeSet};

use integration_tests::workspace_root;

/// The crate's modules each module names (`crate::x`, `crate::{x, y::z}`).
fn module_uses(source: &str) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    let mut rest = source;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The top-level names of the group (nested braces belong to their name).
            let mut depth = 0;
            let mut name = String::new();
            let mut at_start = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if !name.is_empty() {
                            used.insert(std::mem::take(&mut name));
                        }
                        at_start = true;
                    }
                    c if at_start && (c.is_alphanumeric() || c == '_') => name.push(c),
                    // The end of a group's name (`::`, a space): the rest is below it.
                    _ if at_start && !name.is_empty() => {
                        used.insert(std::mem::take(&mut name));
                        at_start = false;
                    }
                    _ => {}
                }
            }
            if !name.is_empty() {
                used.insert(name);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                used.insert(name);
            }
        }
    }
    used
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_ebpf_crates_modules_form_no_cycle() {
    let dir = workspace_root().join("profiler-ebpf/src");
    let mut graph = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).expect("profiler-ebpf/src") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let module = path
            .file_stem()
            .expect("a name")
            .to_string_lossy()
            .into_owned();
        let source = std::fs::read_to_string(&path).expect("the source");
        let mut uses = module_uses(&source);
        uses.remove(&module);
        graph.insert(module, uses);
    }
    assert!(
        graph.get("shared").is_some_and(BTreeSet::is_empty),
        "shared must use no module of the crate: {graph:?}"
    );
    assert_eq!(find_cycle(&graph), None, "{graph:?}");
}

#[test]
fn the_use_parser_sees_groups_and_paths_and_the_cycle_finder_finds_one() {
    let uses = module_uses(
        "use crate::{\n    cuda, python,\n    shared::{A, b},\n    user_stack::{self, R},\n};\n\
         fn f() { crate::sampler::x(); }",
    );
    let names: Vec<&str> = uses.iter().map(String::as_str).collect();
    assert_eq!(names, ["cuda", "python", "sampler", "shared", "user_stack"]);
    let mut graph = BTreeMap::new();
    graph.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    graph.insert("b".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".to_owned(), "b".to_owned(), "a".to_owned()])
    );
}

/// The modules of profiler-user from the top layer to the bottom one, as docs/architecture.md
/// lists them ("Modules of profiler-user").
const LAYERS: &[&str] = &[
    "cli",
    "agent",
    "config",
    "server",
    "self_metrics",
    "store",
    "export",
    "aggregation",
    "gpu",
    "off_cpu",
    "symbolization",
    "sampling",
    "unwinding",
    "runtimes",
    "process",
    "bpf",
    "model",
    "wire",
    "units",
    "bounded",
];

/// Imports that still point up, each named in docs/architecture.md as one to remove.
const KNOWN_UPWARD: &[(&str, &str)] = &[];

/// The non-test source of one module: its file or every file of its directory, each cut at its
/// first `#[cfg(test)]` (test modules sit at the end) and without `tests` files.
fn module_source(src: &std::path::Path, module: &str) -> String {
    let file = src.join(format!("{module}.rs"));
    let mut files = Vec::new();
    if file.exists() {
        files.push(file);
    }
    let mut dirs = vec![src.join(module)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if name == "tests" || name == "tests.rs" {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if name.ends_with(".rs") {
                files.push(path);
            }
        }
    }
    assert!(!files.is_empty(), "no source for module {module}");
    files
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path).expect("the source");
            match text.find("#[cfg(test)]") {
                Some(at) => text[..at].to_owned(),
                None => text,
            }
        })
        .collect()
}

#[test]
fn the_agents_modules_import_only_downwards() {
    let src = workspace_root().join("profiler-user/src");
    // Every module of lib.rs is in the list, so a new one gets a place in it.
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let declared: BTreeSet<&str> = lib
        .lines()
        .filter_map(|line| line.strip_prefix("pub mod "))
        .map(|rest| rest.trim_end_matches(';'))
        .collect();
    assert_eq!(
        declared,
        LAYERS.iter().copied().collect(),
        "lib.rs vs LAYERS"
    );
    let mut upward = Vec::new();
    for (level, module) in LAYERS.iter().enumerate() {
        for used in module_uses(&module_source(&src, module)) {
            let Some(used_level) = LAYERS.iter().position(|m| *m == used) else {
                continue;
            };
            if used_level < level && !KNOWN_UPWARD.contains(&(module, used.as_str())) {
                upward.push(format!("{module} -> {used}"));
            }
        }
    }
    assert!(upward.is_empty(), "imports that point up: {upward:?}");
}
