"""Feature-detected access to the torch internals this package relies on (torch 2.13-2.15).

Everything version-sensitive lives here so the rest of the package reads like plain FX code:

* ``require_internals`` fails early, naming the supported range, when an internal is missing.
* ``no_pending_fresh_symbols`` is the torch 2.13 fix for tracing pre-fakified unbacked inputs:
  on 2.13 a symbol created by ``ShapeEnv.create_unbacked_symint`` stays in
  ``pending_fresh_unbacked_symbols`` and ``make_fx`` then tries to bind it to the *list* of
  placeholder proxies (``AssertionError: Expected Proxy, got [Proxy(x_1), ...]``). Creating
  input symbols under ``ShapeEnv.ignore_fresh_unbacked_symbols`` keeps them out of that list;
  2.14+ behave the same way with or without it, so the fix is applied unconditionally and is
  scoped to the creation of the input fakes.
* ``optimization_hint`` reads the hint an unbacked symbol was marked with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ._errors import UnsupportedTorchError

SUPPORTED = ">=2.13,<2.16"


def require_internals() -> None:
    """Raise a clear error when an internal this package needs is missing."""
    missing = [
        name
        for name, ok in (
            ("ShapeEnv.var_to_hint_override", _has_hint_overrides()),
            (
                "ShapeEnv.ignore_fresh_unbacked_symbols",
                hasattr(ShapeEnv, "ignore_fresh_unbacked_symbols"),
            ),
            ("ShapeEnv.create_unbacked_symint", hasattr(ShapeEnv, "create_unbacked_symint")),
            ("torch._dynamo.decorators.mark_unbacked", _has_mark_unbacked()),
        )
        if not ok
    ]
    if missing:
        raise UnsupportedTorchError(
            f"ap-epchunk needs torch {SUPPORTED}; this torch ({torch.__version__}) lacks "
            + ", ".join(missing)
        )


def _has_hint_overrides() -> bool:
    try:
        return hasattr(ShapeEnv(), "var_to_hint_override")
    except Exception:  # noqa: BLE001 - a ShapeEnv that cannot even be built lacks it too
        return False


def mark_unbacked_fn() -> Any:
    """``torch._dynamo.decorators.mark_unbacked``, or UnsupportedTorchError naming it."""
    if not _has_mark_unbacked():
        raise UnsupportedTorchError(
            f"ap-epchunk needs torch {SUPPORTED}; this torch ({torch.__version__}) lacks "
            "torch._dynamo.decorators.mark_unbacked"
        )
    from torch._dynamo import decorators

    return decorators.mark_unbacked


def _has_mark_unbacked() -> bool:
    try:
        from torch._dynamo import decorators
    except ImportError:  # pragma: no cover - torch without dynamo
        return False
    return hasattr(decorators, "mark_unbacked")


@contextlib.contextmanager
def no_pending_fresh_symbols(shape_env: ShapeEnv) -> Iterator[None]:
    """Create input symbols so that ``make_fx`` does not try to bind them (torch 2.13 fix)."""
    with shape_env.ignore_fresh_unbacked_symbols():
        yield


def new_hinted_unbacked_symint(shape_env: ShapeEnv, hint: int) -> torch.SymInt:
    """An unbacked SymInt whose optimization hint is ``hint`` and that make_fx won't rebind."""
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    with no_pending_fresh_symbols(shape_env):
        sym = shape_env.create_unbacked_symint()
    # size-like with a lower bound of 2, as mark_unbacked(min=...) does: tracing may then
    # decide "is this dim 0 or 1?" without guarding on the data-dependent symbol
    _constrain_range_for_size(sym, min=2, max=None)
    shape_env.var_to_hint_override[sym.node.expr] = hint
    return sym


def optimization_hint(shape_env: ShapeEnv, symbol: sympy.Symbol) -> int | None:
    """The hint ``symbol`` was marked with, or None."""
    hint: Any = shape_env.var_to_hint_override.get(symbol)
    return int(hint) if hint is not None else None


def shape_env_of(value: Any) -> ShapeEnv | None:
    """The ShapeEnv behind a SymInt/SymFloat/SymBool or a FakeTensor with symbolic sizes."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        env: ShapeEnv | None = value.node.shape_env
        return env
    if isinstance(value, torch.Tensor):
        for s in (*value.shape, *value.stride()):
            if isinstance(s, torch.SymInt):
                env2: ShapeEnv | None = s.node.shape_env
                return env2
        fake_mode = getattr(value, "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            env3: ShapeEnv | None = fake_mode.shape_env
            return env3
    return None
