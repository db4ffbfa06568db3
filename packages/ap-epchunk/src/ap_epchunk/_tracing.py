"""Tracing a joint forward+backward step into one FX graph the chunk pass understands.

``trace_joint(step, *args)`` runs ``make_fx`` over a function that runs the model, the loss and
``torch.autograd.grad``. It adds the two things a plain ``make_fx`` lacks:

* **backward provenance**: while tracing, ``torch.autograd.grad``/``Tensor.backward`` install
  torch's own stack-trace preservation hooks on the autograd graph, so every backward node gets
  ``meta["autograd_backward"] = True`` and ``meta["seq_nr"]`` of the forward op it differentiates
  (the same metadata AOTAutograd's joint graphs carry). The chunk pass maps a backward node to
  its forward node's ``module_fqn`` through that ``seq_nr``. The swap of the two functions is
  a scoped patch (``backward_provenance``): nestable, thread-safe, undone on exit.
* **hinted unbacked chunk dims**: inputs marked with ``mark_chunk_dim(..., hint=N)`` become fakes
  whose chunk dim is an unbacked SymInt with optimization hint ``N``; inputs marked with the
  same hint share one symbol. The symbols are created with the torch 2.13 pending-symbol fix
  (see ``_compat``).

Run it inside ``ap_tags.annotate_module_fqns(model)`` so forward nodes carry their module FQN.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from ap_tags.checks import require_callable
from ap_tags.scoped import ScopedPatch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ._compat import (
    copy_backward_mark,
    fake_tensor_mode,
    new_hinted_unbacked_symint,
    require_internals,
    stacktrace_preservation_hooks,
    tree_leaves,
    tree_map,
)
from ._marking import chunk_dims_of


def _install_backward_meta_hooks(outputs: Any) -> None:
    roots = [
        t.grad_fn
        for t in tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    if roots:
        stacktrace_preservation_hooks()(roots)


#: How many ``backward_provenance`` scopes the current thread is inside. The patched functions
#: are process-wide while any thread holds the patch; they only mark the autograd graphs of
#: threads that are inside a scope, so a concurrent, unrelated ``autograd.grad`` is untouched.
_inside = threading.local()


def _in_scope() -> bool:
    depth: int = getattr(_inside, "depth", 0)
    return depth > 0


def _patch_autograd() -> Callable[[], None]:
    orig_grad = torch.autograd.grad
    orig_backward = torch.Tensor.backward

    @functools.wraps(orig_grad)
    def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_scope():
            _install_backward_meta_hooks(outputs)
        return orig_grad(outputs, *args, **kwargs)

    @functools.wraps(orig_backward)
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _in_scope():
            _install_backward_meta_hooks(self)
        return orig_backward(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    undo_copy = copy_backward_mark()
    torch.autograd.grad = grad
    torch.Tensor.backward = backward  # type: ignore[method-assign]

    def undo() -> None:
        torch.autograd.grad = orig_grad
        torch.Tensor.backward = orig_backward  # type: ignore[method-assign]
        undo_copy()

    return undo


_AUTOGRAD_PATCH = ScopedPatch("ap_epchunk.backward_provenance", _patch_autograd)


@contextlib.contextmanager
def backward_provenance() -> Iterator[None]:
    """``torch.autograd.grad`` / ``Tensor.backward`` mark the backward nodes they trace.

    A scoped patch (``ap_tags.scoped.ScopedPatch``): the first entry, in any thread, swaps both
    functions process-wide; the last exit puts the originals back, also when the body raised.
    Nested and concurrent scopes share the one swap.
    """
    with _AUTOGRAD_PATCH:
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            yield
        finally:
            _inside.depth -= 1


def fake_chunk_inputs(args: Any, fake_mode: Any) -> Any:
    """``args`` with every tensor leaf made a fake tensor of ``fake_mode`` (which must have a
    ``ShapeEnv``): dims marked with ``mark_chunk_dim(..., hint=N)`` become one unbacked SymInt
    per hint (size-like, at least 2, optimization hint ``N``; inputs marked with the same hint
    share it), every other dim stays static.

    Why shared and unbacked: the chunk pass reads "carries the chunk dim" off the symbol, so
    the tokens and the targets of one batch must be the same symbol, and an unbacked one never
    specialises on a guard (a backed symbol would be replaced by its hint at the first
    comparison, and chunk influence with it)."""
    shape_env = fake_mode.shape_env
    if shape_env is None:
        raise ValueError("fake_chunk_inputs: the fake mode has no ShapeEnv")
    symbols: dict[int, torch.SymInt] = {}

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        marks = {d: h for d, h in chunk_dims_of(t).items() if h is not None}
        if not marks:
            return fake_mode.from_tensor(t, static_shapes=True)
        sizes: list[Any] = list(t.shape)
        for dim, hint in marks.items():
            if hint not in symbols:
                symbols[hint] = new_hinted_unbacked_symint(shape_env, hint)
            sizes[dim] = symbols[hint]
        with fake_mode:
            fake = torch.empty(sizes, dtype=t.dtype, device=t.device)
        if t.requires_grad:
            fake.requires_grad_(True)
        return fake

    return tree_map(one, args)


def trace_joint(step: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    """Trace ``step(*args)`` (forward, loss and ``torch.autograd.grad``) into one graph."""
    require_callable(step, where="trace_joint", arg="step")
    require_internals()
    fake_mode = fake_tensor_mode(ShapeEnv())
    fake_args = fake_chunk_inputs(args, fake_mode)
    # make_fx runs under the inputs' fake mode so factory ops inside ``step`` are fake too;
    # on torch 2.13 this is what needs the pending-symbol fix (see ``_compat``)
    with backward_provenance(), fx_traceback.preserve_node_meta(), fake_mode:
        gm = make_fx(step, tracing_mode="real")(*fake_args)
    return gm
