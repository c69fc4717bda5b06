//! `dynamo-node gpu-check`: without a usable CUDA device it says why and exits 3; with one it runs
//! every kernel comparison and exits 0 only when all of them pass. Which branch this test asserts
//! is decided by `cuda::probe()` on this machine, so it is meaningful on both.

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
