#!/usr/bin/env python3
"""aiperf, the load generator NVIDIA's benchmarks use, against a real dynamo-node, next to the node's own metrics.

Starts the node (the `tiny` model on this CPU, finer latency buckets than the default so that the
comparison means something), then drives it over HTTP with `aiperf profile`, streaming Chat
Completions:

  * a synthetic chat load at each of --concurrency (1, 4 and 16 users by default): --isl prompt
    tokens of random text, --osl output tokens with `ignore_eos`;
  * an agentic trace of ../shared/traces/ replayed as aiperf's multi-turn mooncake trace: the first
    --trace-sessions sessions, every length divided by --trace-scale (each of the trace's 512-token
    hash blocks becomes one 32-token block of the node, so the shared system prompt and each
    conversation's growing history keep their structure at a size this CPU prefills), think times
    capped at --trace-think-cap seconds.

For every run it scrapes the node's /metrics before and after and compares, on the difference:
aiperf's TTFT p50/p90/p99 with the same quantiles of `dynamo_node_request_ttft_seconds`
(interpolated inside the bucket as Prometheus' histogram_quantile does), aiperf's mean
inter-token latency with the mean of `dynamo_node_inter_token_seconds`, its request count with
`dynamo_node_requests_total`, its output tokens (the usage the node reported) with the tokens the
node streamed. A TTFT percentile agrees when aiperf's lies within the node's buckets of the two
observations that any percentile method interpolates between (with few samples they can be
buckets apart), plus 5% + 10 ms for the client's round trip and scheduling; it is required only
where at least five requests lie above it (fewer, and one client hiccup decides it); the mean ITL, when the two differ by no more than the width of the bucket that
holds the node's. aiperf's own artifacts stay in --out (one directory per run) beside our
`report.md` and `report.json`. Exit status 1 when a TTFT percentile or a count disagrees.

Usage: benches/scripts/aiperf_load.py PATH/TO/dynamo-node [--aiperf aiperf] [--out aiperf-report]
(a release build: `cargo build --release -p dynamo-node`; aiperf: `pip install aiperf==0.13.0`).

aiperf generates its prompts with a tokenizer; `--tokenizer builtin` is tiktoken's o200k_base, the
node's own vocabulary, which tiktoken downloads on first use. Without network access this seeds
tiktoken's cache from the copy the `tiktoken-rs` crate ships (checked against tiktoken's hash).
"""

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
TTFT = "dynamo_node_request_ttft_seconds"
ITL = "dynamo_node_inter_token_seconds"
REQUESTS = "dynamo_node_requests_total"
# 1 ms to 60 s in steps of about 20%: a bucket's width is a fifth of its bound.
BUCKETS = [round(0.001 * 1.2**i, 6) for i in range(61)]


def seed_tiktoken_cache(cache: str) -> None:
    """Put o200k_base where tiktoken looks before it downloads (the file name is the URL's SHA-1)."""
    target = os.path.join(cache, hashlib.sha1(O200K_URL.encode()).hexdigest())
    if os.path.exists(target):
        return
    cargo_home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
    for path in sorted(glob.glob(os.path.join(cargo_home, "registry/src/*/tiktoken-rs-*/assets/o200k_base.tiktoken"))):
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() == O200K_SHA256:
            os.makedirs(cache, exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)
            return
    print("no local o200k_base.tiktoken; tiktoken will try to download it", file=sys.stderr)


class Node:
    """The daemon on free ports, with its announcements read from stdout and its log kept."""

    def __init__(self, binary: str, work: str):
        data_dir = os.path.join(work, "data")
        config = os.path.join(work, "node.toml")
        with open(config, "w") as f:
            f.write("[metrics]\nlatency_buckets_seconds = [" + ", ".join(map(str, BUCKETS)) + "]\n")
        self.log = open(os.path.join(work, "node.log"), "w")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", config, "--data-dir", data_dir,
             "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        self.url = self.metrics_url = None
        for line in self.proc.stdout:
            if m := re.match(r"metrics on (\S+)", line):
                self.metrics_url = m.group(1)
            elif m := re.match(r"serving the OpenAI API on (\S+)/v1", line):
                self.url = m.group(1)
            elif line.startswith("ready"):
                break
        if not (self.url and self.metrics_url):
            raise SystemExit(f"the node did not start (exit {self.proc.poll()}); see {self.log.name}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def scrape(self) -> dict:
        """Samples of the families compared here: {(name, labels): value}."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        samples = {}
        for line in text.splitlines():
            m = re.match(r"^(dynamo_node_\w+?)(\{[^}]*\})? (\S+)$", line)
            if m and m.group(1).startswith((TTFT, ITL, REQUESTS)):
                samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
        return samples

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


class Histogram:
    """One histogram's difference between two scrapes."""

    def __init__(self, before: dict, after: dict, name: str):
        def delta(key):
            return after.get(key, 0.0) - before.get(key, 0.0)

        bounds = []
        for metric, labels in after:
            if metric == f"{name}_bucket":
                le = re.search(r'le="([^"]+)"', labels).group(1)
                bounds.append((math.inf if le == "+Inf" else float(le), delta((metric, labels))))
        self.buckets = sorted(bounds)
        self.count = delta((f"{name}_count", ""))
        self.sum = delta((f"{name}_sum", ""))

    def quantile(self, q: float) -> tuple[float, float]:
        """histogram_quantile's estimate, and the width of the bucket it falls in (both seconds)."""
        rank = q * self.count
        lower, below = 0.0, 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(upper):
                    return lower, math.inf
                return lower + (upper - lower) * (rank - below) / (cumulative - below), upper - lower
            lower, below = upper, cumulative
        return math.nan, math.nan

    def bucket_of(self, k: int) -> tuple[float, float]:
        """The bounds of the bucket that holds the k-th smallest observation (1-based)."""
        lower = 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= k:
                return lower, upper
            lower = upper
        return lower, math.inf

    def sample_range(self, q: float) -> tuple[float, float]:
        """Where any percentile method over the same observations can put quantile q: between the
        bucket of the order statistic below q·(n−1) and the bucket of the one above."""
        pos = q * (self.count - 1)
        return self.bucket_of(math.floor(pos) + 1)[0], self.bucket_of(math.ceil(pos) + 1)[1]

    def width_at(self, value: float) -> float:
        lower = 0.0
        for upper, _ in self.buckets:
            if value <= upper:
                return upper - lower
            lower = upper
        return math.inf


def requests_answered(before: dict, after: dict) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == REQUESTS and 'status="200"' in k[1])


def run_aiperf(args, node: Node, name: str, seed: int, extra: list[str]) -> dict:
    artifacts = os.path.join(args.out, name)
    shutil.rmtree(artifacts, ignore_errors=True)
    command = [
        *args.aiperf.split(), "profile", "--model", "tiny", "--url", node.url, "--endpoint-type", "chat",
        "--streaming", "--tokenizer", "builtin", "--use-server-token-count", "--random-seed", str(seed),
        "--artifact-dir", artifacts, "--ui-type", "none", *extra,
    ]
    before = node.scrape()
    started = time.monotonic()
    with open(os.path.join(args.out, f"{name}.log"), "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"aiperf failed ({done.returncode}); see {log.name}")
    time.sleep(0.5)  # the last response's metrics land as its stream closes
    after = node.scrape()
    with open(os.path.join(artifacts, "profile_export_aiperf.json")) as f:
        report = json.load(f)
    report["itl_per_gap_ms"] = itl_per_gap(os.path.join(artifacts, "profile_export.jsonl"))
    return compare(name, report, Histogram(before, after, TTFT), Histogram(before, after, ITL),
                   requests_answered(before, after), time.monotonic() - started)


def itl_per_gap(records: str) -> float | None:
    """aiperf's inter-token latency averaged over every gap, as the node's histogram counts it
    (aiperf's own average weighs each request alike, whatever its length)."""
    total = gaps = 0.0
    with open(records) as f:
        for line in f:
            metrics = json.loads(line).get("metrics", {})
            itl, osl = metrics.get("inter_token_latency"), metrics.get("output_sequence_length")
            if itl and osl and osl["value"] > 1:
                total += itl["value"] * (osl["value"] - 1)
                gaps += osl["value"] - 1
    return total / gaps if gaps else None


def compare(name: str, report: dict, ttft: Histogram, itl: Histogram, answered: float, wall: float) -> dict:
    row = {"run": name, "wall_s": round(wall, 1), "checks": []}

    def check(what: str, ours: float, theirs: float, tolerance: float, must: bool, within=None):
        ok = abs(ours - theirs) <= tolerance if within is None else within[0] <= theirs <= within[1]
        row["checks"].append({"what": what, "aiperf": theirs, "node": ours, "tolerance": tolerance,
                              "within": within, "agrees": ok, "required": must})

    for q in ("p50", "p90", "p99"):
        # aiperf interpolates between the two observations around the quantile; with few samples
        # those may lie buckets apart, so its value must fall within their buckets' bounds. A
        # client's TTFT also holds the HTTP round trip and the client's own scheduling, which on a
        # shared two-core machine (aiperf's Python beside the node) reaches several milliseconds:
        # 5% + 10 ms of slack above.
        quantile = int(q[1:]) / 100
        estimate, width = ttft.quantile(quantile)
        low, high = ttft.sample_range(quantile)
        within = (low * 1e3, high * 1e3 * 1.05 + 10)
        # A quantile with fewer than five requests above it is decided by one or two hiccups of
        # the client (not of the node): reported, not required.
        few_above = ttft.count * (1 - quantile) < 5
        check(f"TTFT {q} (ms)", estimate * 1e3, report["time_to_first_token"][q], width * 1e3,
              not few_above, within)
    if itl.count:
        mean = itl.sum / itl.count
        theirs = report["itl_per_gap_ms"] or report["inter_token_latency"]["avg"]
        check("ITL mean (ms)", mean * 1e3, theirs, itl.width_at(mean) * 1e3, False)
    requests = report["request_count"]["avg"]
    check("requests", answered, requests, 0, True)
    # Every streamed token is one TTFT (the first) or one inter-token gap (each later one).
    check("output tokens", ttft.count + itl.count, report["total_osl"]["avg"], 0, True)
    row["aiperf"] = {
        "ttft_ms": {q: report["time_to_first_token"][q] for q in ("avg", "p50", "p90", "p99")},
        "itl_ms": {q: report["inter_token_latency"][q] for q in ("avg", "p50", "p90", "p99")},
        "output_tokens_per_s": report["output_token_throughput"]["avg"],
        "requests_per_s": report["request_throughput"]["avg"],
        "isl_mean": report["input_sequence_length"]["avg"],
        "cached_prompt_pct": report.get("overall_usage_prompt_cache_read_pct", {}).get("avg"),
        "duration_s": report["benchmark_duration"]["avg"],
    }
    return row


def scaled_trace(path: str, sessions: int, scale: int, out: str) -> str:
    """The first `sessions` sessions of an agentic-code trace, every length divided by `scale`."""
    kept, lines = [], []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["session_id"] not in kept:
                if len(kept) == sessions:
                    continue
                kept.append(row["session_id"])
            row["input_length"] = max(1, math.ceil(row["input_length"] / scale))
            # Outputs by half as much: the tiny model decodes slower than it prefills.
            row["output_length"] = max(1, math.ceil(row["output_length"] / scale * 2))
            lines.append(json.dumps(row) + "\n")
    target = os.path.join(out, "trace.jsonl")
    with open(target, "w") as f:
        f.writelines(lines)
    return target


def table(rows: list[dict]) -> str:
    out = ["| run | aiperf TTFT p50 / p90 / p99 (ms) | node TTFT p50 / p90 / p99 (ms, accepted range) | aiperf ITL mean | node ITL mean "
           "| output tok/s | req/s | cached | agrees |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = {c["what"]: c for c in r["checks"]}
        ttft = [by[f"TTFT {q} (ms)"] for q in ("p50", "p90", "p99")]
        itl = by.get("ITL mean (ms)")
        a = r["aiperf"]
        cached = "" if a["cached_prompt_pct"] is None else f"{a['cached_prompt_pct']:.1f}%"
        bad = [c["what"] for c in r["checks"] if not c["agrees"]]
        theirs = " / ".join(f"{c['aiperf']:.0f}" for c in ttft)
        ours = " / ".join(f"{c['node']:.0f} ({c['within'][0]:.0f}-{c['within'][1]:.0f})" for c in ttft)
        verdict = "yes" if not bad else "no: " + ", ".join(bad)
        out.append(
            f"| {r['run']} | {theirs} | {ours} | {itl['aiperf']:.1f} | {itl['node']:.1f} ±{itl['tolerance']:.1f} "
            f"| {a['output_tokens_per_s']:.0f} | {a['requests_per_s']:.2f} | {cached} | {verdict} |"
        )
    return "\n".join(out)


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf command (a path, or 'python -m aiperf')")
    ap.add_argument("--out", default="aiperf-report")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-user", type=int, default=12)
    ap.add_argument("--isl", type=int, default=512)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--trace", default=os.path.join(here, "../../../shared/traces/aiperf_agentic_code_s42_200.jsonl"))
    ap.add_argument("--trace-sessions", type=int, default=8, help="0 skips the trace")
    ap.add_argument("--trace-scale", type=int, default=16)
    ap.add_argument("--trace-think-cap", type=float, default=2.0)
    ap.add_argument("--trace-duration", type=int, default=120)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    cache = os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dynamo-tiktoken"))
    seed_tiktoken_cache(cache)

    work = tempfile.mkdtemp(prefix="dynamo-aiperf-")
    node = Node(args.binary, work)
    rows = []
    try:
        for users in map(int, args.concurrency.split(",")):
            rows.append(run_aiperf(args, node, f"chat-c{users}", users, [
                "--concurrency", str(users), "--request-count", str(max(users * args.requests_per_user, 16)),
                "--synthetic-input-tokens-mean", str(args.isl), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(args.osl), "--output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true",
            ]))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.trace_sessions and not os.path.exists(args.trace):
            print(f"no trace at {args.trace}: the trace replay is skipped", file=sys.stderr)
        elif args.trace_sessions:
            trace = scaled_trace(args.trace, args.trace_sessions, args.trace_scale, args.out)
            rows.append(run_aiperf(args, node, "agentic-trace", 0, [
                "--input-file", trace, "--custom-dataset-type", "mooncake-trace",
                "--prompt-input-tokens-block-size", str(512 // args.trace_scale),
                "--inter-turn-delay-cap-seconds", str(args.trace_think_cap),
                "--benchmark-duration", str(args.trace_duration),
                # Requests in flight at the end finish and count: none is cut off on one side only.
                "--benchmark-grace-period", "inf",
            ]))
    finally:
        node.stop()
    shutil.copy(os.path.join(work, "node.log"), os.path.join(args.out, "node.log"))
    shutil.rmtree(work, ignore_errors=True)

    text = table(rows)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(f"aiperf against dynamo-node ({args.binary}): node quantiles (histogram_quantile) with the range aiperf's must fall in; ITL ± the bucket width\n\n{text}\n")
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(text)
    failed = [f"{r['run']}: {c['what']}" for r in rows for c in r["checks"] if c["required"] and not c["agrees"]]
    if failed:
        print("disagreements: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
