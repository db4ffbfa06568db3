"""Error catalogue: every public entry point of ap-partitioner, given bad input.

Each case checks the exception type is the package's documented one, that the message names the
argument / option / node at fault, and (for partitioner calls) that a refusal leaves the joint
graph exactly as it was (code and every node's meta).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ap_partitioner as AP
import ap_tags
import pytest
import torch
import torch._functorch.partitioners as torch_partitioners
import torch.fx as fx
import torch.fx.node
from ap_partitioner import (
    TESTED_TORCH,
    MinCutPartitioner,
    ReplayError,
    SaveAllPartitioner,
    UnsupportedTorchError,
)
from ap_tags.scoped import quiet_logger
from ap_tags.torch_support import describe_tested
from ap_testing.graphs import snapshot
from torch.utils.checkpoint import CheckpointPolicy

TESTED = describe_tested(TESTED_TORCH)


@dataclass(frozen=True)
class Case:
    """One bad call: after ``setup(gm, monkeypatch)``, ``call(gm)`` raises ``exc`` and the
    message holds every one of ``names``."""

    id: str
    call: Callable[[fx.GraphModule], object]
    exc: type[BaseException]
    names: tuple[str, ...]
    setup: Callable[[fx.GraphModule, pytest.MonkeyPatch], None] | None = None


def _set_meta(node: str, key: str, value: object) -> Callable[..., None]:
    def setup(gm: fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
        n = next(n for n in gm.graph.nodes if n.name == node)
        n.meta[key] = value

    return setup


def _without(name: str) -> Callable[..., None]:
    def setup(gm: fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
        mp.delattr(torch_partitioners, name)

    return setup


def _registry_not_a_set(gm: fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
    mp.setattr(
        torch.fx.node, "_side_effectful_functions", list(torch.fx.node._side_effectful_functions)
    )


def _save_all(**opts: Any) -> Callable[[fx.GraphModule], object]:
    return lambda gm: SaveAllPartitioner(**opts)(gm, [], num_fwd_outputs=1)


def _call(**kwargs: Any) -> Callable[[fx.GraphModule], object]:
    return lambda gm: SaveAllPartitioner(strict=True)(gm, [], **kwargs)


CASES: list[Case] = []
# constructor options
for opt, value, kind in [
    ("strict", "yes", "str"),
    ("strict", 1, "int"),
    ("strict", None, "NoneType"),
    ("dce_unused_waits", "no", "str"),
    ("dce_unused_waits", 0, "int"),
    ("on_report", 3, "int"),
    ("on_report", "print", "str"),
]:
    CASES.append(
        Case(
            f"SaveAllPartitioner/{opt}={value!r}",
            lambda gm, o=opt, v=value: SaveAllPartitioner(**{o: v}),
            TypeError,
            ("SaveAllPartitioner", opt, kind),
        )
    )
CASES.append(
    Case(
        "MinCutPartitioner/on_report=3",
        lambda gm: MinCutPartitioner(on_report=3),  # type: ignore[arg-type]
        TypeError,
        ("MinCutPartitioner", "on_report", "int"),
    )
)
CASES.append(
    Case(
        "SaveAllPartitioner/unknown_option",
        lambda gm: SaveAllPartitioner(foo=1),  # type: ignore[call-arg]
        TypeError,
        ("foo",),
    )
)
CASES.append(
    Case(
        "MinCutPartitioner/unknown_option",
        lambda gm: MinCutPartitioner(bar=1),  # type: ignore[call-arg]
        TypeError,
        ("bar",),
    )
)
# call arguments
for cls in (SaveAllPartitioner, MinCutPartitioner):
    name = cls.__name__
    for bad in ["gm", None, 3]:
        CASES.append(
            Case(
                f"{name}/gm={type(bad).__name__}",
                lambda gm, c=cls, b=bad: c()(b, [], num_fwd_outputs=1),
                TypeError,
                (name, "gm", "GraphModule", type(bad).__name__),
            )
        )
    CASES.append(
        Case(
            f"{name}/gm=Graph",
            lambda gm, c=cls: c()(gm.graph, [], num_fwd_outputs=1),
            TypeError,
            (name, "gm", "GraphModule", "Graph"),
        )
    )
    CASES.append(
        Case(
            f"{name}/num_fwd_outputs_missing",
            lambda gm, c=cls: c()(gm, []),
            TypeError,
            ("num_fwd_outputs",),
        )
    )
    for value in ["1", 1.5, True, None]:
        CASES.append(
            Case(
                f"{name}/num_fwd_outputs={value!r}",
                lambda gm, c=cls, v=value: c()(gm, [], num_fwd_outputs=v),
                TypeError,
                ("num_fwd_outputs", repr(value)),
            )
        )
    for value in [-1, 3]:
        CASES.append(
            Case(
                f"{name}/num_fwd_outputs={value}",
                lambda gm, c=cls, v=value: c()(gm, [], num_fwd_outputs=v),
                ValueError,
                ("num_fwd_outputs", str(value), "[0, 2]"),
            )
        )
    for value in ["ab", [0.5], [True]]:
        CASES.append(
            Case(
                f"{name}/static_lifetime_input_indices={value!r}",
                lambda gm, c=cls, v=value: c()(
                    gm, [], num_fwd_outputs=1, static_lifetime_input_indices=v
                ),
                TypeError,
                ("static_lifetime_input_indices", repr(value)),
            )
        )
    CASES.append(
        Case(
            f"{name}/joint_inputs=int",
            lambda gm, c=cls: c()(gm, 3, num_fwd_outputs=1),
            TypeError,
            ("joint_inputs", "int"),
        )
    )

# graphs that violate the replay's preconditions (strict: refuse, graph untouched)
CASES += [
    Case(
        "strict/malformed_custom",
        _save_all(strict=True),
        ap_tags.TagError,
        ("add_tensor", "ap_must_save"),
        setup=_set_meta("add_tensor", "custom", {"ap_must_save": "yes"}),
    ),
    Case(
        "strict/malformed_recompute",
        _save_all(strict=True),
        ap_tags.TagError,
        ("sin", "recompute", "2"),
        setup=_set_meta("sin", "recompute", 2),
    ),
    Case(
        "strict/must_recompute_input_no_valid_cut",
        _save_all(strict=True),
        ReplayError,
        ("primals_1", "MUST_RECOMPUTE", "not a valid cut"),
        setup=_set_meta("primals_1", "recompute", CheckpointPolicy.MUST_RECOMPUTE),
    ),
]


def _misuse(
    id: str, call: Callable[[fx.GraphModule], object], *words: str, exc: type[Exception] = TypeError
) -> Case:
    """A public function given a bad argument: the message names the function (``id``'s first
    part) and ``words``."""
    return Case(id, call, exc, (id.split("/")[0], *words))


# other public functions
CASES += [
    _misuse(
        "report_for/fw_module=str",
        lambda gm: AP.report_for("fw", gm, 1),
        "fw_module",
        "GraphModule",
        "str",
    ),
    _misuse(
        "report_for/bw_module=None", lambda gm: AP.report_for(gm, None, 1), "bw_module", "NoneType"
    ),
    _misuse(
        "report_for/num_fwd_outputs=str",
        lambda gm: AP.report_for(gm, gm, "1"),
        "num_fwd_outputs",
        "'1'",
    ),
    _misuse(
        "report_for/num_fwd_outputs=-1",
        lambda gm: AP.report_for(gm, gm, -1),
        ">= 0",
        "-1",
        exc=ValueError,
    ),
    _misuse("plan_saves/candidates=int", lambda gm: AP.plan_saves(3), "candidates", "int"),
    _misuse("plan_saves/candidates=strs", lambda gm: AP.plan_saves(["a"]), "torch.fx.Node", "str"),
    _misuse(
        "is_all_gather_output/node=str",
        lambda gm: AP.is_all_gather_output("a"),
        "torch.fx.Node",
        "str",
    ),
]
# unsupported torch: a partitioner internal disappears / the side-effect registry changes shape
for internal in (
    "classify_nodes",
    "_extract_fwd_bwd_modules",
    "force_save_collectives",
    "min_cut_rematerialization_partition",
):
    CASES.append(
        Case(
            f"SaveAllPartitioner/no_{internal}",
            _save_all(),
            UnsupportedTorchError,
            (internal, TESTED),
            setup=_without(internal),
        )
    )
CASES.append(
    Case(
        "MinCutPartitioner/no_min_cut",
        lambda gm: MinCutPartitioner()(gm, [], num_fwd_outputs=1),
        UnsupportedTorchError,
        ("min_cut_rematerialization_partition", TESTED),
        setup=_without("min_cut_rematerialization_partition"),
    )
)
CASES.append(
    Case(
        "wait_tensor_dce/registry_not_a_set",
        lambda gm: AP.wait_tensor_dce().__enter__(),
        UnsupportedTorchError,
        ("_side_effectful_functions", TESTED),
        setup=_registry_not_a_set,
    )
)
CASES.append(
    Case(
        "SaveAllPartitioner/registry_not_a_set",
        _save_all(),
        UnsupportedTorchError,
        ("_side_effectful_functions", TESTED),
        setup=_registry_not_a_set,
    )
)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with quiet_logger("ap_partitioner"):  # fallback warnings are expected here
        yield


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_package_error_naming_the_culprit(
    case: Case, simple: Callable[[], fx.GraphModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    gm = simple()
    with monkeypatch.context() as mp:
        if case.setup is not None:
            case.setup(gm, mp)
        before = snapshot(gm)
        with pytest.raises(case.exc) as info:
            case.call(gm)
    unnamed = [word for word in case.names if word not in str(info.value)]
    assert not unnamed, f"{unnamed} not in {info.value!s}"
    assert snapshot(gm) == before, "a refusing entry point modified the graph"
    assert not AP.wait_tensor_dce().active


def test_catalogue_size() -> None:
    assert len(CASES) >= 50


@pytest.mark.parametrize(
    "setup",
    [
        _set_meta("add_tensor", "custom", {"ap_must_save": "yes"}),
        _set_meta("add_tensor", "custom", "not-a-dict"),
        _set_meta("primals_1", "recompute", 2),
        _set_meta("sin", "recompute", "MUST_SAVE"),
        _set_meta("primals_1", "recompute", CheckpointPolicy.MUST_RECOMPUTE),
    ],
    ids=[
        "custom_bool",
        "custom_not_dict",
        "recompute_int_on_input",
        "recompute_str",
        "must_recompute_input",
    ],
)
def test_non_strict_never_raises_on_bad_tags(
    setup: Callable[..., None],
    simple: Callable[[], fx.GraphModule],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: malformed tags used to reach min-cut, which crashed on them
    (``'str' object has no attribute 'get'``, "Node ... was invalid, but is output")."""
    gm = simple()
    setup(gm, monkeypatch)
    reports: list[AP.PartitionReport] = []
    fw, bw = SaveAllPartitioner(on_report=reports.append)(gm, [], num_fwd_outputs=1)
    fw.graph.lint()
    bw.graph.lint()
    assert reports[0].fell_back and reports[0].fallback_reason


def test_unsupported_torch_error_follows_the_shared_convention(
    simple: Callable[[], fx.GraphModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One error type per package, deriving from ap-tags' convention and carrying the package,
    the missing internal and the tested versions."""
    monkeypatch.delattr(torch_partitioners, "classify_nodes")
    with pytest.raises(ap_tags.torch_support.UnsupportedTorchError) as info:
        SaveAllPartitioner()(simple(), [], num_fwd_outputs=1)
    assert type(info.value) is UnsupportedTorchError
    assert info.value.package == "ap-partitioner"
    assert info.value.internal == "torch._functorch.partitioners.classify_nodes"
    assert info.value.tested == TESTED_TORCH
