"""ap-bucketing's own copies of shared concepts agree with ap-tags' definitions.

ap-bucketing depends on torch only, so it cannot import ``ap_tags``; it keeps its own copies of
the few concepts it needs (``docs/architecture.md``, "Shared vocabulary and conventions"):

* the wait op it keys on (``_compat.wait_tensor_op``) vs ``ap_tags.graph.is_wait``;
* its reduce-scatter predicate (``_metrics.is_reduce_scatter``) vs
  ``ap_tags.graph.is_reduce_scatter``;
* hint-safe sizes (``_sizes.hint_int``, ``_sizes.collective_bytes``) vs
  ``ap_tags.graph.size_hint`` / ``tensor_nbytes``;
* ``UnsupportedTorchError``, ``TESTED_TORCH`` and the newer-torch warning
  (``_compat.untested_message`` / ``warn_if_untested``) vs ``ap_tags.torch_support``;
* argument-check messages (``_checks``) vs ``ap_tags.checks``;
* "this op's output is a view of its input" (``_hazards.is_view``, which keeps reads of an
  ``out=`` buffer after its write) vs ``ap_tags.graph.aliases_input``.
* "a structured trace writes now" (``_compat.structured_trace_writes``, which decides whether
  torch's scheduler builds its estimation table) vs ap-backend's ``_compat.structured_tracing``
  (which decides whether the backend builds its artifacts' text).

Each test compares both sides on the same input, so a change to either side that makes them
disagree fails here.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import ap_bucketing
import ap_tags
import pytest
import torch
import torch.fx as fx
from ap_bucketing import _checks, _compat, _hazards, _metrics, _sizes
from ap_tags import checks, graph, torch_support
from ap_testing.collectives import GraphBuilder, RandomCollectiveGraph, random_collective_graphs
from hypothesis import HealthCheck, given, settings

c10d = torch.ops._c10d_functional

AGREEMENT = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _expected_collective_bytes(coll: fx.Node) -> int | None:
    """``max(output bytes, first input bytes)`` in ap-tags' terms; unknown if either is."""
    out = graph.tensor_nbytes(coll.meta["val"])
    inp = graph.tensor_nbytes(coll.all_input_nodes[0].meta["val"])
    return None if out is None or inp is None else max(out, inp)


def _assert_nodes_agree(gm: fx.GraphModule) -> set[str]:
    """Both vocabularies on every node of ``gm``; returns what was compared (for coverage)."""
    wait = _compat.wait_tensor_op()
    seen: set[str] = set()
    for node in gm.graph.nodes:
        is_wait = node.target is wait
        assert is_wait == graph.is_wait(node), node.format_node()
        is_rs = _metrics.is_reduce_scatter(node)
        assert is_rs == graph.is_reduce_scatter(node), node.format_node()
        seen.update(kind for kind, hit in (("wait", is_wait), ("reduce_scatter", is_rs)) if hit)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            numel = val.numel()
            assert _sizes.hint_int(numel) == graph.size_hint(numel), node.name
        if not (graph.is_collective(node) and node.op == "call_function"):
            continue
        if "val" not in node.meta:
            with pytest.raises(ap_bucketing.MissingValueError, match=node.name):
                _sizes.collective_bytes(node)
            seen.add("unsizable")
            continue
        assert _sizes.collective_bytes(node) == _expected_collective_bytes(node), node.name
        seen.add("sized")
    return seen


def test_predicates_and_sizes_agree_on_random_collective_graphs() -> None:
    seen: set[str] = set()

    @AGREEMENT
    @given(random_collective_graphs(("dp", "tp")))
    def prop(sample: RandomCollectiveGraph) -> None:
        seen.update(_assert_nodes_agree(sample.gm))

    prop()
    assert seen == {"wait", "reduce_scatter", "sized", "unsizable"}  # not vacuous


def test_predicates_agree_on_every_collective_kind() -> None:
    """The coalesced and ``_out`` variants the random graphs do not draw."""
    b = GraphBuilder(dtype=torch.float32)
    x, y = b.placeholder((8, 4)), b.placeholder((8, 4))
    nodes = [
        b.call(c10d.reduce_scatter_tensor_coalesced.default, ([x, y], "sum", 2, "dp"), (4, 4)),
        b.call(c10d.all_gather_into_tensor_coalesced.default, ([x, y], 2, "dp"), (16, 4)),
        b.call(c10d.all_gather_into_tensor_out.default, (x, 2, "dp"), (16, 4)),
        b.call(c10d.all_reduce.default, (x, "sum", "dp"), (8, 4)),
    ]
    waits = [b.call(c10d.wait_tensor.default, (n,), (8, 4)) for n in nodes]
    gm = b.module(waits)
    assert [_metrics.is_reduce_scatter(n) for n in nodes] == [True, False, False, False]
    assert [graph.is_reduce_scatter(n) for n in nodes] == [True, False, False, False]
    assert _assert_nodes_agree(gm) == {"wait", "reduce_scatter", "sized"}


def _many_views(x: torch.Tensor) -> torch.Tensor:
    aten = torch.ops.aten
    y = x.reshape(4, 16).t().transpose(0, 1)[1:3].unsqueeze(0).squeeze(0).expand(2, 16)
    z = x.permute(1, 0).select(0, 2).narrow(0, 1, 4).as_strided((2,), (1,)).view(torch.int32)
    parts = x.split(4)  # a multi-output view: its getitems are not views themselves
    w = aten._unsafe_view(aten.alias(x.diagonal()), [8]).unfold(0, 2, 2).detach()
    return y.sum() + z.float().sum() + parts[1].exp().sum() + w.sum() + x.clone().sum()


def test_view_predicates_agree_on_a_traced_graph() -> None:
    gm = torch.fx.experimental.proxy_tensor.make_fx(_many_views)(torch.randn(8, 8))
    views = set()
    for node in gm.graph.nodes:
        ours = _hazards.is_view(node)
        assert ours == graph.aliases_input(node), node.format_node()
        if ours:
            views.add(getattr(node.target, "__name__", str(node.target)).split(".")[0])
    # not vacuous: the schema views above and _unsafe_view are among them
    assert {"view", "t", "transpose", "slice", "expand", "_unsafe_view", "alias"} <= views


def _symbols() -> dict[str, torch.SymInt]:
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(64, source=ConstantSource("s")), hint=64)
    hinted = env.create_unbacked_symint()
    env.var_to_hint_override[hinted.node.expr] = 48
    unhinted = env.create_unbacked_symint()
    assert isinstance(backed, torch.SymInt)
    return {"backed": backed, "hinted": hinted, "unhinted": unhinted}


SYMBOLIC: list[tuple[str, Callable[[dict[str, torch.SymInt]], Any], int | None]] = [
    ("backed", lambda s: s["backed"], 64),
    ("backed*2", lambda s: s["backed"] * 2, 128),
    ("unbacked with hint_override", lambda s: s["hinted"], 48),
    ("unbacked with hint_override*8", lambda s: s["hinted"] * 8, 384),
    ("backed*hinted+3", lambda s: s["backed"] * s["hinted"] + 3, 64 * 48 + 3),
    ("unbacked without hint", lambda s: s["unhinted"], None),
    ("unhinted*2+backed", lambda s: s["unhinted"] * 2 + s["backed"], None),
    ("hinted+unhinted", lambda s: s["hinted"] + s["unhinted"], None),
    ("plain int", lambda s: 7, 7),
]


@pytest.mark.parametrize(
    ("expr", "want"), [(e, w) for _, e, w in SYMBOLIC], ids=[i for i, *_ in SYMBOLIC]
)
def test_symbolic_sizes_agree(
    expr: Callable[[dict[str, torch.SymInt]], Any], want: int | None
) -> None:
    value = expr(_symbols())
    assert graph.size_hint(value) == want
    assert _sizes.hint_int(value) == want
    t = torch.empty((value, 16), device="meta", dtype=torch.float32)
    nbytes = graph.tensor_nbytes(t)
    assert nbytes == (None if want is None else want * 16 * 4)
    numel = _sizes.hint_int(t.numel())
    assert (None if numel is None else numel * t.element_size()) == nbytes


def test_collective_bytes_agree_on_symbolic_collectives() -> None:
    """A hinted unbacked all-gather is sized alike; an unhinted one is unknown on both sides."""
    symbols = _symbols()
    for name, want in (("hinted", 8 * 48 * 16 * 4), ("unhinted", None)):
        u = symbols[name]
        b = GraphBuilder(dtype=torch.float32)
        p = b.graph.placeholder("p")
        p.meta["val"] = torch.empty((u, 16), device="meta")
        ag = b.graph.call_function(c10d.all_gather_into_tensor.default, (p, 8, "dp"))
        ag.meta["val"] = torch.empty((u * 8, 16), device="meta")
        assert _sizes.collective_bytes(ag) == _expected_collective_bytes(ag) == want


# --------------------------------------------------------------------------- torch support


def test_unsupported_torch_error_has_the_convention_shape() -> None:
    tested = ap_bucketing.TESTED_TORCH
    ours = ap_bucketing.UnsupportedTorchError("ap-bucketing", "x.y", tested)
    theirs = torch_support.UnsupportedTorchError("ap-bucketing", "x.y", tested)
    assert str(ours) == str(theirs)
    assert (ours.package, ours.internal, ours.tested) == (
        theirs.package,
        theirs.internal,
        theirs.tested,
    )
    assert isinstance(ours, RuntimeError)
    # the error ap-bucketing raises for a missing internal names itself the same way
    with pytest.raises(ap_bucketing.UnsupportedTorchError) as info:
        _compat.attr("torch", "no_such_internal")
    assert str(info.value) == str(
        torch_support.UnsupportedTorchError("ap-bucketing", "torch.no_such_internal", tested)
    )
    assert ap_bucketing.TESTED_TORCH == ap_tags.TESTED_TORCH


@pytest.mark.parametrize(
    "version",
    [
        "2.16.0.dev20261101",
        "2.16.0.dev20261101+cpu",
        "2.16.0",
        "3.0.0",
        "2.15.0",
        "2.15.1",
        "2.14.1",
        "2.13.0a0+git",
        "2.12.0",
        "unknown",
        "",
    ],
)
@pytest.mark.parametrize("tested", [ap_bucketing.TESTED_TORCH, ("2.13.0",), ("2.13.0", "x")])
def test_newer_torch_warning_agrees(version: str, tested: tuple[str, ...]) -> None:
    ours = _compat.untested_message("ap-bucketing", tested, version)
    assert ours == torch_support.untested_message("ap-bucketing", tested, version)


def test_newer_torch_warning_is_logged_once_like_the_convention(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.16.0.dev20261101")
    monkeypatch.setattr(_compat, "_WARNED", set())
    monkeypatch.setattr(torch_support, "_WARNED", set())
    convention = torch_support.TorchSupport(
        "ap-bucketing", ap_bucketing.TESTED_TORCH, torch_support.UnsupportedTorchError
    )
    with caplog.at_level(logging.WARNING, logger="ap_bucketing"):
        assert _compat.warn_if_untested() is True and _compat.warn_if_untested() is False
        assert convention.warn_if_untested() is True and convention.warn_if_untested() is False
    ours, theirs = (r for r in caplog.records if r.name == "ap_bucketing")
    assert ours.getMessage() == theirs.getMessage() and ours.levelno == theirs.levelno


def test_ap_bucketing_imports_no_sibling_package() -> None:
    code = (
        "import sys, ap_bucketing\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0].startswith('ap_')"
        " and m.split('.')[0] != 'ap_bucketing')\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --------------------------------------------------------------------------- argument checks

_GM = fx.GraphModule(torch.nn.Module(), fx.Graph())

BAD_ARGUMENTS: list[tuple[str, object, dict[str, Any]]] = [
    ("require_bool", "yes", {}),
    ("require_bool", None, {}),
    ("require_bool", 1, {}),
    ("require_int", True, {}),
    ("require_int", "3", {}),
    ("require_int", 1.5, {"minimum": 0}),
    ("require_int", -1, {"minimum": 0}),
    ("require_callable", 3, {}),
    ("require_callable", None, {}),
    ("require_callable", "f", {"optional": True}),
    ("require_graph", "g" * 100, {}),
    ("require_graph", b"x", {}),
    ("require_graph", _GM.graph.nodes, {}),
    ("require_graph_module", _GM.graph, {}),
    ("require_graph_module", math.nan, {}),
    ("require_node", 2.5, {}),
    ("require_node", _GM, {}),
    ("require_instance", [1], {"types": (int, str), "expected": "an int or a str"}),
]


def _outcome(fn: Callable[..., object], value: object, kwargs: dict[str, Any]) -> tuple[str, str]:
    try:
        result = fn(value, where="entry_point", arg="thing", **kwargs)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "returned", repr(result)


@pytest.mark.parametrize(
    ("name", "value", "kwargs"),
    BAD_ARGUMENTS,
    ids=[f"{n}-{i}" for i, (n, *_) in enumerate(BAD_ARGUMENTS)],
)
def test_checks_raise_the_same_error_with_the_same_message(
    name: str, value: object, kwargs: dict[str, Any]
) -> None:
    ours = _outcome(getattr(_checks, name), value, kwargs)
    theirs = _outcome(getattr(checks, name), value, kwargs)
    assert ours == theirs
    assert ours[0] in ("TypeError", "ValueError")


@pytest.mark.parametrize(
    "value", [None, True, 3, -2.5, "s" * 61, "s" * 62, "s" * 70, b"b", [1], _GM, math.inf]
)
def test_describe_agrees(value: object) -> None:
    assert _checks.describe(value) == checks.describe(value)


def test_good_arguments_pass_through_alike() -> None:
    assert _checks.require_graph(_GM, where="w") is checks.require_graph(_GM, where="w")
    assert _checks.require_int(0, where="w", arg="a", minimum=0) == 0
    assert checks.require_int(0, where="w", arg="a", minimum=0) == 0
    assert _checks.require_callable(None, where="w", arg="a", optional=True) is None
    assert checks.require_callable(None, where="w", arg="a", optional=True) is None


class _Collecting(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        pass


@pytest.mark.parametrize(
    "handlers",
    [
        lambda: [],
        lambda: [_lazy_trace_handler(None)],
        lambda: [_lazy_trace_handler("/tmp/ap-some-trace-dir")],
        lambda: [_Collecting()],
        lambda: [_lazy_trace_handler(None), _Collecting()],
    ],
    ids=["none", "lazy_without_dir", "lazy_with_dir", "other", "lazy_and_other"],
)
def test_structured_trace_rules_agree(
    handlers: Callable[[], list[logging.Handler]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ap_backend import _compat as backend_compat

    monkeypatch.delenv("MAST_HPC_JOB_NAME", raising=False)
    monkeypatch.setattr(logging.getLogger(_compat.TRACE_LOGGER), "handlers", handlers())
    assert _compat.structured_trace_writes() == backend_compat.structured_tracing()


def _lazy_trace_handler(root_dir: str | None) -> logging.Handler:
    from torch._logging._internal import LazyTraceHandler

    handler: logging.Handler = LazyTraceHandler(root_dir)
    return handler
