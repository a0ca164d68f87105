"""Real aggregated workers for the tests that need a whole gateway path in this process (tests.e2e.inprocess)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.inprocess import RealWorkers


@pytest.fixture(scope="session")
def real_workers(default_model, tmp_path_factory) -> Iterator[RealWorkers]:
    """Worker processes on the default model, started on first use, shared by the session's modules."""
    workers = RealWorkers(default_model, tmp_path_factory.mktemp("worker-logs"))
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def aggregated_worker(real_workers) -> str:
    """The address of one real aggregated worker."""
    return real_workers.addresses(1)[0]
