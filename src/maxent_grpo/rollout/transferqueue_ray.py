"""TransferQueue's controller and storage unit as Ray actors: on a private Ray instance, or on a Ray
cluster that every trainer rank joins (``rollout.transferqueue_ray_address``).

* No address: this process starts a Ray instance of its own (``ray.init(address="local")``: a
  cluster already running on the machine is never joined by accident, as ``ray.init()`` without
  an address would), starts the controller and the storage unit on it, and stops it all at close.
  Each trainer rank has its own.
* An address (``HOST:PORT`` or ``auto``): every rank joins that cluster (``ray.init(address=...)``);
  rank 0 starts the controller and one storage unit, the ranks agree (a collective), then the other
  ranks connect to that controller as clients. One plane holds every rank's partitions. At close a
  client rank closes its client; rank 0 stops the storage unit and kills the controller; every rank
  disconnects from the cluster, which is left running.

A client rank builds its client from the controller's stored config, as ``transfer_queue.init``
does when it finds a controller, but without ``init``: ``transfer_queue.close`` kills the
controller it found (TransferQueue 0.1.11, interface.py), which would end the plane under rank 0.

A process that is in Ray already (its own ``ray.init``) keeps its cluster: neither joined nor left here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from maxent_grpo.errors import UserError

log = logging.getLogger("maxent_grpo")

# The controller and the storage unit each ask Ray for one CPU.
RAY_CPUS = 2
# Ray's object store is not used (rows travel over TransferQueue's own sockets); its floor is 75 MiB.
RAY_OBJECT_STORE_BYTES = 128 * 2**20
CONTROLLER, NAMESPACE = "TransferQueueController", "transfer_queue"  # where transfer_queue.init puts it
# Ray's default for clusters started with `ray start` or ray.init (Ray >= 2.60); joining an address
# turns it on only when RAY_AUTH_MODE says so.
AUTH_HINT = ("the cluster asks for a token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (the head node's "
             "~/.ray/auth_token) in every trainer process's environment")


class TransferQueueStartError(UserError):
    """TransferQueue could not be started; the message says what to change."""


@dataclass(frozen=True)
class Ranks:
    """The trainer processes that open one plane together on a joined cluster: this one's ``rank`` of
    ``world_size``, and ``gather``, every rank's list concatenated in rank order, on every rank (a
    collective: every rank calls it, in the same order, from its main thread)."""

    rank: int = 0
    world_size: int = 1
    gather: Callable[[list], list] = field(default=list, compare=False)


ONE_PROCESS = Ranks()


@dataclass
class RayPlane:
    """What this process holds of TransferQueue on Ray, and what it closes."""

    client: object = None
    listen_ip: str = ""  # the controller's address (the storage unit's is its node's)
    started_controller: bool = False  # rank 0 (or the only process): transfer_queue.init
    joined_ray: bool = False  # this process called ray.init, and leaves Ray at close

    def close(self) -> None:
        """Rank 0's close ends the storage unit and the controller; a client's, its client; then this
        process leaves Ray (which stops a private instance, and only disconnects from a cluster)."""
        import ray

        if self.started_controller:
            import transfer_queue as tq

            tq.close()  # closes the client, stops the storage actor and kills the controller
            self.started_controller = False
        elif self.client is not None:
            self.client.close()
        self.client = None
        if self.joined_ray:
            ray.shutdown()
            self.joined_ray = False


def open_on_ray(tq, *, address: str | None, ranks: Ranks = ONE_PROCESS) -> RayPlane:
    """Start TransferQueue on a private Ray instance (``address`` None: ``ranks`` is ignored, each
    process has its own), or on the cluster at ``address``, one plane for all ``ranks``. Every rank
    raises the same refusal when any rank failed, after closing what it had opened.

    Each rank logs a line saying where the plane is and what this rank did; rank 0 logs every rank's
    (under the CLI the other ranks log errors only: cli.py)."""
    import ray

    if address is None:
        ranks = ONE_PROCESS
    held = RayPlane()
    problem = None
    try:
        held.joined_ray = _join(ray, address)
        if ranks.rank == 0:
            _start_controller(tq, ray, held, address)
    except TransferQueueStartError as err:
        problem = str(err)
    _agree(ranks, problem, held)
    if ranks.rank != 0:
        try:
            _connect(tq, ray, held, ranks.rank, address)
        except TransferQueueStartError as err:
            problem = str(err)
    line = None if problem is not None else _start_line(ray, address, ranks, held)
    lines = _agree(ranks, problem, held, line)
    for said in lines if ranks.rank == 0 else [line]:
        log.info("%s", said)
    return held


def _agree(ranks: Ranks, problem: str | None, held: RayPlane, line: str | None = None) -> list[str | None]:
    """Every rank's problem (and ``line``), gathered: when any rank has a problem, each closes what it
    holds and raises the first; else every rank's line, in rank order."""
    said = ranks.gather([(problem, line)])
    failed = [(rank, p) for rank, (p, _) in enumerate(said) if p is not None]
    if not failed:
        return [ln for _, ln in said]
    held.close()
    rank, first = failed[0]
    raise TransferQueueStartError(first if rank == ranks.rank else f"rank {rank} of {ranks.world_size}: {first}")


def _join(ray, address: str | None) -> bool:
    """Enter Ray (a private instance, or the cluster at ``address``); False when this process is in
    Ray already (its cluster is used as it is)."""
    if ray.is_initialized():
        return False
    if address is None:
        # address="local": a new instance even when a cluster runs on this machine.
        options = dict(address="local", num_cpus=RAY_CPUS, include_dashboard=False,
                       object_store_memory=RAY_OBJECT_STORE_BYTES, configure_logging=False)
    else:
        options = dict(address=address, configure_logging=False)  # resources are the cluster's own
    try:
        ray.init(**options)
    except (RuntimeError, ConnectionError, OSError, ValueError) as e:
        if address is None:
            raise TransferQueueStartError(
                f"rollout.data_plane: Ray did not start for TransferQueue ({type(e).__name__}: {e}); "
                "set rollout.transferqueue_ray: false to run it in this process"
            ) from e
        # Ray keeps the GCS client's last error as a traceback's text only, under the ConnectionError.
        hint = f"; {AUTH_HINT}" if "AuthenticationError" in str(e.__cause__) else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TransferQueueStartError(
            f"rollout.transferqueue_ray_address: could not join the Ray cluster at {address} "
            f"({type(e).__name__}: {first}){hint}"
        ) from e
    return True


def _start_controller(tq, ray, held: RayPlane, address: str | None) -> None:
    """The controller and one storage unit, refused when a controller runs in the cluster already
    (another plane's, which close() would kill) or when they could not get their CPUs."""
    cluster = "the Ray cluster this process joined" if address is None else f"the Ray cluster at {address}"
    try:
        ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        pass  # none running: ours will be the only one, and close() may kill it
    else:
        raise TransferQueueStartError(
            f"rollout.data_plane: a TransferQueue controller already runs in {cluster} (another plane is "
            "open); close it first, or set rollout.transferqueue_ray: false"
        )
    free = ray.available_resources().get("CPU", 0.0)
    if free < RAY_CPUS:
        raise TransferQueueStartError(
            f"rollout.data_plane: {cluster} has {free:g} free CPUs; TransferQueue's controller and storage "
            f"unit need {RAY_CPUS} (or set rollout.transferqueue_ray: false)"
        )
    config = {"controller": {"polling_mode": True}, "backend": {"SimpleStorage": {"num_data_storage_units": 1}}}
    try:
        conf = tq.init(config)
    except (RuntimeError, ValueError, ray.exceptions.RayError) as e:
        tq.close()  # what init started before it failed: on a cluster a named controller would outlive the run
        raise TransferQueueStartError(
            f"rollout.data_plane: TransferQueue did not start on Ray ({type(e).__name__}: {e})"
        ) from e
    held.started_controller = True
    held.client, held.listen_ip = tq.get_client(), conf.controller.zmq_info.ip


def _connect(tq, ray, held: RayPlane, rank: int, address: str) -> None:
    """A client of the controller rank 0 started (its config, stored on the controller, names the
    sockets of the controller and of the storage unit)."""
    try:
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        conf = ray.get(controller.get_config.remote(), timeout=120)
    except (ValueError, ray.exceptions.RayError) as e:
        raise TransferQueueStartError(
            f"rollout.transferqueue_ray_address: rank {rank} found no TransferQueue controller in the Ray cluster "
            f"at {address} after rank 0 started one ({type(e).__name__}: {e})"
        ) from e
    backend = conf.backend.storage_backend
    held.client = tq.TransferQueueClient(
        client_id=f"maxent_grpo_rank{rank}_{os.getpid()}", controller_info=conf.controller.zmq_info
    )
    held.client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    held.listen_ip = conf.controller.zmq_info.ip


def _start_line(ray, address: str | None, ranks: Ranks, held: RayPlane) -> str:
    """Where the plane is (the cluster, its nodes and CPUs), and what this rank did there."""
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    cpus = ray.cluster_resources().get("CPU", 0.0)
    where = ray.get_runtime_context().gcs_address
    if address is None:
        cluster = f"a private Ray instance at {where}" if held.joined_ray else f"the Ray cluster at {where}"
        role = "this process started its controller and storage unit"
    else:
        cluster = f"the Ray cluster at {where} (rollout.transferqueue_ray_address {address})"
        role = (f"rank {ranks.rank} started its controller and storage unit" if held.started_controller
                else f"rank {ranks.rank} connected to the controller rank 0 started")
    return (f"rollout.data_plane: TransferQueue on {cluster}, {nodes} node{'' if nodes == 1 else 's'}, "
            f"{cpus:g} CPUs; {role}")
