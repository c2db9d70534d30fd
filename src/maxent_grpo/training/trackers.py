"""Experiment trackers behind one small interface: tensorboard, wandb, mlflow, trackio.

``report_to`` follows TRL: a list of names, one name (or names joined by commas),
``"none"`` or ``"all"`` (every installed one). Each backend's package is imported
only when it is asked for; a missing one is a :class:`ConfigError` naming
``logging.report_to`` and what to install (:func:`require_trackers`, which a run calls
before any model loads). Create the trackers on the main process only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import numbers
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from maxent_grpo.errors import ConfigError

__all__ = ["TRACKER_NAMES", "Trackers", "make_trackers", "require_trackers", "resolve_report_to"]

# Each is also the name of its package on PyPI and of the module it installs.
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "trackio")


class _Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None: ...

    def close(self) -> None: ...


def resolve_report_to(report_to: str | Sequence[str] | None) -> list[str]:
    """Normalise ``report_to`` to a list of backend names (without importing them)."""
    if report_to is None:
        return []
    names = [n.strip() for n in report_to.split(",")] if isinstance(report_to, str) else [str(n) for n in report_to]
    names = [n for n in names if n]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [n for n in TRACKER_NAMES if importlib.util.find_spec(n) is not None]
    unknown = [n for n in names if n not in TRACKER_NAMES]
    if unknown:
        raise ValueError(
            f"report_to has unknown tracker(s) {unknown}; choose from {list(TRACKER_NAMES)}, 'all' or 'none'"
        )
    return list(dict.fromkeys(names))


def _not_installed(name: str) -> ConfigError:
    return ConfigError(f"logging.report_to: {name} is not installed (pip install {name})")


def require_trackers(report_to: str | Sequence[str] | None) -> list[str]:
    """The backend names of ``report_to``; a :class:`ConfigError` for the first whose package is
    not installed (found without importing it, so this is quick: a run calls it first)."""
    names = resolve_report_to(report_to)
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise _not_installed(name)
    return names


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _not_installed(name) from exc


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"metrics[{key!r}] must be a real number, got {type(value).__name__}")
        out[key] = float(value)
    return out


class _TensorBoard:
    def __init__(self, output_dir: Path, config: dict | None):
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # so that a live tensorboard sees every step, not every 2 minutes

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        # tensorboard has no tables: a markdown table in the text tab.
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\r\n", "<br>").replace("\r", "<br>").replace("\n", "<br>")

        lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, output_dir: Path, project: str, run_name: str | None, config: dict | None):
        self.wandb = _import("wandb")
        # The mode (online/offline/disabled) comes from WANDB_MODE, as users expect.
        self.run = self.wandb.init(project=project, name=run_name, dir=str(output_dir), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


# mlflow metric names allow alphanumerics and _ - . space : / only ("pass@k" is not).
_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")


def _mlflow_key(key: str) -> str:
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class _Mlflow:
    def __init__(self, output_dir: Path, project: str, run_name: str | None, config: dict | None):
        _import("mlflow")
        from mlflow.tracking import MlflowClient

        store = output_dir / "mlruns"
        store.mkdir(parents=True, exist_ok=True)
        # MLFLOW_TRACKING_URI (a server, or any store) wins; else a sqlite store inside the run.
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{store.resolve()}/mlflow.db"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        if experiment is None:
            experiment_id = self.client.create_experiment(project, artifact_location=(store / "artifacts").resolve().as_uri())
        else:
            experiment_id = experiment.experiment_id
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        if config is not None:
            self.client.log_dict(self.run_id, config, "config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"{name}/step-{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, project: str, run_name: str | None, config: dict | None):
        self.trackio = _import("trackio")
        # Local runs go to trackio's own folder (TRACKIO_DIR, else HF_HOME/trackio), where
        # `trackio show` finds them.
        self.run = self.trackio.init(
            project=project, name=run_name, config=config, embed=False, auto_log_gpu=False, auto_log_cpu=False
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        # trackio stores NaN/inf poorly (JSON); they are dropped here and visible in metrics.jsonl.
        self.run.log(metrics={k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log(metrics={name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class Trackers:
    """The active tracker backends; every call goes to each of them."""

    def __init__(self, names: list[str], backends: list[_Backend]):
        self.names = names
        self._backends = backends

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self._backends:
            return
        values = _floats(metrics)
        for backend in self._backends:
            backend.log(values, step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        for i, row in enumerate(rows):
            if len(row) != len(columns):
                raise ValueError(f"rows[{i}] has {len(row)} values for {len(columns)} columns")
        for backend in self._backends:
            backend.log_table(name, list(columns), [list(r) for r in rows], step)

    def close(self) -> None:
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_trackers(
    report_to: str | Sequence[str] | None,
    output_dir: str | Path,
    *,
    project: str = "maxent-grpo",
    run_name: str | None = None,
    config: dict | None = None,
    observers: Sequence[_Backend] = (),
) -> Trackers:
    """Start the trackers named by ``report_to`` for a run writing to ``output_dir``; ``observers``
    (objects with the backends' ``log``, ``log_table`` and ``close``, given from Python) are told
    what they are told.

    tensorboard writes ``OUTPUT_DIR/tensorboard``; wandb ``OUTPUT_DIR/wandb`` (offline
    with ``WANDB_MODE=offline``); mlflow a sqlite store in ``OUTPUT_DIR/mlruns`` unless
    ``MLFLOW_TRACKING_URI`` is set; trackio its local store. ``config`` (the resolved
    run config) is recorded with the run.
    """
    names = require_trackers(report_to)  # every package, before any backend starts a run
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    backends: list[_Backend] = []
    try:
        for name in names:
            if name == "tensorboard":
                backends.append(_TensorBoard(out, config))
            elif name == "wandb":
                backends.append(_Wandb(out, project, run_name, config))
            elif name == "mlflow":
                backends.append(_Mlflow(out, project, run_name, config))
            else:
                backends.append(_Trackio(project, run_name, config))
    except BaseException:
        for backend in backends:
            backend.close()
        raise
    return Trackers(names, [*backends, *observers])
