//! Finding the CUDA libraries and compiling the kernel sources with NVRTC.
//!
//! `cudarc` loads its libraries lazily by bare name and panics when one is missing, so every entry
//! point of the CUDA backend first calls `require_library` for each library it needs: it
//! `dlopen`s it (`RTLD_NOW`) and turns absence into [`KernelError::CudaUnavailable`]. A library that is not on the loader's
//! search path but sits in a known directory (`DYNAMO_CUDA_LIB_DIR`, `DYNAMO_NVRTC_LIB_DIR`,
//! `$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`, a Python wheel's `nvidia/cu13/lib`) is loaded by full
//! path with `RTLD_GLOBAL` and kept loaded: the dynamic loader then satisfies cudarc's later
//! load-by-soname with that copy.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::backend::KernelError;

/// The CUDA C sources, `(file name, text)`; each is compiled after [`PRELUDE`].
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise.cu", include_str!("../../cuda/elementwise.cu")),
    ("norm_rope.cu", include_str!("../../cuda/norm_rope.cu")),
    ("attention.cu", include_str!("../../cuda/attention.cu")),
    ("attention_mma.cu", include_str!("../../cuda/attention_mma.cu")),
    ("kv_copy.cu", include_str!("../../cuda/kv_copy.cu")),
    ("sampling.cu", include_str!("../../cuda/sampling.cu")),
];

/// Helpers shared by every source (bf16 conversions, warp reductions).
pub const PRELUDE: &str = include_str!("../../cuda/common.cuh");

/// A CUDA library the backend needs: candidate file names, most specific first.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lib {
    pub(crate) what: &'static str,
    pub(crate) names: &'static [&'static str],
    /// File-name prefixes of libraries loaded first from the same directory (cuBLAS needs
    /// cuBLASLt; NVRTC opens its builtins library by bare name).
    pub(crate) deps: &'static [&'static str],
}

pub(crate) const DRIVER: Lib =
    Lib { what: "the NVIDIA driver library", names: &["libcuda.so.1", "libcuda.so"], deps: &[] };
pub(crate) const NVRTC: Lib =
    Lib { what: "NVRTC", names: &["libnvrtc.so.13", "libnvrtc.so"], deps: &["libnvrtc-builtins.so.13"] };
pub(crate) const CUBLAS: Lib =
    Lib { what: "cuBLAS", names: &["libcublas.so.13", "libcublas.so"], deps: &["libcublasLt.so.13"] };

fn dlerror_string() -> String {
    // SAFETY: dlerror returns null or a pointer to a NUL-terminated string owned by libc, valid
    // until the next dl* call on this thread; it is copied at once.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated, see above.
        unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned()
    }
}

/// `dlopen`s `name`; `keep` leaves it loaded (with `RTLD_GLOBAL`), otherwise it is closed again.
fn try_dlopen(name: &str, keep: bool) -> Result<(), String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    let flags = if keep { libc::RTLD_NOW | libc::RTLD_GLOBAL } else { libc::RTLD_NOW | libc::RTLD_LOCAL };
    // SAFETY: `c` is a valid C string; dlopen has no other preconditions.
    let handle = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if handle.is_null() {
        return Err(dlerror_string());
    }
    if !keep {
        // SAFETY: `handle` was just returned by dlopen and is closed exactly once.
        unsafe { libc::dlclose(handle) };
    }
    Ok(())
}

/// Directories searched for libraries that the loader's own search path does not find.
pub fn library_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["DYNAMO_CUDA_LIB_DIR", "DYNAMO_NVRTC_LIB_DIR"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.extend(std::env::split_paths(&v));
        }
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(Path::new(&v).join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.extend(python_wheel_dirs());
    dirs
}

/// `nvidia/cu13/lib` and `nvidia/cuda_nvrtc/lib` under Python site-packages directories (pip wheels).
fn python_wheel_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(v.into());
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(Path::new(&home).join(".local"));
    }
    roots.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(root.join("lib")) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with("python3") {
                continue;
            }
            for site in ["site-packages", "dist-packages"] {
                for sub in ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cublas/lib"] {
                    let dir = entry.path().join(site).join(sub);
                    if dir.is_dir() {
                        out.push(dir);
                    }
                }
            }
        }
    }
    out
}

/// Makes `lib` loadable by soname, from the search path or from [`library_dirs`]. Cached per process.
pub(crate) fn require_library(lib: Lib) -> Result<(), KernelError> {
    type Outcomes = Mutex<Vec<(&'static str, Result<(), String>)>>;
    static DONE: OnceLock<Outcomes> = OnceLock::new();
    let done = DONE.get_or_init(|| Mutex::new(Vec::new()));
    let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, r)) = done.iter().find(|(n, _)| *n == lib.names[0]) {
        return r.clone().map_err(KernelError::CudaUnavailable);
    }
    let result = locate(lib);
    done.push((lib.names[0], result.clone()));
    result.map_err(KernelError::CudaUnavailable)
}

/// Loads (and keeps) every file in `dir` whose name starts with one of `prefixes`.
fn preload_deps(dir: &Path, prefixes: &[&str]) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            prefixes.iter().any(|pre| name.starts_with(pre)) && !name.contains(".alt.")
        })
        .collect();
    paths.sort();
    for path in paths {
        let _ = try_dlopen(&path.to_string_lossy(), true);
    }
}

fn locate(lib: Lib) -> Result<(), String> {
    let mut first_error = None;
    for name in lib.names {
        match try_dlopen(name, false) {
            Ok(()) => return Ok(()),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let dirs = library_dirs();
    for dir in &dirs {
        for name in lib.names {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            preload_deps(dir, lib.deps);
            if try_dlopen(&path.to_string_lossy(), true).is_ok() {
                return Ok(());
            }
        }
    }
    Err(format!(
        "{} ({}) cannot be loaded: {}; also searched {}",
        lib.what,
        lib.names[0],
        first_error.unwrap_or_default(),
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    ))
}

/// Runs `f`, turning a panic inside cudarc (a missing symbol, an unexpected library) into an error.
pub(crate) fn guarded<T>(op: &'static str, f: impl FnOnce() -> Result<T, KernelError>) -> Result<T, KernelError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(KernelError::CudaUnavailable(format!("{op}: {msg}")))
        }
    }
}

/// Whether NVRTC can be loaded (for tests that only compile).
pub fn nvrtc_available() -> Result<(), KernelError> {
    require_library(NVRTC)
}

/// The NVRTC version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    require_library(NVRTC)?;
    guarded("nvrtcVersion", || {
        let mut major = 0;
        let mut minor = 0;
        // SAFETY: NVRTC is loaded (checked above); the out-pointers are valid for the call.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(KernelError::Cuda { op: "nvrtcVersion", detail: format!("{r:?}") });
        }
        Ok((major, minor))
    })
}

/// Compiles one source (prefixed with [`PRELUDE`]) to PTX for `arch` (e.g. `"sm_90"`).
pub fn compile_source(name: &str, source: &str, arch: &str) -> Result<String, KernelError> {
    require_library(NVRTC)?;
    let text = format!("{PRELUDE}\n#line 1 \"{name}\"\n{source}");
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some(name.to_string()),
        ..Default::default()
    };
    guarded("NVRTC", || match cudarc::nvrtc::compile_ptx_with_opts(text, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => Err(KernelError::Cuda {
            op: "nvrtc compile",
            detail: format!("{name} for {arch}:\n{}", log.to_string_lossy()),
        }),
        Err(e) => Err(KernelError::Cuda { op: "nvrtc compile", detail: format!("{name} for {arch}: {e}") }),
    })
}

/// Every source compiled for `arch`, as `(file name, PTX)`; compiled once per architecture per process.
pub fn compiled_sources(arch: &str) -> Result<Vec<(&'static str, String)>, KernelError> {
    type Cache = Mutex<Vec<(String, Vec<(&'static str, String)>)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    if let Some((_, ptx)) = cache.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(a, _)| a == arch) {
        return Ok(ptx.clone());
    }
    let ptx = SOURCES
        .iter()
        .map(|(name, src)| compile_source(name, src, arch).map(|p| (*name, p)))
        .collect::<Result<Vec<_>, _>>()?;
    cache.lock().unwrap_or_else(|e| e.into_inner()).push((arch.to_string(), ptx.clone()));
    Ok(ptx)
}
