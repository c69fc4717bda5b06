#!/usr/bin/env bash
# One prepared run of every GPU check, for a machine lent with a GPU for a few minutes: nothing to
# build there, only the release binary built here (carry target/release/dynamo-node).
#
#   scripts/device-check.sh [--device cuda|cpu] [--bin PATH] [--out DIR] [--skip-gpu-check]
#                           [--ports HTTP,METRICS] [--steps N]
#
# 1. `dynamo-node gpu-check`: every CUDA kernel against the CPU backend, the gather/scatter and
#    pinned-copy bandwidths, the PyTorch-referenced prefill, and the end-to-end cached-prefix TTFT
#    table (llama-8b, 32K-token prompt: cold, G1, G2, G3, another worker, and the overlap of a
#    G2 load with the prefill of 4K new tokens).
# 2. The serving node on that device: two workers, G1 sized from device memory, G2 registered with
#    the device, G3 on disk; turn 1 of a conversation, then turn 2 carrying it. Turn 2 must report
#    cached tokens; the Prometheus scrape says from which tier they came.
#
# `--device cpu` runs step 2 on the CPU (step 1 needs a GPU), so the script itself is tested
# without one (tests/tests/gpu_check.rs). `--steps` sizes turn 1 (about 8 tokens a step).
#
# The tensor-core attention checks itself against the fp32 kernel when a backend opens and stays
# off when it disagrees. If the device fails that check outright (a CUDA error, which poisons the
# context), gpu-check cannot start: the script says so and runs everything again with
# DYNAMO_CUDA_ATTENTION=fp32, so the lent minutes still measure the rest (and exits 1). gpu-check
# gets 8 minutes; if it hangs before its report, the serving node still runs, on the fp32 kernel.
# Exit 0: all passed; 1: a check failed; 3: no usable CUDA device.
set -uo pipefail

device=cuda
bin=target/release/dynamo-node
out=${OUT:-/tmp/dynamo-device-check}
gpu_check=1
ports=18431,18432
steps=400
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device=$2; shift 2 ;;
        --bin) bin=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --skip-gpu-check) gpu_check=0; shift ;;
        --ports) ports=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        *) echo "usage: see the top of $0" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
status=0

gpu_check_run() {
    # A hung kernel must not spend the lent minutes: 8 minutes is several times a full run.
    timeout 480 "$bin" gpu-check --e2e-model llama-8b --e2e-prompt-tokens 32768 --e2e-runs 3 --e2e-dir "$out/e2e" \
        2>&1 | tee "$out/gpu-check.txt"
    rc=${PIPESTATUS[0]}
    rm -rf "$out/e2e"
}

if [ "$device" = cuda ] && [ "$gpu_check" = 1 ]; then
    echo "## gpu-check (kernels, bandwidth, prefill, cached-prefix TTFT)"
    gpu_check_run
    if [ "$rc" = 124 ] && ! grep -q '^attention: ' "$out/gpu-check.txt"; then
        # No time is left for a second run; the serving node below still runs, on the fp32 kernel.
        echo "FAIL: gpu-check hung before its report; the tensor-core attention's start-up check is the suspect"
        export DYNAMO_CUDA_ATTENTION=fp32
    elif [ "$rc" != 0 ] && [ "$rc" != 3 ] && grep -q 'attention self-check' "$out/gpu-check.txt"; then
        echo "FAIL: the tensor-core attention's start-up check failed on the device (above);"
        echo "## gpu-check again with DYNAMO_CUDA_ATTENTION=fp32 (and so is the serving node below)"
        export DYNAMO_CUDA_ATTENTION=fp32
        mv "$out/gpu-check.txt" "$out/gpu-check-mma-failed.txt"
        gpu_check_run
        status=1
    fi
    case $rc in
        0) ;;
        3) echo "no usable CUDA device: skipped"; exit 3 ;;
        *) echo "gpu-check failed (exit $rc)"; status=1 ;;
    esac
fi

echo "## the serving node on $device"
http=127.0.0.1:${ports%,*}
metrics=127.0.0.1:${ports#*,}
data="$out/data"
rm -rf "$data"
if [ "$device" = cuda ]; then
    engine='device = "cuda"'
    dtype=bf16
    g1=0
else
    engine='device = "cpu"'
    dtype=f32
    g1='"64MiB"'
fi
cat > "$out/node.toml" <<EOF
[node]
data_dir = "$data"
[model]
name = "tiny"
dtype = "$dtype"
[engine]
$engine
workers = 2
[tiers.g1]
capacity = $g1
[tiers.g2]
capacity = "512MiB"
[tiers.g3]
capacity_per_path = "1GiB"
EOF
"$bin" --config "$out/node.toml" --http "$http" --metrics "$metrics" > "$out/node.log" 2>&1 &
node=$!
# Whatever ends the script (a failed check, a closed pipe), the node does not outlive it.
trap 'kill $node 2>/dev/null' EXIT
for _ in $(seq 1 600); do
    grep -q '^ready' "$out/node.log" && break
    kill -0 $node 2>/dev/null || break
    sleep 0.2
done
if ! grep -q '^ready' "$out/node.log"; then
    echo "the node did not start:"; cat "$out/node.log"
    kill $node 2>/dev/null
    [ "$device" = cuda ] && grep -q 'no CUDA device is usable' "$out/node.log" && exit 3
    exit 1
fi
grep -E '^(node|engines:|tier|G[1-4]) ' "$out/node.log"

words=$(for i in $(seq 1 "$steps"); do printf 'step%d of the plan touches file%d ' "$i" $((i % 37)); done)
ask() { # messages JSON → the response body; prints the time to the first byte
    curl -s -o "$out/answer.json" -w '%{time_starttransfer}' "http://$http/v1/chat/completions" \
        -H 'content-type: application/json' -d "{\"model\":\"tiny\",\"max_tokens\":4,\"messages\":$1}"
}
field() { grep -o "\"$1\":[0-9]*" "$out/answer.json" | head -1 | cut -d: -f2; }
turn1="[{\"role\":\"system\",\"content\":\"You are a coding agent.\"},{\"role\":\"user\",\"content\":\"$words\"}]"
t1=$(ask "$turn1")
prompt1=$(field prompt_tokens)
reply=$(grep -o '"content":"[^"]*"' "$out/answer.json" | head -1 | cut -d'"' -f4)
turn2="${turn1%]},{\"role\":\"assistant\",\"content\":\"$reply\"},{\"role\":\"user\",\"content\":\"now run the tests\"}]"
t2=$(ask "$turn2")
prompt2=$(field prompt_tokens)
cached2=$(field cached_tokens)
printf '%-8s %14s %14s %10s\n' turn prompt_tokens cached_tokens ttft_s
printf '%-8s %14s %14s %10s\n' 1 "${prompt1:-?}" - "$t1"
printf '%-8s %14s %14s %10s\n' 2 "${prompt2:-?}" "${cached2:-?}" "$t2"
curl -s "http://$metrics/metrics" | grep -E '^dynamo_node_kv_hit_tokens_total' | tee "$out/hits.txt"
if [ -z "$cached2" ] || [ "$cached2" -eq 0 ]; then
    echo "FAIL: turn 2 reused no cached tokens"; cat "$out/answer.json"; status=1
else
    echo "ok: turn 2 reused $cached2 of $prompt2 prompt tokens"
fi
kill -TERM $node
wait $node
grep -q '^stopped' "$out/node.log" && echo "ok: stopped cleanly on SIGTERM" || { echo "FAIL: no clean stop"; status=1; }
exit $status
