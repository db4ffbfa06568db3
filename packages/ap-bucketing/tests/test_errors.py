"""Error catalogue: every public entry point of ap-bucketing, given bad input.

Each case checks the exception type is the package's documented one, that the message names the
argument / option / collective at fault, that the graph was not touched, and that torch is left
unpatched.
"""

from __future__ import annotations

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
from ap_bucketing import TESTED_TORCH, BucketingConfig, MissingValueError, UnsupportedTorchError
from ap_bucketing._compat import predates_fsdp_prebucketing
from ap_testing.collectives import GraphBuilder
from ap_testing.collectives import all_gather_bucketing_args as ag_args
from ap_testing.graphs import snapshot

TESTED = ", ".join(TESTED_TORCH)


def _graph() -> fx.GraphModule:
    b = GraphBuilder()
    waits = []
    for _ in range(3):
        p = b.placeholder((4, 4))
        waits.append(b.all_gather(p)[1])
    x = b.placeholder((4, 4))
    y = b.relu(b.mm(x, b.call(torch.ops.aten.t.default, (waits[0],), (4, 32))))
    return b.module([*waits, y])


def _torch_functions() -> tuple[object, object]:
    return (
        getattr(torch_fsdp, "identify_fsdp_groups", None),
        getattr(torch_bucketing, "greedy_bucket_collective_by_mb", None),
    )


@dataclass(frozen=True)
class Case:
    """One bad input: ``call(gm)`` raises ``exc`` naming every one of ``names``, after
    ``setup`` and with ``torch_config`` in force."""

    id: str
    call: Callable[[fx.GraphModule], object]
    exc: type[BaseException]
    names: tuple[str, ...]
    setup: Callable[[fx.GraphModule, pytest.MonkeyPatch], None] | None = None
    #: torch config patches in force around the call (torch's config modules cannot be
    #: monkeypatched: pytest deletes the attribute on undo, which hides the option)
    torch_config: dict[str, object] | None = None


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
# BucketingConfig fields: the wrong type is a TypeError, the right type out of range a ValueError
for field_name, value, exc in [
    ("max_topo_span", -1, ValueError),
    ("max_topo_span", "10", TypeError),
    ("max_topo_span", True, TypeError),
    ("max_topo_span", 1.5, TypeError),
    ("max_compute_pre_fetch", -1, ValueError),
    ("max_compute_pre_fetch", None, TypeError),
    ("max_compute_pre_fetch", 2.0, TypeError),
    ("bucket_cap_mb", 0, ValueError),
    ("bucket_cap_mb", -1.0, ValueError),
    ("bucket_cap_mb", math.nan, ValueError),
    ("bucket_cap_mb", math.inf, ValueError),
    ("bucket_cap_mb", "25", TypeError),
    ("bucket_cap_mb", True, TypeError),
    ("primary_group_only", "yes", TypeError),
    ("primary_group_only", 1, TypeError),
    ("non_adjacent", None, TypeError),
    ("non_adjacent", 0, TypeError),
    ("bucket_mode", "custom_ops_multidtype", ValueError),
    ("bucket_mode", None, TypeError),
]:
    CASES.append(
        Case(
            f"BucketingConfig/{field_name}={value!r}",
            lambda gm, f=field_name, v=value: BucketingConfig(**{f: v}),
            exc,
            (f"BucketingConfig: {field_name} must be", repr(value)),
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
    CASES.append(
        Case(f"{name}/config=str", call, TypeError, (f"{name}: config", "BucketingConfig", "str"))
    )
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
for arg in ["filter_wait_node", "observer"]:
    CASES.append(
        Case(
            f"bucket_collectives/{arg}=3",
            _bc(**{arg: 3}),
            TypeError,
            ("bucket_collectives", arg, "a callable or None", "int"),
        )
    )
for value, exc in [("x", TypeError), (None, TypeError), (-1.0, ValueError), (0, ValueError)]:
    CASES.append(
        Case(
            f"bucket_collectives/cap_fn_returns={value!r}",
            _bc(cap_fn=lambda _i, v=value: v),
            exc,
            ("cap_fn", "bucket 0", repr(value)),
        )
    )
CASES.append(
    Case(
        "bucket_collectives/cap_fn_returns=nan",
        _bc(cap_fn=lambda _i: math.nan),
        ValueError,
        ("cap_fn", "bucket 0", "nan"),
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
        TypeError,
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
# other functions given the wrong kind of object: "<function>: <arg> must be <expected>, got ..."
WRONG_KIND: list[tuple[str, str, Callable[[fx.GraphModule], object], str, str]] = [
    ("primary_fsdp_groups", "gm", lambda gm: AB.primary_fsdp_groups("gm"), "GraphModule", "str"),
    ("primary_fsdp_groups", "gm", lambda gm: AB.primary_fsdp_groups(gm.graph), "GraphModule", "Graph"),
    ("max_consec_compute_between_rs", "graph", lambda gm: AB.max_consec_compute_between_rs("g"), "Graph", "str"),
    ("cpu_runtime_estimation", "node", lambda gm: AB.cpu_runtime_estimation("n"), "Node", "str"),
    ("OverlapBucketingPass", "graph", lambda gm: AB.OverlapBucketingPass()("g"), "Graph", "str"),
    ("add_stats_observer", "observer", lambda gm: AB.add_stats_observer(3), "callable", "int"),
    ("cpu_overlap_estimators", "enabled", lambda gm: AB.cpu_overlap_estimators("yes").__enter__(), "bool", "str"),
]  # fmt: skip
for function, arg, call, expected, given in WRONG_KIND:
    names = (f"{function}: {arg} must be", expected, f"got {given}")
    CASES.append(Case(f"{function}/{arg}={given}", call, TypeError, names))
CASES.append(
    Case(
        "OverlapBucketingPass/graph_without_module",
        lambda gm: AB.OverlapBucketingPass()(fx.Graph()),
        ValueError,
        ("OverlapBucketingPass: graph must be owned by a GraphModule",),
    )
)
CASES.append(
    Case(
        "remove_stats_observer/unknown",
        lambda gm: AB.remove_stats_observer(print),
        ValueError,
        ("remove_stats_observer", "stats observer", "not registered"),
    )
)
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
        ("identify_fsdp_groups", TESTED),
        setup=_without(torch_fsdp, "identify_fsdp_groups"),
    ),
    Case(
        "patched/no_greedy_bucket_collective_by_mb",
        lambda gm: AB.patched().__enter__(),
        UnsupportedTorchError,
        ("greedy_bucket_collective_by_mb", TESTED),
        setup=_without(torch_bucketing, "greedy_bucket_collective_by_mb"),
    ),
    Case(
        "primary_fsdp_groups/no_is_fsdp_all_gather",
        lambda gm: AB.primary_fsdp_groups(gm),
        UnsupportedTorchError,
        ("is_fsdp_all_gather", TESTED),
        setup=_without(torch_fsdp, "is_fsdp_all_gather"),
    ),
    Case(
        "max_consec_compute_between_rs/no_is_compute_node",
        lambda gm: AB.max_consec_compute_between_rs(gm),
        UnsupportedTorchError,
        ("is_compute_node", TESTED),
        setup=_without(torch_overlap, "is_compute_node"),
    ),
]


# a cache-key tag the config fingerprint cannot be appended to: refused before any change
for name, call in [
    ("install", lambda gm: AB.install()),
    ("patched", lambda gm: AB.patched().__enter__()),
]:
    CASES.append(
        Case(
            f"{name}/cache_key_tag=None",
            call,
            TypeError,
            (f"{name}: torch.compiler.config.cache_key_tag must be a str", "NoneType"),
            torch_config={"cache_key_tag": None},
        )
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_package_error_naming_the_culprit(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = ("install/no_identify_fsdp_groups", "primary_fsdp_groups/no_is_fsdp_all_gather")
    if case.id in absent and predates_fsdp_prebucketing():
        pytest.skip("this torch predates the fsdp function the case removes (2.13+; carried)")
    gm = _graph()
    with monkeypatch.context() as mp, torch.compiler.config.patch(case.torch_config or {}):
        if case.setup is not None:
            case.setup(gm, mp)
        originals = _torch_functions()
        tag = torch.compiler.config.cache_key_tag
        before = snapshot(gm)
        with pytest.raises(case.exc) as info:
            case.call(gm)
        assert _torch_functions() == originals, "a refusing call left torch patched"
        assert torch.compiler.config.cache_key_tag == tag, "a refusing call changed the tag"
    message = str(info.value)
    for word in case.names:
        assert word in message, f"{word!r} not in {message!r}"
    assert snapshot(gm) == before
    assert not AB.is_installed()


def test_catalogue_size() -> None:
    assert len(CASES) >= 50


@pytest.mark.skipif(
    predates_fsdp_prebucketing(),
    reason="this torch has no fsdp.identify_fsdp_groups to remove (FSDP pre-bucketing is 2.13+)",
)
def test_missing_patch_site_leaves_the_other_site_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """install() checks every site before replacing any, so a half-patched torch is impossible."""
    greedy = torch_bucketing.greedy_bucket_collective_by_mb
    monkeypatch.delattr(torch_fsdp, "identify_fsdp_groups")
    with pytest.raises(UnsupportedTorchError):
        AB.install()
    assert torch_bucketing.greedy_bucket_collective_by_mb is greedy
