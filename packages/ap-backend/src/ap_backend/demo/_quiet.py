"""torch's own log lines the demo's output leaves out unless ``ap-backend demo --verbose``.

Every rank compiles, so every rank would print torch's INFO lines and its environment warnings
into the demo's table. Two kinds are dropped, each by a filter on the one logger that emits it
(so everything else -- warnings, errors, tracebacks -- still shows):

* ``torch._inductor.fx_passes.fsdp`` records below WARNING (its module sets that logger to
  INFO, so ``pre_bucket_fsdp_collectives: fsdp_groups=...`` reaches torch's handler on every
  compile);
* ``torch.utils.cpp_extension``'s "No CUDA runtime is found" warning (a CPU run on a machine
  with a CUDA toolkit installed), that message only;
* torch 2.11/2.12's ``UserWarning`` from ``torch._inductor.comm_analysis`` on a gloo group
  ("``_get_pg_default_device`` will be deprecated", "Multiple backends are registered with
  this ProcessGroup"), those messages only (a ``warnings`` filter; the old filter list comes
  back on undo).

:data:`QUIET_DEMO_LOGS` applies them in the demo's process and, through the environment
variable :data:`QUIET_ENV`, in the ranks it spawns (``spawn_ranks`` calls
:func:`quiet_from_env` in each rank); other users of ``spawn_ranks`` do not set it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable

from ap_tags.scoped import ScopedPatch

from ap_backend import _compat

__all__ = ["QUIET_DEMO_LOGS", "QUIET_ENV", "quiet_from_env", "quiet_torch_logs"]

#: Set (to ``"1"``) in the environment of the demo's ranks when torch's lines are dropped.
QUIET_ENV = "AP_BACKEND_DEMO_QUIET_TORCH_LOGS"

_FSDP_LOGGER = _compat.FSDP_PASS_LOGGER
_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"
_NO_CUDA = "No CUDA runtime is found"
#: torch 2.11/2.12's comm_analysis warnings on a gloo group (``re.match`` patterns).
_PG_DEVICE_WARNINGS = (
    r"`_get_pg_default_device` will be deprecated",
    r"Multiple backends are registered with this ProcessGroup",
)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class _NoCudaRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_CUDA)


def quiet_torch_logs() -> Callable[[], None]:
    """Install the filters; returns the function that removes them."""
    installed = [
        (logging.getLogger(_FSDP_LOGGER), _BelowWarning()),
        (logging.getLogger(_CPP_EXTENSION_LOGGER), _NoCudaRuntime()),
    ]
    for logger, flt in installed:
        logger.addFilter(flt)
    scope = warnings.catch_warnings()  # restores the filter list when it exits
    scope.__enter__()
    for message in _PG_DEVICE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)

    def undo() -> None:
        for logger, flt in installed:
            logger.removeFilter(flt)
        scope.__exit__(None, None, None)

    return undo


def _quiet_here_and_in_ranks() -> Callable[[], None]:
    previous = os.environ.get(QUIET_ENV)
    os.environ[QUIET_ENV] = "1"
    remove = quiet_torch_logs()

    def undo() -> None:
        remove()
        if previous is None:
            os.environ.pop(QUIET_ENV, None)
        else:
            os.environ[QUIET_ENV] = previous

    return undo


#: ``with QUIET_DEMO_LOGS:`` -- torch's demo-irrelevant lines dropped here and in the ranks
#: spawned inside the block.
QUIET_DEMO_LOGS = ScopedPatch(
    "torch's INFO / no-CUDA lines dropped in the demo", _quiet_here_and_in_ranks
)


def quiet_from_env() -> bool:
    """In a spawned rank: install the filters when the demo asked for it. Returns whether."""
    if os.environ.get(QUIET_ENV) != "1":
        return False
    quiet_torch_logs()
    return True
