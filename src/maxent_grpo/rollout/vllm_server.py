"""Generation by a vLLM server (``generation.backend: vllm_server``): a thin client of vLLM's own API.

The server is vLLM's OpenAI-compatible server, started by ``maxent-grpo serve``
(``vllm serve`` with the flags this client
relies on: ``--logprobs-mode processed_logprobs`` and ``VLLM_SERVER_DEV_MODE=1``
for the ``/collective_rpc`` and ``/reset_prefix_cache`` endpoints). We write no
server of our own.

Requests: one ``/v1/completions`` call per prompt (token-id prompt, ``n``,
its own ``seed``, ``logprobs: 0``, ``return_tokens_as_token_ids``), sent
concurrently. Weight sync after each optimizer step:

* ``disk`` (anywhere): the main process writes the weights, in the server's
  dtype (``generation.dtype``, else the policy's), as safetensors into
  a fresh folder (renamed into place when complete, so the server never reads
  half a file), asks the server to ``reload_weights`` from it through
  ``/collective_rpc``, then ``/reset_prefix_cache``; the previous folder is
  removed. The folder must be readable by the server (same machine or shared
  file system); for a server on this machine it defaults to ``/dev/shm``
  (memory, no disk): ``shared_memory_sync_dir``.
The disk sync is the only one: a transfer over NCCL would need vLLM's weight-transfer API
with CUDA on both ends (docs/VLLM.md).

With ``lora_sync: adapter`` (a server started with ``maxent-grpo serve --lora-rank R``)
the first push sends the base weights (the server may hold another run's), and every
push then writes the adapter alone into a fresh folder (``vllm_weights.write_adapter``),
loads it under a new name (``/v1/load_lora_adapter``, ``policy-<n>``), unloads the last
one and sends the completions to that name. Every process counts the pushes, so all ask
for the same adapter.

Every process sends its own prompts; only the main process pushes weights,
and ``any_rank`` keeps the others from sampling before the push has finished
and tells every process whether it worked: a failed push stops them all.

A server that stops answering (refused or cut-off connections: it died, or was replaced) is waited
for, up to ``server_wait_s`` (``generation.vllm.server_wait_s``), with a line saying so. Once it (or a
replacement at the same address) answers again, a push in progress is sent again; a generation call
raises :class:`~maxent_grpo.rollout.backend.SamplerLost`, and the pipeline has every process agree,
reload the last pushed weights (:meth:`VLLMServerBackend.restore_weights`) and sample the lost batch
again from the same seeds (``training/pipeline.py``, :func:`settle_sampling`). A server that answers
with an error, or not within ``request_timeout_s`` (hung), is not waited for: the run stops with a
checkpoint.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from maxent_grpo.errors import UserError
from maxent_grpo.rollout.backend import PromptGroup, SamplerGone, SamplerLost, SamplingParams, TokenPrompts
from maxent_grpo.rollout.vllm_common import request_seeds, sampling_kwargs, to_completion
from maxent_grpo.rollout.vllm_weights import engine_lora_rank, full_state_items, write_adapter

log = logging.getLogger("maxent_grpo")


# vLLM's CPU build reads the default gpu_memory_utilization (0.92) as a share of the NUMA node's
# memory and fails at start unless VLLM_CPU_KVCACHE_SPACE (GiB) is set; 2 GiB holds ~20k tokens of
# a 135M model's fp32 cache.
DEFAULT_CPU_KV_CACHE_GIB = 2


def server_command(
    model_path: str, *, host: str = "127.0.0.1", port: int = 8000, dtype: str = "auto", extra: list[str] = (),
    cpu_kv_cache_gib: int | None = None, lora_rank: int | None = None, head_fp32: bool = False,
    reload_mode: str = "layerwise",
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start vLLM's server the way this client expects it.

    ``vllm serve`` through :mod:`maxent_grpo.rollout.vllm_serve`, run by this Python (the one whose
    environment holds vLLM), which also runs it on vLLM's CPU build (where the ``vllm`` command fails at
    a package-metadata lookup);
    ``VLLM_SERVER_DEV_MODE=1`` turns on ``/collective_rpc`` and ``/reset_prefix_cache``;
    ``cpu_kv_cache_gib`` sets the CPU build's ``VLLM_CPU_KVCACHE_SPACE``; ``lora_rank`` plans the
    server for one LoRA adapter of that rank, loaded at run time (``lora_sync: adapter``); ``head_fp32``
    runs the LM head's matmul in float32 (vLLM's ``head_dtype``, for ``model.lm_head_fp32``);
    ``reload_mode: direct`` writes pushed weights in place (``VLLM_RELOAD_MODE``, vLLM >= 0.34).
    """
    lora = [] if lora_rank is None else ["--enable-lora", "--max-lora-rank", str(engine_lora_rank(lora_rank)),
                                         "--max-loras", "1"]
    cmd = [
        sys.executable, "-m", "maxent_grpo.rollout.vllm_serve", str(model_path),
        "--host", host, "--port", str(port), "--dtype", dtype, "--logprobs-mode", "processed_logprobs",
        *lora, *(["--hf-overrides", json.dumps({"head_dtype": "float32"})] if head_fp32 else []), *extra,
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)
    if reload_mode != "layerwise":
        env["VLLM_RELOAD_MODE"] = reload_mode
    return cmd, env


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def shared_memory_sync_dir(server_url: str) -> Path | None:
    """Where the disk sync writes by default when the server runs on this machine: a folder of this
    process under ``/dev/shm`` (memory: the push costs no disk write and read); None elsewhere."""
    host = urllib.parse.urlsplit(server_url).hostname
    shm = Path("/dev/shm")
    if host not in _LOCAL_HOSTS or not shm.is_dir():
        return None
    return shm / f"maxent-grpo-{os.getpid()}-vllm-weights"


class VLLMServerError(UserError, RuntimeError):
    """The server could not be reached or answered with an error; the message has its URL and reply."""


class ServerUnreachable(VLLMServerError):
    """No server answered: the connection was refused or reset, or the reply broke off (it died)."""


class ServerGone(VLLMServerError, SamplerGone):
    """The server stopped answering and did not answer again within ``server_wait_s``."""


# Seconds between two asks of a server that stopped answering.
SERVER_POLL_S = 2.0


def _request(base_url: str, method: str, path: str, body: dict | None, timeout_s: float, *,
             reply_json: bool = True) -> dict:
    """The JSON reply of ``method path`` (``reply_json=False``: a route that answers in plain text, whose
    text is not read: its HTTP status says whether it worked)."""
    url = base_url.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        raise VLLMServerError(f"{method} {url}: HTTP {err.code}: {err.read().decode(errors='replace')[:500]}") from None
    except (TimeoutError, urllib.error.URLError) as err:
        if isinstance(err, TimeoutError) or isinstance(err.reason, TimeoutError):
            # It took the connection and did not answer in time: hung, not gone.
            raise VLLMServerError(f"{method} {url}: no reply within {timeout_s:g} s "
                                  "(generation.vllm.request_timeout_s)") from None
        raise ServerUnreachable(f"{method} {url}: {err} (is `maxent-grpo serve` running there?)") from None
    except ConnectionError as err:
        raise ServerUnreachable(f"{method} {url}: {err} (is `maxent-grpo serve` running there?)") from None
    except http.client.HTTPException as err:
        # A server that dies while it writes its reply (headers sent, body not; half a status line)
        # leaves http.client's own errors, which are neither OSError nor URLError: the server's failure
        # all the same. Unconverted, it escaped the sampler thread on one rank as a traceback while the
        # other ranks waited for it in a collective.
        raise ServerUnreachable(f"{method} {url}: the reply broke off ({type(err).__name__}: {err}); "
                                "did the server die?") from None
    if not reply_json:
        return {}
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise VLLMServerError(f"{method} {url}: the reply is not JSON ({err}): {raw[:200]!r}") from None


def served_model(base_url: str, *, timeout_s: float = 30.0) -> str:
    """The name of the one base model the server at ``base_url`` serves (an error if none or several);
    LoRA adapters loaded on it (listed with their base as ``parent``) are not counted."""
    models = [m for m in _request(base_url, "GET", "/v1/models", None, timeout_s)["data"] if m.get("parent") is None]
    if len(models) != 1:
        raise VLLMServerError(f"{base_url} serves {len(models)} models; this client needs exactly one")
    return models[0]["id"]


def loaded_adapters(base_url: str, *, timeout_s: float = 30.0) -> list[str]:
    """The names of the LoRA adapters loaded on the server."""
    return [m["id"] for m in _request(base_url, "GET", "/v1/models", None, timeout_s)["data"]
            if m.get("parent") is not None]


class VLLMServerBackend(TokenPrompts):
    MAX_CONCURRENCY = 64  # most requests in flight at once

    def __init__(
        self, base_url: str, tokenizer, *, sync_dir: str | Path, is_main: bool = True,
        any_rank: Callable[[bool], bool] | None = None, timeout_s: float = 600.0,
        dtype: torch.dtype | None = None, lora_adapter: bool = False,
        server_wait_s: float = 0.0,
    ):
        self.base_url = base_url.rstrip("/")
        self.dtype = dtype  # what the disk sync writes (the server's dtype); None: the policy's own
        self.tokenizer = tokenizer
        self.sync_dir = Path(sync_dir)
        self.is_main = is_main
        self.any_rank = any_rank
        self.timeout_s = timeout_s
        self.server_wait_s = server_wait_s  # 0: a server that stops answering is an error at once
        self._pushes = 0
        # What the server was last sent (main process): restore_weights sends it again.
        self._last_weights: Path | None = None
        self._last_adapter: tuple[str, Path] | None = None
        # The server answered again after it was lost and has not had the last weights back: no batch is
        # sampled from it (whatever it holds) until restore_weights or a push.
        self._restore_due = False
        self.base_model = served_model(self.base_url, timeout_s=timeout_s)
        self.model_name = self.base_model  # with lora_sync: adapter, the last adapter's name once pushed
        # lora_sync: adapter: the requests name the last adapter pushed (adapter_pushes counts them on every rank).
        self.lora_adapter, self.adapter_pushes = lora_adapter, 0
        if is_main and self.sync_dir == shared_memory_sync_dir(self.base_url):
            # A folder of our own under /dev/shm is memory: do not leave the last weights in it.
            weakref.finalize(self, shutil.rmtree, self.sync_dir, True)

    def _request(self, method: str, path: str, body: dict | None = None, *, reply_json: bool = True) -> dict:
        return _request(self.base_url, method, path, body, self.timeout_s, reply_json=reply_json)

    # ------------------------------------------------------------ generation

    def _generate(
        self, prompts: list[str], prompt_ids: list[list[int]], num_generations: int, params: SamplingParams
    ) -> list[PromptGroup]:
        if self._restore_due:
            raise SamplerLost(f"the generation server at {self.base_url} was lost and has not had the weights back")
        seeds = request_seeds(len(prompts), num_generations, params.seed)
        bodies = [
            {
                "model": self.model_name,
                "prompt": list(ids),
                "return_tokens_as_token_ids": True,
                **sampling_kwargs(params, num_generations, seed),
            }
            for ids, seed in zip(prompt_ids, seeds)
        ]
        try:
            with ThreadPoolExecutor(max_workers=min(self.MAX_CONCURRENCY, len(bodies))) as pool:
                replies = list(pool.map(lambda b: self._request("POST", "/v1/completions", b), bodies))
        except ServerUnreachable as err:
            if self.server_wait_s <= 0:
                raise
            waited = self._await_server(err)
            self._restore_due = True
            raise SamplerLost(f"the generation server at {self.base_url} was lost mid-batch and answered again "
                              f"after {waited:.0f} s") from None
        return [
            PromptGroup(prompt=prompt, prompt_ids=list(ids), completions=self._completions(reply))
            for prompt, ids, reply in zip(prompts, prompt_ids, replies)
        ]

    def _completions(self, reply: dict):
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            lp = c["logprobs"]
            # return_tokens_as_token_ids spells each token "token_id:<id>".
            ids = [int(tok.rsplit(":", 1)[1]) for tok in lp["tokens"]]
            out.append(to_completion(self.tokenizer, ids, [float(x) for x in lp["token_logprobs"]], c["finish_reason"]))
        return out

    # ------------------------------------------------------------ weights

    def rollout_phase(self, policy) -> AbstractContextManager[None]:
        return nullcontext()  # nothing to wake or put to sleep

    def sync_weights(self, policy: torch.nn.Module) -> None:
        if not self.lora_adapter:
            self._push_weights(full_state_items(policy, self.dtype))
            return
        if self.adapter_pushes == 0:  # the base weights once: the server may hold another run's
            self._push_weights(full_state_items(policy, self.dtype, merge_lora=False))
        self._push_adapter(policy)

    def _push_adapter(self, policy: torch.nn.Module) -> None:
        self.adapter_pushes += 1
        name = f"policy-{self.adapter_pushes}"
        failed: VLLMServerError | None = None
        if self.is_main:
            folder, _ = write_adapter(policy, self.sync_dir, self.adapter_pushes, self.dtype)
            self._last_adapter = (name, folder)
            try:
                self._waiting_for_server(self._load_adapter, restore_base=True)
            except VLLMServerError as err:
                failed = VLLMServerError(f"{err} (lora_sync: adapter needs a server started with maxent-grpo serve "
                                         "--lora-rank R)")
        self._agree(failed)
        self.model_name, self._restore_due = name, False

    def _push_weights(self, items) -> None:
        failed: VLLMServerError | None = None
        if not self.is_main:
            for _ in items:  # sharded weights are gathered by every rank; only the main one keeps them
                pass
        else:
            folder = self._write(items)
            try:
                self._waiting_for_server(lambda: self._reload(folder))
            except VLLMServerError as err:
                failed = err
            else:
                self._last_weights = folder
                for old in self.sync_dir.glob("weights-*"):
                    if old != folder:
                        shutil.rmtree(old)
        self._agree(failed)
        self._restore_due = False  # the server holds what was pushed last

    def restore_weights(self) -> None:
        """Every process: the main one sends the server the weights it last pushed (kept on disk) and, with
        ``lora_sync: adapter``, loads the last adapter again; for a server that came back (or a
        replacement) before a batch is sampled again. The others wait for the outcome."""
        failed: VLLMServerError | None = None
        if self.is_main:
            try:
                self._waiting_for_server(self._load_last)
            except VLLMServerError as err:
                failed = err
            else:
                sent = [folder.name for folder in (self._last_weights, self._last_adapter and self._last_adapter[1])
                        if folder is not None]
                log.warning("generation server %s: the last pushed weights loaded again (%s)", self.base_url,
                            ", ".join(sent))
        self._agree(failed)
        self._restore_due = False

    # ------------------------------------------------------------ a server that stops answering

    def _waiting_for_server(self, send: Callable[[], None], *, restore_base: bool = False) -> None:
        """``send()``; if the server stopped answering, wait for it (``server_wait_s``), then send the last
        pushed state again (``restore_base``: the base weights first, for a replacement) and ``send()``."""
        try:
            send()
        except ServerUnreachable as err:
            if self.server_wait_s <= 0:
                raise
            self._await_server(err)
            if restore_base and self._last_weights is not None:
                self._reload(self._last_weights)
            send()

    def _await_server(self, err: ServerUnreachable) -> float:
        """Ask the server every few seconds until it answers (the seconds waited), or raise after
        ``server_wait_s``. A replacement at the same address counts: it must serve the same model."""
        log.warning("generation server %s stopped answering (%s); waiting up to %g s for it, or a replacement at "
                    "the same address (generation.vllm.server_wait_s)", self.base_url, err, self.server_wait_s)
        start = time.monotonic()
        while True:
            time.sleep(SERVER_POLL_S)
            waited = time.monotonic() - start
            try:
                served = served_model(self.base_url, timeout_s=min(self.timeout_s, 30.0))
            except ServerUnreachable:
                if waited >= self.server_wait_s:
                    raise ServerGone(f"generation server {self.base_url} did not answer again within "
                                          f"{self.server_wait_s:g} s (generation.vllm.server_wait_s): {err}") from None
                continue
            log.warning("generation server %s answered again after %.0f s", self.base_url, waited)
            if served != self.base_model:  # another model's server: not this run's to sample from
                raise ServerGone(f"generation server {self.base_url} came back serving {served!r}, not "
                                      f"{self.base_model!r}")
            return waited

    def _load_last(self) -> None:
        if self._last_weights is not None:
            self._reload(self._last_weights)
        if self._last_adapter is not None:
            self._load_adapter()

    def _reload(self, folder: Path) -> None:
        self._request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        self._request("POST", "/reset_prefix_cache")

    def _load_adapter(self) -> None:
        """The last adapter written, under its name. Every adapter loaded (this run's last version, or
        another run's, which may bear this version's name) goes first: no request is in flight during a push."""
        name, folder = self._last_adapter
        for old in loaded_adapters(self.base_url, timeout_s=self.timeout_s):
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": old}, reply_json=False)
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)},
                      reply_json=False)

    def _agree(self, failed: VLLMServerError | None) -> None:
        """In place of a barrier after a push: a rank that only waited would sit in it until the process
        group's timeout if the main rank's push failed; here every rank learns the outcome and stops with it."""
        if self.any_rank is not None and self.any_rank(failed is not None) and failed is None:
            failed = VLLMServerError("the main process's weight push to the vLLM server failed (its error is in its log)")
        if failed is not None:
            raise failed

    def _write(self, items) -> Path:
        self._pushes += 1
        final = self.sync_dir / f"weights-{self._pushes:06d}"
        tmp = self.sync_dir / f".tmp-weights-{self._pushes:06d}"
        for stale in (tmp, final):  # left by an earlier run in this folder
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir(parents=True)
        # One host copy per tensor, made straight from the device (no clone on the GPU); a copy
        # also for a tensor already on the host, since safetensors refuses shared storage (a tied head).
        save_file({name: t.to("cpu", copy=True).contiguous() for name, t in items}, str(tmp / "model.safetensors"))
        tmp.replace(final)
        return final
