"""Build a tiny random causal LM and a real byte-level BPE tokenizer, offline.

Used by the test suite and the benchmark smoke runs: a Llama-architecture model
of about 1M parameters with a ChatML chat template (the same template family as
SmolLM2), saved in Hugging Face format so every code path loads it the way it
loads a real checkpoint. A fixture, not part of the package: tests and benchmarks
import it as ``benchmarks.tiny_model`` from the repository root.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    # Arithmetic and boxed-answer text: the tokens the tests' tasks use.
    lines = []
    for a in range(0, 60):
        for b in range(0, 12):
            lines.append(f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}.")
            lines.append(f"<think>{a} plus {b} equals {a + b}</think><answer>{a + b}</answer>")
    lines += ["You are a helpful assistant.", "user", "assistant", "system", "Answer with a number."]
    return lines


def build_tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(
    output_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, seed: int = 0
) -> Path:
    """Write a tiny random Llama model and its tokenizer to ``output_dir``; return the path.

    vLLM's CPU attention needs a head size of at least 32 (``hidden_size / num_heads``):
    the vLLM tests build ``hidden_size=128, num_heads=2``.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(output_dir)
    tok = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
