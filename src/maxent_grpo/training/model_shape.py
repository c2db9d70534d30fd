"""A decoder's sizes from its ``config.json`` (no weights loaded), and what one token of a
forward/backward keeps for autograd: what the micro-batch budget (``training/micro_batches.py``)
and the memory plan (``benchmarks/memory_plan.py``) count from.

The family is a Llama/Qwen2-style decoder: embeddings, per layer q/k/v/o and a gated MLP (with
q/k/v biases where the family has them), two RMSNorms. ``tests/test_memory_plan.py`` checks the
parameter count against transformers' own model on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxent_grpo.errors import ConfigError

_BIASED_QKV = {"qwen2"}  # families whose q/k/v projections carry a bias
_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        """From a ``config.json`` as a dict; a ``ValueError`` naming the keys a non-decoder lacks."""
        missing = [k for k in _KEYS if k not in cfg]
        if missing:
            raise ValueError(f"model_type {cfg.get('model_type')!r} has no {', '.join(missing)} "
                             "(a Llama/Qwen2-style decoder config is needed)")
        return cls(
            hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"], kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") in _BIASED_QKV or bool(cfg.get("attention_bias", False)),
        )

    @classmethod
    def from_pretrained(cls, model_path: str, needed_by: str) -> "Shape":
        """From a model folder's config.json; a ConfigError naming ``needed_by`` when it is not a decoder's."""
        from transformers import AutoConfig

        try:
            return cls.from_config(AutoConfig.from_pretrained(model_path).to_dict())
        except ValueError as err:
            raise ConfigError(f"{needed_by} cannot size {model_path}: {err}; set a number") from None

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear module of one decoder layer, by its transformers name."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        linear = sum(a * b for a, b in self.linear_shapes().values())
        bias = (self.hidden + 2 * self.kv_dim) if self.qkv_bias else 0
        return linear + bias + 2 * self.hidden  # two RMSNorm gains

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def saved_values_per_token(self, gradient_checkpointing: bool) -> int:
        """Values (in the compute dtype) autograd keeps per token of a forward/backward, with SDPA
        (no attention matrix kept): per layer ``6h + 2kv + 4i``; with gradient checkpointing only
        each layer's input ``h``, plus one layer recomputed at a time."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        layer = 6 * h + 2 * kv + 4 * i
        return self.layers * h + layer if gradient_checkpointing else self.layers * layer
