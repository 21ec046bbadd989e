"""Shared test set-up: where the repository and ../shared are, the tiny datasets, one etcd."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# CI clones the repository with shared/ beside it; PARCAE_SHARED points elsewhere.
SHARED = Path(os.environ.get("PARCAE_SHARED", REPO.parent / "shared"))
TRACES = SHARED / "traces"
ANCHORS = SHARED / "anchors" / "parcae"


@pytest.fixture(scope="session")
def tiny_data() -> dict[str, str]:
    """The corpus, vocabularies and indexed datasets of configs/*-tiny.yaml, built once."""
    from megatron_parcae.data.corpus import prepare_tiny_datasets

    return prepare_tiny_datasets(REPO / "data")


@pytest.fixture(scope="session")
def etcd_server():
    """One real etcd server for the whole session."""
    from megatron_parcae.etcd import EtcdServer

    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture
def client(etcd_server):
    from megatron_parcae.etcd import EtcdClient

    with EtcdClient(etcd_server.endpoint, timeout=3) as c:
        yield c
