"""The trained policy, its reference and its optimizer, from the plan's :class:`ModelPlan` and
:class:`OptimizerPlan`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import get_scheduler

from maxent_grpo.core.fp32_head import has_linear_head, use_fp32_head
from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.errors import UserError
from maxent_grpo.models import (
    apply_lora, enable_activation_checkpointing, fill_pad_token, is_peft_model, load_tokenizer, prepare_tokenizer,
    reference_context,
)
from maxent_grpo.training.strategy import Strategy


@dataclass(frozen=True)
class LoraPlan:
    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]
    use_rslora: bool


@dataclass(frozen=True)
class ModelPlan:
    name_or_path: str
    dtype: str  # the compute dtype (model.dtype): frozen weights are stored in it
    master_dtype: str  # the dtype the trained weights are stored and updated in
    lora: LoraPlan | None  # None: full fine-tuning
    gradient_checkpointing: bool
    autocast_bf16: bool  # resolved from auto
    lm_head_fp32: bool  # the LM head's matmul in float32 (core/fp32_head.py), policy and reference
    # A model given as a Python object (name_or_path is then its python: reference): trained in place,
    # with its own LoRA adapters when it is a peft model; and a tokenizer given (None: read from the folder).
    given: torch.nn.Module | None = None
    given_tokenizer: Any = None


@dataclass(frozen=True)
class OptimizerPlan:
    """The optimizer (AdamW: torch's, fused or not, or bitsandbytes' 8-bit) and its learning-rate
    schedule over every update of the run."""

    learning_rate: float
    lr_scheduler: str
    warmup_steps: int  # updates; with warmup_ratio, set with total_updates (plan.with_run_length)
    warmup_ratio: float  # 0: warmup_steps as given
    weight_decay: float
    betas: tuple[float, float]
    total_updates: int | None  # max_steps x num_iterations; None until the run's length is known
    name: str  # training.optimizer: adamw, adamw_fused or adamw_8bit (bitsandbytes' AdamW8bit)
    # torch's fused AdamW kernel (a few launches a step, as TRL's adamw_torch_fused): on CUDA, for
    # parameters that are not sharded (compile_run decides).
    fused: bool


def load_policy(m: ModelPlan, model_path: str | None, strategy: Strategy):
    """The trained policy in its master dtype, with LoRA and activation checkpointing, placed by the
    strategy; ``m.given`` (a model object, ``model_path`` None) is trained in place."""
    tokenizer = prepare_tokenizer(m.given_tokenizer) if m.given_tokenizer is not None else load_tokenizer(model_path)

    def adapt(model: torch.nn.Module) -> torch.nn.Module:
        fill_pad_token(model, tokenizer)
        if m.lm_head_fp32:  # before LoRA, which config rules keep off the head
            if not has_linear_head(model):  # a family whose head is its own module
                raise UserError(f"model.lm_head_fp32: the model's LM head is a "
                                f"{type(model.get_output_embeddings()).__name__}, not a plain nn.Linear")
            use_fp32_head(model)
        if m.lora is not None and not is_peft_model(model):  # a given peft model brings its own adapters
            model = apply_lora(model, r=m.lora.r, alpha=m.lora.alpha, dropout=m.lora.dropout,
                               target_modules=list(m.lora.target_modules), use_rslora=m.lora.use_rslora)
        if m.gradient_checkpointing:
            enable_activation_checkpointing(model)
        return model

    # Before the optimizer exists: it must hold the (sharded) parameters.
    if m.given is not None:
        dtype = None if is_peft_model(m.given) else m.master_dtype
        return strategy.adopt_policy(m.given, dtype=dtype, adapt=adapt), tokenizer
    model = strategy.load_policy(model_path, dtype=m.master_dtype, adapt=adapt, bf16_compute=m.autocast_bf16)
    return model, tokenizer


def load_reference(m: ModelPlan, model_path: str | None, strategy: Strategy) -> torch.nn.Module | None:
    """The frozen reference model: a second copy of the start weights in the compute dtype, placed
    by the strategy; None with LoRA (the reference is the base with its adapters off). Of a model
    given as an object, load it before the policy: the copy is of its weights before any step."""
    if m.lora is not None:
        return None
    if m.given is not None:
        reference = strategy.adopt_reference(m.given, dtype=m.dtype)
    else:
        reference = strategy.load_reference(model_path, dtype=m.dtype)
    return use_fp32_head(reference) if m.lm_head_fp32 else reference


def reference_scorer(scoring: Scoring, model, reference: torch.nn.Module | None):
    """(input_ids, attention_mask, prompt_length) -> the frozen reference's completion log-probs:
    ``reference`` (:func:`load_reference`'s), or the LoRA ``model`` with its adapters off when None."""
    if reference is None:
        def score(ids, mask, plen):
            with reference_context(model):
                return scoring.score_rows(model, ids, mask, plen)[0]
        return score

    def score(ids, mask, plen):
        return scoring.score_rows(reference, ids, mask, plen)[0]
    return score


def build_optimizer(model: torch.nn.Module, o: OptimizerPlan) -> tuple[torch.optim.Optimizer, object]:
    """The run's AdamW over the trainable parameters and its LR schedule."""
    trained = [p for p in model.parameters() if p.requires_grad]
    params: list = trained
    if o.weight_decay > 0:
        # Biases and norm gains (the 1-D parameters) are not decayed, as in HF / TRL and
        # OpenRLHF: decay would pull an RMSNorm gain from 1 toward 0. One group when there is
        # no decay, so checkpoints of earlier runs (one group) still resume.
        params = [{"params": [p for p in trained if p.ndim >= 2]},
                  {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}]
    if o.name == "adamw_8bit":
        # The moments in 8 bits (block-wise quantised; tensors under 4096 elements stay 32-bit), on the
        # CPU and CUDA. Imported here: bitsandbytes is an optional dependency.
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit(params, lr=o.learning_rate, betas=o.betas,
                                                 weight_decay=o.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=o.learning_rate, betas=o.betas, weight_decay=o.weight_decay,
                                      fused=o.fused or None)
    lr_scheduler = get_scheduler(
        {"constant": "constant_with_warmup"}.get(o.lr_scheduler, o.lr_scheduler),
        optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=o.total_updates,
    )
    return optimizer, lr_scheduler
