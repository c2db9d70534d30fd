"""Where the update phase's time goes on one GPU: our scoring paths against a plain forward.

    python benchmarks/update_profile.py --model qwen2.5-0.5b [--trace-out DIR]

One GRPO batch as ``benchmarks/gpu.py`` trains it (P prompts x G completions, each micro-batch
one group of G rows sharing its prompt), random weights from ``benchmarks/model_configs``,
float32 master weights under bf16 autocast. Each variant runs the forward and backward of every
micro-batch (the loss is the mean completion log-prob, plus the mean entropy where the variant
computes it), and is timed over ``--reps`` batches after one warm-up, synchronised, median:

* ``ours``: ``Scoring.logps`` as the trainer calls it (shared prompts, fused LM head, entropies);
* ``ours, no entropy``; ``ours, no shared prompts``; ``ours, no fused head``;
* ``ours, packed``: padding-free (``training.packing``), no shared prompts;
* ``ours, packed behind shared prompts``: each prompt once, its completions packed behind it;
* ``plain``: one forward over prompt + completion, the logits at the completion positions,
  ``log_softmax`` and a gather (what TRL does), no entropy.

``--ragged``: completions of varied length (uniform from 1/8 of ``--completion-len`` to all of it,
right-padded), as sampled ones are; without it every completion is full and nothing is padding.
Prints a table (with the token positions each variant computes per batch), and with ``--trace-out``
the profiler's top operations for ``ours``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, device, ragged: bool = False):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0)
    completion = torch.randint(0, vocab, (prompts * group, completion_len), generator=g)
    ids = torch.cat([prompt, completion], 1)
    mask = torch.ones_like(ids)
    if ragged:
        lengths = torch.randint(max(1, completion_len // 8), completion_len + 1, (prompts * group,), generator=g)
        pad = torch.arange(completion_len)[None, :] >= lengths[:, None]
        mask[:, prompt_len:][pad] = 0
        ids[:, prompt_len:][pad] = 0
    return ids.to(device), mask.to(device)


def variants():
    import torch

    from maxent_grpo.core.logprobs import Scoring, get_per_token_logps_and_entropies

    def ours(share=True, fused=True, entropy=True, pack=False):
        def run(model, ids, mask, p):
            with torch.autocast(ids.device.type, dtype=torch.bfloat16):
                return get_per_token_logps_and_entropies(model, ids, mask, p, with_entropy=entropy,
                                                         share_prompts=share, fused_head=fused, pack=pack)
        run.scoring = Scoring(share_prompts=share, packing=pack)
        return run

    def plain(model, ids, mask, p):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=ids.shape[1] - p + 1).logits[:, :-1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p:, None])[..., 0]
        return logps, None

    assert Scoring().share_prompts  # the trainer's default, which "ours" mirrors
    plain.scoring = Scoring(share_prompts=False)
    return {"ours": ours(), "ours, no entropy": ours(entropy=False), "ours, no shared prompts": ours(share=False),
            "ours, packed": ours(share=False, pack=True), "ours, packed behind shared prompts": ours(pack=True),
            "ours, no fused head": ours(fused=False), "plain": plain}


def positions(fn, model, ids, mask, p, micro: int) -> int:
    """Token positions the variant's forwards compute over the batch (``Scoring.forward_positions``)."""
    return sum(fn.scoring.forward_positions(model, ids[s:s + micro], mask[s:s + micro], p) for s in range(0, ids.shape[0], micro))


def time_variant(fn, model, ids, mask, p, micro: int, reps: int) -> tuple[float, float]:
    import torch

    cuda = ids.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for rep in range(reps + 1):
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        for s in range(0, ids.shape[0], micro):
            logps, ent = fn(model, ids[s:s + micro], mask[s:s + micro], p)
            keep = mask[s:s + micro, p:].float()
            loss = -(logps.float() * keep).sum() / keep.sum() - ((ent.float() * keep).sum() / keep.sum()
                                                                  if ent is not None else 0.0)
            loss.backward()
        sync()
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times), (torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=168, help="benchmarks/gpu.py's pair_sum prompts: ~168 tokens")
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ragged", action="store_true", help="completions of varied length, right-padded")
    p.add_argument("--trace-out", type=Path)
    p.add_argument("--cpu", action="store_true", help="the tiny model on the CPU: a check of the script, no figures")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.model_paths import cache_root, random_model, resolve_model

    device = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        print("benchmarks/update_profile.py: no CUDA device here (--cpu checks the script on the tiny model)",
              file=sys.stderr)
        return 2
    model_dir = (resolve_model("tiny") if args.cpu
                 else random_model(args.model, cache_root() / "random" / args.model, device="cuda"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.config.use_cache = False
    ids, mask = batch(model.config.vocab_size, args.prompts, args.group, args.prompt_len, args.completion_len, device,
                      ragged=args.ragged)
    tokens = int(mask.sum())  # real tokens: what tokens/s and MFU count
    params = sum(t.numel() for t in model.parameters())
    print(f"{'tiny' if args.cpu else args.model}: {params / 1e9:.2f}B parameters, {ids.shape[0]} rows x {ids.shape[1]} tokens "
          f"({args.prompt_len} prompt + {args.completion_len if not args.ragged else 'ragged, up to ' + str(args.completion_len)} "
          f"completion, {tokens} real tokens), micro-batch {args.group}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    print("\n| variant | s per batch | tokens/s | MFU (6 N tokens, 989 TFLOP/s) | peak GiB | positions computed |"
          "\n|---|---|---|---|---|---|")
    for name, fn in variants().items():
        seconds, peak = time_variant(fn, model, ids, mask, args.prompt_len, args.group, args.reps)
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:.0f} | {6 * params * tokens / seconds / 989e12:.1%} "
              f"| {peak:.1f} | {positions(fn, model, ids, mask, args.prompt_len, args.group)} |", flush=True)
    if args.trace_out is not None:
        from torch.profiler import ProfilerActivity, profile

        fn = variants()["ours"]
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
            time_variant(fn, model, ids, mask, args.prompt_len, args.group, 1)
        args.trace_out.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by=f"{device}_time_total", row_limit=30)
        (args.trace_out / "update_profile_ops.txt").write_text(table)
        print(table[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
