"""How a rank that ``torchrun`` started leaves once its job has returned.

Why: ``torchrun`` fails the whole job when any rank exits non-zero, also after that rank's work
is done. A rank's interpreter finalization can abort in torch's C++ destructors: seen on a
loaded 2-core machine (``tests/test_graph_trainer.py``, 2026-12-01), where both ranks of
torchtitan's trainer logged "Training completed" and "Process group destroyed", then rank 1
died with ``terminate called without an active exception`` / ``Fatal Python error: Aborted``
(a joinable ``std::thread`` destroyed during finalization) and torchrun reported the job
failed. The zoo's torchrun entry points (``zoo.graph_trainer``, ``zoo.torchrun``,
``zoo.meshes`` under torchrun) leave through :func:`exit_without_finalization` after their job
returned: what they printed and logged is flushed, and the status is the job's. An exception
still propagates with Python's own exit status. Spawned ranks (``ap_backend.demo.spawn_ranks``)
are not affected the same way: the parent reads their results from a queue, not their status.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

__all__ = ["exit_without_finalization"]


def exit_without_finalization(status: int = 0) -> NoReturn:
    """Flush logging, stdout and stderr, then end the process with ``status`` at once
    (``os._exit``: no ``atexit`` handlers, no interpreter finalization)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
