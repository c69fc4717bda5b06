//! The CUDA backend against the CPU backend on a real GPU: the whole `gpu_check` comparison.
//!
//! Needs a CUDA GPU, so it is ignored by default and must be asked for:
//! `cargo nextest run -p dynamo-kernels --run-ignored all cuda` (or `dynamo-node gpu-check`).
//! Asked for on a machine without a usable GPU it fails with the reason, never passes.

use dynamo_kernels::cuda::{self, check};

#[test]
#[ignore = "needs a CUDA GPU; run on a GPU machine with --run-ignored or via dynamo-node gpu-check"]
fn cuda_kernels_match_the_cpu_backend() {
    let info = cuda::probe().unwrap_or_else(|e| panic!("no usable CUDA device: {e}"));
    eprintln!("{info}");
    let opts = check::GpuCheckOptions { bandwidth_bytes: 64 << 20, repetitions: 3, ..Default::default() };
    let report = check::gpu_check(&opts).expect("gpu_check");
    eprintln!("{report}");
    assert!(report.all_passed(), "kernel mismatches:\n{report}");
    assert!(report.bandwidth_error.is_none(), "bandwidth section failed:\n{report}");
}

#[test]
fn probe_never_panics_and_backend_agrees() {
    match cuda::probe() {
        Ok(info) => {
            assert!(info.compute_capability.0 >= 5, "{info}");
            cuda::CudaBackend::new(info.ordinal).expect("a probed device opens");
        }
        Err(e) => {
            assert_eq!(e.kind(), "cuda_unavailable", "{e}");
            let err = cuda::CudaBackend::new(0).expect_err("no device, no backend");
            assert_eq!(err.kind(), "cuda_unavailable");
            eprintln!("no GPU here (this test checks only the no-GPU path): {e}");
        }
    }
}
