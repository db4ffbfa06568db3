"""The two compilations without ap-backend: what ap-partitioner's tests and benchmark need.

``first_compile`` exports the joint graph, tags FSDP chains, partitions with torch's
``default_partition`` and compiles with ap-tags' tagging interpreter; ``second_compile`` then
``torch.compile``s the result with identity fw/bw compilers and the partitioner under test.
Needs ap-tags (import this module only from tests of packages that depend on it).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ap_tags
import torch
import torch.fx as fx
import torch.nn as nn
from ap_tags.graph import is_rng_op

__all__ = ["CapturedJoint", "First", "FirstCompiled", "first_compile", "second_compile"]

Partitioner = Callable[..., tuple[fx.GraphModule, fx.GraphModule]]


class FirstCompiled(nn.Module):
    """Calls the first compilation's callable with ``model``'s parameters in exported order."""

    def __init__(self, model: nn.Module, fn: Callable[..., Any], order: list[str]) -> None:
        super().__init__()
        self.model, self.fn, self.order = model, fn, order

    def forward(self, x: torch.Tensor) -> Any:
        params = dict(self.model.named_parameters())
        return self.fn(*[params[n] for n in self.order], x)


@dataclass
class First:
    """The first compilation: the module to retrace, its input, its partition and report."""

    module: nn.Module
    x: torch.Tensor
    fw: fx.GraphModule  # the first forward graph (tagged)
    bw: fx.GraphModule
    num_fwd_outputs: int
    fsdp: ap_tags.FsdpTagReport


def first_compile(
    model: nn.Module,
    x: torch.Tensor,
    *,
    fw_hook: Callable[[fx.GraphModule], None] | None = None,
) -> First:
    """Export, tag FSDP chains MUST_RECOMPUTE, ``default_partition``, tagging interpreter.

    ``fw_hook(fw)`` runs on the forward graph before it is tagged (e.g. to stamp provenance).
    """
    from torch._functorch.aot_autograd import (
        aot_compile_joint_with_descriptors,
        aot_export_joint_with_descriptors,
    )
    from torch._functorch.partitioners import default_partition

    seen: dict[str, Any] = {}

    def partition(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        kw.pop("compiler", None)
        with _rng_rule_like_2_14():
            fw, bw = default_partition(gm, joint_inputs, **kw)
        seen.update(bw=bw, num_fwd_outputs=kw["num_fwd_outputs"])
        return fw, bw

    def fw_compiler(gm: fx.GraphModule, example_inputs: Any) -> Any:
        if fw_hook is not None:
            fw_hook(gm)
        seen["fw"] = gm
        return ap_tags.preserve_meta_compiler(tag_forward=True)(gm, example_inputs)

    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(stack, model, (x,))
        fsdp = ap_tags.mark_fsdp_all_gather_recomputation(jd.graph_module.graph)
        fn = aot_compile_joint_with_descriptors(
            jd,
            partition_fn=partition,
            fw_compiler=fw_compiler,
            bw_compiler=ap_tags.preserve_meta_compiler(),  # type: ignore[arg-type]
        )
        order = list(jd.params_spec)
    return First(
        FirstCompiled(model, fn, order), x, seen["fw"], seen["bw"], seen["num_fwd_outputs"], fsdp
    )


def _boxed_identity(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Run the graph as is, with AOTAutograd's boxed calling convention."""

    def run(args: list[Any]) -> Any:
        return gm(*args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


@dataclass
class CapturedJoint:
    """A second-compile joint graph (after any joint pass) and the partitioner's kwargs."""

    gm: fx.GraphModule
    kwargs: dict[str, Any]

    def fresh(self) -> fx.GraphModule:
        return copy.deepcopy(self.gm)


def second_compile(
    first: First,
    partitioner: Partitioner,
    *,
    joint_pass: Callable[..., Any] | None = None,
    capture: list[CapturedJoint] | None = None,
) -> list[fx.GraphModule]:
    """``torch.compile`` the first callable (identity compilers, ``partitioner``), run one
    forward + backward; return the forward graph of every partition. ``capture`` receives a
    copy of every joint graph handed to the partitioner."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: list[fx.GraphModule] = []

    def partition(gm: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        if capture is not None:
            capture.append(CapturedJoint(copy.deepcopy(gm), dict(kw)))
        fw, bw = partitioner(gm, joint_inputs, **kw)
        graphs.append(fw)
        return fw, bw

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=_boxed_identity,
            bw_compiler=_boxed_identity,
            partition_fn=partition,
        )

    torch._dynamo.reset()
    with torch._functorch.config.patch(joint_custom_pass=joint_pass):
        loss = torch.compile(first.module, backend=backend, fullgraph=True)(first.x)
    loss.backward()
    return graphs


@contextlib.contextmanager
def _rng_rule_like_2_14() -> Iterator[None]:
    """What ap-backend's first compilation does (``ap_backend._compat.FIRST_PARTITION_RNG_RULE``)
    on a torch without ``partitioners.is_rng_op`` (2.11-2.13): decide "recomputes a random op"
    by 2.14's rule (``ap_tags.graph.is_rng_op``), so an AC-recomputed zero-dropout SDPA is not
    wrapped in ``run_and_save_rng_state`` (which the second compile cannot retrace)."""
    import torch._functorch.partitioners as partitioners

    if hasattr(partitioners, "is_rng_op"):
        yield
        return
    old = partitioners.has_recomputable_rng_ops

    def has_recomputable_rng_ops(fx_g: fx.GraphModule) -> bool:
        return any(partitioners.must_recompute(n) and is_rng_op(n) for n in fx_g.graph.nodes)

    partitioners.has_recomputable_rng_ops = has_recomputable_rng_ops
    try:
        yield
    finally:
        partitioners.has_recomputable_rng_ops = old
