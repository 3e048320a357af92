"""Fixtures of the conformance suite: `backend` runs each test on every backend that can run."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.conformance._support import BACKEND_NAMES, make_transport
from tests.markers import backend_unavailable_reason, requires_rdma_device
from weight_transfer.backends.base import Transport

_MARKS = {"ibverbs": [requires_rdma_device]}


@pytest.fixture(
    params=[pytest.param(name, id=name, marks=_MARKS.get(name, [])) for name in BACKEND_NAMES]
)
def backend(request: pytest.FixtureRequest) -> str:
    """A backend name; skipped, with the reason, where the backend cannot run on this host."""
    name: str = request.param
    reason = backend_unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return name


@pytest.fixture
def transports(backend: str) -> Iterator[Callable[[], Transport]]:
    """A factory of transports of `backend`; every one is closed after the test."""
    made: list[Transport] = []

    def make() -> Transport:
        transport = make_transport(backend)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.close()
