#!/usr/bin/env python3
"""A multi-turn Claude Code session (`claude -p`, then `claude -p -c` for every later turn) against
an Anthropic Messages server, offline, in a throwaway HOME and working directory.

Usage:
    claude_code_session.py [CLAUDE [BASE_URL [TURNS]]] [options]
    claude_code_session.py --claude PATH --base-url http://127.0.0.1:8000 --turns 3
    claude_code_session.py --claude PATH --node target/debug/dynamo-node     # starts its own node

CLAUDE defaults to $CLAUDE_BIN, BASE_URL to $ANTHROPIC_BASE_URL (the server's root: a trailing
/v1 is dropped). `--node BINARY` starts that dynamo-node on free ports with the scripted engine
(and the qwen3/hermes parsers) instead, and stops it at the end.

Every turn's `--output-format json` result is parsed and printed as one JSON line on stdout:
turn, ok, session_id, input_tokens, cache_read_input_tokens, cache_creation_input_tokens,
output_tokens, prompt_tokens (their sum), cache_share (read / prompt), api_calls (requests the
turn made), seconds, result (the answer). Diagnostics go to stderr.

Exit 0 when every turn succeeded and, from turn 2 on, cache_read_input_tokens is at least
--min-cache-share (0.8) of the turn's prompt tokens; 1 when a turn failed or a check did not hold;
2 on a usage or setup error (no binary, server unreachable, node failed to start).

The environment is offline: ANTHROPIC_API_KEY=--api-key (any), DISABLE_TELEMETRY=1,
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1, DISABLE_AUTOUPDATER=1, DISABLE_ERROR_REPORTING=1,
CLAUDE_CODE_MAX_OUTPUT_TOKENS=--max-output-tokens (16), and no ANTHROPIC_* / CLAUDE_* variable of
the caller's. Usage in a turn's result is summed over the requests of that turn (a tool call makes
two). A `-c` turn must continue the same conversation: its transcript must hold every earlier
prompt.
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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("pos", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--claude", default=os.environ.get("CLAUDE_BIN"), help="the claude binary ($CLAUDE_BIN)")
    p.add_argument("--base-url", default=os.environ.get("ANTHROPIC_BASE_URL"), help="server root ($ANTHROPIC_BASE_URL)")
    p.add_argument("--node", help="start this dynamo-node binary (scripted engine) instead of using --base-url")
    p.add_argument("--node-log", help="write the started node's output here")
    p.add_argument("--turns", type=int, default=int(os.environ.get("TURNS", 3)))
    p.add_argument("--model", default=os.environ.get("MODEL", "tiny"), help="served model name (tiny)")
    p.add_argument("--prompt", default="Reply with one short sentence. This is turn {turn}.",
                   help="prompt of each turn; {turn} is its number")
    p.add_argument("--timeout", type=float, default=300, help="seconds a turn may take (300)")
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--min-cache-share", type=float, default=0.8)
    p.add_argument("--api-key", default="any", help="the server's API key (any)")
    p.add_argument("--extra-arg", action="append", default=[], help="one more argument for every claude call")
    p.add_argument("--keep", action="store_true", help="keep the temporary HOME and working directory")
    a = p.parse_args()
    if len(a.pos) > 3:
        p.error("at most CLAUDE BASE_URL TURNS as positional arguments")
    for value, name in zip(a.pos, ("claude", "base_url", "turns")):
        setattr(a, name, int(value) if name == "turns" else value)
    if not a.claude:
        p.error("name the claude binary (argument, --claude or $CLAUDE_BIN)")
    if not a.base_url and not a.node:
        p.error("name the server (argument, --base-url or $ANTHROPIC_BASE_URL) or --node")
    if a.turns < 1:
        p.error("--turns must be at least 1")
    return a


def transcript_text(home, session_id):
    """The text of the session's transcript (~/.claude/projects/*/SESSION.jsonl), or None."""
    files = glob.glob(os.path.join(home, ".claude", "projects", "*", f"{session_id}.jsonl"))
    if not files:
        return None
    with open(files[0], errors="replace") as f:
        return f.read()


def main():
    a = parse_args()
    claude = shutil.which(a.claude) or a.claude
    if not (os.path.isfile(claude) and os.access(claude, os.X_OK)):
        cc.log(f"error: {a.claude} is not an executable")
        return 2
    work = cc.make_workdir(a.keep, "claude-session-")
    home, cwd = os.path.join(work, "home"), os.path.join(work, "work")
    os.makedirs(home)
    os.makedirs(cwd)
    node = None
    try:
        if a.node:
            try:
                node, base = cc.start_node(a.node, os.path.join(work, "node"), DEFAULT_ANSWERS, a.node_log)
            except (RuntimeError, OSError) as e:
                cc.log(f"error: the node did not start: {e}")
                return 2
            cc.log(f"node started at {base}")
        else:
            base = a.base_url.rstrip("/")
            if base.endswith("/v1"):
                base = base[: -len("/v1")]
        reason = cc.check_reachable(base + "/v1/models")
        if reason:
            cc.log(f"error: nothing answers at {base}: {reason}")
            return 2
        code = run_session(a, claude, base, home, cwd)
        if node is not None and code != 0:
            cc.log(f"node log (last lines):\n{node.log_tail()}")
        return code
    finally:
        if node is not None:
            rc = node.stop()
            if rc != 0:
                cc.log(f"warning: the node exited with {rc}")
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def run_session(a, claude, base, home, cwd):
    env = cc.clean_env(home, ("ANTHROPIC_", "CLAUDE_", "CLAUDECODE"))
    env.update({
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": a.api_key,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(a.max_output_tokens),
    })
    failures = []
    prompts = []
    shares = []
    for turn in range(1, a.turns + 1):
        prompt = a.prompt.format(turn=turn)
        prompts.append(prompt)
        argv = [claude, "-p", prompt, "--model", a.model, "--output-format", "json", *a.extra_arg]
        if turn > 1:
            argv.insert(1, "-c")
        rc, out, err, seconds, timed_out = cc.run_turn(argv, env, cwd, a.timeout)
        line = {"turn": turn, "ok": False, "seconds": round(seconds, 2)}
        problem = None
        result = None
        if timed_out:
            problem = f"timed out after {a.timeout:.0f}s"
        else:
            result = last_result(out)
            if result is None:
                problem = f"exit {rc} and no JSON result on stdout"
            elif result.get("is_error") or result.get("subtype") != "success":
                problem = (f"claude reported an error (exit {rc}, subtype {result.get('subtype')}, "
                           f"api_error_status {result.get('api_error_status')}): {str(result.get('result'))[:500]}")
            elif rc != 0:
                problem = f"exit {rc}"
        if result is not None:
            u = result.get("usage") or {}
            inp = int(u.get("input_tokens") or 0)
            read = int(u.get("cache_read_input_tokens") or 0)
            create = int(u.get("cache_creation_input_tokens") or 0)
            prompt_tokens = inp + read + create
            share = read / prompt_tokens if prompt_tokens else 0.0
            line.update({
                "session_id": result.get("session_id"),
                "input_tokens": inp,
                "cache_read_input_tokens": read,
                "cache_creation_input_tokens": create,
                "output_tokens": int(u.get("output_tokens") or 0),
                "prompt_tokens": prompt_tokens,
                "cache_share": round(share, 4),
                "api_calls": result.get("num_turns"),
                "result": result.get("result"),
            })
            if problem is None and prompt_tokens == 0:
                problem = "the result carries no usage"
            if problem is None and turn > 1:
                shares.append(share)
                if share < a.min_cache_share:
                    problem = (f"cache_read_input_tokens {read} is {share:.1%} of the prompt's {prompt_tokens} "
                               f"tokens, under {a.min_cache_share:.0%}")
            if problem is None and turn > 1:
                transcript = transcript_text(home, result.get("session_id"))
                if transcript is None:
                    cc.log(f"warning: turn {turn}: no transcript for session {result.get('session_id')}; "
                           "cannot check that -c continued the conversation")
                else:
                    missing = [p for p in prompts if json.dumps(p)[1:-1] not in transcript]
                    if missing:
                        problem = f"-c did not continue the conversation: its transcript lacks {missing}"
        line["ok"] = problem is None
        print(json.dumps(line), flush=True)
        if problem:
            failures.append(f"turn {turn}: {problem}")
            cc.log(f"turn {turn} FAILED: {problem}")
            if err.strip():
                cc.log(f"claude stderr (last lines):\n{cc.tail(err)}")
            if out.strip() and result is None:
                cc.log(f"claude stdout (last lines):\n{cc.tail(out)}")
            break
        cc.log(f"turn {turn}: ok in {seconds:.1f}s, {line['prompt_tokens']} prompt tokens, "
               f"{line['cache_read_input_tokens']} read from cache ({line['cache_share']:.1%})")
    if failures:
        cc.log("FAILED: " + "; ".join(failures))
        return 1
    mean = f", mean cache share from turn 2 {sum(shares) / len(shares):.1%}" if shares else ""
    cc.log(f"ok: {a.turns} turn(s){mean}")
    return 0


def last_result(stdout):
    """The `type: result` object of `--output-format json` (the last JSON value on stdout)."""
    text = stdout.strip()
    candidates = [text] + [l for l in reversed(text.splitlines()) if l.strip().startswith("{")]
    for c in candidates:
        try:
            v = json.loads(c)
        except ValueError:
            continue
        if isinstance(v, list):
            v = next((x for x in reversed(v) if isinstance(x, dict) and x.get("type") == "result"), None)
        if isinstance(v, dict) and (v.get("type") == "result" or "usage" in v):
            return v
    return None


if __name__ == "__main__":
    sys.exit(main())
