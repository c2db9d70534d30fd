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


# ---------------------------------------------------------------- a server lost, and back

from vllm_stand_in import StandInServer  # noqa: E402

def _replacement_after(port: int, delay_s: float, box: list, model: str = "tiny") -> threading.Thread:
    """A replacement stand-in on ``port`` after ``delay_s`` (put into ``box``), serving ``model``."""
    def start() -> None:
        import time

        time.sleep(delay_s)
        box.append(StandInServer(port, model=model))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def _tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


PARAMS = SamplingParams(max_new_tokens=2, seed=0)


def test_request_errors_say_whether_the_server_is_gone_or_failing():
    """Refused: gone (waited for). An HTTP error or no reply in time: the server is there and failing or
    hung (not waited for), and the message names the setting that bounds it."""
    from maxent_grpo.rollout.vllm_server import ServerUnreachable

    gone = StandInServer()
    gone.stop()
    with pytest.raises(ServerUnreachable, match="is `maxent-grpo serve` running there"):
        _request(gone.url, "GET", "/v1/models", None, 5)
    with pytest.raises(VLLMServerError) as caught:
        _request(_server(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops", requests=1),
                 "POST", "/v1/completions", {}, 5)
    assert "HTTP 500" in str(caught.value) and not isinstance(caught.value, ServerUnreachable)
    listener = socket.socket()  # takes the connection, never answers: a hung server
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with listener, pytest.raises(VLLMServerError) as caught:
        _request(f"http://127.0.0.1:{listener.getsockname()[1]}", "GET", "/v1/models", None, 0.5)
    assert "request_timeout_s" in str(caught.value) and not isinstance(caught.value, ServerUnreachable)


def test_generation_waits_for_a_replacement_says_so_and_asks_for_the_batch_again(tiny_model_dir, tmp_path, caplog):
    from maxent_grpo.rollout.backend import SamplerLost

    first = StandInServer()
    backend = VLLMServerBackend(first.url, _tokenizer(tiny_model_dir), sync_dir=tmp_path, timeout_s=10,
                                server_wait_s=60)
    assert len(backend._generate(["p"], [[1, 2]], 2, PARAMS)[0].completions) == 2
    first.stop()
    box: list[StandInServer] = []
    _replacement_after(first.port, 3.0, box)
    with caplog.at_level("WARNING", logger="maxent_grpo"), pytest.raises(SamplerLost, match="answered again"):
        backend._generate(["p"], [[1, 2]], 2, PARAMS)
    text = caplog.text
    assert f"generation server {first.url} stopped answering" in text and "waiting up to 60 s" in text
    assert f"generation server {first.url} answered again after" in text
    # Nothing is sampled from it until the weights are back: it may be a replacement holding others.
    with pytest.raises(SamplerLost, match="has not had the weights back"):
        backend._generate(["p"], [[1, 2]], 2, PARAMS)
    assert box[0].posted("/v1/completions") == []
    backend.restore_weights()  # nothing pushed yet in this test: nothing to send, and sampling goes on
    assert len(backend._generate(["p"], [[1, 2]], 2, PARAMS)[0].completions) == 2
    box[0].stop()


def test_a_server_not_back_in_time_stops_the_sampler(tiny_model_dir, tmp_path):
    from maxent_grpo.rollout.backend import SamplerGone
    from maxent_grpo.rollout.vllm_server import ServerUnreachable

    server = StandInServer()
    backend = VLLMServerBackend(server.url, _tokenizer(tiny_model_dir), sync_dir=tmp_path, timeout_s=10,
                                server_wait_s=3)
    server.stop()
    with pytest.raises(SamplerGone, match=r"did not answer again within 3 s \(generation.vllm.server_wait_s\)"):
        backend._generate(["p"], [[1, 2]], 2, PARAMS)
    backend.server_wait_s = 0  # 0: not waited for
    with pytest.raises(ServerUnreachable):
        backend._generate(["p"], [[1, 2]], 2, PARAMS)


def test_a_replacement_serving_another_model_stops_the_sampler(tiny_model_dir, tmp_path):
    from maxent_grpo.rollout.backend import SamplerGone

    first = StandInServer()
    backend = VLLMServerBackend(first.url, _tokenizer(tiny_model_dir), sync_dir=tmp_path, timeout_s=10,
                                server_wait_s=60)
    first.stop()
    box: list[StandInServer] = []
    _replacement_after(first.port, 1.0, box, model="another")
    with pytest.raises(SamplerGone, match="came back serving 'another', not 'tiny'"):
        backend._generate(["p"], [[1, 2]], 2, PARAMS)
    assert box[0].posted("/v1/completions") == []
    box[0].stop()


def test_a_push_to_a_replaced_server_is_sent_again_and_restore_sends_the_last_weights(tmp_path, caplog):
    import torch

    policy = torch.nn.Linear(3, 2)
    first = StandInServer()
    backend = VLLMServerBackend(first.url, None, sync_dir=tmp_path, timeout_s=10, server_wait_s=60)
    backend.sync_weights(policy)
    assert [b["kwargs"]["weights_path"] for b in first.posted("/collective_rpc")] == [str(tmp_path / "weights-000001")]
    first.stop()
    box: list[StandInServer] = []
    _replacement_after(first.port, 3.0, box)
    with torch.no_grad():
        policy.weight.add_(1.0)
    with caplog.at_level("WARNING", logger="maxent_grpo"):
        backend.sync_weights(policy)  # waits for the replacement, then pushes to it
    back = box[0]
    assert "stopped answering" in caplog.text and "answered again" in caplog.text
    assert [b["kwargs"]["weights_path"] for b in back.posted("/collective_rpc")] == [str(tmp_path / "weights-000002")]
    assert sorted(p.name for p in tmp_path.glob("weights-*")) == ["weights-000002"]
    backend.restore_weights()
    assert [b["kwargs"]["weights_path"] for b in back.posted("/collective_rpc")] == [str(tmp_path / "weights-000002")] * 2
    assert len(back.posted("/reset_prefix_cache")) == 2
    from safetensors.torch import load_file

    pushed = load_file(str(tmp_path / "weights-000002" / "model.safetensors"))
    assert torch.equal(pushed["weight"], policy.weight.detach())
    back.stop()
