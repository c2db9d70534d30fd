"""A stand-in for ``maxent-grpo serve`` (vLLM's server) that can die and come back on cue.

Only for failures whose timing a test must hold exactly: a server that dies on a given request and
a replacement that answers at the same address some seconds later. It answers the routes the
``vllm_server`` client calls (``/v1/models``, ``/v1/completions`` with fixed completions,
``/collective_rpc``, ``/reset_prefix_cache``) and records every request in order. Runs against
vLLM itself are in tests/rollout/test_vllm_async.py (``.venv-vllm``).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DIED = ("DIED", "", None)  # where the request log shows the server's death
BACK = ("BACK", "", None)  # and where it listens again


class StandInServer:
    """``die_at_completion``: the n-th completions request (1-based) gets no reply: the server dies with
    it, and listens again at the same address ``back_after_s`` later (a replacement), or never (None)."""

    def __init__(self, port: int = 0, *, die_at_completion: int | None = None, back_after_s: float | None = None,
                 model: str = "tiny"):
        self.model = model
        self.requests: list[tuple[str, str, dict | None]] = []
        self.completions = 0
        self._die_at, self._back_after = die_at_completion, back_after_s
        self._lock = threading.Lock()
        self._start(port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self, port: int) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def posted(self, path: str) -> list[dict | None]:
        return [body for method, p, body in self.requests if method == "POST" and p == path]

    def dies_now(self) -> bool:
        """Count a completions request; True (and the server goes down) when it is the one to die on."""
        with self._lock:
            self.completions += 1
            if self.completions != self._die_at:
                return False
            self.requests.append(DIED)
        threading.Thread(target=self._die_and_return, daemon=True).start()
        return True

    def _die_and_return(self) -> None:
        self.stop()
        if self._back_after is not None:
            time.sleep(self._back_after)
            self.requests.append(BACK)
            self._start(self.port)


def _handler(owner: StandInServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            owner.requests.append(("GET", self.path, None))
            self._reply({"data": [{"id": owner.model}]})

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw) if raw else None
            if self.path == "/v1/completions" and owner.dies_now():
                self.close_connection = True  # no reply: the client sees the connection end
                return
            owner.requests.append(("POST", self.path, body))
            if self.path != "/v1/completions":
                self._reply({})
                return
            self._reply({"choices": [
                {"index": i, "finish_reason": "length",
                 "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.5, -0.25]}}
                for i in range(body["n"])
            ]})

    return Handler
