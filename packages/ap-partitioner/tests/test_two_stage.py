"""Two-stage compile on an FSDP-style transformer (fake process group, world size 8, CPU).

First compilation: export the joint graph, tag FSDP all-gather chains MUST_RECOMPUTE, partition
with torch's ``default_partition``, interpret with ``preserve_meta_compiler(tag_forward=True)``.
Second compilation: ``torch.compile`` of the first compilation's callable, capturing the
partition with ``aot_module_simplified`` and identity compilers (no codegen). The fake process
group's data is garbage: these tests check structure only, never numbers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ap_tags
import pytest
import torch
import torch.fx as fx
from ap_partitioner import (
    MinCutPartitioner,
    PartitionReport,
    SaveAllPartitioner,
    is_all_gather_output,
    report_for,
)
from ap_tags.graph import (
    activation_storages,
    aliases_input,
    saved_for_backward,
    storage_base,
    storage_nbytes,
)
from ap_testing.distributed import fake_world
from ap_testing.models import Transformer
from ap_testing.two_stage import First, first_compile, second_compile

ORIGIN = "test_origin"  # custom key: the first forward node a second-graph node was traced from


# ----------------------------------------------------------------------------- two stages


def _stamp_origin(fw: fx.GraphModule) -> None:
    """Provenance for the comparison: every first-forward node records its own name (in its
    own ``custom`` dict), which the retrace carries onto the nodes traced from it."""
    for node in fw.graph.nodes:
        node.meta["custom"] = {**(node.meta.get("custom") or {}), ORIGIN: node.name}


@dataclass
class FirstPartition:
    """The first compilation and the report of its partition (torch's ``default_partition``)."""

    compiled: First
    report: PartitionReport

    @property
    def fw(self) -> fx.GraphModule:
        return self.compiled.fw

    @property
    def num_fwd_outputs(self) -> int:
        return self.compiled.num_fwd_outputs


def _second(
    first: FirstPartition, partitioner: Any, *, ac: bool
) -> tuple[PartitionReport, fx.GraphModule]:
    """``torch.compile`` the first callable; return the partition report and forward graph."""
    reports: list[PartitionReport] = []
    partitioner.on_report = reports.append
    joint_pass = ap_tags.ac_joint_pass("auto") if ac else None
    graphs = second_compile(first.compiled, partitioner, joint_pass=joint_pass)
    assert len(reports) == 1 and len(graphs) == 1
    return reports[0], graphs[0]


# ----------------------------------------------------------------------------- comparison


def _canonical_classes(fw: fx.GraphModule) -> dict[str, str]:
    """first-forward node name -> name of its CSE class representative.

    Structurally identical values (``y.view(...)`` feeding q, k and v) are one value: either
    partition may save any of them. Comparing classes compares values.
    """
    rep: dict[fx.Node, str] = {}
    seen: dict[Any, str] = {}
    for node in fw.graph.nodes:
        if node.op != "call_function" or node.is_impure():
            rep[node] = node.name
            continue
        key = (
            node.target,
            repr(fx.node.map_arg(node.args, lambda a: rep[a])),
            repr(fx.node.map_arg(node.kwargs, lambda a: rep[a])),
        )
        rep[node] = seen.setdefault(key, node.name)
    return {n.name: r for n, r in rep.items()}


def _shape(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
    val = node.meta["val"]
    return tuple(val.shape), val.dtype


def _origin(node: fx.Node) -> str | None:
    custom = node.meta.get("custom") or {}
    return custom.get(ORIGIN)


def _saved_activations(fw: fx.GraphModule, names: tuple[str, ...]) -> list[fx.Node]:
    by_name = {n.name: n for n in fw.graph.nodes}
    return [by_name[n] for n in names if by_name[n].op != "placeholder"]


def first_saved_classes(first: FirstPartition) -> list[str]:
    classes = _canonical_classes(first.fw)
    acts = _saved_activations(first.fw, first.report.saved_names)
    # by storage: SaveAll recomputes a view of a saved value from its saved base
    return sorted({classes[storage_base(n).name] for n in acts})


def replayed_classes(
    first: FirstPartition, fw: fx.GraphModule, report: PartitionReport
) -> list[str]:
    """Map each saved value of a second partition back to the first forward node it came from.

    A getitem created by a retrace inherits its parent's meta, so it maps to the first graph's
    getitem of the same index under that parent.
    """
    classes = _canonical_classes(first.fw)
    first_nodes = {n.name: n for n in first.fw.graph.nodes}
    out: list[str] = []
    for node in _saved_activations(fw, report.saved_names):
        origin = _origin(node)
        # the retraced backward may read a fresh alias (``detach``) of a tagged value: the
        # replay saves what the backward reads, and an alias is the same value and storage
        while origin is None and aliases_input(node) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            origin = _origin(node)
        if origin is None:
            out.append(f"<untagged {node.name}>")
            continue
        src = first_nodes[origin]
        if node.target is operator.getitem and src.target is not operator.getitem:
            src = next(
                u for u in src.users if u.target is operator.getitem and u.args[1] == node.args[1]
            )
        out.append(classes[storage_base(src).name])
    return sorted(out)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def world() -> Iterator[str]:
    with fake_world() as group_name:
        yield group_name


@pytest.fixture(scope="module")
def first(world: str) -> FirstPartition:
    torch.manual_seed(0)
    model = Transformer(layers=2)
    compiled = first_compile(model, torch.randn(2, 16, 64), fw_hook=_stamp_origin)
    assert compiled.fsdp.chains_found == 6 * len(model.layers)
    report = report_for(compiled.fw, compiled.bw, compiled.num_fwd_outputs, partitioner="first")
    return FirstPartition(compiled, report)


_cache: dict[tuple[str, bool], tuple[PartitionReport, fx.GraphModule]] = {}


@pytest.fixture(scope="module")
def run(first: FirstPartition) -> Callable[[str, bool], tuple[PartitionReport, fx.GraphModule]]:
    def get(which: str, ac: bool) -> tuple[PartitionReport, fx.GraphModule]:
        if (which, ac) not in _cache:
            part = SaveAllPartitioner(strict=True) if which == "save_all" else MinCutPartitioner()
            _cache[(which, ac)] = _second(first, part, ac=ac)
        return _cache[(which, ac)]

    _cache.clear()
    return get


# ----------------------------------------------------------------------------- tests


def test_first_partition_saves_no_all_gather_outputs(first: FirstPartition) -> None:
    assert first.report.saved_activation_count > 0
    assert first.report.saved_all_gather_count == 0
    assert first.report.backward_all_gathers > 0  # the backward re-gathers the weights


@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "ac"])
def test_save_all_replays_the_first_saved_set(first: FirstPartition, run: Any, ac: bool) -> None:
    report, fw = run("save_all", ac)
    assert not report.fell_back
    expected = first_saved_classes(first)
    got = replayed_classes(first, fw, report)
    # same values; a value saved more than once is the same storage (three views of one
    # normalized input feeding q, k and v), which the storage measure below counts once
    assert sorted(set(got)) == expected
    first_storages = activation_storages(saved_for_backward(first.fw, first.num_fwd_outputs))
    replayed = [n for n in fw.graph.nodes if n.name in report.saved_names]
    replay_storages = activation_storages(replayed)
    if not ac:  # AC may add stage-boundary saves; without it the storages are the same
        # the same storages (as a multiset of shape and dtype; the two forwards order them
        # differently)
        assert sorted(map(_shape, replay_storages), key=repr) == sorted(
            map(_shape, first_storages), key=repr
        )
        assert storage_nbytes(replay_storages) == storage_nbytes(first_storages)


def test_save_all_saves_no_all_gather_or_wait_output(run: Any) -> None:
    report, fw = run("save_all", True)
    assert report.saved_all_gather_count == 0 and report.saved_all_gather_bytes == 0
    by_name = {n.name: n for n in fw.graph.nodes}
    for name in report.saved_names:
        assert not is_all_gather_output(by_name[name]), name


def test_min_cut_with_ac_differs_from_the_replay(first: FirstPartition, run: Any) -> None:
    save_all, sa_fw = run("save_all", True)
    min_cut, mc_fw = run("min_cut", True)
    assert replayed_classes(first, mc_fw, min_cut) != replayed_classes(first, sa_fw, save_all)
    rows = {
        "first": first.report,
        "save_all+ac": save_all,
        "min_cut+ac": min_cut,
        "min_cut": run("min_cut", False)[0],
    }
    print("\npartition           saved_act  act_bytes  ag_saved  ag_bytes  bw_coll  bw_ag  time_ms")
    for name, r in rows.items():
        print(
            f"{name:<18} {r.saved_activation_count:>10} {r.saved_activation_bytes:>10} "
            f"{r.saved_all_gather_count:>9} {r.saved_all_gather_bytes:>9} "
            f"{r.backward_collectives:>8} {r.backward_all_gathers:>6} "
            f"{r.partition_time_s * 1e3:>8.1f}"
        )
    # the replay re-gathers exactly what the first backward re-gathered
    assert save_all.backward_all_gathers == first.report.backward_all_gathers
    assert save_all.backward_collectives == first.report.backward_collectives


def test_wait_dce_keeps_unused_cast_parameters_out_of_the_saved_set(
    first: FirstPartition, run: Any
) -> None:
    """Without ``wait_tensor_dce`` an unused re-gather in the backward (layer 0's q/k/v weights:
    the input needs no gradient) stays alive through its impure wait, so extraction hands the
    sharded parameter to the backward as a saved input with no users."""
    with_dce, _ = run("save_all", False)
    without, _ = _second(first, SaveAllPartitioner(dce_unused_waits=False), ac=False)
    extra = set(without.saved_names) - set(with_dce.saved_names)
    assert extra and all(name.startswith("primals_") for name in extra), extra
    assert without.saved_input_count == with_dce.saved_input_count + len(extra)
