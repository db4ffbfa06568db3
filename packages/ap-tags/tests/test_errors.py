"""Error catalogue: every public entry point of ap-tags, given bad input.

Each case builds a fresh small joint graph, optionally corrupts it (``setup``), snapshots it,
calls one entry point and checks (1) the exception type is the package's documented one,
(2) the message names the node / key / option at fault, (3) a pass that refused its input left
the graph exactly as it was (code and every node's meta).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ap_tags as T
import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
import torch.fx
import torch.fx.traceback
import torch.utils.checkpoint
from ap_tags import TagError, UnsupportedTorchError
from ap_tags._compat import functional_collective_ops
from ap_testing.graphs import snapshot
from torch.utils.checkpoint import CheckpointPolicy as P

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
Nodes = dict[str, torch.fx.Node]


def _joint() -> tuple[torch.fx.GraphModule, Nodes]:
    """``w -> cast -> all_gather -> wait -> mm(x, .) -> relu -> split -> getitems``; the
    backward multiplies the tangent by saved forward values (so mark_ac_stages has candidates).
    """
    g = torch.fx.Graph()

    def op(target: Any, args: tuple[Any, ...], name: str, val: Any) -> torch.fx.Node:
        n = g.call_function(target, args, name=name)
        n.meta["val"] = val
        return n

    w = g.placeholder("primals_1")
    w.meta["val"] = torch.empty(2, 4)
    x = g.placeholder("primals_2")
    x.meta["val"] = torch.empty(4, 4)
    t = g.placeholder("tangents_1")
    t.meta["val"] = torch.empty(2, 4)
    cast = op(aten._to_copy.default, (w,), "cast", torch.empty(2, 4))
    ag = op(c10d.all_gather_into_tensor.default, (cast, 2, "0"), "ag", torch.empty(4, 4))
    wait = op(c10d.wait_tensor.default, (ag,), "wait", torch.empty(4, 4))
    mm = op(aten.mm.default, (x, wait), "mm", torch.empty(4, 4))
    relu = op(aten.relu.default, (mm,), "relu", torch.empty(4, 4))
    split = op(aten.split.Tensor, (relu, 2), "split", (torch.empty(2, 4), torch.empty(2, 4)))
    g0 = op(operator.getitem, (split, 0), "getitem_0", torch.empty(2, 4))
    g1 = op(operator.getitem, (split, 1), "getitem_1", torch.empty(2, 4))
    gr = op(aten.mul.Tensor, (t, g0), "grad_mul", torch.empty(2, 4))
    gr2 = op(aten.add.Tensor, (gr, g1), "grad_add", torch.empty(2, 4))
    g.output((g0, gr2, relu, g1))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    return gm, {n.name: n for n in gm.graph.nodes}


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[torch.fx.GraphModule, Nodes], object]
    exc: type[BaseException]
    names: tuple[str, ...]
    setup: Callable[[torch.fx.GraphModule, Nodes, pytest.MonkeyPatch], None] | None = None
    unchanged: bool = True


def _set_custom(node: str, key: str, value: object) -> Callable[..., None]:
    def setup(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
        n[node].meta.setdefault("custom", {})[key] = value

    return setup


def _set_meta(node: str, key: str, value: object) -> Callable[..., None]:
    def setup(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
        n[node].meta[key] = value

    return setup


def _no_checkpoint_policy(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
    mp.delattr(torch.utils.checkpoint, "CheckpointPolicy")


def _recompute_then_no_policy(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
    n["relu"].meta["recompute"] = P.MUST_SAVE  # validating it needs the enum
    _no_checkpoint_policy(gm, n, mp)


def _no_fx_traceback(name: str) -> Callable[..., None]:
    def setup(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
        mp.delattr(torch.fx.traceback, name)

    return setup


class _NoCollectives:
    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"no op {name}")


def _no_collectives(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
    functional_collective_ops.cache_clear()
    mp.setattr(torch.ops, "_c10d_functional", _NoCollectives())


RANGE = ", ".join(T.TESTED_TORCH)
GRAPH_ARG = "must be a torch.fx.Graph or torch.fx.GraphModule"
BAD_GRAPHS: list[object] = ["graph", None, 3, torch.nn.Linear(2, 2)]

VALIDATE_CASES = [
    # (node, custom key or top-level key, bad value, words the message must contain)
    ("relu", "custom", "not-a-dict", ["custom", "str", "not dict"]),
    ("relu", "custom:ap_must_save", 1, ["ap_must_save", "bool", "1"]),
    ("relu", "custom:ap_must_save", "yes", ["ap_must_save", "'yes'"]),
    ("split", "custom:ap_must_save_getitem_indices", 3, ["ap_must_save_getitem_indices", "int"]),
    ("split", "custom:ap_must_save_getitem_indices", ["0"], ["non-int", "'0'"]),
    ("split", "custom:ap_must_save_getitem_indices", [True], ["non-int", "True"]),
    ("split", "custom:ap_must_save_getitem_indices", [-1], ["negative", "-1"]),
    ("split", "custom:ap_must_save_getitem_indices", [1, 1], ["duplicate", "[1]"]),
    ("split", "custom:ap_must_save_getitem_indices", [7], ["out of range", "[7]", "2 outputs"]),
    ("mm", "custom:module_fqn", 3, ["module_fqn", "str", "3"]),
    ("mm", "custom:ap_chunk_index", -1, ["ap_chunk_index", ">= 0", "-1"]),
    ("mm", "custom:ap_chunk_index", "0", ["ap_chunk_index", "int", "'0'"]),
    ("mm", "custom:ap_chunk_index", True, ["ap_chunk_index", "True"]),
    ("mm", "custom:ap_chunk_region", 1, ["ap_chunk_region", "str"]),
    ("mm", "custom:ap_chunk_glue", "yes", ["ap_chunk_glue", "bool"]),
    ("relu", "recompute", 2, ["recompute", "CheckpointPolicy", "2"]),
    ("relu", "recompute", "MUST_SAVE", ["recompute", "'MUST_SAVE'"]),
    ("relu", "ac_graph_id", "1", ["ac_graph_id", "int", "'1'"]),
    ("relu", "ac_graph_id", True, ["ac_graph_id", "True"]),
    ("relu", "ac_graph_id", 1.5, ["ac_graph_id", "1.5"]),
]


def _validate_setup(node: str, key: str, value: object) -> Callable[..., None]:
    if key.startswith("custom:"):
        setup = _set_custom(node, key.split(":", 1)[1], value)
        if key.endswith("indices"):
            base = setup

            def setup(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
                base(gm, n, mp)
                n[node].meta["custom"]["ap_must_save"] = True

        return setup
    return _set_meta(node, key, value)


CASES: list[Case] = []
for bad in BAD_GRAPHS:
    kind = type(bad).__name__
    CASES += [
        Case(
            f"validate_tags/graph={kind}",
            lambda gm, n, b=bad: T.validate_tags(b),
            TypeError,
            ("validate_tags", GRAPH_ARG, kind),
        ),
        Case(
            f"fsdp/graph={kind}",
            lambda gm, n, b=bad: T.mark_fsdp_all_gather_recomputation(b),
            TypeError,
            ("mark_fsdp_all_gather_recomputation", GRAPH_ARG, kind),
        ),
        Case(
            f"ac_stages/graph={kind}",
            lambda gm, n, b=bad: T.mark_ac_stages(b),
            TypeError,
            ("mark_ac_stages", GRAPH_ARG, kind),
        ),
        Case(
            f"tag_saved_outputs/fw_gm={kind}",
            lambda gm, n, b=bad: T.tag_saved_outputs(b),
            TypeError,
            ("tag_saved_outputs", "fw_gm", "GraphModule", kind),
        ),
        Case(
            f"ac_joint_pass/fx_g={kind}",
            lambda gm, n, b=bad: T.ac_joint_pass(1.0)(b, []),
            TypeError,  # type: ignore[arg-type]
            ("mark_ac_stages", GRAPH_ARG, kind),
        ),
        Case(
            f"preserve_meta_compiler/gm={kind}",
            lambda gm, n, b=bad: T.preserve_meta_compiler()(b, []),
            TypeError,  # type: ignore[arg-type]
            ("preserve_meta_compiler", "gm", kind),
        ),
    ]
for accessor in [
    "custom_meta",
    "is_must_save",
    "must_save_indices",
    "recompute_policy",
    "ac_graph_id",
    "module_fqn",
    "mark_must_save",
    "node_tag_problems",
]:
    CASES.append(
        Case(
            f"{accessor}/node=str",
            lambda gm, n, a=accessor: getattr(T, a)("relu"),
            TypeError,
            (accessor, "torch.fx.Node", "str"),
        )
    )
for bad in ["gm", None, torch.fx.Graph()]:
    CASES.append(
        Case(
            f"release_recomputed_saves/bw_gm={type(bad).__name__}",
            lambda gm, n, b=bad: T.release_recomputed_saves(b),  # type: ignore[arg-type]
            TypeError,
            ("release_recomputed_saves", "bw_gm", "GraphModule", type(bad).__name__),
        )
    )
CASES.append(
    Case(
        "set_recompute/node=str",
        lambda gm, n: T.set_recompute("relu", P.MUST_SAVE),  # type: ignore[arg-type]
        TypeError,
        ("set_recompute", "torch.fx.Node", "str"),
    )
)
CASES.append(
    Case(
        "tag_saved_outputs/fw_gm=Graph",
        lambda gm, n: T.tag_saved_outputs(gm.graph),  # type: ignore[arg-type]
        TypeError,
        ("tag_saved_outputs", "GraphModule", "Graph"),
    )
)

for node, key, value, words in VALIDATE_CASES:
    CASES.append(
        Case(
            f"validate_tags/{node}.{key}={value!r}",
            lambda gm, n: T.validate_tags(gm),
            TagError,
            (node, *words),
            setup=_validate_setup(node, key, value),
        )
    )
CASES.append(
    Case(
        "validate_tags/indices_without_must_save",
        lambda gm, n: T.validate_tags(gm),
        TagError,
        ("split", "ap_must_save_getitem_indices is set but ap_must_save is not True"),
        setup=_set_custom("split", "ap_must_save_getitem_indices", [0]),
    )
)


def _two_bad(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
    n["relu"].meta["recompute"] = 2
    n["mm"].meta["custom"] = {"ap_must_save": 1, "module_fqn": 5}


CASES.append(
    Case(
        "validate_tags/every_bad_node_named",
        lambda gm, n: T.validate_tags(gm),
        TagError,
        ("2 nodes", "relu", "mm", "ap_must_save", "module_fqn"),
        setup=_two_bad,
    )
)

# accessors reading malformed values
CASES += [
    Case(
        "custom_meta/non_dict",
        lambda gm, n: T.custom_meta(n["relu"]),
        TagError,
        ("relu", "custom", "list"),
        setup=_set_meta("relu", "custom", [1]),
    ),
    Case(
        "is_must_save/int",
        lambda gm, n: T.is_must_save(n["relu"]),
        TagError,
        ("relu", "ap_must_save", "bool"),
        setup=_set_custom("relu", "ap_must_save", 1),
    ),
    Case(
        "must_save_indices/negative",
        lambda gm, n: T.must_save_indices(n["split"]),
        TagError,
        ("split", "negative", "-1"),
        setup=_set_custom("split", "ap_must_save_getitem_indices", [-1]),
    ),
    Case(
        "must_save_indices/str",
        lambda gm, n: T.must_save_indices(n["split"]),
        TagError,
        ("split", "ap_must_save_getitem_indices", "str"),
        setup=_set_custom("split", "ap_must_save_getitem_indices", "01"),
    ),
    Case(
        "recompute_policy/int",
        lambda gm, n: T.recompute_policy(n["relu"]),
        TagError,
        ("relu", "recompute", "2"),
        setup=_set_meta("relu", "recompute", 2),
    ),
    Case(
        "ac_graph_id/str",
        lambda gm, n: T.ac_graph_id(n["relu"]),
        TagError,
        ("relu", "ac_graph_id", "'x'"),
        setup=_set_meta("relu", "ac_graph_id", "x"),
    ),
    Case(
        "module_fqn/int",
        lambda gm, n: T.module_fqn(n["mm"]),
        TagError,
        ("mm", "module_fqn", "3"),
        setup=_set_custom("mm", "module_fqn", 3),
    ),
]
# writers given bad values (nothing written)
CASES += [
    Case(
        "mark_must_save/index=-1",
        lambda gm, n: T.mark_must_save(n["split"], -1),
        TagError,
        ("split", "index", "-1"),
    ),
    Case(
        "mark_must_save/index=str",
        lambda gm, n: T.mark_must_save(n["split"], "0"),
        TagError,
        ("split", "index", "'0'"),
    ),  # type: ignore[arg-type]
    Case(
        "mark_must_save/index=bool",
        lambda gm, n: T.mark_must_save(n["split"], True),
        TagError,
        ("split", "index", "True"),
    ),
    Case(
        "mark_must_save/malformed_existing",
        lambda gm, n: T.mark_must_save(n["split"], 0),
        TagError,
        ("split", "duplicate", "[1]"),
        setup=_set_custom("split", "ap_must_save_getitem_indices", [1, 1]),
    ),
    Case(
        "set_recompute/policy=int",
        lambda gm, n: T.set_recompute(n["relu"], 2),
        TagError,
        ("relu", "recompute", "CheckpointPolicy", "2"),
    ),
    Case(
        "set_recompute/ac_graph_id=str",
        lambda gm, n: T.set_recompute(n["relu"], P.MUST_SAVE, "1"),  # type: ignore[arg-type]
        TagError,
        ("relu", "ac_graph_id", "'1'"),
    ),
]
# options
for value in ["yes", 1, None]:
    CASES.append(
        Case(
            f"fsdp/reshard_after_forward={value!r}",
            lambda gm, n, v=value: T.mark_fsdp_all_gather_recomputation(gm, v),  # type: ignore[arg-type]
            TypeError,
            ("reshard_after_forward", "bool", type(value).__name__),
        )
    )
for value, exc in [
    (0, ValueError),
    (-1.0, ValueError),
    (float("nan"), ValueError),
    (float("inf"), ValueError),
    (True, TypeError),
    ("big", ValueError),
    (None, TypeError),
]:
    CASES.append(
        Case(
            f"ac_stages/stage_size_gib={value!r}",
            lambda gm, n, v=value: T.mark_ac_stages(gm, stage_size_gib=v),  # type: ignore[arg-type]
            exc,
            ("mark_ac_stages", "stage_size_gib", "'auto' or a positive finite number", repr(value)),
        )
    )
    CASES.append(
        Case(
            f"ac_joint_pass/stage_size_gib={value!r}",
            lambda gm, n, v=value: T.ac_joint_pass(v),  # type: ignore[arg-type]
            exc,
            ("ac_joint_pass", "stage_size_gib", repr(value)),
        )
    )
for value in [1, "yes", None]:
    CASES.append(
        Case(
            f"preserve_meta_compiler/tag_forward={value!r}",
            lambda gm, n, v=value: T.preserve_meta_compiler(v),  # type: ignore[arg-type]
            TypeError,
            ("tag_forward", "bool", type(value).__name__),
        )
    )
for value in ["1", 1.0, True]:
    CASES.append(
        Case(
            f"preserve_meta_compiler/num_fwd_outputs={value!r}",
            lambda gm, n, v=value: T.preserve_meta_compiler(True, v),  # type: ignore[arg-type]
            TypeError,
            ("preserve_meta_compiler", "num_fwd_outputs", repr(value)),
        )
    )
    CASES.append(
        Case(
            f"tag_saved_outputs/num_fwd_outputs={value!r}",
            lambda gm, n, v=value: T.tag_saved_outputs(gm, num_fwd_outputs=v),  # type: ignore[arg-type]
            TypeError,
            ("tag_saved_outputs", "num_fwd_outputs", repr(value)),
        )
    )
for value in [-1, 5]:
    CASES.append(
        Case(
            f"tag_saved_outputs/num_fwd_outputs={value}",
            lambda gm, n, v=value: T.tag_saved_outputs(gm, num_fwd_outputs=v),
            ValueError,
            ("num_fwd_outputs", str(value), "[0, 4]"),
        )
    )
for fn, call in [
    (
        "mark_fsdp_all_gather_recomputation",
        lambda gm, n: T.mark_fsdp_all_gather_recomputation(gm, reshard=True),
    ),  # type: ignore[call-arg]
    ("mark_ac_stages", lambda gm, n: T.mark_ac_stages(gm, stage_size=1.0)),  # type: ignore[call-arg]
    ("tag_saved_outputs", lambda gm, n: T.tag_saved_outputs(gm, num_fwd=1)),  # type: ignore[call-arg]
    ("validate_tags", lambda gm, n: T.validate_tags(gm, strict=True)),  # type: ignore[call-arg]
    ("preserve_meta_compiler", lambda gm, n: T.preserve_meta_compiler(tag_fw=True)),  # type: ignore[call-arg]
    (
        "annotate_module_fqns",
        lambda gm, n: T.annotate_module_fqns(torch.nn.Linear(1, 1), root=True),
    ),  # type: ignore[call-arg]
]:
    CASES.append(Case(f"{fn}/unknown_option", call, TypeError, ("unexpected keyword",)))
for value in ["model", None, torch.fx.Graph()]:
    CASES.append(
        Case(
            f"annotate_module_fqns/model={type(value).__name__}",
            lambda gm, n, v=value: T.annotate_module_fqns(v).__enter__(),  # type: ignore[arg-type]
            TypeError,
            ("annotate_module_fqns", "nn.Module", type(value).__name__),
        )
    )

# graphs that violate a pass's preconditions: malformed existing tags (refused, untouched)
CASES += [
    Case(
        "ac_stages/malformed_recompute_on_candidate",
        lambda gm, n: T.mark_ac_stages(gm),
        TagError,
        ("relu", "recompute", "2"),
        setup=_set_meta("relu", "recompute", 2),
    ),
    Case(
        "ac_stages/malformed_ac_graph_id_on_candidate",
        lambda gm, n: T.mark_ac_stages(gm),
        TagError,
        ("mm", "ac_graph_id", "'x'"),
        setup=_set_meta("mm", "ac_graph_id", "x"),
    ),
    Case(
        "tag_saved_outputs/saved_node_custom_not_dict",
        lambda gm, n: T.tag_saved_outputs(gm, num_fwd_outputs=1),
        TagError,
        ("grad_add", "custom", "str"),
        setup=_set_meta("grad_add", "custom", "oops"),
    ),
    Case(
        "tag_saved_outputs/parent_indices_malformed",
        lambda gm, n: T.tag_saved_outputs(gm, num_fwd_outputs=1),
        TagError,
        ("split", "ap_must_save_getitem_indices", "str"),
        setup=_set_custom("split", "ap_must_save_getitem_indices", "0"),
    ),
]


def _negative_getitem(gm: torch.fx.GraphModule, n: Nodes, mp: pytest.MonkeyPatch) -> None:
    n["getitem_1"].args = (n["split"], -1)
    gm.recompile()


# regression: the relu output used to be stamped before the bad getitem was refused
CASES.append(
    Case(
        "tag_saved_outputs/negative_getitem_index_refused_before_writing",
        lambda gm, n: T.tag_saved_outputs(gm, num_fwd_outputs=1),
        TagError,
        ("getitem_1", "index -1"),
        setup=_negative_getitem,
    )
)

# unsupported torch (the internal each probe looks up is removed)
CASES += [
    Case(
        "fsdp/no_CheckpointPolicy",
        lambda gm, n: T.mark_fsdp_all_gather_recomputation(gm),
        UnsupportedTorchError,
        ("CheckpointPolicy", RANGE),
        setup=_no_checkpoint_policy,
    ),
    Case(
        "ac_stages/no_CheckpointPolicy",
        lambda gm, n: T.mark_ac_stages(gm),
        UnsupportedTorchError,
        ("CheckpointPolicy", RANGE),
        setup=_no_checkpoint_policy,
    ),
    Case(
        "validate_tags/no_CheckpointPolicy",
        lambda gm, n: T.validate_tags(gm),
        UnsupportedTorchError,
        ("CheckpointPolicy", RANGE),
        setup=_recompute_then_no_policy,
    ),
    Case(
        "set_recompute/no_CheckpointPolicy",
        lambda gm, n: T.set_recompute(n["relu"], 2),
        UnsupportedTorchError,
        ("CheckpointPolicy", RANGE),
        setup=_no_checkpoint_policy,
    ),
    Case(
        "fsdp/no_functional_collectives",
        lambda gm, n: T.mark_fsdp_all_gather_recomputation(gm),
        UnsupportedTorchError,
        ("_c10d_functional", RANGE),
        setup=_no_collectives,
    ),
    Case(
        "preserve_meta_compiler/no_preserve_node_meta",
        lambda gm, n: T.preserve_meta_compiler(),
        UnsupportedTorchError,
        ("torch.fx.traceback.preserve_node_meta", RANGE),
        setup=_no_fx_traceback("preserve_node_meta"),
    ),
    Case(
        "annotate_module_fqns/no_annotate",
        lambda gm, n: T.annotate_module_fqns(torch.nn.Linear(1, 1)).__enter__(),
        UnsupportedTorchError,
        ("torch.fx.traceback.annotate", RANGE),
        setup=_no_fx_traceback("annotate"),
    ),
]


@pytest.fixture(autouse=True)
def _fresh_probe_cache() -> Any:
    functional_collective_ops.cache_clear()
    yield
    functional_collective_ops.cache_clear()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_package_error_naming_the_culprit(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    gm, nodes = _joint()
    with monkeypatch.context() as mp:
        if case.setup is not None:
            case.setup(gm, nodes, mp)
        before = snapshot(gm)
        with pytest.raises(case.exc) as info:
            case.call(gm, nodes)
    message = str(info.value)
    for word in case.names:
        assert word in message, f"{word!r} not in {message!r}"
    if case.unchanged:
        assert snapshot(gm) == before


def test_catalogue_size() -> None:
    """The report quotes this number; keep it honest."""
    assert len(CASES) >= 100


def test_tag_error_is_a_value_error_and_lists_problems() -> None:
    gm, n = _joint()
    n["relu"].meta["recompute"] = 2
    with pytest.raises(ValueError) as info:
        T.validate_tags(gm)
    assert isinstance(info.value, TagError)
    assert set(info.value.problems) == {"relu"}


def test_tuple_indices_accepted_by_writer_as_by_validator() -> None:
    """Regression: validate_tags accepts a tuple index list, mark_must_save refused it."""
    gm, n = _joint()
    n["split"].meta["custom"] = {"ap_must_save": True, "ap_must_save_getitem_indices": (1,)}
    T.validate_tags(gm)
    T.mark_must_save(n["split"], 0)
    assert T.must_save_indices(n["split"]) == (1, 0)
    T.validate_tags(gm)
