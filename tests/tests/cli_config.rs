//! The `dynamo-node config` commands, run as the real binary: defaults round-trip, the shipped
//! files validate, and bad files fail with FILE:LINE:COL and the offending key.

use std::process::Command;

use dynamo_config::NodeConfig;
use dynamo_tests::node_binary;

fn repo_file(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn check(contents: &str) -> (i32, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("node.toml");
    std::fs::write(&path, contents).expect("write config");
    let out = Command::new(node_binary()).args(["config", "check"]).arg(&path).output().expect("run dynamo-node");
    let stderr = String::from_utf8_lossy(&out.stderr).replace(&path.display().to_string(), "FILE");
    (out.status.code().expect("exit code"), stderr)
}

#[test]
fn config_default_prints_a_config_equal_to_the_defaults() {
    let out = Command::new(node_binary()).args(["config", "default"]).output().expect("run dynamo-node");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let parsed = NodeConfig::parse(&text, "stdout").expect("the printed defaults parse");
    assert_eq!(parsed, NodeConfig::default());
}

#[test]
fn shipped_default_and_example_files_pass_the_check() {
    for file in ["config/default.toml", "config/example.toml"] {
        let out = Command::new(node_binary())
            .args(["config", "check"])
            .arg(repo_file(file))
            .output()
            .expect("run dynamo-node");
        assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).ends_with(": ok\n"));
    }
}

#[test]
fn unknown_key_is_reported_with_its_line_column_and_name() {
    let (code, err) = check("[node]\nname = \"a\"\n\n[tiers.g2]\n  capcity = \"1GiB\"\n");
    assert_eq!(code, 2);
    assert!(err.starts_with("FILE:5:3: `tiers.g2.capcity`: unknown key"), "{err}");
}

#[test]
fn wrong_type_is_reported_at_the_value() {
    let (code, err) = check("[tiers.g3]\nqueue_depth = \"deep\"\n");
    assert_eq!(code, 2);
    assert!(err.starts_with("FILE:2:15: `tiers.g3.queue_depth`:"), "{err}");
}

#[test]
fn impossible_values_name_the_key_and_the_fix() {
    let (code, err) = check("[blocks]\nblock_size = 32\n[tiers.g2]\ncapacity = \"16KiB\"\n");
    assert_eq!(code, 2);
    assert!(err.starts_with("FILE:4:1: `tiers.g2.capacity`:"), "{err}");
    assert!(err.contains("smaller than one block"), "{err}");

    let (code, err) = check("[tiers.g3]\nlow_watermark = 0.99\nhigh_watermark = 0.5\n");
    assert_eq!(code, 2);
    assert!(err.contains("tiers.g3."), "{err}");

    let (code, err) = check("[tiers.g2]\ncapacity = \"12XB\"\n");
    assert_eq!(code, 2);
    assert!(err.starts_with("FILE:2:"), "{err}");
    assert!(err.contains("12XB"), "{err}");
}

#[test]
fn a_missing_file_is_an_error_not_a_panic() {
    let out = Command::new(node_binary()).args(["config", "check", "/nonexistent/node.toml"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/node.toml"));
}

/// `config check` runs what `serve` checks: an unknown parser name is refused, listing the
/// names, and a known one passes.
#[test]
fn parser_names_are_checked() {
    let (code, stderr) = check("[frontend]\nreasoning_parser = \"qwen4\"\n");
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("frontend.reasoning_parser") && stderr.contains("deepseek_r1"), "{stderr}");
    let (code, stderr) = check("[frontend]\ntool_call_parser = \"xml\"\n");
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("frontend.tool_call_parser") && stderr.contains("qwen3_coder"), "{stderr}");
    let (code, stderr) = check("[frontend]\nreasoning_parser = \"qwen3\"\ntool_call_parser = \"hermes\"\n");
    assert_eq!(code, 0, "{stderr}");
}
