//! The governor's structure, checked from its sources: its modules import
//! each other in layers (no import circle), and the file map in
//! `docs/architecture.md` lists exactly the files under `src/governor/`.
//! The same holds for the library's own top modules and for every backend
//! crate and the kit they share: no two of a crate's modules import each
//! other, directly or around a circle (`CRATES` below).
//!
//! A module's dependencies are the governor modules its source names
//! through `super::x` or `crate::governor::x` (in `use` lines, paths and
//! doc links alike; its own `#[cfg(test)] mod tests` left out). A
//! submodule counts as its top module (`ledger/charges.rs` is `ledger`),
//! and `mod.rs` at the top is the façade that re-exports everything, so it
//! is left out.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn governor_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/governor")
}

/// Every `.rs` file under `dir`, relative to it, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).expect("read src/governor") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.strip_prefix(dir).expect("under dir").to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// The top module a file belongs to (`""` for the façade `mod.rs`).
fn top_module(rel: &Path) -> String {
    let first = rel.components().next().expect("a file name");
    let name = first.as_os_str().to_string_lossy();
    name.strip_suffix(".rs").unwrap_or(&name).to_owned()
}

/// The governor modules `source` names after `prefix` (`super::` or
/// `crate::governor::`), including inside `{...}` groups.
fn named_after(source: &str, prefix: &str, modules: &BTreeSet<String>, out: &mut BTreeSet<String>) {
    let mut rest = source;
    while let Some(i) = rest.find(prefix) {
        rest = &rest[i + prefix.len()..];
        let word = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let w = word(item.trim());
                if modules.contains(&w) {
                    out.insert(w);
                }
            }
        } else {
            let w = word(rest);
            if modules.contains(&w) {
                out.insert(w);
            }
        }
    }
}

/// The module graph: each top module and the top modules it names.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let dir = governor_dir();
    let files = files(&dir);
    let modules: BTreeSet<String> = files.iter().map(|f| top_module(f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for rel in &files {
        let module = top_module(rel);
        if module == "mod" {
            continue;
        }
        let text = fs::read_to_string(dir.join(rel)).expect("read a governor source");
        let text = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default();
        let deps = graph.entry(module.clone()).or_default();
        let mut named = BTreeSet::new();
        // Inside a submodule, `super::` is its own top module: only
        // `crate::governor::` reaches the others from there.
        if rel.components().count() == 1 {
            named_after(text, "super::", &modules, &mut named);
        }
        named_after(text, "crate::governor::", &modules, &mut named);
        named.remove(&module);
        named.remove("mod");
        deps.extend(named);
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().expect("on the stack");
                    self.on_stack.remove(w);
                    component.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

#[test]
fn the_governor_has_no_import_circle() {
    let graph = graph();
    // The graph was read at all: the record and the modules above it.
    assert!(graph.len() > 20, "only {} modules read", graph.len());
    assert!(graph["handle"].contains("record"), "{:?}", graph["handle"]);
    let circles = circles(&graph);
    let edges: Vec<String> = circles
        .iter()
        .flatten()
        .map(|m| format!("  {m} -> {:?}", graph[m]))
        .collect();
    assert!(
        circles.is_empty(),
        "the governor's modules import each other in a circle: {circles:?}\nedges:\n{}",
        edges.join("\n")
    );
    println!(
        "{} governor modules, {} imports, no circle",
        graph.len(),
        graph.values().map(BTreeSet::len).sum::<usize>()
    );
}

#[test]
fn a_circle_is_found_when_there_is_one() {
    let mut graph = graph();
    // `role` is at the bottom; make it name `handle`, at the top.
    graph
        .get_mut("role")
        .expect("role.rs")
        .insert("handle".into());
    let circles = circles(&graph);
    assert!(
        circles.iter().any(|c| c.contains(&"role".to_owned())),
        "{circles:?}"
    );
}

/// The crates whose top modules must form layers, as directories under
/// the workspace root: the library's own top modules, the backend kit, the
/// stream-ordered core CUDA and HIP share, and every backend.
const CRATES: &[&str] = &[
    "src",
    "crates/backend/src",
    "crates/stream-ordered/src",
    "crates/conformance/src",
    "crates/sync/src",
    "backends/host/src",
    "backends/null/src",
    "backends/vulkan/src",
    "backends/cuda/src",
    "backends/hip/src",
];

/// The module graph of the crate whose sources are in `dir`: each top
/// module (a file or a directory under `dir`, `lib.rs` the façade left out)
/// and the top modules it names through `crate::x`, or `super::x` where
/// that is the crate root (a top-level file, a directory's `mod.rs`), or
/// `super::super::x` from a file inside a directory. Doc links count.
fn crate_graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = files(dir);
    let modules: BTreeSet<String> = files
        .iter()
        .map(|f| top_module(f))
        .filter(|m| m != "lib" && m != "main" && m != "mod")
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for rel in &files {
        let module = top_module(rel);
        if !modules.contains(&module) {
            continue;
        }
        let text = fs::read_to_string(dir.join(rel)).expect("read a source");
        let text = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default();
        let depth = rel.components().count();
        let is_mod = rel.file_name().is_some_and(|n| n == "mod.rs");
        let mut named = BTreeSet::new();
        named_after(text, "crate::", &modules, &mut named);
        match (depth, is_mod) {
            (1, _) | (2, true) => named_after(text, "super::", &modules, &mut named),
            (2, false) => named_after(text, "super::super::", &modules, &mut named),
            _ => {}
        }
        named.remove(&module);
        graph.entry(module).or_default().extend(named);
    }
    graph
}

#[test]
fn no_crate_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut failures = Vec::new();
    for dir in CRATES {
        let graph = crate_graph(&root.join(dir));
        let circles = circles(&graph);
        for circle in &circles {
            let edges: Vec<String> = circle
                .iter()
                .map(|m| {
                    let inside: Vec<&String> =
                        graph[m].iter().filter(|d| circle.contains(d)).collect();
                    format!("    {m} -> {inside:?}")
                })
                .collect();
            failures.push(format!("{dir}: {circle:?}\n{}", edges.join("\n")));
        }
        println!(
            "{dir}: {} modules, {} imports, no circle",
            graph.len(),
            graph.values().map(BTreeSet::len).sum::<usize>()
        );
    }
    assert!(
        failures.is_empty(),
        "modules import each other in a circle:\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_crate_circle_is_found_when_there_is_one() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut planted = Vec::new();
    for dir in CRATES {
        let mut graph = crate_graph(&root.join(dir));
        // A crate whose modules import nothing of each other (their
        // imports go through the crate root's re-exports) has no edge to
        // turn around.
        let Some((from, to)) = graph
            .iter()
            .find_map(|(m, deps)| deps.iter().next().map(|d| (m.clone(), d.clone())))
        else {
            continue;
        };
        // Plant the back edge: the module imported names its importer.
        graph.entry(to.clone()).or_default().insert(from.clone());
        let found = circles(&graph);
        assert!(
            found.iter().any(|c| c.contains(&from) && c.contains(&to)),
            "{dir}: the planted edge {to} -> {from} made no circle: {found:?}"
        );
        planted.push(*dir);
    }
    // The graphs were read: the core and the library's own modules import
    // each other.
    for dir in ["src", "crates/stream-ordered/src"] {
        assert!(
            planted.contains(&dir),
            "no import read in {dir}: {planted:?}"
        );
    }
}

/// The paths the architecture doc's file map lists under `governor/`.
fn documented_files() -> Vec<PathBuf> {
    let doc =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .expect("read docs/architecture.md");
    let mut lines = doc.lines().skip_while(|l| l.trim_end() != "  governor/");
    let header = lines.next().expect("a `  governor/` entry in the file map");
    let base = header.len() - header.trim_start().len();
    let mut dirs: Vec<(usize, String)> = Vec::new();
    let mut out = Vec::new();
    for line in lines {
        let indent = line.len() - line.trim_start().len();
        let name = line.split_whitespace().next().unwrap_or("");
        if indent <= base {
            break; // the next entry beside `governor/`
        }
        // Entries are names ending in `.rs` or `/`; other lines continue
        // the description of the entry above.
        let is_entry = name.ends_with(".rs") || (name.ends_with('/') && !name.contains(' '));
        if !is_entry {
            continue;
        }
        while dirs.last().is_some_and(|(i, _)| *i >= indent) {
            dirs.pop();
        }
        if let Some(dir) = name.strip_suffix('/') {
            dirs.push((indent, dir.to_owned()));
        } else {
            let mut path = PathBuf::new();
            for (_, d) in &dirs {
                path.push(d);
            }
            path.push(name);
            out.push(path);
        }
    }
    out
}

#[test]
fn the_file_map_lists_every_governor_file() {
    let listed = documented_files();
    let mut twice: Vec<_> = listed.clone();
    twice.sort();
    twice.dedup();
    let twice: Vec<_> = twice
        .into_iter()
        .filter(|p| listed.iter().filter(|q| *q == p).count() > 1)
        .collect();
    let documented: BTreeSet<PathBuf> = listed.into_iter().collect();
    let actual: BTreeSet<PathBuf> = files(&governor_dir()).into_iter().collect();
    let missing: Vec<_> = actual.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&actual).collect();
    assert!(
        missing.is_empty() && stale.is_empty() && twice.is_empty(),
        "docs/architecture.md's file map of src/governor/ is out of date: not listed {missing:?}, \
         listed but absent {stale:?}, listed twice {twice:?}"
    );
    println!("{} governor files, each listed once", actual.len());
}
