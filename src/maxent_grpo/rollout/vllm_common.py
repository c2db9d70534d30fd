"""What both vLLM backends share: sampling settings, request seeds, turning vLLM's outputs into ``Completion``s.

Conventions (ALGORITHMS.md §9, ``rollout/backend.py``):

* Prompts go to vLLM as token ids (the trainer's own tokenisation), never as text.
* Behaviour log-probs are asked for with ``logprobs=0`` (the sampled token's
  only) from an engine started with ``logprobs_mode="processed_logprobs"``, so
  they are ``log_softmax(logits / temperature)`` like the trainer's. vLLM
  renormalises them over the top-k / top-p set when those are on; the trainer
  does not (see docs/VLLM.md).
* Within one request vLLM draws sample ``i`` of ``n`` with seed ``seed + i``, so
  the seeds of a call's prompts are spaced ``n`` apart from a base drawn from
  torch's RNG, which the loop seeds per (run seed, rank, step): a resumed run
  asks for the same seeds, and ranks draw independent bases.
* ``text`` is our tokenizer's decoding of the returned ids (so every backend's
  text means the same thing); a stop string stays in it
  (``include_stop_str_in_output``).
"""

from __future__ import annotations

import math

import torch

from maxent_grpo.rollout.backend import Completion, SamplingParams

# Seeds vLLM accepts are 63-bit; leave room for the +i of the samples.
_SEED_SPACE = 2**62


def request_seeds(num_prompts: int, num_generations: int, seed: int | None = None) -> list[int]:
    """One seed per prompt, ``num_generations`` apart, from the base ``seed`` (the call's own,
    ``SamplingParams.seed``) or, when None, a base drawn from torch's global RNG."""
    base = int(torch.randint(0, _SEED_SPACE, (1,)).item()) if seed is None else seed % _SEED_SPACE
    return [(base + p * num_generations) % _SEED_SPACE for p in range(num_prompts)]


def sampling_kwargs(params: SamplingParams, num_generations: int, seed: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` (also the fields of a ``/v1/completions`` request)."""
    greedy = not params.do_sample
    return dict(
        n=num_generations,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=-1 if greedy or params.top_k == 0 else params.top_k,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=seed,
        stop=list(params.stop),
        include_stop_str_in_output=True,
        logprobs=0,
        skip_special_tokens=True,
    )


def to_completion(tokenizer, token_ids: list[int], logps: list[float], finish_reason: str | None) -> Completion:
    """A ``Completion`` from one vLLM sample; ``finish_reason`` is vLLM's (``stop`` covers EOS and stop strings)."""
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sample with reason {finish_reason!r}")
    if len(logps) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logps)} log-probs for {len(token_ids)} tokens")
    if any(math.isnan(x) for x in logps):
        raise RuntimeError("vLLM returned a NaN log-prob")
    text = tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Completion(token_ids=list(token_ids), text=text, finish_reason=finish_reason, logps=list(logps))


def engine_dtype(model_dtype: torch.dtype, sample_dtype: torch.dtype | None) -> str:
    """vLLM's ``dtype`` argument: the sampling dtype when set (``generation.dtype``), else the policy's."""
    dtype = sample_dtype if sample_dtype is not None else model_dtype
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"vLLM cannot sample in {dtype}; set generation.dtype to float32 or bfloat16")
    return names[dtype]
