"""A stand-in for llama-server in tests of `ferry bench peer`: takes its flags (-m, --host, --port, the rest
ignored), answers ``--version``, ``GET /health``, ``GET /v1/models`` and streamed ``POST /v1/completions`` (one
chunk per token, then a usage chunk, then ``[DONE]``), and appends its argument list as one JSON line to
``$FAKE_LLAMA_LOG`` when set."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DELAY_S = 0.002


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    model = "model.gguf"

    def log_message(self, *args) -> None:
        pass

    def _json(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json({"status": "ok"})
        elif self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        else:
            self._json({"error": {"message": "not found"}}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or not body.get("stream"):
            self._json({"error": {"message": "only streamed completions"}}, 400)
            return
        prompt, n = body["prompt"], int(body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            time.sleep(DELAY_S)
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                          "total_tokens": len(prompt) + n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


def main() -> None:
    if "--version" in sys.argv:
        print("version: 0 (fake)", file=sys.stderr)
        return
    if os.environ.get("FAKE_LLAMA_LOG"):
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\n")
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args, _ = p.parse_known_args()
    Handler.model = os.path.basename(args.m)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
