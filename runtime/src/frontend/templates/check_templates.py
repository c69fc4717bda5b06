#!/usr/bin/env python3
"""Checks dynamo-node's chat templates (the *.jinja files beside this script).

For every template variant and scenario it plays an agent loop: render the prompt P_N (with the
generation prompt), let the "model" write its answer A (the exact text the family's model
generates after P_N, ending with the token it samples to stop), parse A the way the server's
parsers do (raw thinking, raw text, tool calls with the model's argument bytes and ids), append
the assistant message and what the client sends next (tool results, an inline system message, a
new user query), and render again. The prefix property is

    render(C + [assistant A] + next, add_generation_prompt=True).startswith(P_N + A)

("full"). "body" means it holds without A's final stop token (a family that rewrites it in
history); "miss" means the new prompt diverges, which is expected only where a family documents
that it drops history thinking (or for a form of input it cannot replay). Every result is
compared with the expected one in EXPECTED; the script exits 1 on any surprise.

Each prompt is rendered twice, with Python's jinja2 (as transformers renders templates:
trim_blocks, lstrip_blocks, loop controls, a json.dumps tojson, raise_exception) and, when the
`minijinja` package is installed, with MiniJinja (the engine the server uses, with Python
methods); the two must agree byte for byte.

    python3 check_templates.py            # prints every final prompt, then the table
    python3 check_templates.py --quiet    # the table only
    python3 check_templates.py --show qwen3 --scenario one_call   # one variant / scenario
    python3 check_templates.py --quiet --client trimmed   # a client that trims text and thinking
    python3 check_templates.py --quiet --sorted-keys       # JSON keys sorted, as the server does today
    python3 check_templates.py --quiet --golden /tmp/golden.json  # renders for a Rust-side test

Setup: python3 -m venv /tmp/tpl-venv && /tmp/tpl-venv/bin/pip install jinja2 minijinja
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jinja2
import jinja2.sandbox

try:
    import minijinja  # type: ignore
except ImportError:  # the cross-check is skipped
    minijinja = None

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------


def tojson(value, indent=None, **_ignored):
    """transformers' tojson: json.dumps(ensure_ascii=False), Python's separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


class TemplateException(Exception):
    pass


def raise_exception(message):
    raise TemplateException(message)


# transformers renders chat templates in an immutable sandbox.
JINJA = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
JINJA.filters["tojson"] = tojson
JINJA.globals["raise_exception"] = raise_exception

MINI = None
if minijinja is not None:
    MINI = minijinja.Environment(
        trim_blocks=True, lstrip_blocks=True, filters={"tojson": tojson}, globals={"raise_exception": raise_exception}
    )

_sources: dict[str, str] = {}


def source(name: str) -> str:
    if name not in _sources:
        _sources[name] = (HERE / name).read_text(encoding="utf-8")
    return _sources[name]


class EngineMismatch(Exception):
    pass


GOLDEN: list | None = None  # every render, when --golden asks for them


SORTED_KEYS = False  # --sorted-keys: every JSON object key-sorted, as serde_json/minijinja without preserve_order


def key_sorted(x):
    if isinstance(x, dict):
        return {k: key_sorted(x[k]) for k in sorted(x)}
    if isinstance(x, list):
        return [key_sorted(i) for i in x]
    return x


def render(template: str, messages: list, tools: list | None, generation: bool, kwargs: dict) -> str:
    """Renders like the server: `tools` absent when there are none."""
    if SORTED_KEYS:
        messages, tools = key_sorted(messages), key_sorted(tools)
    context = dict(messages=messages, add_generation_prompt=generation, bos_token="", eos_token="", **kwargs)
    if tools:
        context["tools"] = tools
    text = JINJA.from_string(source(template)).render(**context)
    if GOLDEN is not None:
        GOLDEN.append({"template": template, "kwargs": kwargs, "add_generation_prompt": generation,
                       "messages": json.loads(json.dumps(messages)), "tools": tools, "expected": text})
    if MINI is not None:
        other = MINI.render_str(source(template), **context)
        if other != text:
            at = common_prefix(text, other)
            raise EngineMismatch(
                f"{template}: jinja2 and minijinja differ at byte {at}:\n"
                f"  jinja2:    {text[max(0, at - 60):at + 60]!r}\n  minijinja: {other[max(0, at - 60):at + 60]!r}"
            )
    return text


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------------
# What the model generates and how the server reads it back
# --------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List the files in a directory.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "The directory."}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.\nReturns its text, numbered.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file to read."},
                    "limit": {"type": "integer", "description": "At most this many lines.", "default": 200},
                    "mode": {"type": "string", "enum": ["text", "hex"], "default": "text"},
                },
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
]

SCHEMA = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in TOOLS}


def typed(tool: str, key: str, raw: str):
    """A tagged argument value, typed by the tool's schema (the XML parsers' rule)."""
    kind = SCHEMA.get(tool, {}).get(key, {}).get("type")
    if kind == "integer":
        return int(raw)
    if kind in ("object", "array", "boolean", "number"):
        return json.loads(raw)
    return raw


@dataclass
class Gen:
    """One generated assistant turn: reasoning, then text, then tool calls."""

    think: str = ""
    text: str = ""
    calls: list = field(default_factory=list)  # [(name, {args})]


@dataclass
class Ctx:
    """Per-scenario state: call counters for ids."""

    calls: int = 0

    def next_id(self, name: str, family: str) -> str:
        i = self.calls
        self.calls += 1
        return f"functions.{name}:{i}" if family == "kimi" else f"call_{i}"


def assistant_message(reasoning: str, text: str, calls: list) -> dict:
    """The assistant message a client echoes back (the server's chat response): `content` null
    for a turn that only calls tools, `reasoning_content` only when there is some."""
    m = {"role": "assistant", "content": text if text else (None if calls else "")}
    if reasoning:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def call_entry(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def dumps(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def value_text(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


@dataclass
class Family:
    """How one family's model writes an answer (`emit`), which tokens end it (`stops`), and how the
    server parses it back (`parse`)."""

    name: str
    emit: Callable[["Variant", Gen, Ctx], str]
    parse: Callable[["Variant", str, Ctx], dict]
    stops: tuple
    one_call_per_turn: bool = False


# ---- Qwen3 (hermes) -------------------------------------------------------------------------


def qwen3_emit(v, g: Gen, ctx: Ctx) -> str:
    s = ""
    if v.kwargs.get("enable_thinking", True):
        s += "<think>\n" + g.think + "\n</think>\n\n"
    if g.text:
        s += g.text + ("\n" if g.calls else "")
    s += "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {dumps(a)}}}\n</tool_call>' for n, a in g.calls)
    return s + "<|im_end|>"


def qwen3_parse(v, out: str, ctx: Ctx) -> dict:
    out = strip_stop(out, ("<|im_end|>",))
    reasoning = ""
    if out.startswith("<think>"):
        reasoning, out = out[len("<think>"):].split("</think>", 1)
    calls, text = [], ""
    pos = 0
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>", out, re.S):
        text += out[pos:m.start()]
        pos = m.end()
        body = m.group(1)
        name = json.loads(body)["name"]
        at = body.index('"arguments":') + len('"arguments":')
        while body[at] == " ":
            at += 1
        _, end = json.JSONDecoder().raw_decode(body, at)
        calls.append(call_entry(ctx.next_id(name, "qwen"), name, body[at:end]))  # the model's bytes
    text += out[pos:]
    return assistant_message(reasoning, text, calls)


# ---- DeepSeek-R1 (deepseek_v3 tool format; starts inside reasoning) -----------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_EOS = "<｜end▁of▁sentence｜>"


def r1_emit(v, g: Gen, ctx: Ctx) -> str:
    s = g.think + "\n</think>\n\n" + g.text
    if g.calls:
        s += DS_CALLS_BEGIN
        s += "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{dumps(a)}\n```<｜tool▁call▁end｜>" for n, a in g.calls
        )
        s += DS_CALLS_END
    return s + DS_EOS


def r1_parse(v, out: str, ctx: Ctx) -> dict:
    out = strip_stop(out, (DS_EOS,))
    reasoning, out = out.split("</think>", 1)  # the prompt opened the block
    calls, text = [], out
    if DS_CALLS_BEGIN in out:
        text, rest = out.split(DS_CALLS_BEGIN, 1)
        section, after = rest.split(DS_CALLS_END, 1)
        text += after
        for m in re.finditer(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>", section, re.S):
            calls.append(call_entry(ctx.next_id(m.group(2), "ds"), m.group(2), m.group(3)))
    return assistant_message(reasoning, text, calls)


# ---- gpt-oss (harmony) ----------------------------------------------------------------------


def oss_emit(v, g: Gen, ctx: Ctx) -> str:
    messages = []  # (channel, recipient, body, end)
    if g.think:
        messages.append(("analysis", None, g.think, "<|end|>"))
    if g.calls:
        assert len(g.calls) == 1, "gpt-oss stops at <|call|>: one call per turn"
        if g.text:
            messages.append(("commentary", None, g.text, "<|end|>"))
        name, args = g.calls[0]
        messages.append(("commentary", "functions." + name, dumps(args), "<|call|>"))
    else:
        messages.append(("final", None, g.text, "<|return|>"))
    s = ""
    for i, (channel, recipient, body, end) in enumerate(messages):
        header = "<|channel|>" + channel + (f" to={recipient} <|constrain|>json" if recipient else "")
        s += ("" if i == 0 else "<|start|>assistant") + header + "<|message|>" + body + end
    return s


def oss_parse(v, out: str, ctx: Ctx) -> dict:
    reasoning, text, calls = "", "", []
    for chunk in out.split("<|start|>assistant"):
        if not chunk:
            continue
        header, body = chunk.split("<|message|>", 1)
        body = re.sub(r"(<\|end\|>|<\|call\|>|<\|return\|>)$", "", body)
        recipient = re.search(r"to=(\S+)", header)
        channel = re.search(r"<\|channel\|>(\w+)", header).group(1)
        if recipient:
            name = recipient.group(1).removeprefix("functions.")
            calls.append(call_entry(ctx.next_id(name, "oss"), name, body))
        elif channel == "analysis":
            reasoning += body
        else:
            text += body
    return assistant_message(reasoning, text, calls)


# ---- Nemotron 3 (qwen3_coder XML; starts inside reasoning) ----------------------------------


def nemotron_emit(v, g: Gen, ctx: Ctx) -> str:
    s = (g.think + "</think>") if v.kwargs.get("enable_thinking", True) else ""
    s += g.text
    if g.calls:
        s += "\n"
        for n, a in g.calls:
            params = "".join(f"<parameter={k}>\n{value_text(x)}\n</parameter>\n" for k, x in a.items())
            s += f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>\n"
    return s + "<|im_end|>"


def xml_parse_calls(out: str, ctx: Ctx, family: str, v) -> tuple[str, list]:
    calls, text, pos = [], "", 0
    for m in re.finditer(r"<tool_call>\s*<function=([^>]+)>(.*?)</function>\s*</tool_call>", out, re.S):
        text += out[pos:m.start()]
        pos = m.end()
        name = m.group(1)
        args = {k: typed(name, k, x) for k, x in re.findall(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S)}
        calls.append(call_entry(ctx.next_id(name, family), name, args if v.args_as == "object" else dumps(args)))
    return text + out[pos:], calls


def nemotron_parse(v, out: str, ctx: Ctx) -> dict:
    out = strip_stop(out, ("<|im_end|>",))
    reasoning = ""
    if v.kwargs.get("enable_thinking", True):
        reasoning, out = out.split("</think>", 1)
    text, calls = xml_parse_calls(out, ctx, "nemotron", v)
    return assistant_message(reasoning, text, calls)


# ---- GLM-4.7 (glm47 XML; starts inside reasoning; stops on the next role token) -------------


def glm_emit(v, g: Gen, ctx: Ctx) -> str:
    s = (g.think + "</think>") if v.kwargs.get("enable_thinking", True) else ""
    s += g.text
    for n, a in g.calls:
        s += "<tool_call>" + n + "".join(f"<arg_key>{k}</arg_key><arg_value>{value_text(x)}</arg_value>" for k, x in a.items())
        s += "</tool_call>"
    return s + ("<|observation|>" if g.calls else "<|user|>")


def glm_parse(v, out: str, ctx: Ctx) -> dict:
    out = strip_stop(out, ("<|observation|>", "<|user|>", "<|endoftext|>"))
    reasoning = ""
    if v.kwargs.get("enable_thinking", True):
        reasoning, out = out.split("</think>", 1)
    calls, text, pos = [], "", 0
    for m in re.finditer(r"<tool_call>([^<]*)(.*?)</tool_call>", out, re.S):
        text += out[pos:m.start()]
        pos = m.end()
        name = m.group(1).strip()
        args = {k: typed(name, k, x) for k, x in re.findall(r"<arg_key>(.*?)</arg_key><arg_value>(.*?)</arg_value>", m.group(2), re.S)}
        calls.append(call_entry(ctx.next_id(name, "glm"), name, args if v.args_as == "object" else dumps(args)))
    text += out[pos:]
    return assistant_message(reasoning, text, calls)


# ---- Kimi K2 (kimi_k2 tool format; ids are the model's) ------------------------------------


def kimi_emit(v, g: Gen, ctx: Ctx) -> str:
    s = ("<think>" + g.think + "</think>") if v.kwargs.get("thinking", False) else ""
    s += g.text
    if g.calls:
        s += "<|tool_calls_section_begin|>"
        for n, a in g.calls:
            s += f"<|tool_call_begin|>functions.{n}:{ctx.calls}<|tool_call_argument_begin|>{dumps(a)}<|tool_call_end|>"
            ctx.calls += 1
        s += "<|tool_calls_section_end|>"
    return s + "<|im_end|>"


def kimi_parse(v, out: str, ctx: Ctx) -> dict:
    out = strip_stop(out, ("<|im_end|>",))
    reasoning = ""
    if out.startswith("<think>"):
        reasoning, out = out[len("<think>"):].split("</think>", 1)
    calls, text = [], out
    if "<|tool_calls_section_begin|>" in out:
        text, rest = out.split("<|tool_calls_section_begin|>", 1)
        section, after = rest.split("<|tool_calls_section_end|>", 1)
        text += after
        for m in re.finditer(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", section, re.S):
            call_id = m.group(1)
            calls.append(call_entry(call_id, call_id.split(":")[0].split(".")[-1], m.group(2)))
    return assistant_message(reasoning, text, calls)


def strip_stop(out: str, stops: tuple) -> str:
    for s in stops:
        if out.endswith(s):
            return out[: -len(s)]
    return out


FAMILIES = {
    "qwen3": Family("qwen3", qwen3_emit, qwen3_parse, ("<|im_end|>",)),
    "deepseek_r1": Family("deepseek_r1", r1_emit, r1_parse, (DS_EOS,)),
    "gpt_oss": Family("gpt_oss", oss_emit, oss_parse, ("<|call|>", "<|return|>"), one_call_per_turn=True),
    "nemotron": Family("nemotron", nemotron_emit, nemotron_parse, ("<|im_end|>",)),
    "glm47": Family("glm47", glm_emit, glm_parse, ("<|observation|>", "<|user|>", "<|endoftext|>")),
    "kimi_k2": Family("kimi_k2", kimi_emit, kimi_parse, ("<|im_end|>",)),
}


@dataclass
class Variant:
    name: str
    template: str
    family: str
    kwargs: dict = field(default_factory=dict)
    args_as: str = "string"  # how the client echoes tool-call arguments: "string" (OpenAI) or "object"


VARIANTS = [
    Variant("qwen3", "qwen3.jinja", "qwen3"),
    Variant("qwen3 enable_thinking=false", "qwen3.jinja", "qwen3", {"enable_thinking": False}),
    Variant("qwen3_preserve", "qwen3_preserve.jinja", "qwen3"),
    Variant("deepseek_r1", "deepseek_r1.jinja", "deepseek_r1"),
    Variant("deepseek_r1 preserve_thinking=true", "deepseek_r1.jinja", "deepseek_r1", {"preserve_thinking": True}),
    Variant("gpt_oss", "gpt_oss.jinja", "gpt_oss"),
    Variant("nemotron args=object", "nemotron.jinja", "nemotron", args_as="object"),
    Variant("nemotron args=string", "nemotron.jinja", "nemotron"),
    Variant("nemotron truncate_history_thinking=false", "nemotron.jinja", "nemotron",
            {"truncate_history_thinking": False}, args_as="object"),
    Variant("glm47 args=object", "glm47.jinja", "glm47", args_as="object"),
    Variant("glm47 args=string", "glm47.jinja", "glm47"),
    Variant("glm47 clear_thinking=false", "glm47.jinja", "glm47", {"clear_thinking": False}, args_as="object"),
    Variant("kimi_k2", "kimi_k2.jinja", "kimi_k2"),
    Variant("kimi_k2 thinking=true", "kimi_k2.jinja", "kimi_k2", {"thinking": True}),
]


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}
REMINDER = {"role": "system", "content": "<system-reminder>The user can see your tool calls.</system-reminder>"}

RESULTS = {"ls": "a.rs\nb.rs", "read_file": "1\tfn main() {}"}


def results_for(message: dict) -> list:
    """The tool results a client sends for an assistant message's calls, in order."""
    return [
        {"role": "tool", "tool_call_id": c["id"], "content": RESULTS[c["function"]["name"]] + f" ({c['id']})"}
        for c in message.get("tool_calls", [])
    ]


@dataclass
class Step:
    gen: Gen
    # what follows the assistant message: "results", "results+reminder", "user:TEXT" or None (last)
    then: str | None


@dataclass
class Scenario:
    name: str
    start: list
    tools: bool
    steps: list


SCENARIOS = [
    Scenario("plain", [SYSTEM, {"role": "user", "content": "What is 2+2?"}], False, [
        Step(Gen("The user asks for 2+2. That is 4.", "2 + 2 = 4."), "user:And 3+3?"),
    ]),
    Scenario("one_call", [SYSTEM, {"role": "user", "content": "List the files here."}], True, [
        Step(Gen("I should list the directory.", "I'll list them.", [("ls", {"path": "."})]), "results"),
        Step(Gen("Two files.", "There are two files: a.rs and b.rs."), None),
    ]),
    Scenario("parallel_calls", [SYSTEM, {"role": "user", "content": "Show me a.rs and b.rs."}], True, [
        Step(Gen("Read both files at once.", "", [("read_file", {"path": "a.rs"}),
                                                  ("read_file", {"path": "b.rs", "limit": 50})]), "results"),
        Step(Gen("Both read.", "Both files are tiny."), None),
    ]),
    Scenario("think_tool_think_tool", [SYSTEM, {"role": "user", "content": "What does a.rs do?"}], True, [
        Step(Gen("First find the file.", "", [("ls", {"path": "."})]), "results"),
        Step(Gen("It is there; read it.", "Reading it now.", [("read_file", {"path": "a.rs"})]), "results"),
        Step(Gen("It is an empty main.", "a.rs defines an empty `main`."), None),
    ]),
    Scenario("tool_then_new_query", [SYSTEM, {"role": "user", "content": "List the files here."}], True, [
        Step(Gen("I should list the directory.", "", [("ls", {"path": "."})]), "results"),
        Step(Gen("Two files.", "There are two files."), "user:Now read a.rs."),
    ]),
    Scenario("inline_system", [SYSTEM, {"role": "user", "content": "List the files here."}], True, [
        Step(Gen("I should list the directory.", "", [("ls", {"path": "."})]), "results+reminder"),
        Step(Gen("Two files.", "There are two files."), None),
    ]),
    # Whitespace the family's canonical form does not have, at the edges of the reasoning and text:
    # templates that write it verbatim replay it; those that normalise (Qwen's strip('\n'),
    # Nemotron's trim before the calls) do not.
    Scenario("edge_whitespace", [SYSTEM, {"role": "user", "content": "List the files here."}], True, [
        Step(Gen("  First, list.\n", "\nI'll look.  ", [("ls", {"path": "."})]), "results"),
        Step(Gen("Two files.", "There are two files."), None),
    ]),
]

# Expected result of each checked step (steps followed by a re-render), where not all "full".
# "miss:WHY" entries are the documented ones.
DROPS = "history thinking dropped after a new user turn (the family's rule)"
R1 = "DeepSeek-R1 drops all history reasoning, tool loops included"
OSS_FINAL = "gpt-oss drops analysis once a final answer exists (and <|return|> becomes <|end|>)"
STR_ARGS = "JSON-string arguments cannot be re-rendered as XML parameters in a template"
KIMI_T = "Kimi-K2-Thinking empties reasoning up to the last answer"
NA_ONE_CALL = "n/a: gpt-oss makes one call per turn (it stops at <|call|>)"

EXPECTED: dict[tuple[str, str], list[str]] = {}


def expect(variant: str, scenario: str, *results: str):
    EXPECTED[(variant, scenario)] = list(results)


for v in ["qwen3", "qwen3 enable_thinking=false", "nemotron args=object", "glm47 args=object"]:
    expect(v, "plain", "miss:" + DROPS)
    expect(v, "tool_then_new_query", "full", "miss:" + DROPS)
expect("kimi_k2 thinking=true", "plain", "miss:" + KIMI_T)
expect("kimi_k2 thinking=true", "tool_then_new_query", "full", "miss:" + KIMI_T)
expect("gpt_oss", "plain", "miss:" + OSS_FINAL)
expect("gpt_oss", "tool_then_new_query", "full", "miss:" + OSS_FINAL)
expect("gpt_oss", "parallel_calls", NA_ONE_CALL)
for s in ["plain", "one_call", "parallel_calls", "inline_system"]:
    expect("deepseek_r1", s, "miss:" + R1)
expect("deepseek_r1", "think_tool_think_tool", "miss:" + R1, "miss:" + R1)
expect("deepseek_r1", "tool_then_new_query", "miss:" + R1, "miss:" + R1)
NORMALISED = "the template normalises whitespace at the edges of reasoning/text (see its header)"
for v in ["qwen3", "qwen3 enable_thinking=false", "qwen3_preserve", "deepseek_r1 preserve_thinking=true",
          "nemotron args=object", "nemotron truncate_history_thinking=false"]:
    expect(v, "edge_whitespace", "miss:" + NORMALISED)
expect("deepseek_r1", "edge_whitespace", "miss:" + R1)
for v in ["nemotron args=string", "glm47 args=string"]:
    expect(v, "edge_whitespace", "miss:" + STR_ARGS)
for v in ["nemotron args=string", "glm47 args=string"]:
    expect(v, "plain", "miss:" + DROPS)
    for s in ["one_call", "parallel_calls", "inline_system"]:
        expect(v, s, "miss:" + STR_ARGS)
    expect(v, "think_tool_think_tool", "miss:" + STR_ARGS, "miss:" + STR_ARGS)
    expect(v, "tool_then_new_query", "miss:" + STR_ARGS, "miss:" + STR_ARGS)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


@dataclass
class Check:
    result: str  # "full", "body", "miss", "n/a"
    detail: str = ""


def trimmed(message: dict) -> dict:
    """What a client that trims the answer's text and thinking echoes back."""
    m = dict(message)
    if "reasoning_content" in m:
        m["reasoning_content"] = m["reasoning_content"].strip()
        if not m["reasoning_content"]:
            del m["reasoning_content"]
    if isinstance(m.get("content"), str):
        m["content"] = m["content"].strip() or (None if m.get("tool_calls") else "")
    return m


CLIENT = "raw"  # or "trimmed" (--client)


def run(variant: Variant, scenario: Scenario) -> tuple[list[Check], str]:
    family = FAMILIES[variant.family]
    tools = TOOLS if scenario.tools else None
    messages = [dict(m) for m in scenario.start]
    ctx = Ctx()
    checks = []
    prompt = render(variant.template, messages, tools, True, variant.kwargs)
    for step in scenario.steps:
        if family.one_call_per_turn and len(step.gen.calls) > 1:
            checks.append(Check("n/a", NA_ONE_CALL))
            return checks, prompt
        answer = family.emit(variant, step.gen, ctx)
        assistant = family.parse(variant, answer, ctx)
        check_parse(variant, step.gen, assistant)
        messages.append(trimmed(assistant) if CLIENT == "trimmed" else assistant)
        if step.then is None:
            break
        if step.then.startswith("user:"):
            messages.append({"role": "user", "content": step.then[len("user:"):]})
        else:
            messages.extend(results_for(assistant))
            if step.then == "results+reminder":
                messages.append(dict(REMINDER))
        following = render(variant.template, messages, tools, True, variant.kwargs)
        checks.append(compare(prompt, answer, following, family))
        prompt = following
    final = render(variant.template, messages, tools, scenario.steps[-1].then is not None, variant.kwargs)
    return checks, final


def check_parse(variant: Variant, gen: Gen, message: dict):
    """The harness's parse gives back what the model meant (a check of the harness itself)."""
    names = [c["function"]["name"] for c in message.get("tool_calls", [])]
    assert names == [n for n, _ in gen.calls], (variant.name, names, gen.calls)
    for c, (_, args) in zip(message.get("tool_calls", []), gen.calls):
        got = c["function"]["arguments"]
        assert (json.loads(got) if isinstance(got, str) else got) == args, (variant.name, got, args)


def compare(prompt: str, answer: str, following: str, family: Family) -> Check:
    expected = prompt + answer
    if following.startswith(expected):
        return Check("full")
    for stop in family.stops:
        if answer.endswith(stop) and following.startswith(expected[: -len(stop)]):
            return Check("body", f"all but the stop token {stop}")
    at = common_prefix(expected, following)
    where = f"in P_N at byte {at} of {len(prompt)}" if at < len(prompt) else f"in A at byte {at - len(prompt)} of {len(answer)}"
    return Check("miss", f"diverges {where}: P_N+A has {expected[max(0, at - 40):at + 40]!r}, "
                         f"the new prompt {following[max(0, at - 40):at + 40]!r}")


def extra_checks() -> list[str]:
    """Checks outside the scenario matrix; returns failures."""
    failures = []
    # gpt-oss takes the reasoning as `thinking` as well as `reasoning_content`.
    base = [SYSTEM, {"role": "user", "content": "hi"}]
    call = call_entry("call_0", "ls", '{"path": "."}')
    a = render("gpt_oss.jinja", base + [{"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [call]}], TOOLS, True, {})
    b = render("gpt_oss.jinja", base + [{"role": "assistant", "content": None, "thinking": "r", "tool_calls": [call]}], TOOLS, True, {})
    if a != b or "<|channel|>analysis<|message|>r<|end|>" not in a:
        failures.append("gpt_oss: `thinking` and `reasoning_content` render differently")
    # Object arguments render with tojson where a template writes JSON.
    obj = call_entry("call_0", "ls", {"path": "."})
    for t, needle in [("qwen3.jinja", '"arguments": {"path": "."}'), ("deepseek_r1.jinja", '```json\n{"path": "."}\n```'),
                      ("gpt_oss.jinja", 'json<|message|>{"path": "."}<|call|>'),
                      ("kimi_k2.jinja", '<|tool_call_argument_begin|>{"path": "."}<|tool_call_end|>')]:
        out = render(t, base + [{"role": "assistant", "content": None, "tool_calls": [obj]}], TOOLS, False, {})
        if needle not in out:
            failures.append(f"{t}: object arguments not rendered with tojson")
    # A conversation without a system message, and one whose client left <think> in the content.
    for v in VARIANTS:
        render(v.template, [{"role": "user", "content": "hi"}], None, True, v.kwargs)
        render(v.template, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>x</think>y"},
                            {"role": "user", "content": "again"}], TOOLS, True, v.kwargs)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quiet", action="store_true", help="print only the result table")
    parser.add_argument("--show", help="only variants whose name starts with this")
    parser.add_argument("--scenario", help="only this scenario")
    parser.add_argument("--client", choices=["raw", "trimmed"], default="raw",
                        help="what the client echoes: the server's raw text and thinking (default), or both "
                             "trimmed (informational: results are printed, not checked)")
    parser.add_argument("--sorted-keys", action="store_true",
                        help="key-sort every JSON object first, as the server does while serde_json and "
                             "minijinja lack preserve_order (informational: printed, not checked)")
    parser.add_argument("--golden", metavar="PATH",
                        help="also write every render as JSON (template, kwargs, messages, tools, "
                             "add_generation_prompt, expected) for a test of the server's own engine")
    args = parser.parse_args()
    global CLIENT, GOLDEN, SORTED_KEYS
    CLIENT = args.client
    SORTED_KEYS = args.sorted_keys
    if args.golden:
        GOLDEN = []

    variants = [v for v in VARIANTS if not args.show or v.name.startswith(args.show)]
    scenarios = [s for s in SCENARIOS if not args.scenario or s.name == args.scenario]
    print(f"engines: jinja2 {jinja2.__version__}" + (", minijinja (cross-check on)" if MINI else ", minijinja not installed (cross-check off)"))
    table, surprises = {}, []
    for v in variants:
        for s in scenarios:
            try:
                checks, final = run(v, s)
            except (EngineMismatch, TemplateException, jinja2.TemplateError) as e:
                surprises.append(f"{v.name} / {s.name}: {type(e).__name__}: {e}")
                table[(v.name, s.name)] = "ERROR"
                continue
            if not args.quiet:
                print(f"\n===== {v.name} / {s.name} " + "=" * max(0, 70 - len(v.name) - len(s.name)))
                print(final)
                print("===== end")
            want = EXPECTED.get((v.name, s.name), ["full"] * len(checks))
            if CLIENT != "raw" or SORTED_KEYS:
                want = [c.result for c in checks]  # informational
            cells = []
            for i, c in enumerate(checks):
                w = want[i] if i < len(want) else "full"
                ok = c.result == w.split(":")[0]
                cells.append(c.result + ("" if ok else "!"))
                if not ok:
                    surprises.append(f"{v.name} / {s.name} step {i + 1}: got {c.result}, expected {w}. {c.detail}")
                elif c.result == "miss":
                    why = w.split(":", 1)[1] + ". " if ":" in w else ""
                    informational = CLIENT != "raw" or SORTED_KEYS
                    print(f"[{'' if informational else 'expected '}miss] {v.name} / {s.name} step {i + 1}: {why}{c.detail}")
            table[(v.name, s.name)] = ",".join(cells)
    failures = extra_checks() if not args.show and not args.scenario and CLIENT == "raw" and not SORTED_KEYS else []
    if args.golden:
        Path(args.golden).write_text(json.dumps(GOLDEN, ensure_ascii=False, indent=1), encoding="utf-8")
        print(f"wrote {len(GOLDEN)} renders to {args.golden}")

    print(f"\nPrefix property, {CLIENT} client{', sorted keys' if SORTED_KEYS else ''} (one cell per re-render: full / body / miss / n/a; '!' = unexpected)\n")
    width = max(len(v.name) for v in variants)
    print(" " * width + " | " + " | ".join(s.name for s in scenarios))
    for v in variants:
        print(v.name.ljust(width) + " | " + " | ".join(table[(v.name, s.name)].ljust(len(s.name)) for s in scenarios))
    for f in surprises + failures:
        print("FAIL:", f)
    print(f"\n{'OK' if not surprises and not failures else 'FAILED'}: {len(surprises) + len(failures)} unexpected result(s)")
    return 1 if surprises or failures else 0


if __name__ == "__main__":
    sys.exit(main())
