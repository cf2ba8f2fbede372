"""Fixtures of the Flower layer's tests (records, Messages, strategies and app handlers)."""

from __future__ import annotations

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture
def task_identity(monkeypatch):
    """The identity a Flower process gives itself (run 1, node 0, task 1), so that Messages can
    be built and answered in-process, outside a running ServerApp or ClientApp."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


@pytest.fixture
def trained(monkeypatch):
    """The names of the sites that trained a model."""
    from fedfuse.federation import site as site_module

    names = []
    train = site_module._train

    def recording(settings, data, seed, initial_state, name, clock):
        names.append(name)
        return train(settings, data, seed, initial_state, name, clock)

    monkeypatch.setattr(site_module, "_train", recording)
    return names
