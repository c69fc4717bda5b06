//! Compiles every CUDA source with NVRTC for sm_90 — no GPU needed, only `libnvrtc.so.13` (from the
//! CUDA toolkit or the `nvidia-cuda-nvrtc` pip wheel; point `DYNAMO_NVRTC_LIB_DIR` at its directory).
//! This is what catches a syntax or type error in `kernels/cuda/*.cu` on a machine without a GPU.
//!
//! NVRTC is not on a fresh machine, so these tests are ignored by default (the test runner reports
//! them skipped) and `.ci/run`, which installs the wheel, runs them with `--run-ignored only`.
//! Asked for without NVRTC, they fail with the reason — they never pass without compiling.

use dynamo_kernels::cuda::loader;

const NEEDS_NVRTC: &str = "needs NVRTC (libnvrtc.so.13): .ci/run installs the nvidia-cuda-nvrtc wheel and runs this";

fn require_nvrtc() {
    if let Err(e) = loader::nvrtc_available() {
        panic!("{NEEDS_NVRTC}; not found here: {e} (set DYNAMO_NVRTC_LIB_DIR to its directory)");
    }
}

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.13): .ci/run installs the nvidia-cuda-nvrtc wheel and runs this"]
fn every_source_compiles_for_sm90() {
    require_nvrtc();
    let (major, minor) = loader::nvrtc_version().expect("nvrtc version");
    eprintln!("NVRTC {major}.{minor}");
    let mut failures = Vec::new();
    for (name, src) in loader::SOURCES {
        match loader::compile_source(name, src, "sm_90") {
            Ok(ptx) => {
                assert!(ptx.contains(".target sm_90"), "{name}: PTX for the wrong target");
                eprintln!("{name}: {} bytes of PTX", ptx.len());
            }
            Err(e) => failures.push(format!("{e}")),
        }
    }
    assert!(failures.is_empty(), "NVRTC rejected sources:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.13): .ci/run installs the nvidia-cuda-nvrtc wheel and runs this"]
fn every_kernel_entry_point_is_in_the_ptx() {
    require_nvrtc();
    let ptx = loader::compiled_sources("sm_90").expect("compile");
    let all: String = ptx.iter().map(|(_, p)| p.as_str()).collect();
    for entry in dynamo_kernels::cuda::KERNEL_NAMES {
        assert!(all.contains(&format!(".entry {entry}(")), "kernel {entry} missing from the PTX");
    }
}
