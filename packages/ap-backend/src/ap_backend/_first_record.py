"""Records of first compilations on disk: program key -> what the first compilation was.

Why: a restarted job's ``precompile`` can skip its first compilation when the second
compilation will be served from AOTAutograd's cache (which keys it by the first compilation's
content, :mod:`ap_backend._aot_cache`). What ``precompile`` must still hand back without making
it -- the content key the second compilation's cache entry is filed under, what the first
partition saved, the FSDP chains it tagged, the exported parameter and buffer order -- is
recorded here by the cold run, under the key :mod:`ap_backend._program_key` computes before
anything is compiled.

Records live beside Inductor's caches (``<TORCHINDUCTOR_CACHE_DIR>/ap_first_compilation``), so
a fresh cache directory starts without them and clearing Inductor's caches clears them too.
A record that cannot be read is ignored (the first compilation is made, and the record written
again); writes are atomic (a temporary file renamed into place), so concurrent ranks sharing a
cache directory never read half a record.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

import ap_tags

from ap_backend import _compat
from ap_backend._saved import SavedSummary

__all__ = ["FirstRecord", "drop_record", "load_record", "record_path", "save_record"]

log = logging.getLogger(__name__)

_DIR = "ap_first_compilation"


@dataclass(frozen=True)
class FirstRecord:
    """What a first compilation was, as far as anything after ``precompile`` reads it."""

    content_key: str
    partitioner: str
    first_partition: SavedSummary
    fsdp_report: ap_tags.FsdpTagReport
    param_fqns: tuple[str, ...]
    buffer_fqns: tuple[str, ...]
    #: The first compilation callable's ``__name__``: Dynamo names the graph attributes of its
    #: call after it, and AOTAutograd's cache key reads those names.
    fn_name: str


def record_path(program_key: str) -> Path:
    return Path(_compat.inductor_cache_dir()) / _DIR / f"{program_key}.pkl"


def load_record(program_key: str) -> FirstRecord | None:
    """The record filed under ``program_key``; None when there is none or it is unreadable."""
    path = record_path(program_key)
    try:
        with path.open("rb") as f:
            record = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a truncated or foreign file: ignore it, it gets rewritten
        log.info("precompile: ignoring the unreadable first-compilation record %s: %s", path, exc)
        return None
    return record if isinstance(record, FirstRecord) else None


def save_record(program_key: str, record: FirstRecord) -> None:
    """File ``record`` under ``program_key`` (atomically); a failure to write only logs."""
    path = record_path(program_key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(record, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("precompile: could not record the first compilation at %s: %s", path, exc)


def drop_record(program_key: str) -> None:
    """Remove the record filed under ``program_key`` (if any)."""
    try:
        record_path(program_key).unlink()
    except FileNotFoundError:
        pass
