"""Decoding alone: our compiled loop (fixed batch and shrinking), our eager loop, and transformers'
``generate`` with a dynamic and with a static cache, on the same prompts and the same model.

    python benchmarks/decode.py --model qwen2.5-0.5b            # a GPU: random weights, bf16
    python benchmarks/decode.py --model smollm2-135m-instruct --rows 32 --new-tokens 64 --prompt-len 96 --cpu

``--model``: one of ``benchmarks/model_configs`` (random weights, nothing downloaded) or what
``benchmarks.model_paths.resolve_model`` takes. Rows are ``--prompts`` random prompts of
``--prompt-len`` tokens, each sampled ``--rows / --prompts`` times (temperature 1, no top-k/top-p).
``--ragged``: rows end at different steps (a random model never ends one on its own): the eos ids
are every ``--ragged``-th token id, so a row ends with probability about ``1/ragged`` per token.

Each variant runs once to warm up (its compiling included: the ``first s`` column), then ``--reps``
times; the table gives the median, the completion tokens per second (the tokens every row drew) and
the peak memory over the timed calls (CUDA). One process, the variants one after another.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("compiled", "compiled-shrink", "eager", "generate", "generate-static")


def _model(name: str, device: str, dtype):
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.model_paths import cache_root, random_model, random_model_names, resolve_model

    if name in random_model_names():
        path = random_model(name, Path(tempfile.gettempdir()) / "maxent-decode" / name, device=device)
    else:
        path = resolve_model(name, cache_root())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _run(variant: str, model, tok, backends: dict, prompt_ids: list[list[int]], group: int, new_tokens: int,
         seed: int) -> int:
    """One call; the completion tokens drawn."""
    import torch

    from maxent_grpo.rollout.backend import SamplingParams

    if variant.startswith("generate"):
        ids = torch.tensor(prompt_ids, device=model.device).repeat_interleave(group, 0)
        static = {"cache_implementation": "static"} if variant == "generate-static" else {}
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, **static)
        new = out[:, ids.shape[1]:]
        eos = torch.tensor(model.generation_config.eos_token_id, device=new.device).reshape(-1)
        ended = torch.isin(new, eos)
        # tokens up to and including each row's first eos (generate pads after it)
        first = torch.where(ended.any(1), ended.float().argmax(1) + 1, torch.full_like(ended[:, 0], new.shape[1],
                                                                                         dtype=torch.long))
        return int(first.sum())
    groups = backends[variant].generate_ids(prompt_ids, group, SamplingParams(max_new_tokens=new_tokens, seed=seed))
    return sum(len(c.token_ids) for g in groups for c in g.completions)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=168, help="benchmarks/gpu.py's pair_sum prompts: ~168 tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--ragged", type=int, default=0, metavar="K", help="every K-th token id ends a row (0: none)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--cpu", action="store_true", help="run on the CPU in float32 (default: CUDA, bfloat16)")
    args = p.parse_args(argv)

    import torch

    from maxent_grpo.rollout.hf import HFGenerationBackend

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/decode.py: no CUDA device here (--cpu runs it on the CPU)", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}")
    model, tok = _model(args.model, device, torch.float32 if args.cpu else torch.bfloat16)
    if args.ragged:
        model.generation_config.eos_token_id = list(range(args.ragged - 1, model.config.vocab_size, args.ragged))
    group = args.rows // args.prompts
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, min(model.config.vocab_size, len(tok)), (args.prompts, args.prompt_len),
                               generator=g).tolist()
    backends = {
        "compiled": HFGenerationBackend(model, tok, compile=True, shrink=False),
        "compiled-shrink": HFGenerationBackend(model, tok, compile=True, shrink=True),
        "eager": HFGenerationBackend(model, tok),
    }
    print(f"{args.model} on {device} ({next(model.parameters()).dtype}), torch {torch.__version__}: "
          f"{args.prompts} prompts x {group} rows, {args.prompt_len} prompt + {args.new_tokens} new tokens"
          + (f", eos every {args.ragged}th id" if args.ragged else ""), flush=True)
    rows = []
    for variant in variants:
        start = time.perf_counter()
        _run(variant, model, tok, backends, prompt_ids, group, args.new_tokens, seed=0)
        _sync(device)
        first = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, tokens = [], []
        for rep in range(args.reps):
            start = time.perf_counter()
            tokens.append(_run(variant, model, tok, backends, prompt_ids, group, args.new_tokens, seed=1 + rep))
            _sync(device)
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        seconds = statistics.median(times)
        rows.append((variant, first, seconds, statistics.median(tokens), statistics.median(tokens) / seconds, peak))
        print(f"[decode] {variant}: first {first:.2f} s, then {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    print("\n### Decoding alone\n")
    print("| sampler | first s | s | tokens | tokens/s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for variant, first, seconds, n, rate, peak in rows:
        print(f"| {variant} | {first:.2f} | {seconds:.2f} | {n:.0f} | {rate:,.0f} | {peak:.1f} |")
    base = {r[0]: r[4] for r in rows}
    if "eager" in base:
        print("\n* medians of " + str(args.reps) + "; tokens/s against our eager loop: "
              + ", ".join(f"{v} {r / base['eager']:.2f}x" for v, r in base.items() if v != "eager"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
