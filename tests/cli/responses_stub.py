"""A stand-in OpenAI Responses server for checking a CLI (Codex) offline, before the node serves
`/v1/responses`: it records every request and answers `POST /v1/responses` with a minimal valid
streamed answer (one assistant message), or a non-streamed JSON response when `stream` is false.

Usage: responses_stub.py [--port 0] [--record DIR] [--text TEXT] [--omit EVENT,...] [--no-usage]
                         [--completed-fields KEY,...] [--no-event-lines] [--call NAME:JSON]

It prints `listening on http://127.0.0.1:PORT` once bound, then serves until killed. Each request
is saved as DIR/NNN.json (method, path, headers, body, status). The stream is the events a
Responses server sends for a one-message answer, in order:

    response.created, response.in_progress, response.output_item.added (message),
    response.content_part.added, response.output_text.delta (one per word),
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (with usage)

With `--call NAME:JSON`, a request whose `input` does not end in a `function_call_output` is
answered with that function call instead (output_item.added function_call,
function_call_arguments.delta and .done, output_item.done, response.completed), so a client runs
the tool and sends its output back in the same turn.

`--omit` leaves named events out (to find which ones a client needs); `--no-usage` sends
`response.completed` without `usage`; `--completed-fields` keeps only the named keys of its
`response` object; `--no-event-lines` sends each event as a bare `data:` line. The usage imitates a prefix cache: `input_tokens` is the
request's `input` serialized, over 4 characters, and `input_tokens_details.cached_tokens` is the
part of it (whole 32-token blocks) that the previous request with the same `prompt_cache_key`
shared as a prefix.
"""

import argparse
import http.server
import itertools
import json
import os
import sys
import threading
import time
import uuid

BLOCK = 32
CHARS_PER_TOKEN = 4


class State:
    def __init__(self, args):
        self.args = args
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.previous = {}  # prompt_cache_key -> serialized input of the previous request


def usage_for(state, body):
    text = json.dumps(body.get("input", ""), sort_keys=True, ensure_ascii=False)
    key = body.get("prompt_cache_key") or ""
    with state.lock:
        prev = state.previous.get(key, "")
        state.previous[key] = text
    common = 0
    for a, b in zip(prev, text):
        if a != b:
            break
        common += 1
    total = max(1, len(text) // CHARS_PER_TOKEN)
    cached = min(total - 1, (common // CHARS_PER_TOKEN) // BLOCK * BLOCK) if common else 0
    return total, max(0, cached)


def response_object(rid, model, status, output, usage):
    obj = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
    }
    if usage is not None:
        obj["usage"] = usage
    return obj


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "responses-stub/1"

    def log_message(self, fmt, *a):
        print(f"stub: {self.command} {self.path} {fmt % a}", file=sys.stderr, flush=True)

    def record(self, body, status):
        state = self.server.state
        if not state.args.record:
            return
        n = next(state.counter)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        with open(os.path.join(state.args.record, f"{n:03d}.json"), "w") as f:
            json.dump({"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                       "body": parsed, "status": status}, f, indent=1, ensure_ascii=False)

    def read_body(self):
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length else b""

    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.record(b"", 404)
        self.send_json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

    @staticmethod
    def message_events(rid, model, usage, mid, words, part_done, item_done):
        text = part_done["text"]
        events = [
            ("response.created", {"response": response_object(rid, model, "in_progress", [], None)}),
            ("response.in_progress", {"response": response_object(rid, model, "in_progress", [], None)}),
            ("response.output_item.added", {"output_index": 0, "item": {
                "id": mid, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
            ("response.content_part.added", {"item_id": mid, "output_index": 0, "content_index": 0,
                                             "part": {"type": "output_text", "text": "", "annotations": []}}),
        ]
        for i, w in enumerate(words):
            events.append(("response.output_text.delta", {"item_id": mid, "output_index": 0, "content_index": 0,
                                                          "delta": w if i == 0 else " " + w}))
        events += [
            ("response.output_text.done", {"item_id": mid, "output_index": 0, "content_index": 0, "text": text}),
            ("response.content_part.done", {"item_id": mid, "output_index": 0, "content_index": 0, "part": part_done}),
            ("response.output_item.done", {"output_index": 0, "item": item_done}),
            ("response.completed", {"response": response_object(rid, model, "completed", [item_done], usage)}),
        ]
        return events

    @staticmethod
    def call_events(rid, model, usage, call):
        name, _, arguments = call.partition(":")
        fid, call_id = f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex[:24]}"
        item = {"id": fid, "type": "function_call", "status": "in_progress", "call_id": call_id, "name": name,
                "arguments": ""}
        done = {**item, "status": "completed", "arguments": arguments}
        return [
            ("response.created", {"response": response_object(rid, model, "in_progress", [], None)}),
            ("response.in_progress", {"response": response_object(rid, model, "in_progress", [], None)}),
            ("response.output_item.added", {"output_index": 0, "item": item}),
            ("response.function_call_arguments.delta", {"item_id": fid, "output_index": 0, "delta": arguments}),
            ("response.function_call_arguments.done", {"item_id": fid, "output_index": 0, "arguments": arguments}),
            ("response.output_item.done", {"output_index": 0, "item": done}),
            ("response.completed", {"response": response_object(rid, model, "completed", [done], usage)}),
        ]

    def do_POST(self):
        body = self.read_body()
        if self.path.split("?")[0].rstrip("/") != "/v1/responses":
            self.record(body, 404)
            self.send_json(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})
            return
        try:
            req = json.loads(body)
        except ValueError:
            self.record(body, 400)
            self.send_json(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
            return
        self.record(body, 200)
        args = self.server.state.args
        model = req.get("model", "tiny")
        total, cached = usage_for(self.server.state, req)
        words = args.text.split(" ")
        out_tokens = len(words)
        usage = None if args.no_usage else {
            "input_tokens": total,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total + out_tokens,
        }
        rid = f"resp_{uuid.uuid4().hex}"
        mid = f"msg_{uuid.uuid4().hex}"
        part_done = {"type": "output_text", "text": args.text, "annotations": []}
        item_done = {"id": mid, "type": "message", "status": "completed", "role": "assistant", "content": [part_done]}
        if not req.get("stream"):
            self.send_json(200, response_object(rid, model, "completed", [item_done], usage))
            return
        seq = itertools.count()
        last = (req.get("input") or [{}])[-1] if isinstance(req.get("input"), list) else {}
        if args.call and last.get("type") != "function_call_output":
            events = self.call_events(rid, model, usage, args.call)
        else:
            events = self.message_events(rid, model, usage, mid, words, part_done, item_done)
        omit = set(filter(None, args.omit.split(",")))
        keep = set(filter(None, args.completed_fields.split(",")))
        if keep:
            completed = events[-1][1]["response"]
            events[-1][1]["response"] = {k: v for k, v in completed.items() if k in keep}
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        for name, payload in events:
            if name in omit:
                continue
            data = {"type": name, "sequence_number": next(seq), **payload}
            head = "" if args.no_event_lines else f"event: {name}\n"
            self.wfile.write(f"{head}data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--record", help="directory to save each request in")
    p.add_argument("--text", default="Hello from the Responses stub.")
    p.add_argument("--omit", default="", help="comma-separated SSE event names to leave out")
    p.add_argument("--no-usage", action="store_true", help="send response.completed without usage")
    p.add_argument("--completed-fields", default="",
                   help="comma-separated keys of the response object kept in response.completed (default: all)")
    p.add_argument("--no-event-lines", action="store_true", help="send `data:` lines only, no `event:` lines")
    p.add_argument("--call", metavar="NAME:JSON",
                   help="answer each request whose input does not end in a function_call_output with this "
                        "function call (e.g. 'exec_command:{\"cmd\":\"ls\"}'), the others with the text")
    args = p.parse_args()
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.state = State(args)
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
