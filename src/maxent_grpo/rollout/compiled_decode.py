"""Compiled decoding: a static KV cache and a compiled one-token step per bucketed shape.

The eager loop (``rollout/hf.py``) grows a ``DynamicCache`` by one position per step and launches
every kernel of the model from Python: on a GPU it spends most of a step launching (BENCHMARKS.md
§9: 5.65 s for 64 rows x 256 tokens at 0.5B, where transformers' static-cache ``generate`` took
1.26 s). Here each shape gets a :class:`DecodeGraph`: a ``transformers.StaticCache`` allocated once,
fixed input buffers (the fed token, its position, the attention mask over every cache slot) and
the model's one-token forward compiled by ``torch.compile`` (``fullgraph``, no dynamic shapes;
``mode="reduce-overhead"`` on CUDA, which replays the step as a CUDA graph).

What a graph bakes in is its key (:class:`GraphKey`): the batch it runs, the cache length, the
weights' dtype and device, the attention kernel. Anything else the step reads is an input read on
every replay: the KV cache and the buffers above live at fixed addresses
(``torch._dynamo.mark_static_address``) and are written in place; the weights are the module's
parameters, which optimizer steps and ``load_state_dict`` update in place, so a replay always reads
the current weights (a graph that copied them in, as inductor's ``freezing`` does, would sample from
stale ones).

Shapes are bucketed so a run compiles a bounded number of times: the batch to the next power of
two (rows past the call's own run on padding), the cache to the next power of two of
``prompt + max_new_tokens`` (at least 64). Each key compiles on its first step, and the time that
took is logged. When rows end, a call either keeps its graph (their slots run on, unread) or,
with ``shrink``, moves the rows still going to the graph of the next smaller batch bucket once
they fit in it (their KV cache, positions and mask are copied over).

Only full-attention caches are supported (every layer a ``StaticLayer``): :func:`supports_compile`.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer

from maxent_grpo.core.completion_logits import cache_kwarg

log = logging.getLogger("maxent_grpo")

MIN_CACHE_LEN = 64
# A run's keys: batch buckets (at most log2(rows) + 1) times cache buckets (a few): well inside this.
RECOMPILE_LIMIT = 64


def batch_bucket(rows: int) -> int:
    """The batch a call of ``rows`` rows runs: the next power of two."""
    return 1 << (rows - 1).bit_length()


def cache_bucket(positions: int) -> int:
    """The static cache length for ``positions`` (prompt + new tokens): the next power of two, at least 64."""
    return max(MIN_CACHE_LEN, 1 << (positions - 1).bit_length())


def supports_compile(model) -> bool:
    """Whether ``model``'s static cache is full attention in every layer (no sliding-window or recurrent layers)."""
    probe = StaticCache(config=model.config, max_cache_len=1)
    return all(type(layer) is StaticLayer for layer in probe.layers)


@dataclass(frozen=True)
class GraphKey:
    """Everything a compiled step bakes in."""

    batch: int
    cache_len: int
    dtype: torch.dtype
    device: torch.device
    attention: str  # the model's attention implementation (sdpa, eager, flash...)


class DecodeGraph:
    """One key's static cache and input buffers; the step runs through :meth:`DecodeGraphs.step`.

    ``length``: the cache slots filled so far (the prefill's, then one per step), the same for every row.
    """

    def __init__(self, model, key: GraphKey):
        self.key = key
        self.cache = StaticCache(config=model.config, max_cache_len=key.cache_len)
        b, n, device = key.batch, key.cache_len, key.device
        self.ids = torch.zeros((b, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((b, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((b, n), dtype=torch.long, device=device)
        for buffer in (self.ids, self.positions, self.mask):
            torch._dynamo.mark_static_address(buffer)
        self.length = 0
        self.compiled = False  # its first step compiles it

    def _layers(self, like: DynamicCache | StaticCache) -> None:
        """Allocates the cache's tensors (once) with the heads, head size and dtype of ``like``'s layers."""
        for layer, src in zip(self.cache.layers, like.layers):
            if not layer.is_initialized:
                k, v = src.keys, src.values
                layer.lazy_initialization(k.new_empty((self.key.batch, k.shape[1], 0, k.shape[3])),
                                          v.new_empty((self.key.batch, v.shape[1], 0, v.shape[3])))

    def start(self, prefill: DynamicCache, prompt_mask: torch.Tensor, feed: torch.Tensor) -> None:
        """A call's rows in batch positions ``0..rows-1``: the prefill's KV cache (every prompt but its
        last token), the prompts' mask ``[rows, lp]`` and the last prompt tokens ``[rows]`` to feed."""
        rows, lp = prompt_mask.shape
        self._layers(prefill)
        for layer, src in zip(self.cache.layers, prefill.layers):
            layer.keys[:rows, :, : lp - 1].copy_(src.keys)
            layer.values[:rows, :, : lp - 1].copy_(src.values)
            layer.cumulative_length.fill_(lp - 1)
        self.length = lp - 1
        self.mask.zero_()
        self.mask[:rows, :lp].copy_(prompt_mask)
        self.positions.zero_()
        self.positions[:rows, 0] = prompt_mask.sum(-1) - 1  # left padding: real tokens before the fed one
        self.ids.zero_()
        self.ids[:rows, 0] = feed

    def take(self, other: "DecodeGraph", at: torch.Tensor) -> None:
        """The rows at batch positions ``at`` of ``other`` into positions ``0..len(at)-1`` of this graph."""
        n = len(at)
        self._layers(other.cache)
        for layer, src in zip(self.cache.layers, other.cache.layers):
            layer.keys[:n, :, : other.length].copy_(src.keys[at, :, : other.length])
            layer.values[:n, :, : other.length].copy_(src.values[at, :, : other.length])
            layer.cumulative_length.fill_(other.length)
        self.length = other.length
        self.mask.zero_()
        self.mask[:n].copy_(other.mask[at])
        self.positions.zero_()
        self.positions[:n].copy_(other.positions[at])
        self.ids.zero_()
        self.ids[:n].copy_(other.ids[at])


class DecodeGraphs:
    """The compiled one-token step of ``model`` and its graphs by :class:`GraphKey`.

    ``cuda_graphs``: replay each step as a CUDA graph (``mode="reduce-overhead"``); on the CPU the
    step is inductor's generated code. ``shrink``: see the module notes.
    """

    def __init__(self, model, *, cuda_graphs: bool, shrink: bool):
        self.model = model
        self.shrink = shrink
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[GraphKey, DecodeGraph] = {}
        self._cache_name = cache_kwarg()
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self._step = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                   mode="reduce-overhead" if cuda_graphs else None)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: StaticCache):
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **self._keep, **{self._cache_name: cache})
        return out.logits[:, -1]

    def key(self, batch: int, cache_len: int) -> GraphKey:
        p = next(self.model.parameters())
        return GraphKey(batch=batch, cache_len=cache_len, dtype=p.dtype, device=p.device,
                        attention=self.model.config._attn_implementation)

    def get(self, batch: int, cache_len: int) -> DecodeGraph:
        key = self.key(batch, cache_len)
        if key not in self.graphs:
            self.graphs[key] = DecodeGraph(self.model, key)
        return self.graphs[key]

    def step(self, graph: DecodeGraph) -> torch.Tensor:
        """One token for every row of ``graph`` (its ``ids`` at its ``positions``): the logits
        ``[batch, V]`` of the next token; the fed token's K/V fill slot ``graph.length``."""
        graph.mask[:, graph.length] = 1
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are no longer read
        start = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            logits = self._step(graph.ids, graph.mask, graph.positions, graph.cache)
        if not graph.compiled:
            graph.compiled = True
            seconds = time.perf_counter() - start
            k = graph.key
            log.info("compiled decoding: batch %d x cache %d (%s, %s): first step, compiling included, %.1f s",
                     k.batch, k.cache_len, str(k.dtype).removeprefix("torch."), k.device, seconds)
        graph.length += 1
        graph.positions += 1
        return logits

    def feed(self, graph: DecodeGraph, at: torch.Tensor, tokens: torch.Tensor) -> tuple[DecodeGraph, torch.Tensor]:
        """The rows still going, at batch positions ``at`` of ``graph``, fed ``tokens``; with ``shrink``,
        moved first to the smallest batch bucket that holds them. Returns the graph they are in now
        and their batch positions there."""
        if self.shrink and len(at) and batch_bucket(len(at)) < graph.key.batch:
            smaller = self.get(batch_bucket(len(at)), graph.key.cache_len)
            smaller.take(graph, at)
            graph, at = smaller, torch.arange(len(at), device=at.device)
        graph.ids[at, 0] = tokens
        return graph, at
