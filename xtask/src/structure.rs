//! `cargo xtask check-structure`: the layout rules that `ARCHITECTURE.md` states, checked on the sources.
//!
//! 1. **No import circle between source files.** Within each crate, a file uses another when it names one of its
//!    items (`crate::a::b::X`, `super::X`, a child module `b::X`, or an item the crate root re-exports from it). The
//!    crate root (`lib.rs`, `main.rs`) only declares and re-exports, so edges into it count for the file that
//!    defines the item. Across crates Cargo itself forbids circles.
//! 2. **One writer of the environment contract.** Every name in `shoal_comm::env::var` appears as a string literal
//!    in `crates/shoal-comm/src/env.rs` only, outside tests. Names of one plain word (`RANK`) are left out: as
//!    literals they are mostly words of the output (a table's `RANK` column), not the variable.
//!
//! The sources are read as text, not parsed: comments are dropped line by line and `#[cfg(test)]` items by
//! counting braces, so an unbalanced brace inside a string literal can end that skip early or late: a use hidden
//! that way is missed. No source here has one; a parser (`syn`) would close the gap.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Runs both checks on the repository at `root`; the error lists every violation.
pub fn check(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    for cycle in import_cycles(root)? {
        problems.push(format!("import circle: {}", cycle.join(" -> ")));
    }
    for (name, files) in contract_literals(root)? {
        problems.push(format!("contract variable {name:?} spelled out in {}", files.join(", ")));
    }
    if problems.is_empty() {
        println!("structure: no import circle, the contract's names are spelled out only in its module");
        Ok(())
    } else {
        bail!("{} structure problems:\n  {}", problems.len(), problems.join("\n  "))
    }
}

/// The source roots to check: every crate's `src/`, and the xtask's.
fn source_roots(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root.join("crates")).context("reading crates/")? {
        let src = e?.path().join("src");
        if src.is_dir() {
            out.push(src);
        }
    }
    out.push(root.join("xtask/src"));
    out.sort();
    Ok(out)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// The source of a file without its `#[cfg(test)]` items and without comments.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut skip_depth: Option<usize> = None;
    let mut depth = 0usize;
    let mut pending_test = false;
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let trimmed = code.trim();
        if skip_depth.is_none() && trimmed.starts_with("#[cfg(test)]") {
            pending_test = true;
            continue;
        }
        let opens = code.matches('{').count();
        let closes = code.matches('}').count();
        if pending_test && skip_depth.is_none() {
            pending_test = false;
            if opens > closes {
                skip_depth = Some(depth);
            } else {
                // A one-line item (`mod tests;`, `use ...;`).
                continue;
            }
        }
        depth = (depth + opens).saturating_sub(closes);
        if let Some(d) = skip_depth {
            if depth <= d {
                skip_depth = None;
            }
            continue;
        }
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// A module's path (`["a", "b"]`) from its file under `src`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs").to_owned();
        if stem != "mod" && stem != "lib" && stem != "main" {
            parts.push(stem);
        }
    }
    parts
}

/// Every path expression in `code` that starts with one of the words `crate`, `super`, `self` or an identifier,
/// as its segments (`crate::a::b::X` -> ["crate", "a", "b", "X"]), including the branches of `use a::{b, c::d}`.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < bytes.len() {
        if ident(bytes[i]) && (i == 0 || !(ident(bytes[i - 1]) || bytes[i - 1] == ':')) {
            let (path, next) = read_path(&bytes, i, Vec::new(), &mut out);
            if path.len() > 1 {
                out.push(path);
            }
            i = next.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Reads `seg::seg::...` from `i`, with `{...}` groups expanded into `out`; returns the path read and where it ended.
fn read_path(b: &[char], mut i: usize, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> (Vec<String>, usize) {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    loop {
        let start = i;
        while i < b.len() && ident(b[i]) {
            i += 1;
        }
        if i == start {
            return (prefix, i);
        }
        prefix.push(b[start..i].iter().collect());
        if i + 1 < b.len() && b[i] == ':' && b[i + 1] == ':' {
            i += 2;
            if i < b.len() && b[i] == '{' {
                i += 1;
                loop {
                    while i < b.len() && (b[i].is_whitespace() || b[i] == ',') {
                        i += 1;
                    }
                    if i >= b.len() || b[i] == '}' {
                        return (Vec::new(), i + 1);
                    }
                    let (p, next) = read_path(b, i, prefix.clone(), out);
                    if p.len() > prefix.len() {
                        out.push(p);
                    }
                    i = next;
                    // Skip `as name` and anything else up to the next branch.
                    while i < b.len() && b[i] != ',' && b[i] != '}' {
                        i += 1;
                    }
                    if i >= b.len() || b[i] == '}' {
                        return (Vec::new(), i + 1);
                    }
                }
            }
        } else {
            return (prefix, i);
        }
    }
}

/// Import circles between the files of each crate: each as the files of one strongly connected component, closed
/// into a loop, relative to the repository.
pub fn import_cycles(root: &Path) -> Result<Vec<Vec<String>>> {
    let mut cycles = Vec::new();
    for src in source_roots(root)? {
        let mut files = Vec::new();
        rust_files(&src, &mut files)?;
        let modules: HashMap<Vec<String>, PathBuf> = files.iter().map(|f| (module_path(&src, f), f.clone())).collect();
        // Items the crate root re-exports: name -> the module that defines them.
        let mut reexports: HashMap<String, Vec<String>> = HashMap::new();
        for root_file in ["lib.rs", "main.rs"] {
            let Ok(text) = std::fs::read_to_string(src.join(root_file)) else { continue };
            for p in paths_in(&code_of(&text)) {
                if p.len() >= 2 && modules.contains_key(&p[..1]) {
                    let mut m = p[..p.len() - 1].to_vec();
                    while !m.is_empty() && !modules.contains_key(&m) {
                        m.pop();
                    }
                    if !m.is_empty() {
                        reexports.insert(p[p.len() - 1].clone(), m);
                    }
                }
            }
        }
        let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (me, file) in &modules {
            if me.is_empty() {
                continue; // the crate root declares and re-exports
            }
            let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            for p in paths_in(&code_of(&text)) {
                let absolute: Vec<String> = match p[0].as_str() {
                    "crate" => p[1..].to_vec(),
                    "super" => {
                        let mut base = me[..me.len() - 1].to_vec();
                        let mut rest = &p[1..];
                        while rest.first().is_some_and(|s| s == "super") {
                            base.pop();
                            rest = &rest[1..];
                        }
                        base.extend_from_slice(rest);
                        base
                    }
                    "self" => me.iter().chain(&p[1..]).cloned().collect(),
                    _ => {
                        // A child module named without `self::`.
                        let child: Vec<String> = me.iter().chain(std::iter::once(&p[0])).cloned().collect();
                        if !modules.contains_key(&child) {
                            continue;
                        }
                        me.iter().chain(&p).cloned().collect()
                    }
                };
                let mut target = absolute.clone();
                while !target.is_empty() && !modules.contains_key(&target) {
                    target.pop();
                }
                if target.is_empty() {
                    // Through the root: an item it re-exports.
                    match absolute.first().and_then(|n| reexports.get(n)) {
                        Some(m) => target = m.clone(),
                        None => continue,
                    }
                }
                if target != *me {
                    edges.entry(me.clone()).or_default().insert(target);
                }
            }
        }
        for scc in strongly_connected(&edges) {
            let mut names: Vec<String> = scc
                .iter()
                .filter_map(|m| modules.get(m))
                .map(|f| f.strip_prefix(root).unwrap_or(f).display().to_string())
                .collect();
            names.sort();
            if let Some(first) = names.first().cloned() {
                names.push(first);
            }
            cycles.push(names);
        }
    }
    Ok(cycles)
}

/// Components of more than one node (Tarjan's algorithm, iteratively deep enough for source trees).
fn strongly_connected(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    struct T<'a> {
        edges: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: HashMap<Vec<String>, usize>,
        low: HashMap<Vec<String>, usize>,
        stack: Vec<Vec<String>>,
        on: BTreeSet<Vec<String>>,
        next: usize,
        out: Vec<Vec<Vec<String>>>,
    }
    fn visit(t: &mut T<'_>, v: &Vec<String>) {
        t.index.insert(v.clone(), t.next);
        t.low.insert(v.clone(), t.next);
        t.next += 1;
        t.stack.push(v.clone());
        t.on.insert(v.clone());
        let succ: Vec<Vec<String>> = t.edges.get(v).map(|s| s.iter().cloned().collect()).unwrap_or_default();
        for w in &succ {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low[v];
                t.low.insert(v.clone(), lv.min(lw));
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low[v];
                t.low.insert(v.clone(), lv.min(iw));
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(&w);
                let done = &w == v;
                comp.push(w);
                if done {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        edges,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    let nodes: Vec<Vec<String>> = edges.keys().cloned().collect();
    for v in &nodes {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// Contract names spelled out as string literals outside `shoal-comm/src/env.rs` and outside tests: name -> files.
pub fn contract_literals(root: &Path) -> Result<BTreeMap<String, Vec<String>>> {
    let env_rs = root.join("crates/shoal-comm/src/env.rs");
    let text = std::fs::read_to_string(&env_rs).with_context(|| format!("reading {}", env_rs.display()))?;
    let names: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("pub const ")?;
            let (_, value) = rest.split_once(": &str = \"")?;
            Some(value.trim_end_matches("\";").to_owned())
        })
        .filter(|name: &String| name.contains('_'))
        .collect();
    if names.len() < 10 {
        bail!("found only {} contract names in {}: has its `var` module moved?", names.len(), env_rs.display());
    }
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for src in source_roots(root)? {
        let mut files = Vec::new();
        rust_files(&src, &mut files)?;
        for f in files.iter().filter(|f| **f != env_rs) {
            let code = code_of(&std::fs::read_to_string(f)?);
            for n in &names {
                if code.contains(&format!("\"{n}\"")) || code.contains(&format!("\"{n}=")) {
                    out.entry(n.clone()).or_default().push(f.strip_prefix(root).unwrap_or(f).display().to_string());
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    #[test]
    fn paths_are_read_with_their_use_groups() {
        let p = paths_in("use crate::a::{b::C, d as e};\nlet x = super::f::g(1); y::z");
        let want: Vec<Vec<&str>> =
            vec![vec!["crate", "a", "b", "C"], vec!["crate", "a", "d"], vec!["super", "f", "g"], vec!["y", "z"]];
        assert_eq!(p, want.iter().map(|v| v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).collect::<Vec<_>>());
        assert_eq!(code_of("a\n#[cfg(test)]\nmod tests {\n  use crate::x;\n}\nb // crate::y\n"), "a\nb \n");
    }

    #[test]
    fn a_circle_is_found() {
        let d = std::env::temp_dir().join(format!("xtask-structure-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("crates/c/src")).expect("dirs");
        std::fs::create_dir_all(d.join("xtask/src")).expect("dirs");
        std::fs::write(d.join("crates/c/src/lib.rs"), "mod a;\nmod b;\nmod c;\npub use c::Thing;\n").expect("write");
        std::fs::write(d.join("crates/c/src/a.rs"), "use crate::b::B;\n").expect("write");
        std::fs::write(d.join("crates/c/src/b.rs"), "fn f() { crate::Thing::new(); }\n").expect("write");
        std::fs::write(d.join("crates/c/src/c.rs"), "use super::a;\n#[cfg(test)]\nmod t { use crate::b; }\n")
            .expect("write");
        let cycles = import_cycles(&d).expect("check");
        assert_eq!(cycles.len(), 1, "{cycles:?}");
        assert_eq!(cycles[0].len(), 4, "{cycles:?}");
        std::fs::write(d.join("crates/c/src/c.rs"), "pub struct Thing;\n").expect("write");
        assert!(import_cycles(&d).expect("check").is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_repository_keeps_its_structure() {
        let cycles = import_cycles(&repo()).expect("reading the sources");
        assert!(
            cycles.is_empty(),
            "import circles:\n{}",
            cycles.iter().map(|c| c.join(" -> ")).collect::<Vec<_>>().join("\n")
        );
        let literals = contract_literals(&repo()).expect("reading the sources");
        assert!(literals.is_empty(), "contract names spelled out outside shoal_comm::env: {literals:?}");
    }
}
