//! Engines the node launches (`[engine.vllm.launch]`): one `vllm serve` per entry of `devices`,
//! each run under the node's engine guard ([`super::guard`]: the engine's whole process tree ends
//! with the node, however the node ends) and supervised as a stage of a [`Ring`] of their own
//! (started again with backoff when it exits), its output logged as the node's under
//! `engine = N`, and stopped with the node. The node gives each one the flags its worker needs,
//! and with `connector` the node's KV connector: vLLM's `OffloadingConnector` loading the node's
//! plug-in, which the binary carries and writes under `node.data_dir`, so the engines' blocks go
//! through G2, G3 and G4 with no step of the operator's.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use anyhow::Context;
use dynamo_actors::ring::{BoxFuture, Phase, Restart, Ring, RingBuilder, Running, Stage};
use dynamo_config::NodeConfig;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The plug-in vLLM's `OffloadingConnector` loads (`runtime/python/dynamo_node_vllm`), carried
/// in the binary.
const PLUGIN: [(&str, &str); 5] = [
    ("__init__.py", include_str!("../../python/dynamo_node_vllm/__init__.py")),
    ("client.py", include_str!("../../python/dynamo_node_vllm/client.py")),
    ("manager.py", include_str!("../../python/dynamo_node_vllm/manager.py")),
    ("spec.py", include_str!("../../python/dynamo_node_vllm/spec.py")),
    ("worker.py", include_str!("../../python/dynamo_node_vllm/worker.py")),
];

/// How long an engine has to exit after SIGTERM before its process group is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The engines the node launched.
#[derive(Debug)]
pub struct Launched {
    ring: Ring,
    /// Each engine's guard while it runs (0 while it does not): told to stop when the node drops
    /// this without stopping it.
    guards: Arc<[AtomicI32]>,
}

/// What starts one engine.
#[derive(Clone, Debug)]
struct EngineCommand {
    index: usize,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Launched {
    /// Starts one engine per entry of `engine.vllm.launch.devices` (each is then up once its
    /// `/health` answers: [`super::attach`] waits for that), each under `guard` (this binary:
    /// its `engine-guard` subcommand). `block_tokens` is the node's block size, which the
    /// engines take so the router can name what they cache.
    pub async fn start(cfg: &NodeConfig, block_tokens: usize, guard: &Path) -> anyhow::Result<Launched> {
        let commands = commands(cfg, block_tokens)?;
        let guards: Arc<[AtomicI32]> = commands.iter().map(|_| AtomicI32::new(0)).collect();
        let mut ring = RingBuilder::new();
        for command in commands {
            // One label per engine (a handful, for the node's life): the ring counts restarts by it.
            let name: &'static str = Box::leak(format!("vllm_engine_{}", command.index).into_boxed_str());
            let (guards, guard) = (guards.clone(), guard.to_owned());
            ring = ring.stage(Stage::new(name, Phase::Outside, Restart::BACKOFF, move || {
                let (command, guards, guard) = (command.clone(), guards.clone(), guard.clone());
                async move { spawn(&guard, command, guards) }
            }));
        }
        let ring = ring.start().await.map_err(|e| anyhow::anyhow!("cannot launch {}: {}", e.stage, e.reason))?;
        Ok(Launched { ring, guards })
    }

    /// Stops every engine (SIGTERM to its process group, SIGKILL after [`STOP_GRACE`]) and waits.
    pub async fn stop(mut self) {
        self.ring.stop_all().await;
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        // Each guard stops its engine's group (with its grace) on its own.
        for guard in self.guards.iter() {
            let pid = guard.swap(0, Ordering::AcqRel);
            if pid > 0 {
                signal(pid, libc::SIGTERM);
            }
        }
    }
}

/// Sends `sig` to the guard `pid`.
fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a guard this node started, its pid held only while it is not yet
    // reaped (so not reused); it touches no memory of this process.
    unsafe { libc::kill(pid, sig) };
}

/// The command line and environment of each engine `cfg` launches.
fn commands(cfg: &NodeConfig, block_tokens: usize) -> anyhow::Result<Vec<EngineCommand>> {
    let launch = &cfg.engine.vllm.launch;
    let model = cfg.model.path.as_deref().context("launching vLLM engines needs model.path")?;
    let plugin = if launch.connector { Some(write_plugin(&cfg.node.data_dir)?) } else { None };
    let socket = std::path::absolute(crate::node::endpoint_socket(cfg)).context("the engine endpoint's socket")?;
    let (program, first) = launch.command.split_first().context("engine.vllm.launch.command is empty")?;
    let mut commands = Vec::with_capacity(launch.devices.len());
    for (index, device) in launch.devices.iter().enumerate() {
        let port = usize::from(launch.port) + 2 * index;
        let events = json!({"enable_kv_cache_events": true, "publisher": "zmq",
                            "endpoint": format!("tcp://*:{}", port + 1), "topic": ""});
        let mut args: Vec<String> = first.to_vec();
        args.push(model.display().to_string());
        for flag in [
            ["--host", &launch.host],
            ["--port", &port.to_string()],
            ["--block-size", &block_tokens.to_string()],
            ["--scheduling-policy", "priority"],
            ["--kv-events-config", &events.to_string()],
        ] {
            args.extend(flag.map(str::to_owned));
        }
        args.extend(
            ["--enable-prefix-caching", "--enable-scale-out", "--enable-prompt-tokens-details"].map(str::to_owned),
        );
        if let Some(key) = &cfg.engine.vllm.api_key {
            args.extend(["--api-key".to_owned(), key.clone()]);
        }
        let mut env: Vec<(String, String)> = vec![(launch.device_env.clone(), device.clone())];
        if let Some(plugin) = &plugin {
            let transfer = json!({
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "DynamoNodeSpec",
                    "spec_module_path": "dynamo_node_vllm",
                    "socket": socket.display().to_string(),
                    "engine_id": format!("engine-{index}"),
                },
            });
            args.extend(["--kv-transfer-config".to_owned(), transfer.to_string()]);
            let path = std::env::var("PYTHONPATH").ok().filter(|p| !p.is_empty());
            let path = match path {
                Some(rest) => format!("{}:{rest}", plugin.display()),
                None => plugin.display().to_string(),
            };
            env.push(("PYTHONPATH".to_owned(), path));
        }
        args.extend(launch.args.iter().cloned());
        env.extend(launch.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        commands.push(EngineCommand { index, program: program.clone(), args, env });
    }
    Ok(commands)
}

/// Writes the plug-in under `data_dir` (`vllm-plugin/dynamo_node_vllm`) and returns the
/// directory to put on the engines' `PYTHONPATH`: the plug-in of this binary, whatever is
/// installed.
fn write_plugin(data_dir: &Path) -> anyhow::Result<PathBuf> {
    let root = std::path::absolute(data_dir.join("vllm-plugin"))?;
    let package = root.join("dynamo_node_vllm");
    std::fs::create_dir_all(&package).with_context(|| format!("creating {}", package.display()))?;
    for (name, text) in PLUGIN {
        std::fs::write(package.join(name), text)
            .with_context(|| format!("writing {}", package.join(name).display()))?;
    }
    Ok(root)
}

/// Starts engine `command.index` under `guard`: its task ends when the engine exits (the ring
/// then starts it again by its backoff), and its stop ends it.
fn spawn(guard: &Path, command: EngineCommand, guards: Arc<[AtomicI32]>) -> Result<Running, String> {
    let index = command.index;
    let mut cmd = tokio::process::Command::new(guard);
    cmd.arg("engine-guard")
        .args(["--parent", &std::process::id().to_string(), "--grace", &format!("{}s", STOP_GRACE.as_secs()), "--"])
        .arg(&command.program)
        .args(&command.args)
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A terminal's Ctrl-C reaches the node, which stops the engines in order.
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| format!("cannot start the engine guard {}: {e}", guard.display()))?;
    let pid = child.id().map(|id| id as i32).ok_or("the engine guard exited at once")?;
    guards[index].store(pid, Ordering::Release);
    tracing::info!(engine = index, guard = pid, command = %command.program, "launched a vLLM engine");
    if let Some(out) = child.stdout.take() {
        tokio::spawn(log_lines(index, out));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(log_lines(index, err));
    }
    let (exited_tx, exited) = tokio::sync::watch::channel(false);
    let task = tokio::spawn({
        let guards = guards.clone();
        async move {
            let status = child.wait().await;
            let _ = guards[index].compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire);
            match status {
                Ok(status) => tracing::warn!(engine = index, %status, "the vLLM engine exited"),
                Err(e) => tracing::warn!(engine = index, error = %e, "the vLLM engine could not be waited for"),
            }
            let _ = exited_tx.send(true);
        }
    });
    let stop = move || -> BoxFuture<()> {
        Box::pin(async move {
            let mut exited = exited;
            if guards[index].load(Ordering::Acquire) == pid {
                signal(pid, libc::SIGTERM);
            }
            // The guard gives the engine STOP_GRACE, then kills its group.
            let limit = STOP_GRACE + Duration::from_secs(5);
            let ended = tokio::time::timeout(limit, async { exited.wait_for(|&done| done).await.is_ok() }).await;
            if ended.is_err() && guards[index].load(Ordering::Acquire) == pid {
                tracing::error!(engine = index, "the engine guard did not stop within {limit:?}; killing it");
                signal(pid, libc::SIGKILL);
                let _ = exited.wait_for(|&done| done).await.is_ok();
            }
        })
    };
    Ok(Running { task, stop: Box::new(stop) })
}

/// Logs engine `index`'s output line by line at the level vLLM wrote it with.
async fn log_lines(index: usize, output: impl tokio::io::AsyncRead + Unpin) {
    let mut lines = BufReader::new(output).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let line = line.trim_end();
        if line.contains("ERROR") || line.starts_with("Traceback") {
            tracing::error!(target: "vllm", engine = index, "{line}");
        } else if line.contains("WARNING") {
            tracing::warn!(target: "vllm", engine = index, "{line}");
        } else {
            tracing::info!(target: "vllm", engine = index, "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launching(extra: &str) -> NodeConfig {
        let text = format!(
            "[model]\npath = \"/models/tiny\"\n[engine]\nkind = \"vllm\"\n[engine_endpoint]\nenabled = true\n\
             [engine.vllm.launch]\ndevices = [\"0\", \"1\"]\nport = 9000\n{extra}"
        );
        NodeConfig::parse(&text, "test.toml").unwrap()
    }

    #[test]
    fn each_engine_gets_its_device_ports_block_size_and_the_connector() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = launching("args = [\"--dtype\", \"bfloat16\"]\nenv = { VLLM_X = \"1\" }\n");
        cfg.node.data_dir = dir.path().to_owned();
        let commands = commands(&cfg, 32).unwrap();
        assert_eq!(commands.len(), 2);
        let second = &commands[1];
        assert_eq!(second.program, "vllm");
        assert_eq!(&second.args[..2], ["serve", "/models/tiny"]);
        let after = |flag: &str| second.args.iter().position(|a| a == flag).map(|i| second.args[i + 1].clone());
        assert_eq!(after("--port").as_deref(), Some("9002"));
        assert_eq!(after("--block-size").as_deref(), Some("32"));
        assert!(after("--kv-events-config").unwrap().contains("tcp://*:9003"));
        let transfer: serde_json::Value = serde_json::from_str(&after("--kv-transfer-config").unwrap()).unwrap();
        let socket = transfer["kv_connector_extra_config"]["socket"].as_str().unwrap();
        assert!(socket.starts_with('/') && socket.ends_with("engines.sock"), "{socket}");
        assert_eq!(&second.args[second.args.len() - 2..], ["--dtype", "bfloat16"], "the operator's flags come last");
        let env = |key: &str| second.env.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        assert_eq!(env("CUDA_VISIBLE_DEVICES").as_deref(), Some("1"));
        assert_eq!(env("VLLM_X").as_deref(), Some("1"));
        let plugin = PathBuf::from(env("PYTHONPATH").unwrap().split(':').next().unwrap());
        assert!(plugin.join("dynamo_node_vllm/spec.py").is_file(), "the plug-in is written where PYTHONPATH points");
        assert_eq!(
            cfg.engine.vllm.engine_urls(),
            ["http://127.0.0.1:9000", "http://127.0.0.1:9002"],
            "the workers attach where the engines listen"
        );
    }

    #[test]
    fn without_the_connector_no_plug_in_is_configured() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = launching("connector = false\n");
        cfg.node.data_dir = dir.path().to_owned();
        let commands = commands(&cfg, 64).unwrap();
        assert!(commands.iter().all(|c| !c.args.iter().any(|a| a == "--kv-transfer-config")));
        assert!(commands.iter().all(|c| !c.env.iter().any(|(k, _)| k == "PYTHONPATH")));
        assert!(!dir.path().join("vllm-plugin").exists());
    }
}
