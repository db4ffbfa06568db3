"""Save a widening cast's narrow source instead of the cast (SaveAll, after the save rules).

Why: a first compilation partitioned by torch's ``default_partition`` (``precompile(
first_partition="default")``, AutoParallel's choice; the default first partition is min-cut,
which already saves the narrow side) saves what eager autograd saves. Under bf16 mixed precision that includes the fp32 upcast a norm takes of
the bf16 residual stream (RMSNorm's ``x.float()``): ``convert_element_type(h, float32)``,
with ``h = h_prev + attn_out`` a bf16 add. Eager rounds ``h`` to bf16 and widens the rounded
value. Inductor does not: it computes a bf16 pointwise op in fp32 and elides the
bf16-round/fp32-widen pair when the value stays inside one kernel
(``torch._inductor.config.emulate_precision_casts`` off, its default). Replaying that save
makes Inductor store the *unrounded* fp32 sum as the saved upcast, and since ``h`` itself is
then never stored, every later kernel recomputes it inline, unrounded: the whole bf16 residual
stream runs in fp32. Measured on torchtitan's Llama3 debug model with SimpleFSDP bf16 (2 gloo
ranks): loss gap to eager 9.0e-5 against stock Inductor's 2.4e-5 (``zoo/RESULTS-meshes.md``,
finding 1).

torch's min-cut saves the bf16 ``h`` (the cheaper side of the cast), and Inductor rounds a
saved low-precision pointwise value at its store for every consumer in the kernel too
(``emulate_precision_casts_on_saved_tensors``, on by default). Saving ``h`` instead of its
upcast keeps the same information -- a lossless widening is recomputed bitwise in the backward
-- in fewer bytes, and gives the forward eager's rounding: 2.1e-6 on the same model.

A save is narrowed only where the forward and the backward then read the same rounded value,
and where it cannot cost anything the replay promises. The source must be

* a value the forward computes in its own storage: not a graph input (already rounded, and
  the caller's), not a view (Inductor rounds a saved low-precision value for its kernel's
  other consumers only when that value is itself the saved output; a view's base would be
  stored rounded but read unrounded inside its kernel, and a view of a larger storage would
  keep more alive);
* not itself a dtype conversion (a ``.to(bf16)`` saved as is: Inductor's rounding of saved
  outputs covers pointwise arithmetic, not explicit casts, so the forward would go on with the
  unrounded value while the backward reads the rounded one -- a bf16 ``silu(...).float()``
  measured 3.1e-3 from eager on ``down.weight``'s gradient against stock's 2.9e-3 that way);
* not ``MUST_RECOMPUTE`` (rule 1) and not an all-gather's result (an unsharded weight).

A cast a checkpoint policy pinned ``MUST_SAVE`` is saved as the policy says, and so is a cast
another saved value views (the view would keep the cast's storage alive next to the source).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ap_tags
import torch
import torch.fx as fx
from ap_tags.graph import is_all_gather_output, node_nbytes, storage_base

from ap_partitioner._rules import SavePlan, is_must_recompute, is_policy_must_save

_CONVERT = torch.ops.prims.convert_element_type.default
_TO_COPY = torch.ops.aten._to_copy.default


@dataclass(frozen=True)
class Narrowed:
    """One narrowed save: the cast the replay would have saved (``cast``; ``first_name`` is the
    first partition's name for it), the narrow value saved instead (``source``), and whether
    that adds a storage the replay did not already keep (``new_storage``)."""

    cast: fx.Node
    source: fx.Node
    first_name: str
    new_storage: bool

    def note(self) -> str:
        return f"{self.cast.name} -> {self.source.name}"


def lossless_widening(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is exactly representable in ``dst`` and ``dst`` is wider: a real
    floating ``src`` and ``dst`` with ``dst`` at least as precise, as wide in range and with
    more bits (bf16/fp16 -> fp32/fp64, fp32 -> fp64; not bf16 <-> fp16)."""
    if not (src.is_floating_point and dst.is_floating_point) or src == dst:
        return False
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.bits > a.bits and b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny


def _tensor(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def widening_cast_source(node: fx.Node) -> fx.Node | None:
    """The input of ``node`` when ``node`` is a pure dtype conversion that widens losslessly
    (``prims.convert_element_type``, or ``aten._to_copy`` with only ``dtype`` set), else None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is _TO_COPY and set(node.kwargs) - {"dtype"}:
        return None  # a device, layout or memory-format change is not just a cast
    if node.target not in (_CONVERT, _TO_COPY):
        return None
    source = node.args[0]
    src, out = _tensor(source), _tensor(node)
    if src is None or out is None or src.device != out.device:
        return None
    return source if lossless_widening(src.dtype, out.dtype) else None


def _is_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_CONVERT, _TO_COPY)


def narrow_source(cast: fx.Node, saved_bases: Counter[fx.Node]) -> fx.Node | None:
    """The value to save instead of the saved ``cast`` (see the module doc for when), else
    None. ``saved_bases`` counts the saved values per storage base."""
    if is_policy_must_save(cast) or saved_bases[cast] > 1:
        return None
    source = widening_cast_source(cast)
    if source is None or source.op != "call_function" or _is_cast(source):
        return None
    if storage_base(source) is not source or is_must_recompute(source):
        return None
    if is_all_gather_output(source) or node_nbytes(source) > node_nbytes(cast):
        return None
    return source


def narrow_widening_casts(plan: SavePlan) -> tuple[SavePlan, tuple[Narrowed, ...]]:
    """``plan`` with every narrowable saved cast replaced by its source (first-seen order,
    deduplicated), and what was narrowed."""
    saved_bases = Counter(storage_base(v) for v in plan.values)
    values: list[fx.Node] = []
    narrowed: list[Narrowed] = []
    for value in plan.values:
        source = narrow_source(value, saved_bases)
        if source is None:
            values.append(value)
            continue
        new_storage = not saved_bases[source]
        saved_bases[source] += 1
        saved_bases[value] -= 1
        first = ap_tags.first_partition_name(value) or value.name
        narrowed.append(Narrowed(value, source, first, new_storage))
        values.append(source)
    if not narrowed:
        return plan, ()
    out = SavePlan(values, list(plan.sym_nodes), list(plan.opaque_nodes)).deduplicated()
    return out, tuple(narrowed)


def narrowed_note(narrowed: tuple[Narrowed, ...]) -> str:
    """The report's note: which casts were saved as their narrow source, and why."""
    pairs = ", ".join(n.note() for n in narrowed)
    return (
        f"{len(narrowed)} lossless widening casts saved as their narrow source and recomputed "
        f"in the backward (fewer bytes; the forward rounds the source as eager does): {pairs}"
    )


def narrowed_fields(narrowed: tuple[Narrowed, ...]) -> dict[str, tuple[str, ...]]:
    """``PartitionReport`` fields: the first partition's names of the narrowed casts, and the
    storages saved in their place that the replay would not keep otherwise."""
    return {
        "narrowed_first_saves": tuple(n.first_name for n in narrowed),
        "narrowed_storages": tuple(n.source.name for n in narrowed if n.new_storage),
    }
