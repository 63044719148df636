//! The modules of the eBPF crate form no import cycle: `sampler` (the perf-event and lifecycle
//! programs) uses `cuda`, `python` and `user_stack`, which use `shared` (the maps and helpers
//! all programs share), which uses no module of the crate. Read from the sources, so a new
//! `use crate::…` that closes a loop fails here, not in a review.
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
