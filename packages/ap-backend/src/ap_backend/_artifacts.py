"""``trace_structured`` artifacts, so ``TORCH_TRACE=<dir>`` + ``tlparse`` show what each compile
decided (saved set, bucketing stats, chunk graphs) next to torch's own artifacts."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from ap_backend import _compat

__all__ = ["emit_json", "emit_string", "jsonable"]

log = logging.getLogger(__name__)


def jsonable(obj: Any) -> Any:
    """Dataclasses and simple containers to JSON-compatible values (repr as the last resort)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return repr(obj)


def emit_json(name: str, payload: Any) -> None:
    """``payload`` (made JSON-compatible) as artifact ``name``; serialised only when tracing."""
    _compat.trace_structured()(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: json.dumps(jsonable(payload)),
    )
    log.debug("artifact %s emitted", name)


def emit_string(name: str, text_fn: Callable[[], str]) -> None:
    """``text_fn`` runs only when structured tracing is on (printing a big graph is costly)."""
    _compat.trace_structured()(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=text_fn,
    )
