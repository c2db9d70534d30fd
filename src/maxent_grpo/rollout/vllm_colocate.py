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

A LoRA policy is pushed merged, or with ``lora_sync: adapter`` (an :class:`AdapterPush`) as
the adapter alone: the engine is planned for LoRA (``enable_lora``, one adapter at a
time, the rank rounded up to one vLLM plans for), each push writes the adapter into a
fresh folder (``vllm_weights.write_adapter``) and the next generate calls ask for it by
a new ``LoRARequest`` (name and id per version, so neither vLLM's adapter cache nor its
prefix cache, whose blocks are keyed by the adapter, serves an older one).

GPU-only options (docs/VLLM.md): ``gpu_memory_utilization`` and sleep mode,
whose wake / sleep sequence ``rollout/vllm_sleep.py`` owns: the weights wake
alone for a push, the KV cache wakes once per rollout phase
(``rollout_phase``), and the engine sleeps at level 2 at the phase's end.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from packaging.version import Version

from maxent_grpo.rollout.backend import PromptGroup, SamplingParams, TokenPrompts
from maxent_grpo.rollout.settings import VllmConfig
from maxent_grpo.rollout.vllm_common import engine_dtype, request_seeds, sampling_kwargs, to_completion
from maxent_grpo.rollout.vllm_sleep import EngineSleep
from maxent_grpo.rollout.vllm_weights import engine_lora_rank, full_state_items, write_adapter

log = logging.getLogger("maxent_grpo")


@dataclass(frozen=True)
class AdapterPush:
    """``lora_sync: adapter``: the policy's LoRA rank, and the folder each push writes its adapter into."""

    rank: int
    folder: Path


class VLLMColocateBackend(TokenPrompts):
    """Samples from a ``vllm.LLM`` living in this process; weights come from the policy after each step.

    ``options``: the engine's settings (``generation.vllm``: memory share, context length, sleep mode,
    eager mode, scheduler limits, reload mode); the server-only ones are not read. ``adapter``: push the
    LoRA adapter alone (None: the merged weights). ``head_fp32``: the LM head's matmul in float32.
    """

    def __init__(
        self, model_path: str, tokenizer, *, model_dtype: torch.dtype, sample_dtype: torch.dtype | None = None,
        options: VllmConfig = VllmConfig(), world_size: int = 1, seed: int = 0, adapter: AdapterPush | None = None,
        head_fp32: bool = False,
    ):
        # The engine core and its worker must live in this process: the weight push hands
        # them a generator of tensors that cannot cross a process boundary (and copying
        # every weight through a pipe is what colocating avoids). vLLM reads this switch
        # from the environment only.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if options.reload_mode == "direct":  # read once, when the engine loads its weights (vLLM >= 0.34)
            os.environ["VLLM_RELOAD_MODE"] = "direct"
        import vllm  # the optional dependency: imported only by this backend

        self.tokenizer = tokenizer
        self.dtype = engine_dtype(model_dtype, sample_dtype)
        if options.enable_sleep_mode and adapter is not None:
            raise ValueError("sleep mode discards the base weights an adapter push leaves in the engine")
        # lora_sync: adapter: the engine samples each version of the adapter (the last push's) on its own base.
        self.adapter_dir, self._lora, self._pushes = None if adapter is None else adapter.folder, None, 0
        lora = {} if adapter is None else {"enable_lora": True, "max_lora_rank": engine_lora_rank(adapter.rank),
                                             "max_loras": 1}
        self.llm = vllm.LLM(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype=self.dtype,
            # The engine seeds numpy with it, which takes 32 bits (eval's seeds are 63-bit); our samples
            # draw from per-request seeds (request_seeds), not from this one.
            seed=seed % 2**32,
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=options.max_model_len,
            enable_sleep_mode=options.enable_sleep_mode,
            enforce_eager=options.enforce_eager,
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher" if world_size > 1 else None,
            tensor_parallel_size=1,
            max_num_seqs=options.max_num_seqs,  # None: vLLM's default for the platform
            max_num_batched_tokens=options.max_num_batched_tokens,
            # The LM head's matmul in float32 (model.lm_head_fp32), as the trainer's: vLLM's head_dtype.
            **({"hf_overrides": {"head_dtype": "float32"}} if head_fp32 else {}),
            # vLLM >= 0.34 allocates its KV cache outside torch and caps this process's torch allocator beside
            # it, a cap a sleeping engine does not lift: the trainer could not use the memory sleep frees.
            **({"enable_extensible_kv_cache": False}
               if options.enable_sleep_mode and Version(vllm.__version__) >= Version("0.34") else {}),
            **lora,
        )
        self.sleep = EngineSleep(self.llm, enabled=options.enable_sleep_mode)
        self._sampling_params = vllm.SamplingParams

    def _generate(
        self, prompts: list[str], prompt_ids: list[list[int]], num_generations: int, params: SamplingParams
    ) -> list[PromptGroup]:
        seeds = request_seeds(len(prompts), num_generations, params.seed)
        self.sleep.check_can_generate()
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompt_ids],
            sampling_params=[self._sampling_params(**sampling_kwargs(params, num_generations, s)) for s in seeds],
            use_tqdm=False,
            lora_request=self._lora,
        )
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
        """Push ``policy``'s weights into the engine (cast to its dtype, LoRA merged, or its adapter alone)."""
        self.sleep.push(lambda: self._load(policy))

    def rollout_phase(self, policy: torch.nn.Module) -> AbstractContextManager[None]:
        """Every generate call of one step inside: with sleep mode the KV cache wakes once and the engine
        sleeps (level 2) at the end; ``policy`` is pushed first when the engine's weights were discarded."""
        return self.sleep.rollout_phase(lambda: self._load(policy))

    def _load(self, policy: torch.nn.Module) -> None:
        if self.adapter_dir is None:
            items = full_state_items(policy, _TORCH_DTYPES[self.dtype])
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            return
        from vllm.lora.request import LoRARequest

        self._pushes += 1
        folder, _ = write_adapter(policy, self.adapter_dir, self._pushes, _TORCH_DTYPES[self.dtype])
        self._lora = LoRARequest(f"policy-{self._pushes}", self._pushes, str(folder))


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sampled_logps(logprobs, token_ids) -> list[float]:
    """The sampled token's log-prob at each position, from vLLM's per-position ``{token_id: Logprob}``."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (the request asks for logprobs=0)")
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]
