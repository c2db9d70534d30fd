"""The generation backends side by side: HF ``generate`` vs an in-process vLLM engine, fp32 and bf16.

    .venv-vllm/bin/python benchmarks/generation_backends.py [--model smollm2-135m-instruct]
        [--prompts 4 --generations 8 --max-new-tokens 64 --reps 3]

Each (backend, dtype) runs in a fresh process, one after the other. A process
builds the backend (model load, and for vLLM the engine start), generates
``prompts x generations`` completions of the default recipe's task ``reps + 1``
times (the first is warm-up), and pushes the fp32 policy's weights into the
sampler ``reps`` times (vLLM: ``reload_weights`` + prefix-cache reset; HF bf16:
the copy's ``load_state_dict``; HF fp32 samples from the policy itself, nothing
to push). ``vllm_eager`` is the engine with ``enforce_eager`` (no compilation).
``--variants hf:float32,vllm:float32`` picks a subset (bf16 is very slow on a
CPU without native bf16). Printed: start seconds, completion tokens per second (median over the
timed calls), push seconds (median), peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# vllm_eager: the engine without graph compilation (generation.vllm.enforce_eager).
VARIANTS = (("hf", "float32"), ("vllm", "float32"), ("vllm_eager", "float32"),
            ("hf", "bfloat16"), ("vllm", "bfloat16"))


def _prompts(tokenizer, n: int) -> list[str]:
    from maxent_grpo.config.load import load_config
    from maxent_grpo.data.datasets import load_prompt_dataset
    from maxent_grpo.data.prompts import format_prompt

    d = load_config(None).data  # the built-in default's task and its solved example
    rows = load_prompt_dataset(d.source, size=n, seed=1, instruction=d.instruction, task_kwargs=d.task_kwargs)
    return [format_prompt(tokenizer, r["prompt"], few_shot=d.few_shot) for r in rows]


def child(args) -> dict:
    import torch

    from maxent_grpo.models import load_model_and_tokenizer, parse_dtype, resolve_model_path
    from maxent_grpo.rollout.backend import SamplingParams

    path = resolve_model_path(args.model)
    policy, tokenizer = load_model_and_tokenizer(path, dtype="float32", device=torch.device("cpu"))
    sample_dtype = parse_dtype(args.dtype)
    t0 = time.perf_counter()
    if args.backend == "hf":
        from maxent_grpo.rollout.hf import HFGenerationBackend

        backend = HFGenerationBackend(policy, tokenizer, dtype=sample_dtype)
    else:
        from maxent_grpo.rollout.settings import VllmConfig
        from maxent_grpo.rollout.vllm_colocate import VLLMColocateBackend

        backend = VLLMColocateBackend(path, tokenizer, model_dtype=policy.dtype, sample_dtype=sample_dtype,
                                      options=VllmConfig(enforce_eager=args.backend == "vllm_eager"))
    start_s = time.perf_counter() - t0
    prompts = _prompts(tokenizer, args.prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    rates, tokens = [], []
    for rep in range(args.reps + 1):
        torch.manual_seed(rep)
        t = time.perf_counter()
        groups = backend.generate(prompts, args.generations, params)
        dt = time.perf_counter() - t
        n = sum(len(c.token_ids) for g in groups for c in g.completions)
        if rep > 0:
            rates.append(n / dt)
            tokens.append(n)
    pushes = []
    if not (args.backend == "hf" and sample_dtype in (None, torch.float32)):
        for _ in range(args.reps):
            t = time.perf_counter()
            backend.sync_weights(policy)
            pushes.append(time.perf_counter() - t)
    return {
        "backend": args.backend, "dtype": args.dtype, "start_s": start_s,
        "tok_per_s": statistics.median(rates), "tokens": tokens,
        "push_s": statistics.median(pushes) if pushes else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default=",".join(f"{b}:{d}" for b, d in VARIANTS),
                   help="comma-separated backend:dtype pairs")
    p.add_argument("--child", nargs=2, metavar=("BACKEND", "DTYPE"), help=argparse.SUPPRESS)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    if args.child:
        args.backend, args.dtype = args.child
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    results = []
    for variant in args.variants.split(","):
        backend, dtype = variant.split(":")
        cmd = [sys.executable, __file__, "--child", backend, dtype, "--model", args.model,
               "--prompts", str(args.prompts), "--generations", str(args.generations),
               "--max-new-tokens", str(args.max_new_tokens), "--reps", str(args.reps)]
        print(f"{backend} {dtype} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{backend} {dtype} failed with exit code {proc.returncode}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    hf32 = next((r["tok_per_s"] for r in results if (r["backend"], r["dtype"]) == ("hf", "float32")), None)
    print(f"### generation: {args.model}, {args.prompts} prompts x {args.generations} completions, "
          f"up to {args.max_new_tokens} tokens, median of {args.reps} calls after one warm-up\n")
    print("| backend | dtype | start s | completion tok/s | ÷ HF fp32 | weight push s | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = "—" if hf32 is None else f"{r['tok_per_s'] / hf32:.2f}"
        push = "— (samples from the policy)" if r["push_s"] is None else f"{r['push_s']:.2f}"
        print(f"| {r['backend']} | {r['dtype']} | {r['start_s']:.1f} | {r['tok_per_s']:.0f} | {ratio} "
              f"| {push} | {r['peak_rss_gib']:.2f} |")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
