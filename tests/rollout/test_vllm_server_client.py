"""The vllm_server client against a stand-in server that dies while it writes its reply (no vLLM needed).

A SIGKILLed vLLM server can leave a reply half written: uvicorn writes the status line and headers,
then the body, in two writes. http.client then raises its own errors (IncompleteRead, BadStatusLine),
which are neither OSError nor URLError. Before, they escaped the client as such: in the sampler thread
of one rank they became a traceback and exit 1 while the other ranks waited in a collective (issue 33,
the flaky two-process server-death test). Each must be the client's one-line VLLMServerError, which
the pipeline records as a failed generation (a RuntimeError) and the loop agrees on across ranks.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from maxent_grpo.errors import UserError
from maxent_grpo.rollout.backend import SamplingParams
from maxent_grpo.rollout.vllm_server import VLLMServerBackend, VLLMServerError, _request

MODELS = json.dumps({"data": [{"id": "tiny"}]}).encode()
BROKEN_REPLIES = {
    "headers, no body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",
    "half the body": b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"choices": [',
    "half the chunked body": b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n{"choices": [',
    "half the status line": b"HTTP/1.1 2",
    "not JSON": b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n<html>oops",
}


def _server(reply_to_completions: bytes, *, requests: int) -> str:
    """A one-thread HTTP stand-in: ``/v1/models`` names one model; any other request gets
    ``reply_to_completions`` verbatim, then the connection is closed (the server died)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        with listener:
            for _ in range(requests):
                conn, _ = listener.accept()
                with conn:
                    head = _read_request(conn)
                    if b"/v1/models" in head.split(b"\r\n", 1)[0]:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(MODELS), MODELS))
                    else:
                        conn.sendall(reply_to_completions)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def _read_request(conn: socket.socket) -> bytes:
    """The whole request, body included: a socket closed with unread data would send a reset
    (a ConnectionResetError at the client) instead of the cut-off reply under test."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head


@pytest.mark.parametrize("reply", list(BROKEN_REPLIES), ids=list(BROKEN_REPLIES))
def test_a_reply_cut_off_by_a_dying_server_is_a_server_error(reply):
    url = _server(BROKEN_REPLIES[reply], requests=1)
    with pytest.raises(VLLMServerError) as caught:
        _request(url, "POST", "/v1/completions", {"prompt": [1]}, 10)
    assert isinstance(caught.value, UserError) and isinstance(caught.value, RuntimeError)
    assert f"{url}/v1/completions" in str(caught.value) and "\n" not in str(caught.value)


def test_generation_cut_off_mid_reply_fails_as_a_server_error(tmp_path):
    """What the sampler thread meets: the generation call raises the server error (which
    ``sample_rollouts`` turns into a failed batch, agreed on by every rank), nothing else."""
    url = _server(BROKEN_REPLIES["headers, no body"], requests=2)
    backend = VLLMServerBackend(url, tokenizer=None, sync_dir=tmp_path, timeout_s=10)
    assert backend.model_name == "tiny"
    with pytest.raises(VLLMServerError, match="broke off"):
        backend._generate(["p"], [[1, 2, 3]], 2, SamplingParams(max_new_tokens=4, seed=0))
