"""Simulations on a Ray cluster that is already running.

Flower's simulation engine calls ``ray.init()`` without an address, so Ray's own rules pick the
cluster: ``RAY_ADDRESS`` when set, else the cluster that ``ray start`` last recorded on this
machine, else a new Ray instance on this machine. fedfuse makes that choice explicit. A run
given a cluster address (``--ray-address``, or ``RAY_ADDRESS`` in the environment) joins that
cluster, after checking that it answers and that a site fits on one of its nodes. A run given
none starts its own Ray (``RAY_ADDRESS=local``), so it never joins, by accident, a cluster that
someone else started on the machine.

Each simulated site records the Ray node it ran on (:func:`site_ray_node`); ``results.json``
lists it per site, which shows how the sites spread over the cluster.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: Ray's address for "start a new local instance"
LOCAL = "local"

#: run in a child process: join the cluster, print its live nodes as JSON, leave
_LIST_NODES = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = [
    {"node_id": n["NodeID"], "address": n.get("NodeManagerAddress", ""),
     "cpus": n["Resources"].get("CPU", 0.0), "gpus": n["Resources"].get("GPU", 0.0)}
    for n in ray.nodes() if n.get("Alive")
]
ray.shutdown()
print("FEDFUSE-NODES " + json.dumps(nodes))
"""


class RayClusterError(ValueError):
    """The Ray cluster cannot run the simulation: it does not answer, or no node fits a site."""


@dataclass(frozen=True)
class RayNode:
    """One live node of the cluster and the resources it offers."""

    node_id: str
    address: str
    cpus: float
    gpus: float

    def site_slots(self, cpus_per_site: float, gpus_per_site: float) -> int:
        """How many sites this node runs at once (Flower starts one actor per slot)."""
        slots = math.floor(self.cpus / cpus_per_site + 1e-9)
        if gpus_per_site > 0:
            slots = min(slots, math.floor(self.gpus / gpus_per_site + 1e-9))
        return max(slots, 0)


@dataclass(frozen=True)
class RayCluster:
    """A running cluster: its address and its live nodes."""

    address: str
    nodes: tuple[RayNode, ...]

    def site_slots(self, cpus_per_site: float, gpus_per_site: float) -> int:
        """Sites the whole cluster runs at once."""
        return sum(node.site_slots(cpus_per_site, gpus_per_site) for node in self.nodes)

    def check_sites(self, cpus_per_site: float, gpus_per_site: float) -> int:
        """The sites that run at once; RayClusterError when no node can hold one site."""
        slots = self.site_slots(cpus_per_site, gpus_per_site)
        if slots == 0:
            offered = ", ".join(f"{n.cpus:g} CPU/{n.gpus:g} GPU" for n in self.nodes) or "none"
            raise RayClusterError(
                f"no node of the Ray cluster at {self.address} can run a site of "
                f"{cpus_per_site:g} CPU and {gpus_per_site:g} GPU (nodes offer {offered}); "
                "lower --cpus-per-client/--gpus-per-client or add resources to a node"
            )
        return slots

    def describe(self) -> str:
        cpus = sum(n.cpus for n in self.nodes)
        gpus = sum(n.gpus for n in self.nodes)
        return f"{len(self.nodes)} node(s), {cpus:g} CPU, {gpus:g} GPU"


def requested_address(given: str | None = None) -> str | None:
    """The cluster a run should join: ``given``, else ``RAY_ADDRESS``; None for a run that
    starts its own Ray (neither set, or ``local``)."""
    address = (given if given is not None else os.environ.get("RAY_ADDRESS", "")).strip()
    return None if address in ("", LOCAL) else address


def connect(address: str, timeout: float = 60.0) -> RayCluster:
    """Join the cluster at ``address`` (``host:port`` of its head, as ``ray start --head``
    prints it, or ``auto``) from a child process and list its live nodes.

    RayClusterError, naming the address, when nothing answers there: a missing cluster would
    otherwise surface as a Flower simulation that fails to start, with Ray's reason deep in
    the SuperLink's log.
    """
    if address.startswith("ray://"):
        raise RayClusterError(
            f"{address}: give the head's GCS address host:port (what `ray start --head` prints),"
            " not a Ray Client address; Flower's simulation runs as a driver on the cluster"
        )
    if address != "auto":
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise RayClusterError(f"Ray address {address!r} is not host:port")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as error:
            raise RayClusterError(
                f"no Ray cluster answers at {address} ({error.strerror or error}); start one "
                "with `ray start --head --port 6379` (docs/cluster.md) or drop --ray-address"
            ) from None
    try:
        listed = subprocess.run(
            [sys.executable, "-c", _LIST_NODES, address],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
    except subprocess.TimeoutExpired:
        raise RayClusterError(
            f"the Ray cluster at {address} did not answer in {timeout:g} s"
        ) from None
    marker = next((ln for ln in listed.stdout.splitlines() if ln.startswith("FEDFUSE-NODES ")), "")
    if listed.returncode != 0 or not marker:
        reason = (listed.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise RayClusterError(f"could not join the Ray cluster at {address}: {reason}")
    nodes = tuple(RayNode(**node) for node in json.loads(marker.split(" ", 1)[1]))
    return RayCluster(address, nodes)


def ray_environment(
    address: str | None, cpus_per_site: float, gpus_per_site: float
) -> tuple[dict[str, str], int | None]:
    """The environment that points Flower's simulation at its Ray (``RAY_ADDRESS``) and the
    number of sites that run at once on the cluster (None: a local Ray, sized by this
    machine)."""
    if address is None:
        return {"RAY_ADDRESS": LOCAL}, None
    cluster = connect(address)
    slots = cluster.check_sites(cpus_per_site, gpus_per_site)
    log.info(
        "joining the Ray cluster at %s: %s; %d site(s) at a time",
        address,
        cluster.describe(),
        slots,
    )
    return {"RAY_ADDRESS": address}, slots


def site_ray_node() -> str:
    """The id of the Ray node this code runs on, "" outside Ray (a deployed SuperNode)."""
    ray = sys.modules.get("ray")  # never import Ray where Flower did not
    if ray is None:
        return ""
    try:
        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - a site's report must not fail over where it ran
        return ""
