"""Generation with transformers' ``generate`` (KV cache, left padding, batched).

Behaviour log-probs are ``log_softmax(logits / temperature)`` of the raw logits at
the sampled token, taken by a logits processor (:class:`_SampledLogps`) while
``generate`` runs: it holds one step's ``[rows, V]`` logits until the next step
shows which token was drawn. (``output_logits=True`` would hold every step's,
``rows x steps x V x 4`` bytes: 9.3 GiB for 64 rows of 256 tokens at Qwen2.5's
vocabulary.) So that the processor sees the raw logits, the sampling warpers
(temperature, top-k, top-p) are ours, after it, in ``generate``'s own order, and
``generate`` is given neutral values for them: the same draws as its own warpers.

Stop strings are detected by our own stopping criterion, and the same record
decides where a completion is cut afterwards, so "which token completed the
stop string" has one answer.

Shared prefill (``share_prompts``): the ``G`` rows of a group carry the same
prompt, and ``generate`` would run the prompt forward once per row. We run it
once per distinct prompt (all but its last token), copy that KV cache to the
group's rows, and hand it to ``generate``, which then feeds only the last prompt
token. Same tokens, same RNG draws; the logits differ from per-row prefill only
by float rounding.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import numpy as np
import torch
from transformers import (
    DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from maxent_grpo.core.completion_logits import cache_kwarg
from maxent_grpo.rollout.backend import Completion, PromptGroup, SamplingParams, TokenPrompts

# Generation settings that reshape the sampling distribution or end rows early
# and that a checkpoint's generation_config could carry into `generate` where we
# cannot reset them (their "off" value is None, which `generate` fills from the model).
_UNRESETTABLE = (
    "max_time",
    "stop_strings",
    "min_p",
    "top_h",
    "bad_words_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "sequence_bias",
    "exponential_decay_length_penalty",
    "guidance_scale",
    "watermarking_config",
)


class _StopStrings(StoppingCriteria):
    """Stops a row once the text of its generated tokens contains a stop string.

    Each step decodes only the last ``window`` generated tokens: a stop string of
    ``b`` bytes completed by the newest token lies within its last ``b`` tokens.
    ``hit[row]`` is the index of the generated token that completed the first match.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...], prompt_length: int, rows: int):
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_length = prompt_length
        self.window = max(len(s.encode("utf-8")) for s in stops) + 1
        self.hit: list[int | None] = [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_length - 1
        start = max(self.prompt_length, input_ids.shape[1] - self.window)
        tails = self.tokenizer.batch_decode(
            input_ids[:, start:].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for row, text in enumerate(tails):
            if self.hit[row] is None and any(s in text for s in self.stops):
                self.hit[row] = step
        return torch.tensor([h is not None for h in self.hit], dtype=torch.bool, device=input_ids.device)


class _SampledLogps(LogitsProcessor):
    """Each sampled token's ``log_softmax(raw logits / temperature)``, recorded as ``generate`` runs.

    Called first in every decoding step with the raw logits ``[rows, V]``; the token drawn from
    them shows up as ``input_ids[:, -1]`` at the next call (and in the returned sequences after
    the last step, :meth:`finish`). One step's logits are held at a time.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.held: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _take(self, tokens: torch.Tensor) -> None:
        # One step's [rows, V] logits with no graph: a plain log_softmax and gather is 3-6x faster here
        # than the chunked autograd function (selective_logps, built for [B, T, V] with a backward), and
        # the ids need no range check (generate drew them from these logits).
        held = self.held.to(torch.promote_types(self.held.dtype, torch.float32))
        logps = torch.log_softmax(held / self.temperature, dim=-1)
        self.steps.append(logps.gather(-1, tokens.long()[:, None])[:, 0])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.held is not None:
            self._take(input_ids[:, -1])
        # Held as given, no copy: generate hands each step a fresh tensor, and the warpers after this one
        # (_warpers: temperature, top-k, top-p) build new ones (test_draws_are_generates_own_... checks it).
        self.held = scores.detach()
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """``[rows, steps]`` log-probs of ``generated`` (the new tokens of the returned sequences)."""
        if generated.shape[1]:
            self._take(generated[:, -1])
        if len(self.steps) != generated.shape[1]:
            raise RuntimeError(f"recorded {len(self.steps)} sampling steps for {generated.shape[1]} generated tokens")
        self.held = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros((generated.shape[0], 0))


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


class HFGenerationBackend(TokenPrompts):
    """Samples completions from a transformers causal LM (the policy itself: no weight sync needed).

    ``batch_size``: most sequences per ``generate`` call (None: all at once).
    ``seed``: when given, each call samples under its own seed derived from
    ``seed`` and a call counter, without touching the global RNG; otherwise the
    global torch RNG is used (deterministic under ``torch.manual_seed``).
    In multi-process runs give each rank a different seed.
    ``share_prompts``: prefill each distinct prompt once per call (see the module notes).
    ``synced_gpus``: every rank keeps running forwards until the longest row of any rank
    has finished (``generate``'s option; needed when the model is sharded with FSDP2).
    """

    def __init__(
        self, model, tokenizer, *, batch_size: int | None = None, seed: int | None = None,
        dtype: torch.dtype | None = None, share_prompts: bool = True, synced_gpus: bool = False,
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
        leaking = {k: v for k, v in model.generation_config.to_dict().items() if k in _UNRESETTABLE and v is not None}
        if leaking:
            raise ValueError(
                f"model.generation_config sets {sorted(leaking)}, which would change the sampling distribution "
                "behind the behaviour log-probs; set them to None"
            )
        # A generation copy in another dtype (bf16 sampling for an fp32 policy, the way an
        # inference engine holds its own weights); sync_weights refreshes it after each step.
        self.model = model
        self.separate_copy = dtype is not None and dtype != model.dtype
        if self.separate_copy:
            if hasattr(model, "peft_config"):
                raise ValueError("dtype: a separate generation copy is not supported for LoRA (peft) models")
            self.model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seed = seed
        self.eos_ids = sorted(eos_ids)
        self.share_prompts = share_prompts
        self.synced_gpus = synced_gpus
        self._calls = 0

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

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        pad = self.tokenizer.pad_token_id
        # Sampling warpers: neutral here, ours run after _SampledLogps (_warpers).
        sampling = dict(temperature=1.0, top_p=1.0, top_k=0) if params.do_sample else {}
        # Neutral values set explicitly: unset ones would be filled from the checkpoint's generation_config.
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            do_sample=params.do_sample,
            num_beams=1,
            num_return_sequences=1,
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            eos_token_id=self.eos_ids,
            pad_token_id=pad,
            use_cache=True,
            return_dict_in_generate=True,
            **sampling,
        )

    def _generate_chunk(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        pad = self.tokenizer.pad_token_id
        lp = max(len(p) for p in prompt_ids)
        device = self.model.device
        input_ids = torch.tensor([[pad] * (lp - len(p)) + list(p) for p in prompt_ids], dtype=torch.long, device=device)
        attention_mask = torch.tensor(
            [[0] * (lp - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long, device=device
        )
        stop = _StopStrings(self.tokenizer, params.stop, lp, len(prompt_ids)) if params.stop else None
        cache = self._shared_prefill(input_ids, attention_mask) if self.share_prompts else None
        record = _SampledLogps(params.temperature)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(params),
            logits_processor=LogitsProcessorList([record, *_warpers(params)]),
            stopping_criteria=StoppingCriteriaList([stop]) if stop is not None else None,
            synced_gpus=self.synced_gpus,
            **{cache_kwarg(): cache},
        )
        generated = out.sequences[:, lp:]
        logps = record.finish(generated)
        del out
        eos = torch.tensor(self.eos_ids, device=generated.device)
        is_eos = torch.isin(generated, eos)
        result = []
        for row, (ids, lps, eos_row) in enumerate(zip(generated.tolist(), logps.tolist(), is_eos.tolist())):
            cut, reason = len(ids), "length"
            if True in eos_row:
                cut, reason = eos_row.index(True) + 1, "stop"
            hit = stop.hit[row] if stop is not None else None
            if hit is not None and hit + 1 <= cut:
                cut, reason = hit + 1, "stop"
            if reason == "length" and cut != params.max_new_tokens:
                raise RuntimeError(f"row {row} ended after {cut} tokens with no eos or stop string")
            token_ids = ids[:cut]
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            result.append(Completion(token_ids=token_ids, text=text, finish_reason=reason, logps=lps[:cut]))
        return result

    def _shared_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DynamicCache | None:
        """The KV cache of every row's prompt but its last token, computed once per run of equal rows.

        ``None`` when no two neighbouring rows share a prompt (nothing to save) or a
        prompt is a single token (``generate`` needs at least one uncached token).
        """
        if input_ids.shape[0] < 2 or input_ids.shape[1] < 2:
            return None
        starts = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        starts[1:] = (input_ids[1:] != input_ids[:-1]).any(dim=1)
        if bool(starts.all()):
            return None
        owner = torch.cumsum(starts.long(), 0) - 1  # row -> its distinct prompt
        ids, mask = input_ids[starts, :-1], attention_mask[starts, :-1]
        # The positions generate gives a left-padded row: count of real tokens so far.
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
            **{cache_kwarg(): cache}, **extra,
        )
        cache.batch_select_indices(owner)
        return cache


@contextlib.contextmanager
def _seeded_rng(seed: int, cuda_devices: list[int]):
    """Seeds torch's RNG inside; the caller's RNG state is restored on exit."""
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield
