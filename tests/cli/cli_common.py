"""What the CLI session scripts (claude_code_session.py, codex_session.py) share: running a CLI
turn under a timeout in its own process group, an offline environment in a throwaway HOME, and
starting a dynamo-node with the scripted engine (or the Responses stub) on a port it picks itself.

Only the standard library: the scripts run on a bare CI machine.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def tail(text, lines=20):
    return "\n".join(text.strip().splitlines()[-lines:])


def clean_env(home, strip_prefixes):
    """The caller's environment less every variable starting with one of `strip_prefixes` (so a
    developer's real credentials or settings never reach the CLI), with HOME and the XDG
    directories inside the throwaway `home`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(strip_prefixes))}
    env.update({
        "HOME": home,
        "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "XDG_DATA_HOME": os.path.join(home, ".local", "share"),
        "XDG_STATE_HOME": os.path.join(home, ".local", "state"),
        "NO_COLOR": "1",
        "TERM": "dumb",
    })
    for d in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
        os.makedirs(env[d], exist_ok=True)
    return env


def run_turn(argv, env, cwd, timeout):
    """Runs one CLI turn; returns (rc, stdout, stderr, seconds, timed_out). The CLI runs in its own
    session so a timeout kills it and everything it started; stdin is /dev/null (both CLIs read
    a piped stdin as more prompt)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, text=True, errors="replace")
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        out, err = proc.communicate()
    return proc.returncode, out, err, time.monotonic() - start, timed_out


def kill_group(proc, sig=signal.SIGKILL):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def check_reachable(url, timeout=10):
    """Whether anything answers HTTP at `url` (any status counts: only a refused or timed-out
    connection is an error). Returns None or the reason."""
    try:
        urllib.request.urlopen(url, timeout=timeout).read()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
    return None


class Background:
    """A server process started for the session (the node or the stub): its output is kept (and
    copied to `log_path`), and the first line matching `ready` gives its address."""

    def __init__(self, name, argv, ready, cwd=None, log_path=None, timeout=180):
        self.name = name
        self.lines = []
        self.log_file = open(log_path, "w") if log_path else None
        self.proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True)
        self.match = None
        found = threading.Event()

        def pump():
            for line in self.proc.stdout:
                line = re.sub(r"\x1b\[[0-9;]*m", "", line.rstrip("\n"))
                self.lines.append(line)
                if self.log_file:
                    self.log_file.write(line + "\n")
                    self.log_file.flush()
                if self.match is None:
                    m = re.search(ready, line)
                    if m:
                        self.match = m
                        found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.2):
            if time.monotonic() > deadline:
                break
        if self.match is None:
            self.stop()
            raise RuntimeError(f"{name} did not become ready within {timeout}s:\n{tail(chr(10).join(self.lines), 40)}")

    def log_tail(self, lines=30):
        return tail("\n".join(self.lines), lines)

    def stop(self, grace=30):
        """SIGTERM, then SIGKILL after `grace` seconds; the exit code."""
        if self.proc.poll() is None:
            kill_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
                self.proc.wait()
        if self.log_file:
            self.log_file.close()
            self.log_file = None
        return self.proc.returncode


def start_node(binary, workdir, answers, log_path=None, extra_toml=""):
    """Starts `binary serve` with the scripted engine answering `answers` (the qwen3 reasoning and
    hermes tool-call parsers, one worker, small tiers, no O_DIRECT so a tmpfs TMPDIR works),
    listening on 127.0.0.1 ports the node picks. Returns (Background, root URL without /v1)."""
    os.makedirs(workdir, exist_ok=True)
    script = os.path.join(workdir, "script.json")
    with open(script, "w") as f:
        json.dump(answers, f)
    toml = os.path.join(workdir, "node.toml")
    with open(toml, "w") as f:
        f.write(
            "[engine]\n"
            "kind = \"scripted\"\n"
            f"script = {json.dumps(script)}\n"
            "workers = 1\n\n"
            "[tiers.g3]\n"
            "capacity_per_path = \"256MiB\"\n"
            "direct_io = false\n"
            "io_engine = \"psync\"\n\n"
            "[frontend]\n"
            "reasoning_parser = \"qwen3\"\n"
            "tool_call_parser = \"hermes\"\n"
            + extra_toml
        )
    argv = [binary, "serve", "--config", toml, "--data-dir", os.path.join(workdir, "data"),
            "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0"]
    node = Background("dynamo-node", argv, r"serving the OpenAI API on (http://\S+?)/v1\s*$", cwd=workdir,
                      log_path=log_path)
    return node, node.match.group(1)


def start_stub(workdir, log_path=None, extra_args=()):
    """Starts responses_stub.py (recording into workdir/requests). Returns (Background, URL)."""
    argv = [sys.executable, os.path.join(HERE, "responses_stub.py"), "--port", "0",
            "--record", os.path.join(workdir, "requests"), *extra_args]
    stub = Background("responses stub", argv, r"listening on (http://\S+)", log_path=log_path, timeout=30)
    return stub, stub.match.group(1)


def make_workdir(keep, prefix):
    d = tempfile.mkdtemp(prefix=prefix)
    if keep:
        log(f"keeping the session's files in {d}")
    return d
