"""One TransferQueue plane shared by the trainer ranks of a joined Ray cluster (rollout/transferqueue_ray.py),
seen from one process: this process is in Ray already (a private instance the test starts, which the planes
use as they would a joined cluster), plane 0 plays rank 0 and plane 1 plays rank 1; the collective is a
function that hands back what the other rank would have said. tests/training/test_ray_cluster.py runs the
real thing: two nodes, two torchrun agents."""

from __future__ import annotations

import pytest

from maxent_grpo.rollout.transferqueue_plane import TransferQueuePlane, import_transfer_queue
from maxent_grpo.rollout.transferqueue_ray import CONTROLLER, NAMESPACE, Ranks, TransferQueueStartError

from test_data_plane import assert_same_record, multi_turn_record, needs_transferqueue, plain_record

pytestmark = pytest.mark.slow


def _rank(rank: int, others: list) -> Ranks:
    """Rank ``rank`` of two; ``others[i]``: the other rank's problem (None: none) at the i-th agreement."""
    answers = iter(others)

    def gather(mine: list) -> list:
        problem = next(answers)
        theirs = (problem, None if problem is not None else f"rank {1 - rank}'s line")
        return [*mine, theirs] if rank == 0 else [theirs, *mine]

    return Ranks(rank=rank, world_size=2, gather=gather)


@pytest.fixture
def ray_instance():
    """A private Ray instance this process is in (test_data_plane's module plane, which has one of its own,
    is closed when that module ends)."""
    needs_transferqueue()
    import_transfer_queue()  # its defaults before Ray's import
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             configure_logging=False)
    yield ray
    ray.shutdown()


def test_two_ranks_share_one_controller_each_in_its_own_partitions(ray_instance, caplog):
    ray = ray_instance
    with caplog.at_level("INFO", logger="maxent_grpo"):
        first = TransferQueuePlane(ray_address="auto", ranks=_rank(0, [None, None]))
        second = TransferQueuePlane(ray_address="auto", ranks=_rank(1, [None, None]))
    # Rank 0 logs every rank's line (here its own and the stand-in's), rank 1 its own.
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-3:-1] == [lines[-3], "rank 1's line"] and "1 node, 2 CPUs" in lines[-3], lines
    assert lines[-3].startswith("rollout.data_plane: TransferQueue on the Ray cluster at ")
    assert lines[-3].endswith("rank 0 started its controller and storage unit")
    assert lines[-1].endswith("rank 1 connected to the controller rank 0 started")
    try:
        mine, theirs = multi_turn_record(step=3), plain_record(step=3)
        for plane, record in ((first, mine), (second, theirs)):
            plane.register("train/3")  # the same protocol name on both ranks
            plane.put("train/3", record)
        assert_same_record(first.fetch("train/3"), mine)
        assert_same_record(second.fetch("train/3"), theirs)
        assert sorted(first._client.get_partition_list()) == ["rank0/train/3", "rank1/train/3"]
        second.clear("train/3")
        assert first._client.get_partition_list() == ["rank0/train/3"]
        second.close()  # a client's close: the controller and rank 0's rows stay
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        assert_same_record(first.fetch("train/3"), mine)
    finally:
        second.close()
        first.close()
    with pytest.raises(ValueError):  # rank 0's close killed what it started
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    assert ray.is_initialized()  # a process in Ray already stays there


def test_a_rank_that_failed_to_start_stops_every_rank_with_its_line(ray_instance):
    """Rank 0 refuses (a controller of another plane runs in the cluster); rank 1 raises rank 0's refusal,
    named, and rank 0's refusal leaves the other plane's controller alive."""
    ray = ray_instance
    other = TransferQueuePlane(ray_address="auto", ranks=_rank(0, [None, None]))
    try:
        with pytest.raises(TransferQueueStartError, match="already runs"):
            TransferQueuePlane(ray_address="auto", ranks=_rank(0, [None]))
        line = "rollout.data_plane: a TransferQueue controller already runs in the Ray cluster at auto"
        with pytest.raises(TransferQueueStartError) as refused:
            TransferQueuePlane(ray_address="auto", ranks=_rank(1, [line]))
        assert str(refused.value).startswith(f"rank 0 of 2: {line}")
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    finally:
        other.close()
