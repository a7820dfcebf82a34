"""Fixtures shared by the test modules."""

import pytest

from echo_ds import log as echo_log
from utils import RecordingLog


@pytest.fixture
def log(monkeypatch):
    """echo_ds's log messages, recorded instead of emitted (and the once-only memory cleared)."""
    fake = RecordingLog()
    monkeypatch.setattr(echo_log, "logger", fake)
    monkeypatch.setattr(echo_log, "_emitted_once", set())
    return fake
