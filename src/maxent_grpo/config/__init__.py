"""The run's configuration, from YAML to the compiled plan; above the run (``maxent_grpo.training``),
which never imports it.

* ``schema.py``: :class:`TrainConfig`, its sections and each key's help;
* ``load.py``: YAML and ``--set`` overrides -> ``TrainConfig`` (``load_config``), each key's own checks;
* ``rules.py``: the rules between sections;
* ``compile.py``: ``compile_run(cfg, machine) -> RunPlan``, once, in the CLI (every ``auto`` resolved);
* ``help.py``: ``maxent-grpo train --help-config`` and docs/CONFIG.md;
* ``trl.py``, ``trl_fields.py``, ``trl_doc.py``: a TRL ``GRPOConfig`` YAML -> our keys (``--from-trl``)
  and its table in docs/TRL.md.
"""
