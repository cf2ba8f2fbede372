"""Choosing and checking the Ray cluster of a simulation (the real two-node cluster run is in
tests/e2e/test_ray_cluster.py)."""

from __future__ import annotations

import pytest

from fedfuse.cli.simulate import simulation_run_config
from fedfuse.federation.ray_cluster import (
    RayCluster,
    RayClusterError,
    RayNode,
    connect,
    ray_environment,
    requested_address,
    site_ray_node,
)
from tests.helpers import free_port


def test_the_address_given_wins_over_ray_address_and_local_means_none(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert requested_address(None) == "10.0.0.1:6379"
    assert requested_address("10.0.0.2:6379") == "10.0.0.2:6379"
    assert requested_address("local") is None
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert requested_address(None) is None


def test_without_a_cluster_a_run_starts_its_own_ray_never_a_stray_one():
    # RAY_ADDRESS=local stops Ray from joining a cluster that `ray start` recorded on the machine
    assert ray_environment(None, 1, 0.0) == ({"RAY_ADDRESS": "local"}, None)


def test_site_slots_count_cpus_and_gpus_per_node():
    cluster = RayCluster("h:1", (RayNode("a", "10.0.0.1", 16, 1), RayNode("b", "10.0.0.2", 8, 0)))
    assert cluster.site_slots(1, 0) == 24
    assert cluster.site_slots(4, 0) == 6
    assert cluster.site_slots(1, 0.25) == 4  # only node a has a GPU: four quarter-GPU sites
    assert cluster.check_sites(2, 0) == 12
    with pytest.raises(RayClusterError, match="can run a site of 1 CPU and 2 GPU"):
        cluster.check_sites(1, 2)
    with pytest.raises(RayClusterError, match="nodes offer 16 CPU/1 GPU, 8 CPU/0 GPU"):
        cluster.check_sites(32, 0)


def test_a_cluster_address_that_cannot_work_is_refused_by_name():
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(RayClusterError, match=f"no Ray cluster answers at {closed}"):
        connect(closed)
    with pytest.raises(RayClusterError, match="not a Ray Client address"):
        connect("ray://head:10001")
    with pytest.raises(RayClusterError, match="is not host:port"):
        connect("head-without-port")


def test_outside_ray_a_site_names_no_ray_node():
    assert site_ray_node() == ""


def test_sites_in_flight_follow_the_cluster_size():
    config = simulation_run_config("", None, 100, 1, workers=6)
    assert config["max-in-flight"] == 24  # four messages per site slot of the cluster
