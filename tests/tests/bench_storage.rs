//! `dynamo-node bench storage` runs end to end on a small size and writes the JSON it promises.
//! (The throughput targets are met in the benchmark itself, not here: this machine is shared.)

use std::process::Command;

use dynamo_tests::node_binary;

#[test]
fn bench_storage_prints_rows_and_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("rows.json");
    let out = Command::new(node_binary())
        .args(["bench", "storage", "--block-size", "64KiB", "--total", "8MiB", "--repeat", "1", "--queue-depth", "4"])
        .arg("--dir")
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run dynamo-node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("[tiers.g3]"), "a suggested section is printed:\n{stdout}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    let fio_present = Command::new("fio").arg("--version").output().is_ok_and(|o| o.status.success());
    for (row, op) in rows.iter().zip(["write", "read"]) {
        assert_eq!(row["op"], op);
        assert_eq!(row["block_bytes"], 65536);
        assert_eq!(row["queue_depth"], 4);
        assert!(row["ours_gb_s"].as_f64().expect("number") > 0.0);
        if fio_present {
            assert!(row["fio_gb_s"].as_f64().expect("fio ran") > 0.0);
            assert!(row["ratio"].as_f64().expect("ratio") > 0.0);
        } else {
            assert!(row["fio_gb_s"].is_null());
            eprintln!("fio is not installed: the fio half of this test is skipped");
        }
    }
    // Nothing is left behind in the directory but our JSON.
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("rows.json")], "{left:?}");
}

#[test]
fn bench_storage_rejects_bad_sizes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(node_binary())
        .args(["bench", "storage", "--block-size", "5000"])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiple of 4KiB"));
}
