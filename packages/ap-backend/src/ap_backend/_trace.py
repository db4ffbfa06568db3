"""How the first compilation traces user code, and what it says when it cannot.

``precompile`` exports the joint graph non-strictly (``aot_export_joint_with_descriptors``: the
module's Python runs once more with fake tensors). Three things make that trace behave the way
``torch.compile`` users expect:

* ``torch.compiler.is_compiling()`` is True while it runs (``_compat.COMPILING``), as under
  Dynamo and ``torch.export``. Libraries that ask "am I being compiled?" then take their
  traceable paths: transformers' mask and packed-sequence shortcuts call ``.item()`` on real
  tensors only when the answer is False.
* What ``torch.compile`` would turn into a graph break cannot be part of one recorded graph, so
  it is an error (:class:`PrecompileError`) naming the op, the source line and the way out:
  branching on a tensor's value (``if t.item() > 0:``, ``int(t.item())``, ``if t:``), ops with
  value-dependent output shapes (``nonzero``), and ``print`` (which would run while tracing and
  never again). A value read and only used as a size or in arithmetic (``.tolist()`` split
  sizes) is an unbacked symbol, as under Dynamo with ``capture_scalar_outputs``: the trace runs
  in a fake mode with a shape environment (``_compat.fake_mode_with_shape_env``).
* The forward and backward graphs the second compilation retraces have every ``aten.view``
  replaced by ``aten.reshape`` (:func:`reshape_views`): a ``view`` the first trace recorded is
  valid for the strides eager kernels produce, but the retrace runs under Inductor's
  decompositions, whose strides can differ (its ``cat`` decomposition drops empty inputs and
  returns a stride-preserving clone of the one left, where eager's ``cat`` is contiguous: HF
  Phi-3's partial-rotary ``cat`` then made the attention ``view(8, 16, 16)`` impossible).
  ``reshape`` is a view whenever one is possible and a copy otherwise.
"""

from __future__ import annotations

import builtins
import contextlib
import linecache
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
import torch.fx
from ap_tags.scoped import ScopedPatch

from ap_backend import _compat

__all__ = ["PrecompileError", "reshape_views", "translate_trace_error", "tracing_like_compile"]


class PrecompileError(RuntimeError):
    """The first compilation cannot record the module as one graph.

    ``op`` is what stopped it (an aten op, ``print``), ``location`` the source line
    (``file:line in function``) of the innermost frame outside torch and ap, or None."""

    def __init__(self, message: str, *, op: str | None = None, location: str | None = None):
        super().__init__(message)
        self.op = op
        self.location = location


class _TracedPrint(Exception):
    """Raised by the print guard while a first compilation traces (translated, never seen)."""


_tracing = threading.local()


def _guarded_print_factory(real_print: Any) -> Any:
    def guarded_print(*args: Any, **kwargs: Any) -> None:
        if getattr(_tracing, "depth", 0) > 0:
            caller = sys._getframe(1).f_code.co_filename
            if not _is_internal(caller):
                raise _TracedPrint("print")
        real_print(*args, **kwargs)

    return guarded_print


def _install_print_guard() -> Any:
    real_print = builtins.print
    builtins.print = _guarded_print_factory(real_print)

    def undo() -> None:
        builtins.print = real_print

    return undo


_PRINT_GUARD = ScopedPatch("builtins.print raises while precompile traces", _install_print_guard)


@contextlib.contextmanager
def tracing_like_compile() -> Iterator[None]:
    """The scope of one first-compilation trace: ``is_compiling()`` is True, and a ``print``
    from code outside torch on this thread raises (other threads print as usual)."""
    with _compat.COMPILING, _PRINT_GUARD:
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            yield
        finally:
            _tracing.depth -= 1


# --------------------------------------------------------------------------- source locations


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(str(module.__file__))) + os.sep


def _internal_dirs() -> tuple[str, ...]:
    import ap_tags

    import ap_backend

    stdlib = sysconfig.get_paths().get("stdlib")
    dirs = [_package_dir(torch), _package_dir(ap_tags), _package_dir(ap_backend)]
    if stdlib:
        dirs.append(os.path.abspath(stdlib) + os.sep)
    return tuple(dirs)


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_internal_dirs()):
        return True
    return filename.startswith("<")  # generated code (FX graph modules, exec)


def user_location(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` outside torch, ap and the standard library: the line of
    model (or model-library) code that did what could not be traced."""
    found: traceback.FrameSummary | None = None
    for frame in traceback.extract_tb(tb):
        if not _is_internal(frame.filename):
            found = frame
    return found


def _where(frame: traceback.FrameSummary | None) -> str | None:
    if frame is None:
        return None
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def _source(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return ""
    line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f"\n    {line}" if line else ""


# --------------------------------------------------------------------------- error translation

_WAY_OUT = (
    "precompile records forward as one graph, traced once with fake tensors; under "
    "torch.compile this would be a graph break, which a precompiled module cannot have. "
    "Keep the value a tensor (tensor arithmetic instead of .item(), torch.where instead of "
    "`if`), compute it outside the module and pass it in as an argument, or guard "
    "debugging code with `if not torch.compiler.is_compiling():` (True while precompile "
    "traces, as under torch.compile)."
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def translate_trace_error(exc: BaseException, *, where: str) -> PrecompileError | None:
    """A :class:`PrecompileError` for an exception a first-compilation trace raised because
    of a would-be graph break, or None for any other exception (re-raised as it is)."""
    kinds = _compat.data_dependent_errors()
    for err in _chain(exc):
        frame = user_location(err.__traceback__)
        location = _where(frame)
        at = f" at {location}" if location else ""
        if isinstance(err, _TracedPrint):
            message = (
                f"{where}: forward calls print(){at}{_source(frame)}\n"
                "It would run while precompile traces (twice) and never on a later call. "
                + _WAY_OUT
            )
            return PrecompileError(message, op="print", location=location)
        for kind, what in kinds.items():
            if isinstance(err, kind):
                func = getattr(err, "func", None)
                op = str(func) if func is not None else type(err).__name__
                hint = _OP_HINTS.get(op, "")
                message = f"{where}: forward {what}: {op}{hint}{at}{_source(frame)}\n{_WAY_OUT}"
                return PrecompileError(message, op=op, location=location)
    return None


_OP_HINTS = {
    "aten._local_scalar_dense.default": (
        " (Tensor.item(), .tolist(), int()/float()/bool() of a tensor, or `if tensor:`)"
    ),
    "GuardOnDataDependentSymNode": (
        " (a Python decision on a value read from a tensor: `if t.item() > 0:`, `int(t.item())`,"
        " a size compared with a read value)"
    ),
    "aten.nonzero.default": " (nonzero, boolean-mask indexing, torch.where with one argument)",
}


# --------------------------------------------------------------------------- retraceable views


def reshape_views(gm: torch.fx.GraphModule) -> int:
    """Replace every ``aten.view.default`` by ``aten.reshape.default`` in place (node identity
    and meta kept, so tags stay where they were); returns how many were replaced."""
    view = torch.ops.aten.view.default
    count = 0
    for node in gm.graph.find_nodes(op="call_function", target=view):
        node.target = torch.ops.aten.reshape.default
        count += 1
    if count:
        gm.recompile()
    return count
