//! The documentation holds together: every relative link of the README and of the `docs/` book
//! leads to a file of the repository, every `#anchor` to a heading of its page, the book's
//! `SUMMARY.md` lists every page once, the README keeps its two commands, and the book documents
//! every config key once: it includes `config/example.toml` (whose every key the config crate's
//! tests hold read and commented) on exactly one page.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("the repository")
}

/// The pages: the README and every Markdown file of `docs/`.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut book: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    book.sort();
    pages.extend(book);
    pages
}

/// `path` with its `..` and `.` resolved lexically (it need not exist).
fn normalized(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            part => out.push(part),
        }
    }
    out
}

/// GitHub's (and mdBook's) anchor of a heading: lower case, punctuation dropped, spaces to `-`.
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

/// The anchors of a page's headings (outside code blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// The targets of a page's inline links `[text](target)`, outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let tail = &rest[at + 2..];
            let end = tail.find(')').unwrap_or(tail.len());
            out.push(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    out
}

#[test]
fn the_docs_links_resolve() {
    let root = root();
    let pages = pages();
    assert!(pages.len() >= 8, "found only {} pages", pages.len());
    let mut problems = Vec::new();
    let mut checked = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() { page.clone() } else { normalized(&page.parent().unwrap().join(path)) };
            if !target.starts_with(&root) {
                // Outside the repository (the workspace's `../shared/`): not ours to check.
                continue;
            }
            if !target.exists() {
                problems.push(format!("{}: `{link}` leads nowhere", page.display()));
                continue;
            }
            checked += 1;
            if !anchor.is_empty() && target.extension().is_some_and(|e| e == "md") {
                let headings = anchors(&std::fs::read_to_string(&target).unwrap());
                if !headings.contains(anchor) {
                    problems.push(format!("{}: `{link}`: no heading `#{anchor}` there", page.display()));
                }
            }
        }
    }
    assert!(checked >= 20, "checked only {checked} links");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_book_lists_every_page_once_and_the_readme_keeps_its_two_commands() {
    let root = root();
    let summary = std::fs::read_to_string(root.join("docs/SUMMARY.md")).expect("docs/SUMMARY.md");
    let listed: Vec<String> = links(&summary);
    let unique: BTreeSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), listed.len(), "a page listed twice: {listed:?}");
    for page in pages().iter().skip(1) {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        if name != "SUMMARY.md" {
            assert!(listed.contains(&name), "SUMMARY.md does not list {name}");
        }
    }
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    for command in ["cargo run --release -p dynamo-node\n", "cargo nextest run --workspace\n"] {
        assert!(readme.contains(command), "the README lost `{}`", command.trim());
    }
}

#[test]
fn the_book_documents_every_config_key_once_by_including_the_example() {
    let root = root();
    let directive = "{{#include ../config/example.toml}}";
    let including: Vec<PathBuf> =
        pages().into_iter().filter(|p| std::fs::read_to_string(p).unwrap().matches(directive).count() > 0).collect();
    assert_eq!(including.len(), 1, "one page includes the reference, not {including:?}");
    let page = &including[0];
    assert_eq!(std::fs::read_to_string(page).unwrap().matches(directive).count(), 1, "included once");
    assert!(page.starts_with(root.join("docs")), "a page of the book: {}", page.display());
    let example = normalized(&page.parent().unwrap().join("../config/example.toml"));
    assert!(example.is_file(), "{} is the file the directive names", example.display());
}
