//! The code stays walkable. The data flow goes one way: no two top-level modules of `src/`
//! import each other, directly or around a circle (read from the code itself: every
//! `crate::<module>` path outside comments and unit-test modules is an edge), and neither do
//! two files of one module directory (`super::x`, `crate::<module>::x`). No function outside
//! unit tests is longer than 60 lines but those listed with a reason, and no file is longer
//! than 800 lines before its unit tests. The message path never administers tables.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crate's files under `path`, without those of modules compiled for tests only.
fn rust_files(path: &Path) -> Vec<PathBuf> {
    let mut files = all_rust_files(path);
    let test_only: Vec<PathBuf> = files.iter().flat_map(|f| test_only_modules(f)).collect();
    files.retain(|f| {
        !test_only
            .iter()
            .any(|t| f.starts_with(t) || *f == t.with_extension("rs"))
    });
    files
}

fn all_rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).unwrap() {
        files.extend(all_rust_files(&entry.unwrap().path()));
    }
    files.retain(|f| f.extension().is_some_and(|e| e == "rs"));
    files
}

/// The modules `file` declares behind a `#[cfg(...)]` that names `test`, as paths without
/// extension (`src/throttling/simulation` for `mod simulation;` in `src/throttling/mod.rs`):
/// their code is unit tests, however many files it takes.
fn test_only_modules(file: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(file).unwrap();
    let stem = file.file_stem().unwrap_or_default();
    let dir = if stem == "mod" || stem == "lib" || stem == "main" {
        file.parent().unwrap().to_path_buf()
    } else {
        file.with_extension("")
    };
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[0].starts_with("#[cfg(") && w[0].contains("test"))
        .filter_map(|w| w[1].strip_prefix("mod ")?.strip_suffix(';'))
        .map(|name| dir.join(name))
        .collect()
}

#[test]
fn modules_compiled_for_tests_only_are_not_scanned() {
    let files = rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(files.iter().any(|f| f.ends_with("throttling/ceiling.rs")));
    assert!(
        !files
            .iter()
            .any(|f| f.ends_with("throttling/simulation/plant.rs")),
        "the simulation bed is a unit test"
    );
}

/// A file's code without its comments and its unit tests.
fn code_of(text: &str) -> String {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names that follow `prefix` in `code`: `prefix x` gives x, `prefix {a, b::c}` gives a
/// and b.
fn names_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let first = |text: &str| -> String {
        text.trim()
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    };
    let mut found = BTreeSet::new();
    for line in code.lines() {
        let mut rest = line;
        while let Some(at) = rest.find(prefix) {
            rest = &rest[at + prefix.len()..];
            if let Some(inner) = rest.strip_prefix('{') {
                let inner = &inner[..inner.find('}').unwrap_or(inner.len())];
                found.extend(inner.split(',').map(first));
            } else {
                found.insert(first(rest));
            }
        }
    }
    found.remove("");
    found
}

/// The modules a file's code (not its comments, not its unit tests) names as `crate::x`.
fn imports(text: &str) -> BTreeSet<String> {
    names_after(&code_of(text), "crate::")
}

fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut deps = BTreeSet::new();
        for file in rust_files(&path) {
            deps.extend(imports(&std::fs::read_to_string(file).unwrap()));
        }
        graph.insert(name, deps);
    }
    let names: BTreeSet<String> = graph.keys().cloned().collect();
    for (name, deps) in graph.iter_mut() {
        deps.retain(|d| names.contains(d) && d != name);
    }
    graph
}

/// A path from `from` back to itself, if there is one.
fn circle_through(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![(from.to_string(), vec![from.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((node, path)) = stack.pop() {
        for next in &graph[&node] {
            if next == from {
                let mut circle = path.clone();
                circle.push(from.to_string());
                return Some(circle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn no_top_level_module_imports_back_up_the_flow() {
    let graph = module_graph();
    assert!(graph.len() > 10, "read the modules: {graph:?}");
    let circles: Vec<String> = graph
        .keys()
        .filter_map(|m| circle_through(&graph, m))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// The files of each module directory below `src/` (subdirectories count as one node) and
/// the siblings each names: `super::x` from a file directly in the directory (`super::super::x`
/// from one a level deeper), `crate::<the directory's path>::x` from any of them. A file's
/// `mod.rs` is the module's face, which its children may use, so it is no node.
fn file_graphs() -> Vec<(String, BTreeMap<String, BTreeSet<String>>)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs = Vec::new();
    let mut pending: Vec<PathBuf> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            }
        }
        dirs.push(dir);
    }
    let mut graphs = Vec::new();
    for dir in dirs {
        let module = dir
            .strip_prefix(&src)
            .unwrap()
            .display()
            .to_string()
            .replace('/', "::");
        let absolute = format!("crate::{module}::");
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if name == "mod" || !(path.is_dir() || path.extension().is_some_and(|e| e == "rs")) {
                continue;
            }
            let mut named = BTreeSet::new();
            for file in rust_files(&path) {
                let code = code_of(&std::fs::read_to_string(&file).unwrap());
                let relative = match file.parent() == Some(dir.as_path()) {
                    true => "super::",
                    // A file of a subdirectory: its own `mod.rs` is one level up, other
                    // files two.
                    false => "super::super::",
                };
                named.extend(names_after(&code, relative));
                named.extend(names_after(&code, &absolute));
            }
            graph.insert(name, named);
        }
        let nodes: BTreeSet<String> = graph.keys().cloned().collect();
        for (name, named) in graph.iter_mut() {
            named.retain(|n| nodes.contains(n) && n != name);
        }
        graphs.push((module, graph));
    }
    graphs
}

#[test]
fn no_two_files_of_a_module_import_each_other() {
    let graphs = file_graphs();
    assert!(
        graphs.iter().any(|(m, g)| m == "transport" && g.len() > 5),
        "read the module directories: {graphs:?}"
    );
    let circles: Vec<String> = graphs
        .iter()
        .flat_map(|(module, graph)| {
            graph
                .keys()
                .filter_map(|f| circle_through(graph, f))
                .map(move |c| format!("{module}: {}", c.join(" -> ")))
        })
        .collect();
    assert!(
        circles.is_empty(),
        "import circles between files:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_scan_sees_an_import_and_ignores_comments_and_tests() {
    let text = "use crate::{config::X, states};\n// crate::admin in a comment\nfn f() { crate::publish::send(); }\n#[cfg(test)]\nmod tests {\n    use crate::host;\n}\n";
    let found: Vec<String> = imports(text).into_iter().collect();
    assert_eq!(found, vec!["config", "publish", "states"]);
    let siblings = names_after(
        &code_of(
            "use super::{row::Raw, batch};\nfn f() { super::claim::take(); }\n// super::gone\n",
        ),
        "super::",
    );
    assert_eq!(
        siblings.into_iter().collect::<Vec<_>>(),
        vec!["batch", "claim", "row"]
    );
}

/// Functions longer than this (outside unit tests) are split into named steps.
const MAX_FUNCTION_LINES: usize = 60;

/// The functions allowed to be longer, by file under `src/` and name, each with its reason.
/// The list only shrinks: an entry whose function is no longer long fails the check too.
const LONGER_ALLOWED: &[(&str, &str, &str)] = &[
    (
        "config/validate.rs",
        "validate_queue",
        "independent checks, one per setting, in the order host.toml lists them",
    ),
    (
        "config/validate.rs",
        "validate_recoverability",
        "independent checks, one per setting, in the order host.toml lists them",
    ),
    (
        "config/validate.rs",
        "validate_throttling",
        "independent checks, one per setting, in the order host.toml lists them",
    ),
    (
        "config/validate.rs",
        "validate_transport",
        "independent checks, one per setting, in the order host.toml lists them",
    ),
    (
        "host/builder.rs",
        "start",
        "assembly in order, one call a step, then the host's 18 parts in one literal",
    ),
    (
        "load/chart.rs",
        "draw_causes",
        "one chart drawn top to bottom: axes, series, legend",
    ),
    (
        "load/chart.rs",
        "draw_flow",
        "one chart drawn top to bottom: axes, series, legend",
    ),
    (
        "load/chart.rs",
        "draw_states",
        "one chart drawn top to bottom: axes, series, legend",
    ),
    (
        "load/chart.rs",
        "draw_waits",
        "one chart drawn top to bottom: axes, series, legend",
    ),
    (
        "load/report.rs",
        "summarize",
        "the summary's 40 fields, one per line; the scoring is scored_episodes",
    ),
    (
        "main.rs",
        "main",
        "the command table: one arm per subcommand",
    ),
    (
        "transport/postgres/statements.rs",
        "new",
        "SQL texts, one per statement, read side by side with the NServiceBus transport's",
    ),
    (
        "transport/sqlserver/statements.rs",
        "new",
        "SQL texts, one per statement, read side by side with the NServiceBus transport's",
    ),
    (
        "transport/sqlserver/statements/ordered.rs",
        "ordered_receive",
        "SQL texts, one per statement, read side by side with the NServiceBus transport's",
    ),
];

/// No non-test file is longer than this: a file that grows past it holds several jobs.
const MAX_FILE_LINES: usize = 800;

/// Every function of a file's code (not its unit tests) with its first line and length: from
/// the line that starts it to the line that closes its body (braces counted; strings with
/// braces in them are rare enough in this code base not to matter).
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let code = text.split("#[cfg(test)]").next().unwrap_or(text);
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(fn_at) = words.iter().position(|w| *w == "fn") else {
            continue;
        };
        let qualifiers_only = words[..fn_at]
            .iter()
            .all(|w| matches!(*w, "pub" | "async" | "const" | "unsafe") || w.starts_with("pub("));
        if !qualifiers_only || line.trim_start().starts_with("//") {
            continue;
        }
        let name: String = words
            .get(fn_at + 1)
            .map(|w| {
                w.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect()
            })
            .unwrap_or_default();
        let mut depth = 0i64;
        let mut opened = false;
        for (offset, l) in lines[start..].iter().enumerate() {
            depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
            opened |= l.contains('{');
            if !opened && l.trim_end().ends_with(';') {
                break; // a declaration without a body
            }
            if opened && depth <= 0 {
                found.push((name.clone(), start + 1, offset + 1));
                break;
            }
        }
    }
    found
}

#[test]
fn the_scan_measures_a_function_from_its_line_to_its_closing_brace() {
    let text = "pub async fn short() {\n    let x = { 1 };\n}\n\nfn decl(&self);\n#[cfg(test)]\nfn in_tests() {\n}\n";
    assert_eq!(functions(text), vec![("short".to_string(), 1, 3)]);
}

#[test]
fn no_function_outside_tests_is_longer_than_60_lines_unless_listed_with_a_reason() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut long = Vec::new();
    let mut listed_and_long = BTreeSet::new();
    for file in rust_files(&src) {
        let relative = file.strip_prefix(&src).unwrap().display().to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        for (name, line, length) in functions(&text) {
            if length <= MAX_FUNCTION_LINES {
                continue;
            }
            match LONGER_ALLOWED
                .iter()
                .find(|(f, n, _)| *f == relative && *n == name)
            {
                Some(entry) => {
                    listed_and_long.insert((entry.0, entry.1));
                }
                None => long.push(format!("{relative}:{line} {name} ({length} lines)")),
            }
        }
    }
    assert!(long.is_empty(), "split these into named steps: {long:#?}");
    let stale: Vec<_> = LONGER_ALLOWED
        .iter()
        .filter(|(f, n, _)| !listed_and_long.contains(&(*f, *n)))
        .collect();
    assert!(
        stale.is_empty(),
        "these are no longer long (or gone): take them off LONGER_ALLOWED: {stale:#?}"
    );
    assert!(LONGER_ALLOWED.iter().all(|(_, _, why)| !why.is_empty()));
}

/// A file's lines before its unit tests (`#[cfg(test)] mod tests`).
fn lines_before_tests(text: &str) -> usize {
    text.split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or(text)
        .lines()
        .count()
}

#[test]
fn no_file_outside_tests_is_longer_than_800_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let long: Vec<String> = rust_files(&src)
        .into_iter()
        .filter(|f| !f.ends_with("controller/tests.rs"))
        .filter_map(|f| {
            let n = lines_before_tests(&std::fs::read_to_string(&f).unwrap());
            (n > MAX_FILE_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "split these by job: {long:#?}");
}

#[test]
fn a_file_is_counted_up_to_its_unit_tests() {
    assert_eq!(
        lines_before_tests("fn a() {}\n\n#[cfg(test)]\nmod tests {\n}\n"),
        2
    );
}

/// The modules a message passes through, from its receive to its commit and the sends it
/// makes: none of them creates, purges or lists tables (`Transport::admin`), which set-up
/// commands and start-up do.
const MESSAGE_PATH: [&str; 6] = [
    "src/receive",
    "src/dispatch",
    "src/publish.rs",
    "src/queue",
    "src/throttling",
    "src/delayed",
];

#[test]
fn the_message_path_never_administers_tables() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut scanned = 0;
    let mut calls = Vec::new();
    for module in MESSAGE_PATH {
        for file in rust_files(&root.join(module)) {
            scanned += 1;
            let code = code_of(&std::fs::read_to_string(&file).unwrap());
            if code.contains(".admin()") {
                calls.push(file.display().to_string());
            }
        }
    }
    assert!(
        scanned > 20,
        "the message path's files are found ({scanned})"
    );
    assert!(
        calls.is_empty(),
        "these reach the tables' administration: {calls:#?}"
    );
}
