"""Tracing a joint forward+backward step into one FX graph the chunk pass understands.

``trace_joint(step, *args)`` runs ``make_fx`` over a function that runs the model, the loss and
``torch.autograd.grad``. It adds the two things a plain ``make_fx`` lacks:

* **backward provenance**: while tracing, ``torch.autograd.grad``/``Tensor.backward`` install
  torch's own stack-trace preservation hooks on the autograd graph, so every backward node gets
  ``meta["autograd_backward"] = True`` and ``meta["seq_nr"]`` of the forward op it differentiates
  (the same metadata AOTAutograd's joint graphs carry). The chunk pass maps a backward node to
  its forward node's ``module_fqn`` through that ``seq_nr``.
* **hinted unbacked chunk dims**: inputs marked with ``mark_chunk_dim(..., hint=N)`` become fakes
  whose chunk dim is an unbacked SymInt with optimization hint ``N``; inputs marked with the
  same hint share one symbol. The symbols are created with the torch 2.13 pending-symbol fix
  (see ``_compat``).

Run it inside ``ap_tags.annotate_module_fqns(model)`` so forward nodes carry their module FQN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ._compat import new_hinted_unbacked_symint, require_internals
from ._marking import chunk_dims_of


def _install_backward_meta_hooks(outputs: Any) -> None:
    from torch._functorch._aot_autograd.logging_utils import (
        setup_stacktrace_preservation_hooks,
    )

    roots = [
        t.grad_fn
        for t in pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    if roots:
        setup_stacktrace_preservation_hooks(roots)


@contextlib.contextmanager
def backward_provenance() -> Iterator[None]:
    """Scoped patch: autograd.grad / Tensor.backward mark the backward nodes they trace."""
    orig_grad = torch.autograd.grad
    orig_backward = torch.Tensor.backward

    def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        _install_backward_meta_hooks(outputs)
        return orig_grad(outputs, *args, **kwargs)

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _install_backward_meta_hooks(self)
        return orig_backward(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    torch.autograd.grad = grad
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.grad = orig_grad
        torch.Tensor.backward = orig_backward  # type: ignore[method-assign]


def _fakeify(args: Any, fake_mode: FakeTensorMode) -> Any:
    shape_env = fake_mode.shape_env
    assert shape_env is not None
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

    return pytree.tree_map(one, args)


def trace_joint(step: Callable[..., Any], *args: Any) -> torch.fx.GraphModule:
    """Trace ``step(*args)`` (forward, loss and ``torch.autograd.grad``) into one graph."""
    if not callable(step):
        raise TypeError(f"trace_joint: step must be callable, got {type(step).__name__}")
    require_internals()
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fake_args = _fakeify(args, fake_mode)
    # make_fx runs under the inputs' fake mode so factory ops inside ``step`` are fake too;
    # on torch 2.13 this is what needs the pending-symbol fix (see ``_compat``)
    with backward_provenance(), fx_traceback.preserve_node_meta(), fake_mode:
        gm = make_fx(step, tracing_mode="real")(*fake_args)
    return gm
