"""Trackers: names resolve like TRL's report_to, and each backend's own files hold what was logged."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxent_grpo.errors import ConfigError
from maxent_grpo.training.trackers import TRACKER_NAMES, make_trackers, require_trackers, resolve_report_to
from tiny_runs import wandb_history

REPO = Path(__file__).resolve().parents[2]
# A sitecustomize that makes the path finder miss wandb, as on a machine without it (tests/test_gpu_check.py).
NO_WANDB = '''
import importlib.machinery

_find = importlib.machinery.PathFinder.find_spec


def _find_spec(cls, name, path=None, target=None):
    if name.partition(".")[0] == "wandb":
        return None
    return _find(name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)
'''

METRICS = [
    {"reward": 0.25, "kl": 0.0, "eval/pass@1": 0.5, "step_time": 3},
    {"reward": 0.5, "kl": 0.01, "eval/pass@1": 0.5, "step_time": 3},
    {"reward": 0.75, "kl": 0.02, "eval/pass@1": 0.625, "step_time": 2},
]
COLUMNS = ["prompt", "completion", "reward"]
ROWS = [["What is 2+2?", "<think>2+2</think> \\boxed{4}", 1.0], ["a | b", "line1\nline2", 0.0]]


def _log_run(trackers):
    for step, metrics in enumerate(METRICS, start=1):
        trackers.log(metrics, step)
    trackers.log_table("samples", COLUMNS, ROWS, 3)
    trackers.close()


def _needs(name):
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed")


def test_resolve_report_to_follows_trl_conventions():
    assert resolve_report_to(None) == []
    assert resolve_report_to("none") == []
    assert resolve_report_to(["none"]) == []
    assert resolve_report_to([]) == []
    assert resolve_report_to("wandb") == ["wandb"]
    assert resolve_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    assert resolve_report_to(["mlflow", "trackio"]) == ["mlflow", "trackio"]
    installed = [n for n in TRACKER_NAMES if importlib.util.find_spec(n) is not None]
    assert resolve_report_to("all") == installed
    with pytest.raises(ValueError, match="report_to.*'comet'"):
        resolve_report_to(["tensorboard", "comet"])


def test_missing_package_is_a_one_line_config_error_naming_the_key_and_the_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "trackio", None)  # makes `import trackio` fail as if absent
    for call in (lambda: require_trackers("tensorboard,trackio"),
                 lambda: make_trackers(["tensorboard", "trackio"], tmp_path)):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == "logging.report_to: trackio is not installed (pip install trackio)"
    assert not (tmp_path / "tensorboard").exists()  # nothing started before the check failed


def test_train_with_a_tracker_that_is_not_installed_stops_with_one_line_before_the_model(tmp_path):
    """``maxent-grpo train`` asking for wandb where it cannot be imported: one line naming
    logging.report_to and the package, exit 2, no output folder. The model path does not exist:
    the same command without wandb fails on it, so the tracker check comes before the model."""
    (tmp_path / "sitecustomize.py").write_text(NO_WANDB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "src")])}
    missing = tmp_path / "no-such-model"

    def train(report_to, out):
        return subprocess.run(
            [sys.executable, "-m", "maxent_grpo.cli", "train", "--output-dir", str(out),
             "--set", f"logging.report_to={report_to}", "--set", f"model.name_or_path={missing}"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )

    proc = train("[tensorboard, wandb]", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "maxent-grpo: config error: logging.report_to: wandb is not installed (pip install wandb)"
    ]
    assert not (tmp_path / "run").exists()
    proc = train("[tensorboard]", tmp_path / "control")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"maxent-grpo: error: model directory '{missing}' does not exist"


def test_no_trackers_is_a_no_op(tmp_path):
    with make_trackers("none", tmp_path) as trackers:
        trackers.log({"reward": 1.0}, 1)
        trackers.log_table("samples", COLUMNS, ROWS, 1)
    assert trackers.names == []


def test_bad_values_and_rows_are_rejected(tmp_path):
    trackers = make_trackers("tensorboard", tmp_path)
    with pytest.raises(ValueError, match="metrics\\['reward'\\]"):
        trackers.log({"reward": "high"}, 1)
    with pytest.raises(ValueError, match="rows\\[0\\]"):
        trackers.log_table("samples", COLUMNS, [["only", "two"]], 1)
    trackers.close()


@_needs("tensorboard")
def test_tensorboard_events_hold_the_scalars_and_the_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_run(make_trackers(["tensorboard"], tmp_path, config={"beta": 0.04}))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward", "kl", "eval/pass@1", "step_time"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in METRICS])
    texts = events.Tags()["tensors"]
    assert "samples/text_summary" in texts and "config/text_summary" in texts
    table = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "What is 2+2?" in table and "a \\| b" in table  # the pipe is escaped, not a column break


@_needs("wandb")
@pytest.mark.slow
def test_wandb_offline_run_holds_the_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_run(make_trackers("wandb", tmp_path, run_name="test-run", config={"beta": 0.04}))
    import wandb

    wandb.teardown()  # run.finish() can return before wandb's service process has written the file
    run_dirs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    history = wandb_history(glob.glob(run_dirs[0] + "/run-*.wandb")[0])
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["reward"] for row in history] == [m["reward"] for m in METRICS]
    assert history[-1]["samples/_type"] == "table-file"
    table = json.loads(open(run_dirs[0] + "/files/" + history[-1]["samples/path"]).read())
    assert table["columns"] == COLUMNS and table["data"] == ROWS


@_needs("mlflow")
def test_mlflow_file_store_holds_metrics_and_table(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    # A file store starts in a fraction of a second; the default sqlite store is tested below.
    uri = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    _log_run(make_trackers("mlflow", tmp_path, run_name="r1", config={"beta": 0.04}))
    _check_mlflow(MlflowClient(tracking_uri=uri))


def _check_mlflow(client):
    (run,) = client.search_runs([client.get_experiment_by_name("maxent-grpo").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    history = client.get_metric_history(run.info.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(i + 1, m["reward"]) for i, m in enumerate(METRICS)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_at_1")] == [0.5, 0.5, 0.625]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert artifacts == {"samples/step-3.json"}


@_needs("mlflow")
@pytest.mark.slow
def test_mlflow_default_sqlite_store_lives_in_the_run_dir(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_run(make_trackers("mlflow", tmp_path, run_name="r1"))
    db = tmp_path / "mlruns" / "mlflow.db"
    assert db.is_file()
    _check_mlflow(MlflowClient(tracking_uri=f"sqlite:///{db}"))


@_needs("trackio")
def test_trackio_local_run_holds_the_metrics(tmp_path, monkeypatch):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    project = f"maxent-grpo-test-{tmp_path.name}"
    _log_run(make_trackers("trackio", tmp_path, project=project, run_name="r1"))
    assert str(trackio.utils.TRACKIO_DIR).startswith(os.environ["HF_HOME"])
    logs = SQLiteStorage.get_logs(project, "r1")
    scalars = [log for log in logs if "reward" in log]
    assert [log["step"] for log in scalars] == [1, 2, 3]
    assert [log["reward"] for log in scalars] == [m["reward"] for m in METRICS]
