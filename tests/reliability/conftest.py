"""Every case of the fault table is bounded in time: a case still running after ``CASE_LIMIT_S`` fails with a
``TimeoutError`` instead of hanging the suite (SIGALRM in the test's own thread; no plugin needed). Remote
waits inside a case have their own, shorter timeouts (the engine's ``timeout_s``)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

CASE_LIMIT_S = 300


def _too_long(signum: int, frame: object) -> None:
    raise TimeoutError(f"this fault-table case ran past {CASE_LIMIT_S}s: something hangs")


@pytest.fixture(autouse=True)
def bounded_in_time() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(CASE_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
