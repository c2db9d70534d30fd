"""A TRL GRPO script of the longer kind: a GRPOConfig with a dozen fields, a LoraConfig, two reward
functions (one a closure over the tokenizer), a conversational dataset and an environment_factory class.
Written for TRL; only the import line is this library's."""
import json
import sys

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer

from maxent_grpo import GRPOConfig, GRPOTrainer

model_path, output_dir = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_path)

dataset = Dataset.from_list([
    {"prompt": [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"What is {a} + {b}?"}],
     "solution": str(a + b), "a": a}
    for a in range(4) for b in range(4)
])


def make_length_reward(tok, target=6):
    def token_length(completions, **kwargs):
        return [-abs(target - len(tok(c[0]["content"])["input_ids"])) / target for c in completions]
    return token_length


def correct(completions, solution, trainer_state, log_metric, **kwargs):
    log_metric("seen_step", trainer_state.global_step)
    return [1.0 if s in c[0]["content"] else 0.0 for c, s in zip(completions, solution)]


class Scratchpad:
    """TRL's environment convention: reset(**row), public methods as tools, get_reward()."""

    def reset(self, **row):
        self.notes = []
        return None

    def note(self, text: str) -> str:
        """Write a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return "noted"

    def get_reward(self) -> float:
        return 0.1 * len(self.notes)


args = GRPOConfig(
    output_dir=output_dir,
    learning_rate=2e-5,
    lr_scheduler_type="cosine",
    warmup_steps=1,
    max_steps=2,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_generations=4,
    max_completion_length=8,
    temperature=0.9,
    beta=0.04,
    use_bias_correction_kl=False,
    loss_type="dr_grpo",
    reward_weights=[1.0, 0.5],
    seed=7,
    save_steps=1,
    gradient_checkpointing=False,
    report_to="none",
    bf16=False,
)
peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
trainer = GRPOTrainer(
    model=model_path,
    reward_funcs=[correct, make_length_reward(tokenizer)],
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    peft_config=peft_config,
    environment_factory=Scratchpad,
)
result = trainer.train()
trainer.save_model(f"{output_dir}/final")
if trainer.state.is_world_process_zero:
    print("LOG_HISTORY " + json.dumps(trainer.state.log_history))
    print(f"GLOBAL_STEP {result.global_step}")
metrics = trainer.evaluate(dataset.select(range(3)))
if trainer.state.is_world_process_zero:
    print("EVAL " + json.dumps(metrics))
