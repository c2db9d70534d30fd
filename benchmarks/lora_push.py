"""What a LoRA policy's push to a colocated vLLM engine costs, merged vs adapter (``generation.vllm.lora_sync``).

    .venv-vllm/bin/python -m benchmarks.lora_push [--pushes 5] [--models tiny,smollm2]

For each model: the policy with LoRA at the config's defaults (r 16, alpha 32, q/k/v/o), its adapters
moved off zero as training moves them; one fp32 colocated engine per mode; ``--pushes`` pushes timed one
by one after a first (untimed) one. Bytes are what a push hands the engine: every weight of the merged
model (a tied head once), or the adapter's file. After the last push both engines sample the same prompt and their
log-probs are compared with the policy's (both within fp32 rounding of it: the check that the pushes
land). BENCHMARKS.md §5.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from maxent_grpo.core.logprobs import get_per_token_logps
from maxent_grpo.models import apply_lora, load_model_and_tokenizer, resolve_model_path
from maxent_grpo.rollout.backend import SamplingParams, build_rollout_batch, pack_rollout
from maxent_grpo.rollout.settings import VllmConfig
from maxent_grpo.rollout.vllm_colocate import AdapterPush, VLLMColocateBackend
from maxent_grpo.rollout.vllm_weights import adapter_rank, full_state_items
from benchmarks.tiny_model import build_tiny_model

SAMPLING = SamplingParams(max_new_tokens=16, temperature=0.7)


def _policy(model_path: str, seed: int = 0):
    model, tokenizer = load_model_and_tokenizer(model_path, dtype="float32")
    model = apply_lora(model, dropout=0.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at 0: move it as a few steps of training would
                p.copy_(0.02 * torch.randn_like(p))
    return model.eval(), tokenizer


def _max_diff(model, groups, pad_id) -> float:
    packed = pack_rollout(build_rollout_batch(groups, 4), pad_id)
    with torch.no_grad():
        lp = get_per_token_logps(model, packed.input_ids, packed.attention_mask, packed.prompt_length,
                                 temperature=SAMPLING.temperature)
    return float(((lp - packed.behaviour_logps).abs() * packed.completion_mask).max())


def measure(model_path: str, pushes: int, work: Path) -> dict[str, dict]:
    model, tokenizer = _policy(model_path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                           add_generation_prompt=True)
    unique = {id(t): t for _, t in full_state_items(model, torch.float32)}  # a tied head is one tensor
    merged_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    out = {}
    for mode in ("merged", "adapter"):
        adapter = None if mode == "merged" else AdapterPush(adapter_rank(model), work / "adapters")
        engine = VLLMColocateBackend(model_path, tokenizer, model_dtype=torch.float32,
                                     options=VllmConfig(enforce_eager=True), adapter=adapter)
        engine.sync_weights(model)  # untimed: the first adapter load plans the engine's LoRA slots
        seconds = []
        for _ in range(pushes):
            t0 = time.perf_counter()
            engine.sync_weights(model)
            seconds.append(time.perf_counter() - t0)
        groups = engine.generate([prompt], 4, SAMPLING)
        nbytes = merged_bytes if mode == "merged" else sum(
            f.stat().st_size for f in (work / "adapters").glob("adapter-*/adapter_model.safetensors"))
        out[mode] = {"bytes": nbytes, "seconds": statistics.median(seconds),
                     "max_logp_diff": _max_diff(model, groups, tokenizer.pad_token_id)}
        del engine
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--models", default="tiny,smollm2")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {os.cpu_count()} cores")
    print("| model | push | MB per push | s per push (median) | max log-prob diff after |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            work = Path(tmp) / name
            path = (str(build_tiny_model(work / "model", hidden_size=128, num_heads=2)) if name == "tiny"
                    else resolve_model_path("smollm2-135m-instruct"))
            for mode, r in measure(path, args.pushes, work).items():
                print(f"| {name} | {mode} | {r['bytes'] / 2**20:.2f} | {r['seconds']:.3f} | {r['max_logp_diff']:.1e} |")


if __name__ == "__main__":
    main()
