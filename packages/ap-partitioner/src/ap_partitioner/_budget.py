"""``fit_to_budget``: keep the replay's saved activations under a byte budget.

The replay saves exactly what the first compilation saved. A user who must fit a memory budget
("at most N bytes of saved activations per rank") needs fewer saves and some recomputation in
the backward. This module starts from the replay's plan -- so every first-compilation decision
the budget allows is kept -- and drops saved values one at a time, best *bytes freed per unit
of recompute cost* first, until the saved bytes fit.

Dropping value ``v`` means the backward recomputes it, and with it every forward node between
``v`` and values the backward still has (saved values and graph inputs): ``v``'s *recompute
closure*. A value is droppable only when that closure is safe to run twice with the same
result:

* no collective, except inside a chain the first compilation already marked
  ``MUST_RECOMPUTE`` (the FSDP all-gathers the backward re-runs anyway);
* no random op (``_compat.is_random``: it would draw new numbers), no mutation or forward-only
  effect (``must_be_in_forward``, ``with_effects``).

Cost of a closure: FLOPs by ``torch.utils.flop_counter``'s formulas for the ops it knows
(matmuls, convolutions, attention), bytes read + written for every other op (memory bound);
both in one unit (a FLOP and a byte count the same), reported apart. A node already recomputed
for an earlier drop costs nothing again. The greedy order does not depend on the budget, so
one pass down to the *floor* (no droppable value left) gives both the floor and, as the
shortest prefix that fits, the plan for any budget; a budget under the floor is refused with
the floor in the message. That prefix ends with the drop that made it fit, which may free far
more than was missing; the earlier drops it made unnecessary are then kept saved again,
worst-scored first, when that recomputes less (a greedy knapsack's usual repair).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import ap_tags
import torch
import torch.fx as fx
from ap_tags.counting import count_saved_values
from ap_tags.graph import is_collective, is_wait, node_nbytes, op_overload, size_hint, storage_base
from ap_tags.scoped import paused_gc

from ap_partitioner import _compat
from ap_partitioner._rules import SavePlan, is_must_recompute

log = logging.getLogger(__name__)

__all__ = [
    "BudgetError",
    "BudgetOutcome",
    "DroppedSave",
    "budget_fields",
    "budget_notes",
    "check_activation_budget",
    "fit_to_budget",
]

#: What every refusal of a budget says about the one number that decides a graph's smallest
#: budget: it is a property of the graph, known when it is partitioned.
_FLOOR_HINT = (
    "the smallest budget a graph accepts is its floor (the saved bytes left when every "
    "recomputable value is recomputed: 0 without random ops, collectives outside FSDP chains "
    "or mutations), reported as PartitionReport.budget_floor_bytes; a budget under a graph's "
    "floor raises BudgetError naming it"
)


def check_activation_budget(value: object, *, where: str) -> int:
    """``value`` as a budget in bytes, or a ``TypeError`` / ``ValueError`` naming
    ``activation_budget_bytes`` and the floor rule.

    A negative or non-integer budget is wrong for every graph, so it is refused when the option
    is given, before anything is compiled; a budget under a particular graph's floor can only be
    refused when that graph is partitioned (:class:`BudgetError`). ``bool`` is refused (``True``
    is not a byte count) and so is a float, even a whole one: a byte count is exact."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = f"{value!r} ({type(value).__name__})"
        raise TypeError(
            f"{where}: activation_budget_bytes must be an int number of bytes, got {shown}; "
            + _FLOOR_HINT
        )
    if value < 0:
        raise ValueError(
            f"{where}: activation_budget_bytes={value:,} is below every graph's floor (a floor "
            "is never under 0 bytes); " + _FLOOR_HINT
        )
    return value


class BudgetError(ValueError):
    """The activation budget is below what this graph can reach (its floor)."""

    def __init__(self, budget: int, floor: int, replay: int) -> None:
        self.budget = budget
        self.floor = floor
        self.replay = replay
        super().__init__(
            f"activation_budget_bytes={budget:,} is below this graph's floor of {floor:,} bytes "
            f"(the saved activations left when every recomputable value is recomputed; the "
            f"replay saves {replay:,}): pass activation_budget_bytes >= {floor:,}"
        )


@dataclass(frozen=True)
class DroppedSave:
    """One saved value the budget recomputes instead: its node, module, the bytes its drop
    freed and what its recompute closure added (FLOPs, bytes moved, nodes)."""

    name: str
    module_fqn: str | None
    freed_bytes: int
    flops: int
    bytes_moved: int
    recomputed: int


@dataclass(frozen=True)
class BudgetOutcome:
    """The plan that fits ``budget_bytes`` and what it cost."""

    plan: SavePlan
    budget_bytes: int
    before_bytes: int
    after_bytes: int
    floor_bytes: int
    dropped: tuple[DroppedSave, ...] = field(default=())

    @property
    def recompute_flops(self) -> int:
        return sum(d.flops for d in self.dropped)

    @property
    def recompute_bytes_moved(self) -> int:
        return sum(d.bytes_moved for d in self.dropped)


def _hinted(value: object) -> object:
    """A meta tensor with ``value``'s dtype and hinted shape (flop formulas need ints)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [size_hint(s) or 0 for s in value.shape]
    return torch.empty(shape, dtype=value.dtype, device="meta")


def _val(arg: object) -> object:
    if isinstance(arg, fx.Node):
        return _hinted(arg.meta.get("val"))
    if isinstance(arg, list | tuple):
        return type(arg)(_val(a) for a in arg)
    return arg


def _value_bytes(value: object) -> int:
    """Bytes of a tensor value (hinted sizes), or of every tensor in a list/tuple of them."""
    if isinstance(value, torch.Tensor):
        numel = 1
        for s in value.shape:
            numel *= size_hint(s) or 0
        return numel * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_value_bytes(v) for v in value)
    return 0


def _arg_bytes(arg: object) -> int:
    if isinstance(arg, fx.Node):
        return _value_bytes(arg.meta.get("val"))
    if isinstance(arg, list | tuple):
        return sum(_arg_bytes(a) for a in arg)
    return 0


def node_cost(node: fx.Node) -> tuple[int, int]:
    """``(flops, bytes_moved)`` of running ``node`` once: a FLOP formula's count for the ops
    ``torch.utils.flop_counter`` knows (then no bytes), else the bytes of its tensor inputs and
    outputs. Views and getitems move nothing. Only ops with a formula build (meta) tensors."""
    if node.op != "call_function":
        return 0, 0
    op = op_overload(node)
    if op is None:
        return 0, 0
    formula = _compat.flop_formula(op)
    if formula is not None:
        try:
            with _compat.no_fake_mode():
                args = tuple(_val(a) for a in node.args)
                kwargs = {k: _val(v) for k, v in node.kwargs.items()}
                return int(formula(*args, out_val=_val(node), **kwargs)), 0
        except Exception:  # a formula that cannot read these args: fall back to bytes
            log.debug("fit_to_budget: no FLOP count for %s", node.name, exc_info=True)
    if op.is_view or op is torch.ops.aten.detach.default:
        return 0, 0
    moved = sum(_arg_bytes(a) for a in node.args) + sum(_arg_bytes(v) for v in node.kwargs.values())
    return 0, moved + _value_bytes(node.meta.get("val"))


def _cost(node: fx.Node, costs: dict[fx.Node, tuple[int, int]]) -> tuple[int, int]:
    """``node_cost(node)``, computed once per ``costs`` (one budget fit): the greedy re-prices
    every candidate after each drop, and the repair prices the kept drops again."""
    found = costs.get(node)
    if found is None:
        found = costs[node] = node_cost(node)
    return found


def is_unsafe_to_recompute(node: fx.Node) -> bool:
    """``node`` must not run again in the backward (module doc): a collective outside a
    ``MUST_RECOMPUTE`` chain, a random op, a mutation or forward-only effect."""
    if node.op != "call_function":
        return False
    if (is_collective(node) or is_wait(node)) and not is_must_recompute(node):
        return True
    if _compat.is_random(node) or _compat.is_with_effects(node):
        return True
    mod = _compat.partitioners()
    return bool(mod._must_be_in_forward(node))


def recompute_closure(node: fx.Node, available: set[fx.Node]) -> list[fx.Node] | None:
    """The forward nodes the backward must run to recompute ``node`` from ``available``
    values (``node`` included), or None when one of them is unsafe to recompute or is a
    graph input that is not available."""
    closure: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if current in closure:
            continue
        if current.op == "placeholder" or is_unsafe_to_recompute(current):
            return None
        closure[current] = None
        stack.extend(i for i in current.all_input_nodes if i not in available)
    return list(closure)


def _saved_bytes(values: Iterable[fx.Node]) -> int:
    return count_saved_values(values).nbytes


def _storage_groups(values: Sequence[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Saved activations by the storage they keep alive (inputs excluded): a storage is freed
    only when every saved value on it is dropped, so values sharing one are dropped together."""
    groups: dict[fx.Node, list[fx.Node]] = {}
    for v in values:
        base = storage_base(v)
        if v.op != "call_function" or base.op == "placeholder":
            continue
        if isinstance(base.meta.get("val"), torch.Tensor):
            groups.setdefault(base, []).append(v)
    return groups


def _group_closure(group: list[fx.Node], available: set[fx.Node]) -> list[fx.Node] | None:
    """The recompute closure of every value in ``group`` (None when one is unsafe)."""
    others = available - set(group)
    closure: dict[fx.Node, None] = {}
    for v in group:
        part = recompute_closure(v, others)
        if part is None:
            return None
        closure.update(dict.fromkeys(part))
    return list(closure)


def _greedy_drops(
    graph: fx.Graph, plan: SavePlan, costs: dict[fx.Node, tuple[int, int]]
) -> list[tuple[DroppedSave, fx.Node, int]]:
    """Every drop down to the floor, best score first: ``(record, storage, saved bytes after)``.

    Graph inputs are always available to the backward (the caller holds them; saving one
    costs nothing), as are the plan's symbols and opaque values."""
    saved = list(plan.values)
    available = {*saved, *plan.sym_nodes, *plan.opaque_nodes, *graph.find_nodes(op="placeholder")}
    groups = _storage_groups(saved)
    recomputed: set[fx.Node] = set()
    current = _saved_bytes(saved)
    out: list[tuple[DroppedSave, fx.Node, int]] = []
    # a group's closure changes only when a value it stopped at is dropped: cache it with that
    # boundary (the available inputs it read) and recompute it only then
    cache: dict[fx.Node, tuple[list[fx.Node] | None, set[fx.Node]]] = {}
    while True:
        best: tuple[float, fx.Node, list[fx.Node], int] | None = None
        for base, group in groups.items():
            if base not in cache:
                found = _group_closure(group, available)
                boundary = (
                    {i for n in found for i in n.all_input_nodes if i in available}
                    if found is not None
                    else set()
                )
                cache[base] = (found, boundary)
            closure = cache[base][0]
            if closure is None:
                continue
            freed = node_nbytes(base)
            fresh = [n for n in closure if n not in recomputed]
            cost = sum(sum(_cost(n, costs)) for n in fresh)
            score = freed / (cost + 1)
            if freed > 0 and (best is None or score > best[0]):
                best = (score, base, fresh, freed)
        if best is None:
            return out
        _, base, fresh, freed = best
        dropped = set(groups.pop(base))
        available.difference_update(dropped)
        cache = {b: c for b, c in cache.items() if b in groups and not (c[1] & dropped)}
        recomputed.update(fresh)
        current -= freed
        flops = sum(costs[n][0] for n in fresh)
        moved = sum(costs[n][1] for n in fresh)
        record = DroppedSave(base.name, ap_tags.module_fqn(base), freed, flops, moved, len(fresh))
        out.append((record, base, current))


def _costed_drops(
    graph: fx.Graph,
    plan: SavePlan,
    storages: Sequence[fx.Node],
    costs: dict[fx.Node, tuple[int, int]],
) -> list[DroppedSave] | None:
    """The records of dropping exactly ``storages`` (in this order) from ``plan``: each one's
    recompute closure against what stays saved, a node recomputed for an earlier one counted
    once. None when a closure turns out unsafe (never for subsets of one greedy pass: a
    closure only shrinks as more values stay saved)."""
    gone_bases = set(storages)
    groups = {b: g for b, g in _storage_groups(plan.values).items() if b in gone_bases}
    gone = {v for g in groups.values() for v in g}
    available = {
        *(v for v in plan.values if v not in gone),
        *plan.sym_nodes,
        *plan.opaque_nodes,
        *graph.find_nodes(op="placeholder"),
    }
    recomputed: set[fx.Node] = set()
    records: list[DroppedSave] = []
    for base in storages:
        closure = _group_closure(groups[base], available)
        if closure is None:
            return None
        fresh = [n for n in closure if n not in recomputed]
        recomputed.update(fresh)
        priced = [_cost(n, costs) for n in fresh]
        records.append(
            DroppedSave(
                base.name,
                ap_tags.module_fqn(base),
                node_nbytes(base),
                sum(c[0] for c in priced),
                sum(c[1] for c in priced),
                len(fresh),
            )
        )
    return records


def _total_cost(records: Sequence[DroppedSave]) -> int:
    return sum(d.flops + d.bytes_moved for d in records)


def _restored(
    taken: list[fx.Node], freed: dict[fx.Node, int], after: int, budget_bytes: int
) -> tuple[list[fx.Node], int]:
    """``taken`` less the drops the budget no longer needs, latest (worst-scored) first.

    The greedy prefix stops at the first drop that fits, which can free far more than the
    budget asked for: an earlier, lower-yield drop may then be unnecessary. Keeping a value
    saved is always valid (it is one of the replay's saves) and never adds recomputation."""
    kept = list(taken)
    for base in reversed(taken):
        if after + freed[base] <= budget_bytes:
            kept.remove(base)
            after += freed[base]
    return kept, after


def fit_to_budget(graph: fx.Graph, plan: SavePlan, budget_bytes: int) -> BudgetOutcome:
    """``plan`` with the fewest-cost drops that bring its saved activation bytes to
    ``budget_bytes`` or below (module doc). Raises :class:`BudgetError` when the budget is
    below the floor. ``plan`` itself is not changed.

    The greedy prefix that fits is then pruned (:func:`_restored`); the pruned set is kept
    only when its recompute cost, counted afresh, is lower."""
    before = _saved_bytes(plan.values)
    costs: dict[fx.Node, tuple[int, int]] = {}
    with paused_gc():
        drops = _greedy_drops(graph, plan, costs)
    floor = drops[-1][2] if drops else before
    if budget_bytes < floor:
        raise BudgetError(budget_bytes, floor, before)
    taken: list[tuple[DroppedSave, fx.Node, int]] = []
    after = before
    for record, node, remaining in drops:
        if after <= budget_bytes:
            break
        taken.append((record, node, remaining))
        after = remaining
    records = [record for record, _, _ in taken]
    storages = [node for _, node, _ in taken]
    freed = {node: record.freed_bytes for record, node, _ in taken}
    pruned, pruned_after = _restored(storages, freed, after, budget_bytes)
    if len(pruned) < len(storages):
        with paused_gc():
            repriced = _costed_drops(graph, plan, pruned, costs)
        if repriced is not None and _total_cost(repriced) < _total_cost(records):
            log.debug(
                "fit_to_budget: kept %d of the greedy's drops saved",
                len(storages) - len(pruned),
            )
            records, storages, after = repriced, pruned, pruned_after
    gone_storages = set(storages)
    gone = {v for v in plan.values if storage_base(v) in gone_storages}
    kept = SavePlan(
        [v for v in plan.values if v not in gone], list(plan.sym_nodes), list(plan.opaque_nodes)
    )
    return BudgetOutcome(
        plan=kept,
        budget_bytes=budget_bytes,
        before_bytes=before,
        after_bytes=after,
        floor_bytes=floor,
        dropped=tuple(records),
    )


def budget_fields(outcome: BudgetOutcome) -> dict[str, object]:
    """The ``PartitionReport`` fields of ``outcome``."""
    return {
        "budget_bytes": outcome.budget_bytes,
        "budget_floor_bytes": outcome.floor_bytes,
        "budget_replay_bytes": outcome.before_bytes,
        "recompute_flops": outcome.recompute_flops,
        "recompute_bytes_moved": outcome.recompute_bytes_moved,
        "budget_dropped": tuple(
            f"{d.name} ({d.module_fqn})" if d.module_fqn else d.name for d in outcome.dropped
        ),
    }


def budget_notes(outcome: BudgetOutcome) -> tuple[str, ...]:
    """One line for the report's notes (and the log)."""
    line = (
        f"activation budget {outcome.budget_bytes:,} B: saved {outcome.before_bytes:,} -> "
        f"{outcome.after_bytes:,} B (floor {outcome.floor_bytes:,} B), {len(outcome.dropped)} "
        f"saves recomputed: +{outcome.recompute_flops:,} FLOPs, "
        f"+{outcome.recompute_bytes_moved:,} B moved"
    )
    log.info("fit_to_budget: %s", line)
    return (line,)
