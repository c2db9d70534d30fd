"""The data planes' contract, run against each plane: the local one, and TransferQueue's in this
process and on Ray (rollout/transferqueue_plane.py). TransferQueue's Ray start costs 10-15 s, so
one Ray plane serves the whole module; its partitions are cleared after each test."""

from __future__ import annotations

import importlib.util
import ipaddress
import sys
import threading

import psutil
import pytest
import torch

from maxent_grpo.errors import ConfigError
from maxent_grpo.rollout.backend import Completion, PromptGroup, build_rollout_batch
from maxent_grpo.rollout.data_plane import LocalDataPlane, RolloutRecord, Skipped
from maxent_grpo.rollout.open_plane import check_data_plane, open_data_plane
from maxent_grpo.rollout.transferqueue_plane import MISSING_EXTRA, TransferQueuePlane, import_transfer_queue
from maxent_grpo.rollout.transferqueue_ray import TransferQueueStartError


def needs_transferqueue() -> None:
    """Skip without the transferqueue extra. Not importorskip: TransferQueue and Ray read their
    settings at import, so the plane must be the first to import them (it sets its defaults first)."""
    if importlib.util.find_spec("transfer_queue") is None:
        pytest.skip("the transferqueue extra is not installed: pip install -e '.[transferqueue]'")

# -- records ----------------------------------------------------------------------------------


def _logps(n: int, seed: int) -> list[float]:
    """Behaviour log-probs as a sampler gives them: float32 log-softmax values as Python floats."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 50, generator=g)
    return torch.log_softmax(logits, dim=-1)[:, 0].tolist()


def multi_turn_record(step: int = 3) -> RolloutRecord:
    """3 prompts x 4 completions: ragged and empty completions, environment tokens (loss mask 0,
    log-prob 0), environment rewards with gaps, NaN rewards, non-ASCII text."""
    texts = ["4", "Die Antwort ist 4 ✓", "", "四 🤔\n<tool>calc(2+2)</tool>", "x\x00y", "ünïcödé", "\t", "42",
             "a" * 300, "∑ i = n(n+1)/2", "", "😀😀"]
    lengths = [1, 7, 0, 12, 3, 5, 1, 2, 64, 9, 0, 2]
    comps = []
    for i, (text, n) in enumerate(zip(texts, lengths)):
        env = i % 3 == 1  # every third episode had environment turns
        mask = [0 if env and 2 <= t < 5 else 1 for t in range(n)]
        logps = [0.0 if m == 0 else lp for m, lp in zip(mask, _logps(n, seed=i))]
        comps.append(Completion(
            token_ids=[(7 * i + 3 * t) % 49152 for t in range(n)], text=text,
            finish_reason="length" if i % 4 == 3 else "stop", logps=logps,
            loss_mask=mask if env else None, env_reward=[None, 1.0, 0.0, -0.5][i % 4],
        ))
    groups = [
        PromptGroup(prompt=f"<|im_start|>user\nWas ist {p}+{p}? ✨<|im_end|>\n",
                    prompt_ids=list(range(10 + p, 30 + 5 * p)), completions=comps[4 * p: 4 * p + 4])
        for p in range(3)
    ]
    rewards = torch.randn(12, 3, generator=torch.Generator().manual_seed(step))
    rewards[[0, 5, 11], [1, 2, 0]] = float("nan")  # a reward function that returned None
    return RolloutRecord(
        step=step, version=step - 1,
        rows=[{"problem": f"Was ist {p}+{p}? ✨", "answer": str(2 * p), "meta": {"level": p, "tags": ["arith", "de"]}}
              for p in range(3)],
        rollout=build_rollout_batch(groups, 4), rewards=rewards,
        stats={"reward/mean": 0.25, "completions/mean_length": 8.83}, timings={"generate_s": 1.5, "score_s": 0.01},
    )


def plain_record(step: int = 0) -> RolloutRecord:
    """One-shot prompts from a backend without log-probs: no behaviour log-probs, masks or environment
    rewards; float64 rewards, one function."""
    comps = [Completion(token_ids=[1 + i, 2, 3][: 1 + i], text=f"t{i}", finish_reason="stop") for i in range(2)]
    batch = build_rollout_batch([PromptGroup(prompt="p", prompt_ids=[9, 8], completions=comps)], 2)
    return RolloutRecord(step=step, version=step, rows=[{"prompt": "p"}], rollout=batch,
                         rewards=torch.tensor([[0.5], [float("nan")]], dtype=torch.float64))


def failed_record(step: int = 5) -> RolloutRecord:
    return RolloutRecord(step=step, version=4, rows=[{"prompt": "q"}], rollout=None, rewards=None,
                         timings={"generate_s": 0.2}, failure=Skipped("generate", "POST /v1/completions: Connection refused"))


RECORDS = {"multi_turn": multi_turn_record, "plain": plain_record, "failed": failed_record}


def assert_same_record(got: RolloutRecord, want: RolloutRecord) -> None:
    """Equal field by field; the reprs also compare the element types (1 vs 1.0) and the None entries,
    and rewards compare bit for bit (NaN included)."""
    assert type(got) is RolloutRecord
    assert (got.step, got.version, got.failure) == (want.step, want.version, want.failure)
    assert got.rows == want.rows and repr(got.rows) == repr(want.rows)
    assert repr(got.stats) == repr(want.stats) and repr(got.timings) == repr(want.timings)
    assert repr(got.rollout) == repr(want.rollout)
    if want.rewards is None:
        assert got.rewards is None
    else:
        assert got.rewards.dtype == want.rewards.dtype and got.rewards.shape == want.rewards.shape
        assert torch.equal(got.rewards.contiguous().view(torch.uint8), want.rewards.contiguous().view(torch.uint8))


# -- planes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_planes():
    """Holds the module's Ray plane (opened by the first test that asks for it), and the processes
    this test process had before it (another test's helpers, such as a verifier worker, that Ray's
    close must not be charged with)."""
    holder: dict = {"children_before": set(psutil.Process().children(recursive=True))}
    yield holder
    if "plane" in holder:
        holder.pop("plane").close()


def shared_ray_plane(holder: dict) -> TransferQueuePlane:
    needs_transferqueue()
    if "plane" not in holder:
        holder["plane"] = TransferQueuePlane(ray=True)
    return holder["plane"]


@pytest.fixture(params=["local", "tq_in_process", pytest.param("tq_ray", marks=pytest.mark.slow)])
def plane(request, ray_planes):
    if request.param == "tq_ray":
        shared = shared_ray_plane(ray_planes)
        yield shared
        for name in shared.partitions():
            shared.clear(name)
        return
    if request.param == "tq_in_process":
        needs_transferqueue()
        opened = TransferQueuePlane(ray=False)
    else:
        opened = LocalDataPlane()
    yield opened
    opened.close()


# -- the contract -----------------------------------------------------------------------------


def test_lifecycle_register_put_fetch_clear(plane):
    record = multi_turn_record()
    assert plane.partitions() == []
    plane.register("3")
    assert plane.fetch("3") is None  # registered, nothing put yet
    plane.put("3", record)
    assert_same_record(plane.fetch("3"), record)
    assert_same_record(plane.fetch("3"), record)  # reading does not consume
    with pytest.raises(ValueError, match="registered already"):
        plane.register("3")
    with pytest.raises(ValueError, match="holds a record already"):
        plane.put("3", plain_record())
    with pytest.raises(KeyError, match="not registered"):
        plane.put("4", record)
    with pytest.raises(KeyError, match="not registered"):
        plane.fetch("4")
    assert plane.partitions() == ["3"]
    plane.clear("3")
    assert plane.partitions() == []
    with pytest.raises(KeyError, match="not registered"):
        plane.fetch("3")
    plane.register("3")  # the cleared record is gone from the store, not only from the list
    assert plane.fetch("3") is None
    plane.clear("3")
    plane.clear("never registered")  # a no-op, as for a step that produced nothing


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_records_come_back_equal(plane, kind):
    record = RECORDS[kind]()
    plane.register("7")
    plane.put("7", record)
    assert_same_record(plane.fetch("7"), record)


def test_a_step_and_a_validation_partition_side_by_side(plane):
    train, val, failed = multi_turn_record(step=4), plain_record(step=3), failed_record(step=5)
    for name in ("4", "val/3", "5"):
        plane.register(name)
    plane.put("val/3", val)
    plane.put("4", train)
    assert plane.fetch("5") is None
    plane.put("5", failed)
    assert plane.partitions() == ["4", "val/3", "5"]  # in registration order
    assert_same_record(plane.fetch("4"), train)
    assert_same_record(plane.fetch("val/3"), val)
    plane.clear("4")
    assert plane.partitions() == ["val/3", "5"]
    assert_same_record(plane.fetch("val/3"), val)
    assert_same_record(plane.fetch("5"), failed)


def test_a_fetch_during_a_put_sees_nothing_or_the_whole_record(plane):
    """The producer puts from its own thread while the trainer polls (the asynchronous loop)."""
    records = {str(s): multi_turn_record(step=s) for s in range(1, 5)}
    for name in records:
        plane.register(name)
    producer = threading.Thread(target=lambda: [plane.put(name, r) for name, r in records.items()])
    producer.start()
    while producer.is_alive():
        for name, record in records.items():
            got = plane.fetch(name)
            if got is not None:
                assert_same_record(got, record)
    producer.join()
    for name, record in records.items():
        assert_same_record(plane.fetch(name), record)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_run_trains_the_same_on_either_plane(tiny_model_dir, tmp_path, max_staleness):
    """The seed's parity check, on the tiny model: the same run through the local plane and
    through TransferQueue (in-process) logs the same metrics, timings aside."""
    needs_transferqueue()
    from tiny_runs import read_jsonl, tiny_overrides

    from maxent_grpo.cli import main

    def timing(key: str) -> bool:
        return key.startswith("time/") or key in ("step_time", "step_cpu_time")

    runs = {}
    for name in ("local", "transferqueue"):
        out = tmp_path / name
        extra = [f"rollout.data_plane={name}", "rollout.transferqueue_ray=false",
                 f"rollout.max_staleness={max_staleness}"]
        rewards = "[{name: length, kwargs: {max_length: 100}}]"
        assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards=rewards, steps=3, extra=extra)]) == 0
        runs[name] = [{k: v for k, v in row.items() if not timing(k)} for row in read_jsonl(out / "metrics.jsonl")]
    assert len(runs["local"]) == 3 and any(row["loss"] != 0 for row in runs["local"])
    diffs = [{k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)} for a, b in zip(runs["local"], runs["transferqueue"])]
    assert diffs == [{}] * 3


# -- TransferQueue: start, close, errors --------------------------------------------------------


def test_a_missing_transferqueue_is_one_line_naming_the_key_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # what an uninstalled package looks like to import
    with pytest.raises(ConfigError) as checked:
        check_data_plane("transferqueue")
    assert str(checked.value) == MISSING_EXTRA
    with pytest.raises(ConfigError) as opened:
        open_data_plane("transferqueue", ray=False)
    assert str(opened.value).startswith(MISSING_EXTRA) and "\n" not in str(opened.value)
    check_data_plane("local")  # the local plane needs nothing
    assert isinstance(open_data_plane("local", ray=True), LocalDataPlane)


def test_a_run_asking_for_transferqueue_without_it_stops_at_the_config_check(tmp_path, monkeypatch, capsys):
    from maxent_grpo.cli import main

    monkeypatch.setitem(sys.modules, "transfer_queue", None)
    code = main(["train", "--output-dir", str(tmp_path / "out"), "--set", "rollout.data_plane=transferqueue"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.splitlines()[-1] == f"maxent-grpo: config error: {MISSING_EXTRA}", err
    assert not (tmp_path / "out").exists()  # refused before the run claimed its folder or loaded a model


def test_the_in_process_plane_starts_no_process_and_leaves_no_thread(ray_planes):
    needs_transferqueue()
    ray_open = "plane" in ray_planes  # the module's Ray plane, if a test before this one opened it
    threads_before = set(threading.enumerate())
    children_before = set(psutil.Process().children(recursive=True))
    torch_threads = torch.get_num_threads()
    plane = open_data_plane("transferqueue", ray=False)
    assert isinstance(plane, TransferQueuePlane)
    assert ipaddress.ip_address(plane.listen_ip).is_loopback  # its sockets take pickles: loopback only
    plane.register("0")
    plane.put("0", multi_turn_record())
    assert_same_record(plane.fetch("0"), multi_turn_record())
    import ray

    assert set(psutil.Process().children(recursive=True)) == children_before
    assert ray.is_initialized() == ray_open
    assert torch.get_num_threads() == torch_threads  # TransferQueue sets torch's threads in its own threads only
    plane.close()
    plane.close()  # twice is harmless
    assert not set(threading.enumerate()) - threads_before  # none left behind (an earlier test's may end)
    with pytest.raises(RuntimeError, match="closed"):
        plane.register("1")


@pytest.mark.slow
def test_closing_the_ray_plane_leaves_no_ray_process(ray_planes):
    plane = shared_ray_plane(ray_planes)
    ray_planes.pop("plane")
    import ray

    assert ipaddress.ip_address(plane.listen_ip).is_loopback
    children = [c for c in psutil.Process().children(recursive=True) if c not in ray_planes["children_before"]]
    assert children  # Ray's own processes and TransferQueue's two actors
    plane.close()
    _, alive = psutil.wait_procs(children, timeout=60)
    assert alive == []
    assert not ray.is_initialized()


@pytest.mark.slow
def test_a_ray_cluster_without_two_free_cpus_is_refused_not_waited_on(ray_planes):
    """TransferQueue's controller and storage unit each ask Ray for a CPU; with fewer free, its
    start would wait forever. A cluster the user started is left running."""
    needs_transferqueue()
    import_transfer_queue()  # its defaults before Ray's import
    import ray

    if "plane" in ray_planes:
        ray_planes.pop("plane").close()
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=128 * 2**20,
             configure_logging=False)
    try:
        with pytest.raises(TransferQueueStartError, match="has 1 free CPUs.*need 2"):
            TransferQueuePlane(ray=True)
        assert ray.is_initialized()
    finally:
        ray.shutdown()
