"""The floor: the least work any GRPO step on this setting must do.

Per step: HF ``generate`` with the KV cache for the P*G completions (same
sampling as the trainers), then, per micro-batch, a reference forward under
``no_grad`` when beta > 0 and one policy forward + backward over
prompt+completion (logits only at completion positions, log-probs by gather
minus logsumexp), then one AdamW step. No rewards, no advantages, no clipping,
no logging. A trainer's ratio to this number is its overhead. Outside the
timed step, it records the hash of each step's prompt token ids
(:func:`benchmarks.tasks.step_prompt_hash`).

Run as ``python -m benchmarks.floor --setting S.json --model-dir D --out R.json``.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from benchmarks.children import own_peak_rss_bytes
from benchmarks.results import RunResult
from benchmarks.settings import BenchSetting
from benchmarks.tasks import rows_for_step, setting_rows, step_prompt_hash


def _completion_logps(model, input_ids, attention_mask, completion_len: int, temperature: float):
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_len + 1).logits
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, -completion_len:]
    chosen = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def _completion_mask(completion_ids, eos_ids: list[int]):
    """1 up to and including the first EOS of each row, 0 after it."""
    import torch

    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], is_eos.size(1), dtype=torch.long))
    positions = torch.arange(completion_ids.size(1)).unsqueeze(0)
    return (positions <= first.unsqueeze(1)).long()


def run_floor(setting: BenchSetting, model_dir: Path) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(setting.seed)
    dtype = torch.bfloat16 if setting.bf16 else torch.float32
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if setting.gradient_checkpointing:  # as the other sides, when the setting asks for it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = None
    if setting.beta > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=setting.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True
    )
    eos_ids = [tok.eos_token_id]
    gen_config = GenerationConfig(
        max_new_tokens=setting.max_new_tokens, do_sample=True, temperature=setting.temperature,
        top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=eos_ids,
    )
    rows = setting_rows(setting)
    G, micro = setting.num_generations, setting.micro_batch_size

    step_times, gen_times, tokens, cpu_times, prompt_hashes = [], [], [], [], []
    for step in range(setting.steps):
        texts = [
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in rows_for_step(rows, step, setting.prompts_per_step)
            for _ in range(G)
        ]
        start, cpu_start = time.perf_counter(), time.process_time()
        enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        model.eval()
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen_config)
        gen_times.append(time.perf_counter() - start)
        model.train()
        completion = out[:, enc["input_ids"].size(1):]
        c_mask = _completion_mask(completion, eos_ids)
        attention = torch.cat([enc["attention_mask"], c_mask], dim=1)
        n_tokens = int(c_mask.sum())
        for lo in range(0, out.size(0), micro):
            ids, att, m = out[lo : lo + micro], attention[lo : lo + micro], c_mask[lo : lo + micro]
            logps = _completion_logps(model, ids, att, completion.size(1), setting.temperature)
            loss = -(logps * m).sum() / n_tokens
            if reference is not None:
                with torch.no_grad():
                    ref = _completion_logps(reference, ids, att, completion.size(1), setting.temperature)
                d = ref - logps
                loss = loss + setting.beta * ((torch.exp(d) - d - 1) * m).sum() / n_tokens
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        tokens.append(n_tokens)
        # Outside the timed step: the prompt ids generate was fed (left padding dropped).
        fed = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        prompt_hashes.append(step_prompt_hash(fed, G))
    return RunResult(
        side="floor",
        step_times=step_times,
        rewards=[None] * setting.steps,
        completion_tokens=tokens,
        generate_times=gen_times,
        cpu_times=cpu_times,
        prompt_hashes=prompt_hashes,
        peak_rss_bytes=own_peak_rss_bytes(),
        extra={"torch_threads": torch.get_num_threads()},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", type=Path, required=True, help="BenchSetting JSON")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="RunResult JSON to write")
    args = parser.parse_args(argv)
    result = run_floor(BenchSetting.from_json(args.setting), args.model_dir)
    result.to_json(args.out)
    print(f"floor: step times {[round(t, 3) for t in result.step_times]}, peak RSS {result.peak_rss_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
