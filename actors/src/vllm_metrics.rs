//! vLLM's Prometheus text (`GET /metrics`), as the node reads it: the engine's own report of its
//! load (requests running and waiting, KV cache in use) for the router, and its cache
//! configuration at start.
//!
//! Series names as vLLM 0.32 exports them (one sample per engine core, labelled `engine`):
//! `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0 to 1)
//! and `vllm:cache_config_info{block_size="…",num_gpu_blocks="…",…} 1.0`.

use crate::worker::EngineReport;

/// The value of label `label` on the first sample of `series` (a name with its `{`, e.g.
/// `vllm:cache_config_info{`).
pub fn label_of<'a>(metrics: &'a str, series: &str, label: &str) -> Option<&'a str> {
    let line = metrics.lines().find(|l| l.starts_with(series))?;
    let start = line.find(&format!("{label}=\""))? + label.len() + 2;
    line[start..].split('"').next()
}

/// The samples of metric `name`: their sum, and how many there were.
fn samples(metrics: &str, name: &str) -> (f64, usize) {
    let mut found = (0.0, 0);
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(name) else { continue };
        let value = match rest.as_bytes().first() {
            Some(b'{') => rest.rsplit_once('}').map(|(_, v)| v),
            Some(b' ') => Some(rest),
            _ => None,
        };
        // A sample's value, then an optional timestamp.
        if let Some(v) = value.and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<f64>().ok())
            && v.is_finite()
        {
            found.0 += v;
            found.1 += 1;
        }
    }
    found
}

/// The engine's load from its metrics; `None` when they lack the request gauges (not vLLM, or a
/// version that names them otherwise).
pub fn report(metrics: &str) -> Option<EngineReport> {
    let (running, with_running) = samples(metrics, "vllm:num_requests_running");
    let (waiting, with_waiting) = samples(metrics, "vllm:num_requests_waiting");
    if with_running == 0 || with_waiting == 0 {
        return None;
    }
    // One sample per engine core: the cache in use is their mean.
    let (usage, cores) = samples(metrics, "vllm:kv_cache_usage_perc");
    let kv_usage = if cores > 0 { usage / cores as f64 } else { 0.0 };
    let kv_blocks = label_of(metrics, "vllm:cache_config_info{", "num_gpu_blocks")
        .and_then(|b| b.parse::<usize>().ok())
        .unwrap_or(0);
    Some(EngineReport {
        waiting: waiting.max(0.0).round() as usize,
        running: running.max(0.0).round() as usize,
        kv_usage,
        kv_blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_is_read_from_vllms_gauges() {
        let metrics = "\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 3.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 2.0
vllm:num_requests_waiting_by_reason{engine=\"0\",reason=\"capacity\"} 2.0
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.25
vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"512\"} 1.0
";
        let report = report(metrics).expect("a report");
        assert_eq!(report, EngineReport { waiting: 2, running: 3, kv_usage: 0.25, kv_blocks: 512 });
    }

    #[test]
    fn engine_cores_add_up_and_their_cache_usage_is_averaged() {
        let metrics = "\
vllm:num_requests_running{engine=\"0\"} 1
vllm:num_requests_running{engine=\"1\"} 2
vllm:num_requests_waiting{engine=\"0\"} 0
vllm:num_requests_waiting{engine=\"1\"} 4 1700000000000
vllm:kv_cache_usage_perc{engine=\"0\"} 0.5
vllm:kv_cache_usage_perc{engine=\"1\"} 0.25
";
        let report = report(metrics).expect("a report");
        assert_eq!((report.running, report.waiting, report.kv_blocks), (3, 4, 0));
        assert!((report.kv_usage - 0.375).abs() < 1e-9);
    }

    #[test]
    fn metrics_without_the_request_gauges_give_no_report() {
        assert_eq!(report("process_cpu_seconds_total 12.5\n"), None);
        assert_eq!(report("vllm:num_requests_running 1\n"), None, "no waiting gauge");
        assert_eq!(report("vllm:num_requests_running_total 1\nvllm:num_requests_waiting_x 2\n"), None);
    }

    #[test]
    fn the_block_size_is_read_from_the_cache_config_series() {
        let metrics = "# HELP x\nvllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\"} 1.0\n";
        assert_eq!(label_of(metrics, "vllm:cache_config_info{", "block_size"), Some("32"));
        assert_eq!(label_of(metrics, "vllm:cache_config_info{", "num_gpu_blocks"), None);
    }
}
