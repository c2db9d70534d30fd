"""The TransferQueue data plane: a step's rollouts as the rows of a TransferQueue partition.

TransferQueue (PyPI ``transferqueue``, imported as ``transfer_queue``; our ``transferqueue``
extra) is the data plane of NeMo-RL's ``grpo_sync`` and of verl: a controller that tracks
rows and their fields, storage units that hold the rows, and clients that reach both over
ZMQ. It starts in one of three ways (``rollout.transferqueue_ray``, ``rollout.transferqueue_ray_address``;
the Ray side is rollout/transferqueue_ray.py):

* Ray, a private instance, the default: ``ray.init(address="local")`` with two logical CPUs (never
  a Ray cluster already running on the machine; a process already in Ray keeps its own), then
  ``transfer_queue.init``, which starts the controller and one storage unit as Ray actors (two
  processes). Each trainer rank has its own plane;
* Ray, a cluster started with ``ray start`` (``transferqueue_ray_address``: ``HOST:PORT`` or
  ``auto``): every rank joins it, rank 0 starts the controller and the storage unit, and the other
  ranks connect to them as clients: one plane for the run, each rank's partitions under its own
  prefix in the controller (``rank1/train/3``; the ``DataPlane`` names stay ``train/3``). The
  cluster is left running at close;
* in-process, no Ray runtime: the controller and the storage unit run as objects in this
  process. TransferQueue has no public API for this. It goes through the undocumented
  ``__ray_metadata__.modified_class`` (the plain class behind each Ray actor class, which
  TransferQueue's own tests use the same way), so a TransferQueue upgrade may break it.

A record is one row per completion, keyed ``c0 .. c{N-1}`` in the partition (prompt ids,
completion ids, the completion's text as UTF-8 bytes, finish reason, reward row, behaviour
log-probs, loss mask, environment reward, step, version), and one row ``record`` holding the
rest pickled: the dataset rows, prompts, stats, timings, the failure, and which optional
fields the rollout has. The ``record`` row is put last, so a reader that sees it sees the
completions. Reads use TransferQueue's key-value calls, which do not consume rows, so
``fetch`` can be repeated; ``clear`` drops the partition.

Traps of TransferQueue 0.1.11 handled here (docs/ASYNC.md, "Data plane"):

* its default config starts two storage units, and Ray then waits forever for a third CPU
  on a two-core machine: one storage unit, and Ray is given two logical CPUs;
* Ray and the ZMQ sockets bind the machine's network address unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before Ray is imported: set here (as a
  default) before the import, so the sockets of a private instance, which carry pickles, listen
  on loopback. On a joined cluster the actors bind their node's address, which the other nodes
  must reach (the cluster's network is the user's to keep private);
* a blocking read of rows not yet put stalls the controller for 5 s: polling mode, and
  ``fetch`` only reads keys the controller lists;
* per-row fields come back as jagged nested tensors: unbound row by row;
* each put and get warns that 8 threads exceed the cores: ``TQ_NUM_THREADS`` defaults to the
  physical core count;
* the in-process controller has no stop: ``close`` ends its ZMQ context, which ends its
  threads (one of them only through the subclass below).
"""

from __future__ import annotations

import functools
import os
import pickle
import threading
from dataclasses import dataclass

import torch

from maxent_grpo.errors import ConfigError
from maxent_grpo.rollout.backend import FINISH_REASONS, RolloutBatch
from maxent_grpo.rollout.data_plane import RolloutRecord
from maxent_grpo.rollout.transferqueue_ray import ONE_PROCESS, Ranks, RayPlane, open_on_ray

MISSING_EXTRA = "rollout.data_plane: transferqueue needs the transferqueue extra: pip install -e '.[transferqueue]'"
HEADER_KEY = "record"


def import_transfer_queue():
    """The ``transfer_queue`` module, imported with this module's environment defaults.

    The defaults must be in the environment before Ray is imported (Ray reads them at import)
    and before Ray starts its processes (which inherit them).
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import psutil

        os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))
        import transfer_queue
    except ImportError as e:
        raise ConfigError(f"{MISSING_EXTRA} ({e})") from e
    return transfer_queue


@dataclass(frozen=True)
class _InProcess:
    """The in-process controller and storage unit."""

    controller: object
    storage: object


class TransferQueuePlane:
    """A ``DataPlane`` on TransferQueue; ``ray=False`` runs it in this process without Ray.

    ``ray_address``: the Ray cluster that the trainer ranks (``ranks``) share one plane on
    (rollout/transferqueue_ray.py); None, a private Ray instance. Each rank's partitions are its own:
    the controller knows ``train/3`` of rank 1 as ``rank1/train/3``.
    """

    def __init__(self, *, ray: bool = True, ray_address: str | None = None, ranks: Ranks = ONE_PROCESS) -> None:
        if ray_address is not None and not ray:
            raise ValueError("a Ray cluster to join (ray_address) needs ray=True")
        tq = import_transfer_queue()
        self._on_ray: RayPlane | None = None
        self._in_process: _InProcess | None = None
        self._prefix = f"rank{ranks.rank}/"
        self._registered: list[str] = []
        self._closed = False
        if ray:
            self._on_ray = open_on_ray(tq, address=ray_address, ranks=ranks)
            self._client, self.listen_ip = self._on_ray.client, self._on_ray.listen_ip
        else:
            # The controller's IP address (the storage unit's is the same): loopback unless Ray was
            # imported before this plane set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER.
            self._client, self.listen_ip = self._start_in_process(tq)

    # -- start and stop ---------------------------------------------------------------------

    def _start_in_process(self, tq):
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        controller = _in_process_controller_class()(sampler=tq.SequentialSampler, polling_mode=True)
        storage_config = {"total_storage_size": None, "num_data_storage_units": 1}
        storage = SimpleStorageUnit.__ray_metadata__.modified_class(config=storage_config)
        self._in_process = _InProcess(controller=controller, storage=storage)
        client = tq.TransferQueueClient(
            client_id=f"maxent_grpo_{os.getpid()}", controller_info=controller.get_zmq_server_info()
        )
        client.initialize_storage_manager(
            manager_type="SimpleStorage",
            config={**storage_config, "zmq_info": {"TransferQueueStorageUnit#0": storage.get_zmq_server_info()}},
        )
        return client, controller.get_zmq_server_info().ip

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._registered.clear()
        if self._on_ray is not None:
            self._on_ray.close()
            return
        self._client.close()
        self._in_process.storage.shutdown()
        _stop_in_process_controller(self._in_process.controller)

    # -- the DataPlane protocol -------------------------------------------------------------

    def register(self, partition: str) -> None:
        self._check_open()
        if partition in self._registered:
            raise ValueError(f"partition {partition!r} is registered already")
        self._registered.append(partition)

    def put(self, partition: str, record: RolloutRecord) -> None:
        self._check_registered(partition)
        if self._header_meta(partition) is not None:
            raise ValueError(f"partition {partition!r} holds a record already")
        columns, header = encode_record(record)
        if columns:
            self._put_rows(partition, [f"c{i}" for i in range(record.rollout.num_completions)], columns)
        self._put_rows(partition, [HEADER_KEY], {HEADER_KEY: _bytes_tensor(pickle.dumps(header)).unsqueeze(0)})

    def fetch(self, partition: str) -> RolloutRecord | None:
        self._check_registered(partition)
        meta = self._header_meta(partition)
        if meta is None:
            return None
        header = pickle.loads(_row_bytes(_rows(self._client.get_data(meta)[HEADER_KEY])[0]))
        columns = {}
        if header["fields"]:
            keys = [f"c{i}" for i in range(header["num_completions"])]
            rows_meta = self._client.kv_retrieve_meta(keys=keys, partition_id=self._id(partition))
            rows_meta = rows_meta.select_fields(header["fields"])
            columns = {name: _rows(value) for name, value in self._client.get_data(rows_meta).items()}
        return decode_record(header, columns)

    def clear(self, partition: str) -> None:
        self._check_open()
        if partition in self._registered:
            self._registered.remove(partition)
        if self._id(partition) in self._client.get_partition_list():
            self._client.clear_partition(self._id(partition))

    def partitions(self) -> list[str]:
        self._check_open()
        return list(self._registered)

    # -- helpers ----------------------------------------------------------------------------

    def _id(self, partition: str) -> str:
        """The partition's name in the controller, which may hold other ranks' partitions too."""
        return self._prefix + partition

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the TransferQueue data plane is closed")

    def _check_registered(self, partition: str) -> None:
        self._check_open()
        if partition not in self._registered:
            raise KeyError(f"partition {partition!r} is not registered")

    def _header_meta(self, partition: str):
        """The ``record`` row's metadata, or None while it is not put.

        Asking for keys of a partition the controller does not know logs a warning in
        TransferQueue, hence the partition list first.
        """
        if self._id(partition) not in self._client.get_partition_list():
            return None
        meta = self._client.kv_retrieve_meta(keys=[HEADER_KEY], partition_id=self._id(partition))
        # The key exists from just before its data is put: wait for both.
        if meta.size == 0 or HEADER_KEY not in meta.field_names or not meta.is_ready:
            return None
        return meta.select_fields([HEADER_KEY])

    def _put_rows(self, partition: str, keys: list[str], columns: dict[str, torch.Tensor]) -> None:
        from tensordict import TensorDict

        meta = self._client.kv_retrieve_meta(keys=keys, partition_id=self._id(partition), create=True)
        self._client.put(TensorDict(columns, batch_size=len(keys)), meta)


# -- the record as columns --------------------------------------------------------------------


def encode_record(record: RolloutRecord) -> tuple[dict[str, torch.Tensor], dict]:
    """The completions as columns (one entry per completion, ragged ones as jagged tensors), and
    the header: everything else, as plain Python to pickle."""
    header = {
        "step": record.step, "version": record.version, "rows": record.rows, "stats": record.stats,
        "timings": record.timings, "failure": record.failure, "extra_columns": record.extra_columns, "fields": [],
    }
    batch = record.rollout
    if batch is None:
        header["rewards"] = record.rewards
        return {}, header
    n, g = batch.num_completions, batch.num_generations
    columns = {
        "prompt_ids": _jagged([batch.prompt_ids[i // g] for i in range(n)], torch.int64),
        "completion_ids": _jagged(batch.completion_ids, torch.int64),
        "completion_text": torch.nested.nested_tensor(
            [_bytes_tensor(t.encode("utf-8", "surrogatepass")) for t in batch.completion_texts], layout=torch.jagged
        ),
        "finish_reason": torch.tensor([FINISH_REASONS.index(r) for r in batch.finish_reasons], dtype=torch.int8),
        "rewards": record.rewards.detach().cpu(),
        "step": torch.full((n,), record.step, dtype=torch.int64),
        "version": torch.full((n,), record.version, dtype=torch.int64),
    }
    if batch.behaviour_logps is not None:
        columns["behaviour_logps"] = _jagged(batch.behaviour_logps, torch.float64)
    if batch.loss_masks is not None:
        columns["loss_mask"] = _jagged(batch.loss_masks, torch.int8)
    if batch.env_rewards is not None:
        columns["env_reward"] = torch.tensor([0.0 if r is None else r for r in batch.env_rewards], dtype=torch.float64)
        columns["env_reward_given"] = torch.tensor([r is not None for r in batch.env_rewards])
    header.update(
        prompts=batch.prompts, num_generations=g, num_completions=n, fields=sorted(columns),
        rewards_device=str(record.rewards.device),
    )
    return columns, header


def decode_record(header: dict, columns: dict[str, list[torch.Tensor]]) -> RolloutRecord:
    """The inverse of ``encode_record``; ``columns`` hold one tensor per completion."""
    common = dict(
        step=header["step"], version=header["version"], rows=header["rows"], stats=header["stats"],
        timings=header["timings"], failure=header["failure"], extra_columns=header["extra_columns"],
    )
    if not header["fields"]:
        return RolloutRecord(rollout=None, rewards=header["rewards"], **common)
    g = header["num_generations"]
    prompt_ids = columns["prompt_ids"][::g]
    given = columns.get("env_reward_given")
    batch = RolloutBatch(
        prompts=header["prompts"],
        prompt_ids=[t.tolist() for t in prompt_ids],
        completion_ids=[t.tolist() for t in columns["completion_ids"]],
        completion_texts=[_row_bytes(t).decode("utf-8", "surrogatepass") for t in columns["completion_text"]],
        finish_reasons=[FINISH_REASONS[int(t)] for t in columns["finish_reason"]],
        behaviour_logps=[t.tolist() for t in columns["behaviour_logps"]] if "behaviour_logps" in columns else None,
        num_generations=g,
        loss_masks=[t.tolist() for t in columns["loss_mask"]] if "loss_mask" in columns else None,
        env_rewards=None if given is None else [
            float(r) if bool(ok) else None for r, ok in zip(columns["env_reward"], given)
        ],
    )
    rewards = torch.stack(columns["rewards"]).to(header["rewards_device"])
    return RolloutRecord(rollout=batch, rewards=rewards, **common)


def _jagged(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _row_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _rows(value: torch.Tensor) -> list[torch.Tensor]:
    """One tensor per row: TransferQueue returns a field with per-row tensors as a jagged
    nested tensor (even when the rows have one length) and per-row scalars as a dense one."""
    return list(value.unbind())


# -- the in-process controller ----------------------------------------------------------------


@functools.cache
def _in_process_controller_class():
    """TransferQueue's controller as a plain class whose handshake thread ends with its context.

    Undocumented: ``__ray_metadata__.modified_class`` is the class behind the Ray actor. The
    handshake loop has no exit; ending the ZMQ context makes its poll raise, which without this
    override would end the thread with a traceback.
    """
    import zmq
    from transfer_queue.controller import TransferQueueController

    class InProcessController(TransferQueueController.__ray_metadata__.modified_class):
        def _wait_connection(self):
            try:
                super()._wait_connection()
            except zmq.ContextTerminated:
                return

    return InProcessController


def _stop_in_process_controller(controller) -> None:
    """End the controller's two threads and close its sockets (it has no stop of its own).

    ``term`` wakes every blocking call on the context with ContextTerminated (which ends both
    threads) and returns once the sockets are closed, which must happen after the threads,
    the sockets' only users, have ended.
    """
    terminating = threading.Thread(target=controller.zmq_context.term, name="tq-controller-term", daemon=True)
    terminating.start()
    controller.process_request_thread.join()
    controller.wait_connection_thread.join()
    controller.handshake_socket.close(linger=0)
    controller.request_handle_socket.close(linger=0)
    terminating.join()
