"""Generation with an in-process vLLM engine (``generation.backend: vllm``), one per process.

The engine is created after the process group: with several processes it runs
with ``distributed_executor_backend="external_launcher"``, so each rank's
engine joins the torch world instead of spawning workers (tensor parallel size
1: each rank samples its own prompts). After each optimizer step
``sync_weights`` pushes the policy's weights in place
(``collective_rpc("reload_weights", weights_iterator=...)``, the path that also
works on vLLM's CPU build, where the ``model_runner.model.load_weights`` path
TRL uses fails), then resets the prefix cache: without that, prompts whose KV
blocks were cached under the old weights keep them.

GPU-only options (docs/VLLM.md): ``gpu_memory_utilization`` and sleep mode
(the engine's weights are offloaded and its KV cache freed between generations,
level 1, so a later ``generate`` without a weight push still has weights).
"""

from __future__ import annotations

import logging
import os

import torch

from maxent_grpo.rollout.backend import PromptGroup, SamplingParams
from maxent_grpo.rollout.vllm_common import (
    engine_dtype,
    full_state_items,
    request_seeds,
    sampling_kwargs,
    to_completion,
)

log = logging.getLogger("maxent_grpo")


class VLLMColocateBackend:
    """Samples from a ``vllm.LLM`` living in this process; weights come from the policy after each step."""

    def __init__(
        self, model_path: str, tokenizer, *, model_dtype: torch.dtype, sample_dtype: torch.dtype | None = None,
        gpu_memory_utilization: float = 0.3, max_model_len: int | None = None, enable_sleep_mode: bool = False,
        enforce_eager: bool = False, world_size: int = 1, seed: int = 0,
    ):
        # The engine core and its worker must live in this process: the weight push hands
        # them a generator of tensors that cannot cross a process boundary (and copying
        # every weight through a pipe is what colocating avoids). vLLM reads this switch
        # from the environment only.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm  # the optional dependency: imported only by this backend

        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self._asleep = False
        self.dtype = engine_dtype(model_dtype, sample_dtype)
        self.llm = vllm.LLM(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype=self.dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
            tensor_parallel_size=1,
        )
        self._sampling_params = vllm.SamplingParams

    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> list[PromptGroup]:
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty strings")
        prompt_ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        seeds = request_seeds(len(prompts), num_generations)
        self._wake()
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in prompt_ids],
                sampling_params=[
                    self._sampling_params(**sampling_kwargs(params, num_generations, s)) for s in seeds
                ],
                use_tqdm=False,
            )
        finally:
            self._sleep()
        groups = []
        for prompt, ids, out in zip(prompts, prompt_ids, outputs):
            comps = [
                to_completion(
                    self.tokenizer, list(o.token_ids), _sampled_logps(o.logprobs, o.token_ids), o.finish_reason
                )
                for o in out.outputs
            ]
            groups.append(PromptGroup(prompt=prompt, prompt_ids=list(ids), completions=comps))
        return groups

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Push ``policy``'s weights into the engine (cast to its dtype) and drop cached prompt blocks."""
        self._wake()
        items = ((name, t.to(_TORCH_DTYPES[self.dtype])) for name, t in full_state_items(policy))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()
        self._sleep()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sampled_logps(logprobs, token_ids) -> list[float]:
    """The sampled token's log-prob at each position, from vLLM's per-position ``{token_id: Logprob}``."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (the request asks for logprobs=0)")
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]
