"""The "echo_ds" logger and ``log_once``: a decision or a fallback reported once per process, by rank 0.
It imports neither DeepSpeed nor the transports, so every layer of echo_ds can use it."""

from __future__ import annotations

import logging
import sys
import threading
from typing import Optional

import torch.distributed as dist


def _make_logger() -> logging.Logger:
    """The "echo_ds" logger: INFO to stdout, like DeepSpeed's own, whose default level (WARNING) would
    hide the backend choice and the counters. ``logging.getLogger("echo_ds").setLevel(...)`` tunes it."""
    log = logging.getLogger("echo_ds")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()

_emitted_once = set()
_emitted_lock = threading.Lock()


def log_once(level: str, message: str, key: Optional[str] = None, rank: Optional[int] = None) -> None:
    """Log ``message`` once per process (per ``key``, default the message itself) at ``level``
    ("warning", "info", "debug"), from rank 0 only: ``rank`` when given (a rank within a group), else the
    global rank (every process when torch.distributed is not initialised).

    Every decision logged this way is taken identically on every rank, so rank 0 speaks for all.
    """
    key = message if key is None else key
    with _emitted_lock:
        if key in _emitted_once:
            return
        _emitted_once.add(key)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        getattr(logger, level)(message)
