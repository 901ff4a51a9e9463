"""Ray and the replicas: start (or join) a Ray cluster, deploy one Ray Serve application per replica slot, and
stop them again. Blocking calls: the front runs them in a worker thread.

One deployment per slot (rather than one deployment of N replicas) gives each replica a stable identity that
the front's router and /health can name; Ray Serve still places each one on a node with room, health-checks
it and replaces it when its process dies.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve
from ray.serve.api import RunTarget

from engine.checkpoint.source import open_checkpoint
from engine.config import SluiceConfig
from engine.models.chat_templates import read_chat_template
from web.cluster.replica import EngineReplica

logger = logging.getLogger("sluice.cluster")
APP_PREFIX = "sluice-replica-"
LOCAL_START_ATTEMPTS = 3


def replica_config(config: SluiceConfig, num_cpus: int) -> SluiceConfig:
    """Each replica's engine: num_threads = 0 means the local CPUs shared out between the replicas."""
    threads = config.engine.num_threads or max(1, num_cpus // config.cluster.replicas)
    return replace(config, engine=replace(config.engine, num_threads=threads))


@dataclass
class LaunchedCluster:
    handles: list[Any]
    started_ray: bool  # a local cluster this process started, and must stop

    def raise_if_failed(self) -> None:
        """A replica that cannot start (a bad model path, say) fails the start with its own message."""
        status = serve.status().applications
        for i in range(len(self.handles)):
            app = status.get(f"{APP_PREFIX}{i}")
            if app is not None and app.status == "DEPLOY_FAILED":
                # a refusal of the model or a setting (the loader's ValueError) in its own words, one line
                messages = [app.message, *(d.message for d in app.deployments.values())]
                lines = [line.strip() for m in messages for line in (m or "").splitlines()]
                refusal = next((line for line in lines if line.startswith("ValueError: ")), None)
                if refusal is not None:
                    raise ValueError(f"replica {i}: {refusal.removeprefix('ValueError: ')}")
                raise RuntimeError(f"replica {i} failed to start: {app.message}")

    def shutdown(self) -> None:
        try:
            serve.shutdown()
        finally:
            if self.started_ray:
                ray.shutdown()


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """ValueError unless something listens at a host:port address ("auto" and ray:// are Ray's to resolve). Against
    an address where nothing listens, ray.init retries for minutes in native code that holds the GIL: the server
    would answer nothing, not even /health, and take no signal."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise ValueError(f"ray_address {address!r}: nothing answers there ({error}); start Ray on that machine first "
                         f"(`ray start --head`), or leave ray_address empty for a local cluster") from None


@contextmanager
def in_process_groups_of_their_own() -> Iterator[None]:
    """Ray's processes started meanwhile (a local cluster's GCS, raylet and their helpers) each lead a process group
    of their own. In the server's group, a signal to the group (Ctrl-C, a closed terminal, `kill -TERM -PGID`, a
    supervisor stopping a process group) reached them with the front: they died under the drain, and the front
    waited 30 s on Serve's controller, then exited 1 for want of its GCS. Now the front alone gets it, drains the
    replicas and stops Ray. Ray has no setting for this: its launcher (`ConsolePopen`) is wrapped meanwhile; a Ray
    without that launcher starts them as before. (Ray's workers, the replicas, lead their own groups already.)"""
    from ray._private import services

    launcher = getattr(services, "ConsolePopen", None)
    if launcher is None:
        yield
        return

    class InGroupOfItsOwn(launcher):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = InGroupOfItsOwn
    try:
        yield
    finally:
        services.ConsolePopen = launcher


def start_local_ray() -> None:
    """No dashboard, the node known to Ray as 127.0.0.1, the CPUs of this machine, Ray's processes out of the
    server's process group. Ray's own servers (GCS, raylet, workers) still listen on every interface: Ray has no
    setting to bind them to one (the README says to firewall them). Ray gives its raylet 30 s (fixed) to register;
    on a machine busy enough to miss that, the start is tried again."""
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with in_process_groups_of_their_own():
                ray.init(
                    num_cpus=os.cpu_count() or 1,
                    include_dashboard=False,
                    _node_ip_address="127.0.0.1",
                    logging_level=logging.WARNING,
                )
            return
        except Exception as error:  # Ray raises a bare Exception for "timed out during startup"
            ray.shutdown()
            if attempt == LOCAL_START_ATTEMPTS or "timed out during startup" not in str(error):
                raise
            logger.warning("Ray's local start timed out (attempt %d of %d): trying again", attempt,
                           LOCAL_START_ATTEMPTS)  # fmt: skip


def launch_replicas(config: SluiceConfig, on_ray_started: Callable[[], None] | None = None) -> LaunchedCluster:
    """on_ray_started: called once ray.init returns, before the seconds Serve takes to start (ray.init installs a
    native SIGTERM handler that the server takes back)."""
    cluster = config.cluster
    started_ray = False
    if not cluster.ray_address:  # the replicas will run here: a file they would refuse is said before Ray starts
        open_checkpoint(config.engine.model, config.engine.cache_path)  # its header only: ~20 ms
        if config.engine.chat_template:
            read_chat_template(config.engine.chat_template)
    if not ray.is_initialized():
        if cluster.ray_address:
            check_reachable(cluster.ray_address)
            try:
                ray.init(address=cluster.ray_address, logging_level=logging.WARNING)
            except (ConnectionError, ValueError) as error:  # "auto" with no Ray running, a malformed address
                raise ValueError(f"ray_address {cluster.ray_address!r}: {error}") from None
        else:
            start_local_ray()
            started_ray = True
    if on_ray_started is not None:
        on_ray_started()
    # said once the server's signal handlers are back in front of ray.init's: a SIGTERM from here on drains
    logger.info("Ray is up: starting Serve and %d replicas", cluster.replicas)
    num_cpus = int(ray.available_resources().get("CPU", 1)) if cluster.ray_address else (os.cpu_count() or 1)
    engine_config = replica_config(config, num_cpus)
    serve.start(proxy_location="Disabled", logging_config={"enable_access_log": False, "log_level": "WARNING"})
    # A replica asks Ray for the CPUs it computes on; a share when there are more replicas than CPUs, so that
    # e.g. 4 replicas of 1 thread still fit on a 2-CPU test machine.
    actor_cpus = min(float(engine_config.engine.num_threads), max(num_cpus / cluster.replicas, 0.01))
    targets = [
        RunTarget(
            EngineReplica.options(name=f"{APP_PREFIX}{i}", ray_actor_options={"num_cpus": actor_cpus}).bind(
                engine_config, i
            ),
            name=f"{APP_PREFIX}{i}",
            route_prefix=None,
        )
        for i in range(cluster.replicas)
    ]
    handles = serve.run_many(targets, wait_for_applications_running=False)
    logger.info("deployed %d replicas (%d threads, %.2f CPUs each)", cluster.replicas,
                engine_config.engine.num_threads, actor_cpus)  # fmt: skip
    return LaunchedCluster(handles, started_ray)
