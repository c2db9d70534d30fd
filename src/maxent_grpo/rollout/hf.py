"""Generation with a transformers causal LM: our own decoding loop over the model's KV cache.

Each step runs the model on the rows still going (one new token each, ``logits_to_keep=1``),
records the behaviour log-prob ``log_softmax(raw logits / temperature)`` of the token it draws,
and drops the rows that have ended (EOS, a stop string) from the batch and from the cache.
transformers' ``generate`` keeps every row until the last one ends, padding the finished ones:
with completions of 3-64 tokens (mean 35, SmolLM2-135M on chain_sum), about half its
row-steps computed padding (BENCHMARKS.md §10).

Sampling: the warpers are transformers' own (temperature, top-k, top-p, in ``generate``'s
order), applied after the log-prob is taken, so the log-probs are of the raw distribution as
the trainer recomputes it. The draw is by inverse transform: one uniform number per row
against the float64 cumulative sum of the warped probabilities (a token of probability 0 is
never drawn). ``torch.multinomial`` (``generate``'s draw) fills a ``[rows, V]`` tensor of
exponential variates each step instead, 15% of a SmolLM2 decode step on two CPU cores.

Shared prefill (``share_prompts``): the ``G`` rows of a group carry the same prompt. The
prompt, all but its last token, runs once per distinct prompt and its KV cache is copied to
the group's rows; the first decoding step feeds the last prompt token. Without it every row
runs its own prompt. Same draws either way; the logits differ only by float rounding.

Stop strings are found by decoding each row's last few generated tokens after each step; the
token that completes one ends the row, and is kept.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import numpy as np
import torch
from transformers import DynamicCache, LogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from maxent_grpo.core.completion_logits import cache_kwarg
from maxent_grpo.core.fp32_head import is_fp32_head, keep_head_float32
from maxent_grpo.rollout.compiled_decode import DecodeGraphs, batch_bucket, cache_bucket, supports_compile
from maxent_grpo.rollout.backend import Completion, PromptGroup, SamplingParams, TokenPrompts


def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
    """The sampling warpers ``generate`` would build for ``params`` (temperature, top-k, top-p, in its order)."""
    if not params.do_sample:
        return []
    out: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k:
        out.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(params.top_p), min_tokens_to_keep=1))
    return out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ``[rows, V]`` (non-negative, each row summing to about 1),
    by inverse transform sampling: the first index whose float64 cumulative sum exceeds
    ``u * total``, for ``u`` ``[rows]`` uniform in [0, 1). ``[rows]`` int64."""
    cdf = probs.to(torch.float64).cumsum_(-1)
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, u.to(torch.float64)[:, None] * total, right=True)[:, 0]
    over = index == cdf.shape[1]  # u * total rounded up to the total (probability ~2^-53)
    if bool(over.any()):
        last = (probs > 0).cumsum(-1).argmax(-1)  # the last token with mass
        index = torch.where(over, last, index)
    return index


class _Decode:
    """The rows of one decoding call still going: their batch positions, tokens and log-probs so far."""

    def __init__(self, tokenizer, rows: int, params: SamplingParams, eos_ids: list[int]):
        self.tokenizer = tokenizer
        self.params = params
        self.eos = set(eos_ids)
        self.live = list(range(rows))  # batch position -> row
        self.placeholder = False  # every row has ended; one is kept running (synced_gpus)
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logps: list[list[float]] = [[] for _ in range(rows)]
        self.reasons: list[str | None] = [None] * rows
        # A stop string of b bytes completed by the newest token lies within its last b tokens.
        self.window = max((len(s.encode("utf-8")) for s in params.stop), default=0) + 1

    def record(self, tokens: list[int], logps: list[float]) -> list[int]:
        """Appends each live row's new token; returns the batch positions of the rows that go on."""
        if self.placeholder:
            return [0]
        going = []
        for b, (row, token, logp) in enumerate(zip(self.live, tokens, logps)):
            self.tokens[row].append(token)
            self.logps[row].append(logp)
            if token in self.eos or self._stopped(row):
                self.reasons[row] = "stop"
            elif len(self.tokens[row]) == self.params.max_new_tokens:
                self.reasons[row] = "length"
            else:
                going.append(b)
        return going

    def _stopped(self, row: int) -> bool:
        if not self.params.stop:
            return False
        tail = self.tokenizer.decode(
            self.tokens[row][-self.window :], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return any(s in tail for s in self.params.stop)

    def completions(self) -> list[Completion]:
        out = []
        for ids, logps, reason in zip(self.tokens, self.logps, self.reasons):
            if reason is None:
                raise RuntimeError(f"a row ended after {len(ids)} tokens with no eos, stop string or length")
            text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            out.append(Completion(token_ids=ids, text=text, finish_reason=reason, logps=logps))
        return out


class HFGenerationBackend(TokenPrompts):
    """Samples completions from a transformers causal LM (the policy itself: no weight sync needed).

    ``batch_size``: most sequences per decoding call (None: all at once).
    ``seed``: when given, each call samples under its own seed derived from
    ``seed`` and a call counter, without touching the global RNG; otherwise the
    global torch RNG is used (deterministic under ``torch.manual_seed``).
    In multi-process runs give each rank a different seed.
    ``share_prompts``: prefill each distinct prompt once per call (see the module notes).
    ``synced_gpus``: every rank keeps running forwards until the longest row of any rank
    has finished (needed when the model is sharded with FSDP2: each forward gathers the
    weights from every rank). A rank whose rows have all ended runs one placeholder row.
    ``compile``: decode through a static KV cache and a compiled one-token step
    (``rollout/compiled_decode.py``; CUDA graphs on a GPU); the same draws as the eager loop for the
    same uniforms, to float rounding. ``shrink``: with ``compile``, rows still going move to a
    smaller compiled batch as others end (else the batch stays and ended rows run on, unread).
    """

    def __init__(
        self, model, tokenizer, *, batch_size: int | None = None, seed: int | None = None,
        dtype: torch.dtype | None = None, share_prompts: bool = True, synced_gpus: bool = False,
        compile: bool = False, shrink: bool = False,
    ):
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer must have a pad token")
        eos = model.generation_config.eos_token_id
        eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        eos_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if not eos_ids:
            raise ValueError("tokenizer / model generation_config define no eos token")
        # A generation copy in another dtype (bf16 sampling for an fp32 policy, the way an
        # inference engine holds its own weights); sync_weights refreshes it after each step.
        self.model = model
        self.separate_copy = dtype is not None and dtype != model.dtype
        if self.separate_copy:
            if hasattr(model, "peft_config"):
                raise ValueError("dtype: a separate generation copy is not supported for LoRA (peft) models")
            self.model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
            if is_fp32_head(self.model.get_output_embeddings()):
                keep_head_float32(self.model)  # the trainer's float32 head weights, unrounded
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seed = seed
        self.eos_ids = sorted(eos_ids)
        self.share_prompts = share_prompts
        self.synced_gpus = synced_gpus
        self._calls = 0
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.graphs = None
        if compile:
            if not supports_compile(self.model):
                raise ValueError("compile: the model has sliding-window or recurrent cache layers; compiled "
                                 "decoding supports full-attention models only")
            self.graphs = DecodeGraphs(self.model, cuda_graphs=self.model.device.type == "cuda", shrink=shrink)

    def rollout_phase(self, policy) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # nothing to wake or put to sleep

    def sync_weights(self, policy) -> None:
        """Copy ``policy``'s weights into the generation copy; nothing to do when sampling from the policy itself."""
        if self.separate_copy:
            with torch.no_grad():
                self.model.load_state_dict(policy.state_dict())

    def _generate(
        self, prompts: list[str], prompt_ids: list[list[int]], num_generations: int, params: SamplingParams
    ) -> list[PromptGroup]:
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"num_generations must be a positive integer, got {num_generations!r}")
        rows = [i for i in range(len(prompts)) for _ in range(num_generations)]  # prompt-major
        per_call = self.batch_size or len(rows)
        completions: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._rng(params):
                for start in range(0, len(rows), per_call):
                    chunk = [prompt_ids[i] for i in rows[start : start + per_call]]
                    completions.extend(self._generate_chunk(chunk, params))
        finally:
            self.model.train(was_training)
        self._calls += 1
        return [
            PromptGroup(
                prompt=prompts[i],
                prompt_ids=list(prompt_ids[i]),
                completions=completions[i * num_generations : (i + 1) * num_generations],
            )
            for i in range(len(prompts))
        ]

    def _rng(self, params: SamplingParams):
        if params.seed is not None:
            call_seed = params.seed
        elif self.seed is None:
            return contextlib.nullcontext()
        else:
            call_seed = int(np.random.SeedSequence([self.seed, self._calls]).generate_state(1, np.uint64)[0] >> 1)
        device = self.model.device
        return _seeded_rng(call_seed, [device.index or 0] if device.type == "cuda" else [])

    def _generate_chunk(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        pad = self.tokenizer.pad_token_id
        lp = max(len(p) for p in prompt_ids)
        device = self.model.device
        input_ids = torch.tensor([[pad] * (lp - len(p)) + list(p) for p in prompt_ids], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (lp - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long, device=device)
        state = _Decode(self.tokenizer, len(prompt_ids), params, self.eos_ids)
        if self.graphs is not None and lp >= 2:  # one-token prompts have no prefill to place in a static cache
            self._decode_compiled(input_ids, mask, params, state)
        else:
            self._decode_eager(input_ids, mask, params, state)
        return state.completions()

    def _next(self, logits: torch.Tensor, feed: torch.Tensor, u: torch.Tensor, params: SamplingParams,
              warpers: list[LogitsProcessor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The live rows' draws from their ``logits`` ``[live, V]`` (``u`` ``[live]``) and each draw's
        behaviour log-prob under the raw distribution at ``params.temperature``."""
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if params.do_sample:
            warped = scores
            for warper in warpers:
                warped = warper(feed, warped)
            tokens = draw(torch.softmax(warped, dim=-1), u)
        else:
            tokens = scores.argmax(dim=-1)
        logps = torch.log_softmax(scores / params.temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logps

    def _decode_eager(self, input_ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                      state: _Decode) -> None:
        """Each step over the dynamic cache of the rows still going; ended rows leave it."""
        rows, device = input_ids.shape[0], input_ids.device
        cache = self._prefill(input_ids, mask)
        warpers = _warpers(params)
        feed = input_ids[:, -1:]  # the last prompt token; then each step's draw
        keep = {"logits_to_keep": 1} if self._logits_to_keep else {}
        cache_name = cache_kwarg()
        live = torch.arange(rows, device=device)  # state.live as a tensor
        while self._going(state):
            position_ids = mask.sum(-1, keepdim=True) - 1  # left padding: real tokens so far
            out = self.model(
                input_ids=feed, attention_mask=mask, position_ids=position_ids, use_cache=True,
                **{cache_name: cache}, **keep,
            )
            # One uniform number per row of the call every step, used by the rows still going: a row's
            # draws do not depend on when the others end.
            u = torch.rand(rows, dtype=torch.float64, device=device)
            tokens, logps = self._next(out.logits[:, -1], feed, u[live], params, warpers)
            going = self._record(state, tokens, logps)
            if len(going) < len(state.live):
                index = torch.tensor(going, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                mask, tokens, live = mask[index], tokens[index], live[index]
                state.live = [state.live[b] for b in going]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            feed = tokens[:, None]

    def _decode_compiled(self, input_ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                         state: _Decode) -> None:
        """Each step one replay of the compiled step of a bucketed shape (``rollout/compiled_decode.py``);
        the same uniforms and the same sampling as :meth:`_decode_eager`."""
        rows, lp = input_ids.shape
        device = input_ids.device
        graph = self.graphs.get(batch_bucket(rows), cache_bucket(lp + params.max_new_tokens))
        graph.start(self._prefill(input_ids, mask), mask, input_ids[:, -1])
        warpers = _warpers(params)
        feed = input_ids[:, -1:]
        at = torch.arange(rows, device=device)  # the live rows' batch positions in the graph
        live = torch.arange(rows, device=device)  # state.live as a tensor
        while self._going(state):
            logits = self.graphs.step(graph)[at]
            u = torch.rand(rows, dtype=torch.float64, device=device)
            tokens, logps = self._next(logits, feed, u[live], params, warpers)
            going = self._record(state, tokens, logps)
            if len(going) < len(state.live):
                index = torch.tensor(going, dtype=torch.long, device=device)
                at, tokens, live = at[index], tokens[index], live[index]
                state.live = [state.live[b] for b in going]
            graph, at = self.graphs.feed(graph, at, tokens)
            feed = tokens[:, None]

    def _record(self, state: _Decode, tokens: torch.Tensor, logps: torch.Tensor) -> list[int]:
        """Records the live rows' draws; the batch positions of the rows that go on (with ``synced_gpus``,
        one placeholder row once every row has ended)."""
        going = state.record(tokens.tolist(), logps.tolist())
        if not going and self.synced_gpus:
            going, state.placeholder = [0], True  # keeps this rank's forwards in step with the others'
        return going

    def _going(self, state: _Decode) -> bool:
        """Whether to run another step: any row of this call still going (with ``synced_gpus``, of any rank's)."""
        here = bool(state.live) and not state.placeholder
        if not self.synced_gpus:
            return here
        flag = torch.tensor(1.0 if here else 0.0, device=self.model.device)
        torch.distributed.all_reduce(flag)
        return bool(flag.item() > 0)

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DynamicCache:
        """The KV cache of every row's prompt but its last token.

        With ``share_prompts``, each run of neighbouring rows with the same prompt is computed
        once and its cache copied to the run's rows (:func:`distinct_rows`).
        """
        cache = DynamicCache(config=self.model.config)
        if input_ids.shape[1] < 2:
            return cache  # one-token prompts: the first decoding step feeds them whole
        owner = distinct_rows(input_ids) if self.share_prompts else None
        ids, mask = input_ids[:, :-1], attention_mask[:, :-1]
        if owner is not None:
            firsts = torch.ones_like(owner, dtype=torch.bool)
            firsts[1:] = owner[1:] != owner[:-1]
            ids, mask = ids[firsts], mask[firsts]
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens so far
        keep = {"logits_to_keep": 1} if self._logits_to_keep else {}
        self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
            **{cache_kwarg(): cache}, **keep,
        )
        if owner is not None:
            cache.batch_select_indices(owner)
        return cache


def distinct_rows(input_ids: torch.Tensor) -> torch.Tensor | None:
    """``[rows]``: for each row, the index of its run of equal neighbouring rows (prompt-major
    rows of ``G`` samples each form one run); None when no two neighbours are equal."""
    starts = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    starts[1:] = (input_ids[1:] != input_ids[:-1]).any(dim=1)
    if bool(starts.all()):
        return None
    return torch.cumsum(starts.long(), 0) - 1


@contextlib.contextmanager
def _seeded_rng(seed: int, cuda_devices: list[int]):
    """Seeds torch's RNG inside; the caller's RNG state is restored on exit."""
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield
