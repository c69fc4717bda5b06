//! aiperf (PyPI, the load generator NVIDIA's benchmarks use) against the real binary, through
//! `benches/scripts/aiperf_load.py`: a synthetic chat load at 1 and 4 users and a short agentic
//! trace (synthesized by `aiperf synthesize agentic-code`) replayed as multi-turn sessions, with
//! aiperf's TTFT percentiles, request count and output tokens checked against the node's own
//! metrics scraped around each run.
//!
//! Ignored by the plain test command (it needs aiperf: `DYNAMO_AIPERF` names its executable);
//! `.ci/run` installs it in a virtual environment and runs this. Run without it, it fails saying
//! so: it never passes without having checked anything.

use std::path::Path;
use std::process::Command;

use dynamo_tests::node_binary;
use serde_json::Value;

const IGNORED: &str = "needs aiperf (pip install aiperf==0.13.0; DYNAMO_AIPERF names it); .ci/run installs it";

#[test]
#[ignore = "needs aiperf (pip install aiperf==0.13.0; DYNAMO_AIPERF names it); .ci/run installs it"]
fn aiperf_measures_what_the_node_measures() {
    let aiperf = std::env::var("DYNAMO_AIPERF").unwrap_or_else(|_| panic!("DYNAMO_AIPERF is not set: {IGNORED}"));
    let dir = tempfile::tempdir().expect("temp dir");

    // A small agentic-code trace of our own: the shared traces are not part of the checkout.
    let synth = Command::new(&aiperf)
        .args(["synthesize", "agentic-code", "--num-sessions", "2", "--seed", "5", "--output"])
        .arg(dir.path().join("synth"))
        .output()
        .expect("run aiperf synthesize");
    assert!(synth.status.success(), "aiperf synthesize:\n{}", String::from_utf8_lossy(&synth.stderr));
    let trace = std::fs::read_dir(dir.path().join("synth"))
        .expect("the synthesized run")
        .map(|e| e.unwrap().path().join("dataset.jsonl"))
        .find(|p| p.is_file())
        .expect("dataset.jsonl");

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/scripts/aiperf_load.py");
    let out = dir.path().join("report");
    let run = Command::new("python3")
        .arg(script)
        .arg(node_binary())
        .args(["--aiperf", &aiperf, "--concurrency", "1,4", "--requests-per-user", "4", "--isl", "256"])
        .args(["--osl", "16", "--trace-sessions", "2", "--trace-duration", "30", "--trace"])
        .arg(&trace)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run the aiperf bench");
    let said = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "the aiperf bench:\n{said}");

    let report: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).expect("report.json")).expect("JSON");
    let runs: Vec<&str> = report.iter().map(|r| r["run"].as_str().unwrap()).collect();
    assert_eq!(runs, ["chat-c1", "chat-c4", "agentic-trace"], "{said}");
    for row in &report {
        let checks = row["checks"].as_array().unwrap();
        assert!(checks.len() >= 5, "{row}");
        for check in checks.iter().filter(|c| c["required"] == true) {
            assert_eq!(check["agrees"], true, "{}: {check}", row["run"]);
        }
        let requests = checks.iter().find(|c| c["what"] == "requests").unwrap();
        assert!(requests["aiperf"].as_f64().unwrap() >= 4.0, "{row}");
        // aiperf's own report is kept beside ours.
        let run = row["run"].as_str().unwrap();
        assert!(out.join(run).join("profile_export_aiperf.json").is_file(), "{run}'s aiperf artifacts");
    }
    // The trace's sessions grow their history and share a system prompt: most prompt tokens hit.
    let cached = report[2]["aiperf"]["cached_prompt_pct"].as_f64().expect("cached %");
    assert!(cached > 50.0, "cached share of the trace's prompt tokens: {cached}%");
    assert!(std::fs::read_to_string(out.join("report.md")).unwrap().contains("| agentic-trace |"));
}
