#!/usr/bin/env python3
"""A multi-turn Codex CLI session (`codex exec`, then `codex exec resume --last` for every later
turn) against an OpenAI Responses server (`POST /v1/responses`, streamed), offline, in a throwaway
HOME and working directory.

Usage:
    codex_session.py [CODEX [BASE_URL [TURNS]]] [options]
    codex_session.py --codex PATH --base-url http://127.0.0.1:8000/v1 --turns 3
    codex_session.py --codex PATH --node target/debug/dynamo-node   # starts its own node
    codex_session.py --codex PATH --stub                            # against responses_stub.py

CODEX defaults to $CODEX_BIN, BASE_URL to $OPENAI_BASE_URL (the API root with or without /v1).
`--node BINARY` starts that dynamo-node on free ports with the scripted engine; `--stub` starts
tests/cli/responses_stub.py instead (with --keep, its recording of each request is kept).

$HOME/.codex/config.toml names the server as provider `local` (`wire_api = "responses"`,
`env_key = "LOCAL_KEY"`, no retries, so a failure shows at once; `features.plugins = false`, so
nothing but the provider is contacted). Every turn's JSONL events are
parsed; one JSON line per turn is printed on stdout: turn, ok, thread_id, input_tokens,
cached_input_tokens, output_tokens, cache_share (cached / input: OpenAI's input_tokens includes
the cached ones), seconds, result (the last agent message), and cumulative (the turn.completed
usage as Codex printed it). Diagnostics go to stderr.

Codex 0.171.0's `turn.completed` usage of a resumed thread is the thread's running total, not the
turn's: the per-turn usage is the difference from the previous turn's total whenever the
session's rollout file (~/.codex/sessions/**/rollout-*-THREAD.jsonl) shows the printed usage to be
its `total_token_usage` (`--usage cumulative|per-turn` forces either reading).

Exit 0 when every turn completed and, from turn 2 on, cached_input_tokens is at least
--min-cache-share (0.8) of input_tokens and the thread is the first turn's; 1 when a turn failed
or a check did not hold; 2 on a usage or setup error.
"""

import argparse
import glob
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_common as cc  # noqa: E402

DEFAULT_ANSWERS = [
    "Hello from the scripted node.",
    "Second answer from the scripted node.",
    "Third answer from the scripted node.",
    "Fourth answer from the scripted node.",
]
FIELDS = ("input_tokens", "cached_input_tokens", "output_tokens", "reasoning_output_tokens")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("pos", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--codex", default=os.environ.get("CODEX_BIN"), help="the codex binary ($CODEX_BIN)")
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), help="API root ($OPENAI_BASE_URL)")
    p.add_argument("--node", help="start this dynamo-node binary (scripted engine) instead of using --base-url")
    p.add_argument("--node-log", help="write the started node's (or stub's) output here")
    p.add_argument("--stub", action="store_true", help="start tests/cli/responses_stub.py instead")
    p.add_argument("--stub-arg", action="append", default=[], help="one more argument for the stub")
    p.add_argument("--turns", type=int, default=int(os.environ.get("TURNS", 3)))
    p.add_argument("--model", default=os.environ.get("MODEL", "tiny"), help="served model name (tiny)")
    p.add_argument("--prompt", default="Reply with one short sentence. This is turn {turn}.",
                   help="prompt of each turn; {turn} is its number")
    p.add_argument("--timeout", type=float, default=300, help="seconds a turn may take (300)")
    p.add_argument("--min-cache-share", type=float, default=0.8)
    p.add_argument("--api-key", default="any", help="the server's API key (any)")
    p.add_argument("--usage", choices=("auto", "cumulative", "per-turn"), default="auto")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="one more `-c KEY=VALUE` for every codex call")
    p.add_argument("--keep", action="store_true", help="keep the temporary HOME and working directory")
    a = p.parse_args()
    if len(a.pos) > 3:
        p.error("at most CODEX BASE_URL TURNS as positional arguments")
    for value, name in zip(a.pos, ("codex", "base_url", "turns")):
        setattr(a, name, int(value) if name == "turns" else value)
    if not a.codex:
        p.error("name the codex binary (argument, --codex or $CODEX_BIN)")
    if a.node and a.stub:
        p.error("--node and --stub exclude each other")
    if not (a.base_url or a.node or a.stub):
        p.error("name the server (argument, --base-url or $OPENAI_BASE_URL), --node or --stub")
    if a.turns < 1:
        p.error("--turns must be at least 1")
    return a


def write_config(home, api, model, timeout):
    os.makedirs(os.path.join(home, ".codex"), exist_ok=True)
    with open(os.path.join(home, ".codex", "config.toml"), "w") as f:
        f.write(
            f"model = {json.dumps(model)}\n"
            "model_provider = \"local\"\n"
            "approval_policy = \"never\"\n"
            "sandbox_mode = \"read-only\"\n\n"
            "[model_providers.local]\n"
            "name = \"local\"\n"
            f"base_url = {json.dumps(api)}\n"
            "wire_api = \"responses\"\n"
            "env_key = \"LOCAL_KEY\"\n"
            "request_max_retries = 0\n"
            "stream_max_retries = 0\n"
            f"stream_idle_timeout_ms = {int(timeout * 1000)}\n\n"
            "[features]\n"
            "# The plugin sync runs `git ls-remote https://github.com/openai/plugins.git` at start;\n"
            "# off, Codex reaches nothing but the provider (the request is the same either way).\n"
            "plugins = false\n"
        )


def main():
    a = parse_args()
    codex = shutil.which(a.codex) or a.codex
    if not (os.path.isfile(codex) and os.access(codex, os.X_OK)):
        cc.log(f"error: {a.codex} is not an executable")
        return 2
    work = cc.make_workdir(a.keep, "codex-session-")
    home, cwd = os.path.join(work, "home"), os.path.join(work, "work")
    os.makedirs(home)
    os.makedirs(cwd)
    server = None
    try:
        try:
            if a.node:
                server, root = cc.start_node(a.node, os.path.join(work, "node"), DEFAULT_ANSWERS, a.node_log)
            elif a.stub:
                server, root = cc.start_stub(work, a.node_log, a.stub_arg)
                if a.keep:
                    cc.log(f"the stub records each request in {os.path.join(work, 'requests')}")
            else:
                root = a.base_url
        except (RuntimeError, OSError) as e:
            cc.log(f"error: the server did not start: {e}")
            return 2
        root = root.rstrip("/")
        api = root if root.endswith("/v1") else root + "/v1"
        if server is not None:
            cc.log(f"{server.name} started at {api}")
        reason = cc.check_reachable(api + "/models")
        if reason:
            cc.log(f"error: nothing answers at {api}: {reason}")
            return 2
        write_config(home, api, a.model, a.timeout)
        code = run_session(a, codex, home, cwd)
        if server is not None and code != 0:
            cc.log(f"{server.name} log (last lines):\n{server.log_tail()}")
        return code
    finally:
        if server is not None:
            rc = server.stop()
            if rc not in (0, -15) and a.node:
                cc.log(f"warning: the node exited with {rc}")
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def parse_events(stdout):
    """(thread_id, usage of turn.completed, last agent message, failure message) from the JSONL."""
    thread, usage, message, failure = None, None, None, None
    for raw in stdout.splitlines():
        raw = raw.strip()
        if not raw.startswith("{"):
            continue
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        kind = ev.get("type")
        if kind == "thread.started":
            thread = ev.get("thread_id")
        elif kind == "turn.completed":
            usage = ev.get("usage") or {}
        elif kind == "turn.failed":
            failure = (ev.get("error") or {}).get("message") or json.dumps(ev)
        elif kind == "error" and failure is None:
            failure = ev.get("message") or json.dumps(ev)
        elif kind == "item.completed":
            item = ev.get("item") or {}
            if item.get("type") == "agent_message":
                message = item.get("text")
    return thread, usage, message, failure


def rollout_totals(home, thread):
    """The `total_token_usage` of the last token_count event in the thread's rollout, or None."""
    files = glob.glob(os.path.join(home, ".codex", "sessions", "**", f"rollout-*{thread}.jsonl"), recursive=True)
    if not files:
        return None
    total = None
    with open(files[0], errors="replace") as f:
        for raw in f:
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            p = ev.get("payload") or {}
            if ev.get("type") == "event_msg" and p.get("type") == "token_count":
                total = ((p.get("info") or {}).get("total_token_usage")) or total
    return total


def run_session(a, codex, home, cwd):
    env = cc.clean_env(home, ("OPENAI_", "CODEX_", "LOCAL_KEY"))
    env.update({"CODEX_HOME": os.path.join(home, ".codex"), "LOCAL_KEY": a.api_key})
    env.pop("RUST_LOG", None)
    extra = [x for kv in a.config for x in ("-c", kv)]
    failures, shares = [], []
    first_thread, previous = None, None
    for turn in range(1, a.turns + 1):
        prompt = a.prompt.format(turn=turn)
        argv = [codex, "exec", "--skip-git-repo-check", "--json", *extra]
        argv += ["resume", "--last", prompt] if turn > 1 else [prompt]
        rc, out, err, seconds, timed_out = cc.run_turn(argv, env, cwd, a.timeout)
        thread, usage, message, failure = parse_events(out)
        line = {"turn": turn, "ok": False, "seconds": round(seconds, 2), "thread_id": thread}
        problem = None
        if timed_out:
            problem = f"timed out after {a.timeout:.0f}s"
        elif failure:
            problem = f"codex reported: {failure}"
        elif usage is None:
            problem = f"exit {rc} and no turn.completed event"
        elif rc != 0:
            problem = f"exit {rc}"
        if usage is not None:
            raw = {k: int(usage.get(k) or 0) for k in FIELDS}
            mode = a.usage
            if mode == "auto":
                totals = rollout_totals(home, thread) if thread else None
                mode = "cumulative" if totals and all(int(totals.get(k) or 0) == raw[k] for k in FIELDS) else "per-turn"
            per_turn = dict(raw)
            if mode == "cumulative" and previous is not None and thread == first_thread:
                per_turn = {k: raw[k] - previous[k] for k in FIELDS}
            previous = raw
            inp, cached = per_turn["input_tokens"], per_turn["cached_input_tokens"]
            share = cached / inp if inp else 0.0
            line.update({**per_turn, "cache_share": round(share, 4), "result": message,
                         "cumulative": raw, "usage_reading": mode})
            if problem is None and inp == 0:
                problem = "turn.completed carries no input_tokens"
            if problem is None and turn > 1:
                shares.append(share)
                if thread != first_thread:
                    problem = f"resume --last started thread {thread}, not {first_thread}"
                elif share < a.min_cache_share:
                    problem = (f"cached_input_tokens {cached} is {share:.1%} of input_tokens {inp}, "
                               f"under {a.min_cache_share:.0%}")
        if turn == 1:
            first_thread = thread
        line["ok"] = problem is None
        print(json.dumps(line), flush=True)
        if problem:
            failures.append(f"turn {turn}: {problem}")
            cc.log(f"turn {turn} FAILED: {problem}")
            noise = ("could not create PATH aliases", "Reading additional input from stdin", "Unknown model")
            err_lines = "\n".join(l for l in err.splitlines() if not any(n in l for n in noise))
            if err_lines.strip():
                cc.log(f"codex stderr (last lines):\n{cc.tail(err_lines)}")
            if out.strip():
                cc.log(f"codex stdout (last lines):\n{cc.tail(out)}")
            break
        cc.log(f"turn {turn}: ok in {seconds:.1f}s, {line['input_tokens']} input tokens, "
               f"{line['cached_input_tokens']} cached ({line['cache_share']:.1%})")
    if failures:
        cc.log("FAILED: " + "; ".join(failures))
        return 1
    mean = f", mean cache share from turn 2 {sum(shares) / len(shares):.1%}" if shares else ""
    cc.log(f"ok: {a.turns} turn(s){mean}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
