//! The README and the guide stay true: every relative link (and its `#anchor`) resolves,
//! every chapter is in the book's summary, every configuration snippet passes `config
//! check`, and the guide builds as an mdBook (the README's test command installs `mdbook`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use pulldown_cmark::{CodeBlockKind, Event, HeadingLevel, Parser, Tag, TagEnd};

const GUIDE: &str = "docs/guide/src";

/// The Markdown files readers follow links through.
fn documents() -> Vec<PathBuf> {
    let mut files = vec![
        PathBuf::from("README.md"),
        PathBuf::from("docs/ARCHITECTURE.md"),
        PathBuf::from("sql/sqlserver/README.md"),
        PathBuf::from("sql/postgres/README.md"),
    ];
    files.extend(chapters());
    files
}

fn chapters() -> Vec<PathBuf> {
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(GUIDE)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    chapters.sort();
    chapters
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A heading's anchor as GitHub and mdBook make it: lowercase, spaces to `-`, punctuation
/// other than `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(markdown: &str) -> HashSet<String> {
    let mut anchors = HashSet::new();
    let mut heading: Option<String> = None;
    for event in Parser::new(markdown) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                anchors.extend(heading.take().map(|h| slug(&h)));
            }
            _ => {}
        }
    }
    anchors
}

/// Every link and image target of a document.
fn targets(markdown: &str) -> Vec<String> {
    Parser::new(markdown)
        .filter_map(|event| match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                Some(dest_url.to_string())
            }
            _ => None,
        })
        .collect()
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        for target in targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                doc.clone()
            } else {
                doc.parent().unwrap().join(path)
            };
            if !file.exists() {
                broken.push(format!("{}: {target} (no such file)", doc.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && file.extension().is_some_and(|e| e == "md")
                && !anchors(&read(&file)).contains(anchor)
            {
                broken.push(format!("{}: {target} (no such heading)", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_chapter_is_in_the_summary_and_opens_with_its_title() {
    let summary = read(&Path::new(GUIDE).join("SUMMARY.md"));
    let listed: HashSet<String> = targets(&summary).into_iter().collect();
    for chapter in chapters() {
        let name = chapter.file_name().unwrap().to_string_lossy().into_owned();
        if name == "SUMMARY.md" {
            continue;
        }
        assert!(listed.contains(&name), "{name} is not in SUMMARY.md");
        let text = read(&chapter);
        let first = Parser::new(&text).next();
        assert!(
            matches!(
                first,
                Some(Event::Start(Tag::Heading {
                    level: HeadingLevel::H1,
                    ..
                }))
            ),
            "{name} opens with its title (# ...)"
        );
    }
}

/// The `toml` code blocks of a document.
fn toml_blocks(markdown: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for event in Parser::new(markdown) {
        match event {
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info))) if &*info == "toml" => {
                current = Some(String::new())
            }
            Event::Text(t) => {
                if let Some(c) = current.as_mut() {
                    c.push_str(&t);
                }
            }
            Event::End(TagEnd::CodeBlock) => blocks.extend(current.take()),
            _ => {}
        }
    }
    blocks
}

/// A snippet as a whole file: one that tunes a queue's tables (`[queues.x]`) without its
/// `[[queues]]` gets one, and the transport settings a kind needs are left to the snippet.
fn as_config(snippet: &str) -> String {
    if snippet.contains("[queues.") && !snippet.contains("[[queues]]") {
        format!("[[queues]]\nname = \"orders\"\n{snippet}")
    } else {
        snippet.to_string()
    }
}

#[test]
fn every_configuration_snippet_passes_config_check() {
    let dir = std::env::temp_dir().join(format!("th-guide-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut checked = 0;
    let mut refused = Vec::new();
    for doc in documents() {
        for (i, snippet) in toml_blocks(&read(&doc)).into_iter().enumerate() {
            let file = dir.join(format!("snippet-{checked}.toml"));
            std::fs::write(&file, as_config(&snippet)).unwrap();
            let out = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
                .args(["config", "check", "-c"])
                .arg(&file)
                .output()
                .unwrap();
            if !out.status.success() {
                refused.push(format!(
                    "{} snippet {}:\n{snippet}\n{}",
                    doc.display(),
                    i + 1,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            checked += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(checked >= 8, "found {checked} snippets; the guide has more");
    assert!(refused.is_empty(), "{}", refused.join("\n\n"));
}

#[test]
fn the_guide_builds_as_a_book() {
    let out_dir = std::env::temp_dir().join(format!("th-book-{}", std::process::id()));
    let built = Command::new("mdbook")
        .args(["build", "docs/guide", "--dest-dir"])
        .arg(&out_dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("mdbook is needed to build the guide ({e}): cargo install mdbook --locked, or run scripts/test, which installs it")
        });
    let _ = std::fs::remove_dir_all(&out_dir);
    assert!(
        built.status.success(),
        "mdbook build docs/guide:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
}

/// `--help` of the program and of each command names a guide chapter that exists.
#[test]
fn every_command_s_help_points_to_a_chapter_that_exists() {
    for command in [
        &[][..],
        &["run"],
        &["demo"],
        &["config"],
        &["queues"],
        &["send"],
        &["status"],
        &["load"],
        &["errors"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_throttlehost"))
            .args(command)
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        let chapter = help
            .split_whitespace()
            .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric() && c != '/' && c != '.'))
            .find(|w| w.starts_with("docs/guide/src/"))
            .unwrap_or_else(|| panic!("{command:?} --help names no chapter:\n{help}"));
        assert!(Path::new(chapter).exists(), "{command:?} --help: {chapter}");
    }
}
