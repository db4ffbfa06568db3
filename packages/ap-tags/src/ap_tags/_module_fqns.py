"""``annotate_module_fqns``: record which submodule each traced node came from.

Region-selecting passes (ap-epchunk's ``layers.*.moe``) need a module FQN on every node, on
forward *and* backward nodes, and it must survive retracing; ``nn_module_stack`` does neither
reliably. This writes ``custom["module_fqn"]`` through ``torch.fx.traceback.annotate``, which
Dynamo, make_fx and AOTAutograd all honour (2.13-2.15).

Mechanism: each submodule's ``forward`` is wrapped (an instance attribute, removed on exit) in
``with annotate({"module_fqn": fqn})``. A ``with`` block inside the forward is something Dynamo
can trace, whereas an annotate entered in a pre-hook and left in a post-hook is not. Nested
blocks overwrite the key, so the innermost module wins; leaving a block restores the outer FQN.

What lands where:

* make_fx / AOTAutograd tracing a module directly: every op node created inside a submodule's
  forward. The context also enables ``preserve_node_meta`` (the tracer copies ``custom`` only
  then); pass ``preserve_node_meta=False`` if the caller manages that itself.
* Dynamo: the Dynamo graph's op nodes, and also the placeholders (inputs/parameters) first
  touched inside a submodule (Dynamo creates them lazily there). AOTAutograd's forward graph
  then carries the FQN on the op nodes (its ``primals`` placeholders carry none).
* Backward nodes of a joint graph: AOTAutograd's ``copy_fwd_metadata_to_bw_nodes`` merges a
  deep copy of the matching forward node's ``custom`` (by ``seq_nr``) into each backward node,
  so a backward op carries the FQN of the forward op it differentiates. Nodes with no forward
  counterpart (tangent expands, gradient accumulation ``add``) carry none.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx.traceback as fx_traceback
import torch.nn as nn

from ._compat import require_fx_traceback
from ._keys import MODULE_FQN, TAG_SCHEMA, TAG_SCHEMA_VERSION
from .checks import require_instance

_MISSING = object()


def _has_own_forward(module: nn.Module) -> bool:
    """Containers such as ``ModuleList`` have no forward; wrapping them would be pointless."""
    return type(module).forward is not nn.Module.forward


def _annotated(fqn: str, forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with fx_traceback.annotate({MODULE_FQN: fqn, TAG_SCHEMA: TAG_SCHEMA_VERSION}):
            return forward(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def annotate_module_fqns(
    model: nn.Module, *, include_root: bool = False, preserve_node_meta: bool = True
) -> Iterator[nn.Module]:
    """Within the block, nodes traced inside ``model.<fqn>`` carry ``custom["module_fqn"]=fqn``.

    ``include_root=True`` also annotates the root module's own ops with ``""``. Yields
    ``model``. Restores every wrapped ``forward`` on exit, even if tracing raised.
    """
    require_fx_traceback("annotate", "preserve_node_meta")
    require_instance(
        model, nn.Module, where="annotate_module_fqns", arg="model", expected="an nn.Module"
    )
    previous: list[tuple[nn.Module, object]] = []
    try:
        for fqn, module in model.named_modules():
            if (fqn == "" and not include_root) or not _has_own_forward(module):
                continue
            previous.append((module, module.__dict__.get("forward", _MISSING)))
            module.__dict__["forward"] = _annotated(fqn, module.forward)
        with contextlib.ExitStack() as stack:
            if preserve_node_meta:
                stack.enter_context(fx_traceback.preserve_node_meta())
            yield model
    finally:
        for module, old in reversed(previous):
            if old is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = old
