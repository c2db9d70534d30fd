"""A TRL GRPO YAML (the file ``trl grpo --config`` reads) as this project's config: ``--from-trl FILE``.

:data:`TRL_FIELDS` (config/trl_fields.py) is the whole mapping, one entry per field TRL's ``trl grpo`` reads from such a
file: every field of TRL 1.16's ``GRPOConfig`` of its own, the ``TrainingArguments`` fields a GRPO
YAML uses, and the script's ``GRPOScriptArguments``, ``ModelConfig`` and ``DatasetMixtureConfig``.
Each field is

* :class:`Mapped`: it becomes our keys with the same meaning. An absent field takes TRL's default
  (``default``), so the run is the one TRL would make from the same file, not ours with a few keys;
* :class:`Refused`: no equivalent here; the conversion stops with one line naming the field and
  why, unless the value asks for nothing TRL's default would not (``accepts``). An absent field is
  judged at TRL's default like a written one, so a TRL default that changes to something refused
  here stops the conversion instead of changing the run;
* :class:`Ignored`: no effect here (a DeepSpeed knob, a console display); a line says why.

A field in none of them is refused as unknown. docs/TRL.md's table is :func:`markdown_table` of
this mapping (config/trl_doc.py: ``python -m maxent_grpo.config.trl_doc --write docs/TRL.md``).

Batch sizes: TRL counts completions, we count prompts. In TRL each process takes
``per_device_train_batch_size`` completions per forward/backward and ``gradient_accumulation_steps``
of those per optimizer step, so a process trains on ``per_device_train_batch_size *
gradient_accumulation_steps`` completions per step, ``num_generations`` per prompt. Here a process
draws ``training.prompts_per_step`` prompts and samples ``generation.num_generations`` completions of
each, split into forward/backward micro-batches of ``training.micro_batch_size`` completions. So
``prompts_per_step = per_device_train_batch_size * gradient_accumulation_steps / num_generations``
(a group is never split across processes here, so this must divide) and ``micro_batch_size =
per_device_train_batch_size``. Steps: TRL's ``max_steps``, ``save_steps`` and ``warmup_steps``
count optimizer updates; our ``training.max_steps`` and ``checkpoint.save_steps`` count rollout
batches of ``num_iterations`` updates each (our warm-up counts updates, as TRL's). Without
``max_steps`` (TRL's default, -1) the run is ``num_train_epochs`` passes over the prompts:
``training.max_steps: null`` and ``data.num_epochs``, counted once the data is read, as TRL counts
them; ``warmup_ratio`` stays a ratio of that count.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maxent_grpo.errors import ConfigError
from maxent_grpo.config.load import build_config, read_yaml
from maxent_grpo.config.trl_fields import (
    GRPO_FIELDS,
    SCRIPT_FIELDS,
    TRAINING_ARGUMENTS_FIELDS,
    TRL_FIELDS,
    Ignored,
    Mapped,
    Refused,
)

__all__ = ["GRPO_FIELDS", "SCRIPT_FIELDS", "TRAINING_ARGUMENTS_FIELDS", "TRL_FIELDS", "Ignored", "Mapped", "Refused",
           "convert", "convert_with_origin", "load_trl_config", "name_trl_field"]

# Fields applied before those that read them (a later transform's key wins on overlap).
_ORDER = ("loss_type",)


def _default(entry) -> Any:
    """TRL's default of a field (every entry holds it; tests compare them with the installed TRL's)."""
    return entry.default


def convert(trl: Mapping[str, Any], table: Mapping[str, Mapped | Refused | Ignored] = TRL_FIELDS
            ) -> tuple[dict[str, Any], list[str]]:
    """``(our dotted keys -> values, notes)`` for a TRL GRPO YAML's mapping; raises ConfigError naming
    the first refused or unknown field. ``notes``: one line per ignored field the file sets. ``table``:
    the fields read (``GRPOTrainer`` takes the model, data and rewards as objects, not as the script's fields)."""
    keys, notes, _ = convert_with_origin(trl, table)
    return keys, notes


def convert_with_origin(trl: Mapping[str, Any], table: Mapping[str, Mapped | Refused | Ignored] = TRL_FIELDS
                        ) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """:func:`convert`, and which TRL field gave each of our keys (to name it in a later error)."""
    unknown = [name for name in trl if name not in table]
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a field of TRL's GRPOConfig, TrainingArguments or the trl grpo "
                          "script that this converter knows (docs/TRL.md lists them)")
    fields = {name: trl.get(name, _default(entry)) for name, entry in table.items()}
    notes = []
    for name, entry in table.items():
        # Judged at TRL's default too: a default TRL changes to a value refused here must not pass unnoticed.
        if isinstance(entry, Refused) and not entry.allows(fields[name], fields):
            written = "" if name in trl else " (TRL's default)"
            raise ConfigError(f"{name}: {fields[name]!r}{written} is refused: {entry.reason}")
        if isinstance(entry, Ignored) and name in trl:
            notes.append(f"{name}: ignored: {entry.reason}")
    out, origin = _apply(fields, table)
    return out, notes, origin


def name_trl_field(err: ConfigError, origin: Mapping[str, str], trl: Mapping[str, Any]) -> ConfigError:
    """A validator's error on one of our keys, named by the TRL field that gave the key (when one did)."""
    field = next((name for key, name in origin.items() if str(err).startswith(f"{key}:")), None)
    if field is None or field not in trl:
        return err
    return ConfigError(f"{field}: {trl[field]!r} (as {err})")


def _apply(fields: Mapping[str, Any], table: Mapping[str, Mapped | Refused | Ignored]
           ) -> tuple[dict[str, Any], dict[str, str]]:
    """The mapped fields' keys, and which TRL field gave each key."""
    out, origin = {}, {}
    for name in [*(n for n in _ORDER if n in table), *(n for n in table if n not in _ORDER)]:
        entry = table[name]
        if isinstance(entry, Mapped):
            try:
                keys = entry.to(fields[name], fields)
            except (TypeError, ValueError) as exc:
                if isinstance(exc, ConfigError):
                    raise
                raise ConfigError(f"{name}: {fields[name]!r} cannot be read: {exc}") from None
            out.update(keys)
            origin.update(dict.fromkeys(keys, name))
    return out, origin


def load_trl_config(path: str | Path, overrides: list[str] | None = None):
    """Our config from a TRL GRPO YAML at ``path`` (then ``overrides``, as --set), validated; and the notes.
    A value our validator refuses is named by its TRL field, then by our key."""
    path = Path(path)
    trl = read_yaml(path)
    keys, notes, origin = convert_with_origin(trl)
    try:
        return build_config(keys, path.resolve().parent, overrides), notes
    except ConfigError as err:
        raise name_trl_field(err, origin, trl) from None
