"""``contiguous_bucket_inputs``: make the inputs torch's bucketing packs contiguous first.

On torch 2.11/2.12 a bucketed reduce-scatter packs its members with ``x.view(group_size, -1)``
(``bucketing._pre_bucket_reduce_scatter``) and a bucketed all-reduce with ``x.view(-1)``. A
gradient whose strides are not contiguous -- a convolution's weight gradient, timm's
ResNet-10t through ``precompile`` + the backend -- compiles (the fake implementation never looks
at strides) and then fails at run time: "view size is not compatible with input tensor's size
and stride". Unbucketed, Inductor makes a collective's input contiguous anyway, so a contiguous
copy in the graph costs what the unbucketed collective costs and changes no value. torch 2.13+
packs with ``_chunk_cat``, which takes any strides: there the graph is left alone
(``_compat.bucket_packing_needs_contiguous_inputs``).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from . import _compat

log = logging.getLogger(__name__)


def _needs_copy(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_contiguous()


def contiguous_bucket_inputs(graph: fx.Graph) -> list[str]:
    """Give every reduce-scatter and all-reduce whose input is not contiguous (by its
    ``meta["val"]``) a contiguous copy of it as input; return the collectives changed.

    A no-op (empty list) on a torch whose bucketing packs any strides."""
    if not _compat.bucket_packing_needs_contiguous_inputs():
        return []
    changed: list[str] = []
    for target in _compat.c10d_ops("reduce_scatter_tensor", "all_reduce"):
        for node in graph.find_nodes(op="call_function", target=target):
            source = node.args[0]
            if not isinstance(source, fx.Node) or not _needs_copy(source.meta.get("val")):
                continue
            with graph.inserting_before(node):
                copy = graph.call_function(
                    torch.ops.aten.clone.default,
                    (source,),
                    {"memory_format": torch.contiguous_format},
                )
            copy.meta.update({k: v for k, v in source.meta.items() if k != "val"})
            copy.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
            node.replace_input_with(source, copy)
            changed.append(node.name)
    if changed:
        log.info("contiguous_bucket_inputs: contiguous copies for %s", changed)
    return changed
