"""Error catalogue: every public entry point of ap-bucketing, given bad input.

Each case checks the exception type is the package's documented one, that the message names the
argument / option / collective at fault, that the graph was not touched, and that torch is left
unpatched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ap_bucketing as AB
import pytest
import torch
import torch._inductor.fx_passes.bucketing as torch_bucketing
import torch._inductor.fx_passes.fsdp as torch_fsdp
import torch._inductor.fx_passes.overlap_scheduling as torch_overlap
import torch.fx as fx
from ap_bucketing import BucketingConfig, MissingValueError, UnsupportedTorchError
from ap_bucketing.synthetic import GraphBuilder
from ap_bucketing.synthetic import all_gather_bucketing_args as ag_args

RANGE = ">=2.13,<2.16"


def _graph() -> fx.GraphModule:
    b = GraphBuilder()
    waits = []
    for _ in range(3):
        p = b.placeholder((4, 4))
        waits.append(b.all_gather(p)[1])
    x = b.placeholder((4, 4))
    y = b.relu(b.mm(x, b.call(torch.ops.aten.t.default, (waits[0],), (4, 32))))
    return b.module([*waits, y])


def _meta_form(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_meta_form(v) for v in value))
    if isinstance(value, dict):
        return {k: _meta_form(v) for k, v in value.items()}
    return copy.deepcopy(value)


def snapshot(gm: fx.GraphModule) -> tuple[str, list[tuple[str, Any]]]:
    return gm.graph.python_code("self").src, [
        (n.name, _meta_form(dict(n.meta))) for n in gm.graph.nodes
    ]


def _torch_functions() -> tuple[object, object]:
    return (
        getattr(torch_fsdp, "identify_fsdp_groups", None),
        getattr(torch_bucketing, "greedy_bucket_collective_by_mb", None),
    )


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[fx.GraphModule], object]
    exc: type[BaseException]
    names: tuple[str, ...]
    setup: Callable[[fx.GraphModule, pytest.MonkeyPatch], None] | None = None


def _bc(**over: Any) -> Callable[[fx.GraphModule], object]:
    def call(gm: fx.GraphModule) -> object:
        _, cap, filt, key = ag_args(gm)
        args: dict[str, Any] = {"gm": gm, "cap_fn": cap, "filter_node": filt, "group_key": key}
        args.update(over)
        return AB.bucket_collectives(**args)

    return call


def _without(module: Any, name: str) -> Callable[..., None]:
    def setup(gm: fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
        mp.delattr(module, name)

    return setup


def _drop_val(node_prefix: str) -> Callable[..., None]:
    def setup(gm: fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
        node = next(n for n in gm.graph.nodes if n.name.startswith(node_prefix))
        del node.meta["val"]

    return setup


CASES: list[Case] = []
# BucketingConfig fields
for field_name, value in [
    ("max_topo_span", -1),
    ("max_topo_span", "10"),
    ("max_topo_span", True),
    ("max_topo_span", 1.5),
    ("max_compute_pre_fetch", -1),
    ("max_compute_pre_fetch", None),
    ("max_compute_pre_fetch", 2.0),
    ("bucket_cap_mb", 0),
    ("bucket_cap_mb", -1.0),
    ("bucket_cap_mb", math.nan),
    ("bucket_cap_mb", math.inf),
    ("bucket_cap_mb", "25"),
    ("bucket_cap_mb", True),
    ("primary_group_only", "yes"),
    ("primary_group_only", 1),
    ("non_adjacent", None),
    ("non_adjacent", 0),
]:
    CASES.append(
        Case(
            f"BucketingConfig/{field_name}={value!r}",
            lambda gm, f=field_name, v=value: BucketingConfig(**{f: v}),
            ValueError,
            (f"BucketingConfig.{field_name}", repr(value)),
        )
    )
CASES.append(
    Case(
        "BucketingConfig/unknown_option",
        lambda gm: BucketingConfig(span=3),  # type: ignore[call-arg]
        TypeError,
        ("span",),
    )
)
# config arguments of the other entry points
for name, call in [
    ("install", lambda gm: AB.install("cfg")),  # type: ignore[arg-type]
    ("patched", lambda gm: AB.patched("cfg").__enter__()),  # type: ignore[arg-type]
    ("bucket_collectives", _bc(config="cfg")),
    ("OverlapBucketingPass", lambda gm: AB.OverlapBucketingPass("cfg")),  # type: ignore[arg-type]
    ("overlap_config_patches", lambda gm: AB.overlap_config_patches("cfg")),  # type: ignore[arg-type]
]:
    CASES.append(Case(f"{name}/config=str", call, ValueError, ("config", "BucketingConfig", "str")))
# bucket_collectives arguments
for bad in ["gm", None, fx.Graph()]:
    CASES.append(
        Case(
            f"bucket_collectives/gm={type(bad).__name__}",
            _bc(gm=bad),
            TypeError,
            ("bucket_collectives", "gm", "GraphModule", type(bad).__name__),
        )
    )
for arg in ["cap_fn", "filter_node", "group_key"]:
    CASES.append(
        Case(
            f"bucket_collectives/{arg}=str",
            _bc(**{arg: "x"}),
            TypeError,
            ("bucket_collectives", arg, "callable", "str"),
        )
    )
CASES.append(
    Case(
        "bucket_collectives/filter_wait_node=3",
        _bc(filter_wait_node=3),
        TypeError,
        ("bucket_collectives", "filter_wait_node", "callable", "int"),
    )
)
CASES.append(
    Case(
        "bucket_collectives/observer=3",
        _bc(observer=3),
        TypeError,
        ("bucket_collectives", "observer", "callable", "int"),
    )
)
for value in ["x", -1.0, 0, math.nan, None]:
    CASES.append(
        Case(
            f"bucket_collectives/cap_fn_returns={value!r}",
            _bc(cap_fn=lambda _i, v=value: v),
            ValueError,
            ("cap_fn", "bucket 0", repr(value)),
        )
    )
CASES.append(
    Case(
        "bucket_collectives/group_key_raises",
        _bc(group_key=lambda n: 1 / 0),
        ValueError,
        ("group key", "all_gather_into_tensor", "ZeroDivisionError"),
    )
)
CASES.append(
    Case(
        "bucket_collectives/group_key_unhashable",
        _bc(group_key=lambda n: [1]),
        ValueError,
        ("group key", "all_gather_into_tensor", "unhashable"),
    )
)
CASES.append(
    Case(
        "bucket_collectives/no_meta_val_on_collective",
        _bc(group_key=lambda n: "k"),
        MissingValueError,
        ("all_gather_into_tensor", "meta['val']"),
        setup=_drop_val("all_gather"),
    )
)
CASES.append(
    Case(
        "bucket_collectives/no_meta_val_on_input",
        _bc(group_key=lambda n: "k"),
        MissingValueError,
        ("all_gather_into_tensor", "input", "p1"),
        setup=_drop_val("p1"),
    )
)
# other functions given the wrong kind of object
CASES += [
    Case(
        "primary_fsdp_groups/gm=str",
        lambda gm: AB.primary_fsdp_groups("gm"),
        TypeError,  # type: ignore[arg-type]
        ("primary_fsdp_groups", "gm", "GraphModule", "str"),
    ),
    Case(
        "primary_fsdp_groups/gm=Graph",
        lambda gm: AB.primary_fsdp_groups(gm.graph),
        TypeError,  # type: ignore[arg-type]
        ("primary_fsdp_groups", "gm", "GraphModule", "Graph"),
    ),
    Case(
        "max_consec_compute_between_rs/graph=str",
        lambda gm: AB.max_consec_compute_between_rs("g"),
        TypeError,  # type: ignore[arg-type]
        ("max_consec_compute_between_rs", "graph", "str"),
    ),
    Case(
        "cpu_runtime_estimation/node=str",
        lambda gm: AB.cpu_runtime_estimation("n"),
        TypeError,  # type: ignore[arg-type]
        ("cpu_runtime_estimation", "node", "str"),
    ),
    Case(
        "OverlapBucketingPass/graph=str",
        lambda gm: AB.OverlapBucketingPass()("g"),
        TypeError,  # type: ignore[arg-type]
        ("OverlapBucketingPass", "graph", "str"),
    ),
    Case(
        "OverlapBucketingPass/graph_without_module",
        lambda gm: AB.OverlapBucketingPass()(fx.Graph()),
        ValueError,
        ("OverlapBucketingPass", "GraphModule"),
    ),
    Case(
        "add_stats_observer/observer=3",
        lambda gm: AB.add_stats_observer(3),
        TypeError,  # type: ignore[arg-type]
        ("add_stats_observer", "observer", "callable", "int"),
    ),
    Case(
        "remove_stats_observer/unknown",
        lambda gm: AB.remove_stats_observer(print),
        ValueError,
        ("stats observer", "not registered"),
    ),
    Case(
        "cpu_overlap_estimators/enabled=str",
        lambda gm: AB.cpu_overlap_estimators("yes").__enter__(),
        TypeError,  # type: ignore[arg-type]
        ("cpu_overlap_estimators", "enabled", "bool", "str"),
    ),
]
for opt, value in [("cpu", "yes"), ("reorder", 1), ("reorder", None)]:
    CASES.append(
        Case(
            f"OverlapBucketingPass/{opt}={value!r}",
            lambda gm, o=opt, v=value: AB.OverlapBucketingPass(**{o: v}),
            TypeError,
            ("OverlapBucketingPass", opt, "bool"),
        )
    )
CASES.append(
    Case(
        "OverlapBucketingPass/unknown_schedule_override",
        lambda gm: AB.OverlapBucketingPass(not_a_scheduler_option=1),
        TypeError,
        ("not_a_scheduler_option", "schedule_overlap_bucketing"),
    )
)
CASES.append(
    Case(
        "overlap_config_patches/unknown_schedule_override",
        lambda gm: AB.overlap_config_patches(max_compute_prefetch=1),
        TypeError,
        ("max_compute_prefetch", "schedule_overlap_bucketing"),
    )
)
# unsupported torch: a patch site or an internal the package reads is missing
CASES += [
    Case(
        "install/no_identify_fsdp_groups",
        lambda gm: AB.install(),
        UnsupportedTorchError,
        ("identify_fsdp_groups", RANGE),
        setup=_without(torch_fsdp, "identify_fsdp_groups"),
    ),
    Case(
        "patched/no_greedy_bucket_collective_by_mb",
        lambda gm: AB.patched().__enter__(),
        UnsupportedTorchError,
        ("greedy_bucket_collective_by_mb", RANGE),
        setup=_without(torch_bucketing, "greedy_bucket_collective_by_mb"),
    ),
    Case(
        "primary_fsdp_groups/no_is_fsdp_all_gather",
        lambda gm: AB.primary_fsdp_groups(gm),
        UnsupportedTorchError,
        ("is_fsdp_all_gather", RANGE),
        setup=_without(torch_fsdp, "is_fsdp_all_gather"),
    ),
    Case(
        "max_consec_compute_between_rs/no_is_compute_node",
        lambda gm: AB.max_consec_compute_between_rs(gm),
        UnsupportedTorchError,
        ("is_compute_node", RANGE),
        setup=_without(torch_overlap, "is_compute_node"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_package_error_naming_the_culprit(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    gm = _graph()
    with monkeypatch.context() as mp:
        if case.setup is not None:
            case.setup(gm, mp)
        originals = _torch_functions()
        before = snapshot(gm)
        with pytest.raises(case.exc) as info:
            case.call(gm)
        assert _torch_functions() == originals, "a refusing call left torch patched"
    message = str(info.value)
    for word in case.names:
        assert word in message, f"{word!r} not in {message!r}"
    assert snapshot(gm) == before
    assert not AB.is_installed()


def test_catalogue_size() -> None:
    assert len(CASES) >= 50


def test_missing_patch_site_leaves_the_other_site_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """install() checks every site before replacing any, so a half-patched torch is impossible."""
    greedy = torch_bucketing.greedy_bucket_collective_by_mb
    monkeypatch.delattr(torch_fsdp, "identify_fsdp_groups")
    with pytest.raises(UnsupportedTorchError):
        AB.install()
    assert torch_bucketing.greedy_bucket_collective_by_mb is greedy
