"""TRL's ``GRPOTrainer`` on a benchmark setting, timed per optimizer step.

On ``setting.device`` (the CPU; benchmarks/gpu.py runs it on a GPU), no vLLM, no eval, no
saving, no trackers, logging every step. The settings map onto ``GRPOConfig`` in
:func:`grpo_config_kwargs` (checked against trl 1.16): one generation batch of P*G completions per optimizer step, split
into micro-batches of ``micro_batch_size`` with gradient accumulation; prompts
in dataset order (``shuffle_dataset=False``) as the floor and our trainer take
them; constant LR; TRL's default fused AdamW; gradient checkpointing off (TRL
turns it on by default; neither the floor nor our trainer uses it). The
prompt token ids of each step are read where TRL generates from them
(:func:`_record_prompt_ids`).

Run as ``python -m benchmarks.trl_runner --setting S.json --model-dir D --out R.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.common_rewards import setting_rewards
from benchmarks.children import own_peak_rss_bytes
from benchmarks.results import RunResult
from benchmarks.settings import LORA_TARGETS, BenchSetting
from benchmarks.tasks import setting_rows, step_prompt_hash


def grpo_config_kwargs(setting: BenchSetting, output_dir: str) -> dict:
    """``GRPOConfig`` arguments for a setting (the one place that maps names onto TRL's)."""
    accumulation = setting.completions_per_step // setting.micro_batch_size
    return dict(
        output_dir=output_dir,
        use_cpu=setting.device == "cpu",
        use_vllm=False,
        report_to=[],
        bf16=setting.bf16,  # TRL's default is bf16=True: always say it
        fp16=False,
        # On a GPU, float32 weights under bf16=True's autocast: float32 master weights, as ours keeps.
        # With LoRA the base is frozen, stored in the compute dtype as ours stores it. With a static cache,
        # bfloat16 weights: transformers 5.17 (the GPU machine's) allocates that cache in the weights' dtype
        # and autocast's bfloat16 keys cannot be written into a float32 one (5.24 casts them).
        model_init_kwargs={"dtype": "bfloat16" if setting.bf16 and (setting.device == "cpu" or setting.lora_r
                                                                    or setting.trl_cache == "static")
                           else "float32"},
        per_device_train_batch_size=setting.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        num_generations=setting.num_generations,
        max_completion_length=setting.max_new_tokens,
        cache_implementation=setting.trl_cache,
        temperature=setting.temperature,
        top_p=1.0,
        top_k=0,
        beta=setting.beta,
        loss_type=setting.loss_type,
        scale_rewards="group",
        epsilon=0.2,
        reward_weights=[w for _, w in setting_rewards(setting.digest_reward)],
        learning_rate=setting.learning_rate,
        lr_scheduler_type="constant",
        optim={"adamw": "adamw_torch_fused", "adamw_8bit": "adamw_bnb_8bit"}[setting.optimizer],
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        max_steps=setting.steps,
        gradient_checkpointing=setting.gradient_checkpointing,
        shuffle_dataset=False,
        seed=setting.seed,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _step_recorder():
    """A TrainerCallback timing optimizer steps (begin -> end) and keeping each step's logs."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            self.generate_times: list[float] = []
            self.cpu_times: list[float] = []
            self.logs: list[dict] = []
            self.generate_seconds = 0.0
            self._start = 0.0
            self._cpu_start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.generate_seconds = 0.0
            self._start, self._cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self._start)
            self.generate_times.append(self.generate_seconds)
            self.cpu_times.append(time.process_time() - self._cpu_start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            # The last on_log is the run summary (train_runtime, ...); step logs carry "reward".
            if logs is not None and "reward" in logs:
                self.logs.append(dict(logs))

    return StepRecorder()


def _time_generate(model, recorder) -> None:
    """Wrap this model instance's ``generate`` so the recorder sees the generation seconds."""
    original = model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        recorder.generate_seconds += time.perf_counter() - start
        return out

    model.generate = timed_generate


def _record_prompt_ids(trainer, fed: list[list[list[int]]]) -> None:
    """Wrap this trainer's ``_generate`` (one call per generation batch, i.e. per optimizer step
    here) so that ``fed`` gets the prompt token ids it generated from, one list per completion.
    The hashes are taken after training, outside the timed steps."""
    original = trainer._generate

    def recording_generate(prompts):
        out = original(prompts)
        fed.append([list(ids) for ids in out[0]])  # out[0]: prompt_ids, one list per completion
        return out

    trainer._generate = recording_generate


def _lora_config(setting: BenchSetting):
    """peft's LoraConfig for ``setting.lora_r`` (None: full fine-tuning), as ours_config sets ours."""
    if not setting.lora_r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=setting.lora_r, lora_alpha=2 * setting.lora_r, lora_dropout=0.0,
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")


def _reward_function(name: str):
    """The function ``module:function`` names (our trainer imports it the same way)."""
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def run_trl(setting: BenchSetting, model_dir: Path, save_dir: Path | None = None, callbacks: tuple = ()) -> RunResult:
    """Train ``setting.steps`` steps; with ``save_dir``, save the final model and tokenizer there.
    ``callbacks``: more ``TrainerCallback``s (benchmarks/gpu_side.py's phase meter)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list(setting_rows(setting))
    recorder = _step_recorder()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out_dir:
        args = GRPOConfig(**grpo_config_kwargs(setting, out_dir))
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=[_reward_function(name) for name, _ in setting_rewards(setting.digest_reward)],
            args=args,
            train_dataset=dataset,
            callbacks=[recorder, *callbacks],
            peft_config=_lora_config(setting),
        )
        _time_generate(trainer.model, recorder)
        fed: list[list[list[int]]] = []
        _record_prompt_ids(trainer, fed)
        trainer.train()
        if save_dir is not None:
            trainer.save_model(str(save_dir))
            trainer.processing_class.save_pretrained(str(save_dir))
    if len(recorder.step_times) != setting.steps or len(recorder.logs) != setting.steps or len(fed) != setting.steps:
        raise RuntimeError(
            f"TRL ran {len(recorder.step_times)} steps, logged {len(recorder.logs)} and generated {len(fed)} "
            f"batches, expected {setting.steps}"
        )
    n = setting.completions_per_step
    return RunResult(
        side="trl",
        step_times=recorder.step_times,
        rewards=[float(log["reward"]) for log in recorder.logs],
        completion_tokens=[round(float(log["completions/mean_length"]) * n) for log in recorder.logs],
        generate_times=recorder.generate_times,
        cpu_times=recorder.cpu_times,
        prompt_hashes=[step_prompt_hash(rows, setting.num_generations) for rows in fed],
        peak_rss_bytes=own_peak_rss_bytes(),
        extra={"torch_threads": torch.get_num_threads(), "logs": recorder.logs},
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", type=Path, required=True, help="BenchSetting JSON")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="RunResult JSON to write")
    parser.add_argument("--save-dir", type=Path, help="save the final model here (learning comparisons)")
    args = parser.parse_args(argv)
    result = run_trl(BenchSetting.from_json(args.setting), args.model_dir, args.save_dir)
    result.to_json(args.out)
    print(f"trl: step times {[round(t, 3) for t in result.step_times]}, peak RSS {result.peak_rss_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
