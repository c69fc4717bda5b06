//! `dynamo-node gpu-check`: without a usable CUDA device it says why and exits 3; with one it runs
//! every kernel comparison and exits 0 only when all of them pass. Which branch this test asserts
//! is decided by `cuda::probe()` on this machine, so it is meaningful on both.
//!
//! `scripts/device-check.sh`, the one prepared run for a machine lent with a GPU, serves a
//! conversation on the CPU here, so it is known to work before a device minute is spent on it.

use std::process::Command;

use dynamo_kernels::cuda;

#[test]
fn gpu_check_reports_the_device_or_its_absence() {
    let out = Command::new(dynamo_tests::node_binary())
        .args(["gpu-check", "--bandwidth-mib", "32"])
        .output()
        .expect("run dynamo-node");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match cuda::probe() {
        Err(why) => {
            eprintln!("no GPU here; asserting the no-device path ({why})");
            assert_eq!(out.status.code(), Some(3), "stdout:\n{stdout}\nstderr:\n{stderr}");
            assert!(stderr.contains("no usable CUDA device: "), "stderr:\n{stderr}");
            assert!(stderr.contains("CUDA is unavailable"), "the reason is given: {stderr}");
        }
        Ok(info) => {
            eprintln!("{info}\n{stdout}");
            assert_eq!(out.status.code(), Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
            assert!(stdout.contains("kernel checks, 0 failed"), "stdout:\n{stdout}");
        }
    }
}

#[test]
fn the_device_check_script_serves_a_conversation_on_the_cpu() {
    let out_dir = tempfile::tempdir().expect("tempdir");
    let free_port = || std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
    let ports = format!("{},{}", free_port(), free_port());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/device-check.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(["--device", "cpu", "--steps", "30", "--ports", &ports, "--out"])
        .arg(out_dir.path())
        .arg("--bin")
        .arg(dynamo_tests::node_binary())
        .output()
        .expect("run the script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("ok: turn 2 reused"), "stdout:\n{stdout}");
    assert!(stdout.contains("dynamo_node_kv_hit_tokens_total{tier=\"g1\"}"), "stdout:\n{stdout}");
    assert!(stdout.contains("ok: stopped cleanly on SIGTERM"), "stdout:\n{stdout}");
}
