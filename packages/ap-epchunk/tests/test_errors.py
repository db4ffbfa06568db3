"""Error catalogue: every public entry point of ap-epchunk, given bad input.

Each case checks the exception type is the package's documented one, that the message names the
argument / option / node at fault, and that a refused pass left the graph exactly as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ap_epchunk as E
import pytest
import torch
import torch.fx
from _epchunk_testlib import Stack, graph_snapshot, trace
from ap_epchunk import ChunkConfig, ChunkError
from torch.fx.experimental.symbolic_shapes import ShapeEnv

RANGE = ">=2.13,<2.16"
#: the package's "torch internal missing" error (a RuntimeError subclass)
UNSUPPORTED: type[BaseException] = getattr(E, "UnsupportedTorchError", type(None))  # type: ignore[assignment]


@pytest.fixture(scope="module")
def traced() -> tuple[Stack, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = Stack(4, 1)
    return model, trace(model, torch.randn(4, 4), torch.randn(4, 4), symbolic=False)


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta.update(gm.meta)
    return new


CFG = ChunkConfig(module_patterns=("layers.*",), chunk_inputs=("x_1", "y_1"))


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[torch.fx.GraphModule], object]
    exc: type[BaseException]
    names: tuple[str, ...]
    setup: Callable[[torch.fx.GraphModule, pytest.MonkeyPatch], None] | None = None


def _no_shape_env_attr(name: str) -> Callable[..., None]:
    def setup(gm: torch.fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
        mp.delattr(ShapeEnv, name)

    return setup


def _no_mark_unbacked(gm: torch.fx.GraphModule, mp: pytest.MonkeyPatch) -> None:
    import torch._dynamo.decorators as decorators

    mp.delattr(decorators, "mark_unbacked")


CASES: list[Case] = []
# ChunkConfig options
for opt, value, words in [
    ("module_patterns", (), ("module_patterns", "non-empty")),
    ("module_patterns", 3, ("module_patterns",)),
    ("module_patterns", ("",), ("module_patterns", "''")),
    ("module_patterns", ("a", 1), ("module_patterns", "1")),
    ("dim", -1, ("ChunkConfig.dim", "-1")),
    ("dim", "0", ("ChunkConfig.dim", "'0'")),
    ("dim", True, ("ChunkConfig.dim", "True")),
    ("num_chunks", 1, ("num_chunks", "1")),
    ("num_chunks", 2.0, ("num_chunks", "2.0")),
    ("num_chunks", False, ("num_chunks", "False")),
    ("early_grad_accumulation", "yes", ("early_grad_accumulation", "'yes'")),
    ("chunk_inputs", 3, ("chunk_inputs", "3")),
    ("chunk_inputs", ("x", ""), ("chunk_inputs",)),
]:
    kwargs: dict[str, Any] = {"module_patterns": ("layers.*",), opt: value}
    CASES.append(
        Case(
            f"ChunkConfig/{opt}={value!r}", lambda gm, k=kwargs: ChunkConfig(**k), ValueError, words
        )
    )
CASES.append(
    Case(
        "ChunkConfig/unknown_option",
        lambda gm: ChunkConfig(module_patterns=("a",), chunks=2),  # type: ignore[call-arg]
        TypeError,
        ("chunks",),
    )
)
# chunk_pass arguments and graphs it must refuse (untouched)
for bad in ["gm", None, torch.fx.Graph()]:
    CASES.append(
        Case(
            f"chunk_pass/gm={type(bad).__name__}",
            lambda gm, b=bad: E.chunk_pass(b, CFG),
            TypeError,  # type: ignore[arg-type]
            ("chunk_pass", "gm", "GraphModule", type(bad).__name__),
        )
    )
CASES += [
    Case(
        "chunk_pass/config=dict",
        lambda gm: E.chunk_pass(gm, {"module_patterns": "x"}),  # type: ignore[arg-type]
        TypeError,
        ("chunk_pass", "ChunkConfig", "dict"),
    ),
    Case(
        "chunk_pass/no_region_matches",
        lambda gm: E.chunk_pass(gm, CFG.replace(module_patterns=("nope.*",))),
        ChunkError,
        ("no region matched", "nope.*", "layers"),
    ),
    Case(
        "chunk_pass/unknown_chunk_input",
        lambda gm: E.chunk_pass(gm, CFG.replace(chunk_inputs=("zzz",))),
        ChunkError,
        ("chunk_inputs", "zzz", "x_1"),
    ),
    Case(
        "chunk_pass/indivisible_extent",
        lambda gm: E.chunk_pass(gm, CFG.replace(num_chunks=3)),
        ChunkError,
        ("x_1", "not divisible", "num_chunks=3"),
    ),
    Case(
        "chunk_pass/dim_out_of_range",
        lambda gm: E.chunk_pass(gm, CFG.replace(dim=5)),
        ChunkError,
        ("x_1", "no dim 5"),
    ),
    Case(
        "chunk_pass/no_chunk_inputs_static_graph",
        lambda gm: E.chunk_pass(gm, CFG.replace(chunk_inputs=())),
        ChunkError,
        ("chunk",),
    ),
    Case(
        "chunk_pass/unsupported_torch",
        lambda gm: E.chunk_pass(gm, CFG),
        UNSUPPORTED,
        ("create_unbacked_symint", RANGE),
        setup=_no_shape_env_attr("create_unbacked_symint"),
    ),
]
# concretize_chunk_symbols
for bad in ["gm", None]:
    CASES.append(
        Case(
            f"concretize_chunk_symbols/gm={type(bad).__name__}",
            lambda gm, b=bad: E.concretize_chunk_symbols(b),  # type: ignore[arg-type]
            TypeError,
            ("concretize_chunk_symbols", "gm", "GraphModule", type(bad).__name__),
        )
    )
CASES.append(
    Case(
        "concretize_chunk_symbols/example_inputs=str",
        lambda gm: E.concretize_chunk_symbols(gm, example_inputs="x"),  # type: ignore[arg-type]
        TypeError,
        ("concretize_chunk_symbols", "example_inputs", "str"),
    )
)
CASES.append(
    Case(
        "concretize_chunk_symbols/unknown_option",
        lambda gm: E.concretize_chunk_symbols(gm, hints={}),  # type: ignore[call-arg]
        TypeError,
        ("hints",),
    )
)
# mark_chunk_dim
CASES += [
    Case(
        "mark_chunk_dim/tensor=str",
        lambda gm: E.mark_chunk_dim("x", 0, hint=4),  # type: ignore[arg-type]
        ChunkError,
        ("mark_chunk_dim", "tensor", "str"),
    ),
    Case(
        "mark_chunk_dim/0-d",
        lambda gm: E.mark_chunk_dim(torch.tensor(1.0), 0, hint=4),
        ChunkError,
        ("mark_chunk_dim", "0-d"),
    ),
    Case(
        "mark_chunk_dim/dim=3",
        lambda gm: E.mark_chunk_dim(torch.randn(4), 3, hint=4),
        ChunkError,
        ("mark_chunk_dim", "dim 3", "(4,)"),
    ),
    Case(
        "mark_chunk_dim/dim=str",
        lambda gm: E.mark_chunk_dim(torch.randn(4), "0", hint=4),  # type: ignore[arg-type]
        ChunkError,
        ("mark_chunk_dim", "dim", "'0'"),
    ),
    Case(
        "mark_chunk_dim/hint=1",
        lambda gm: E.mark_chunk_dim(torch.randn(4), 0, hint=1),
        ChunkError,
        ("mark_chunk_dim", "hint", "1"),
    ),
    Case(
        "mark_chunk_dim/hint=str",
        lambda gm: E.mark_chunk_dim(torch.randn(4), 0, hint="4"),  # type: ignore[arg-type]
        ChunkError,
        ("mark_chunk_dim", "hint", "'4'"),
    ),
    Case(
        "mark_chunk_dim/unsupported_torch",
        lambda gm: E.mark_chunk_dim(torch.randn(4), 0, hint=4),
        UNSUPPORTED,
        ("mark_unbacked", RANGE),
        setup=_no_mark_unbacked,
    ),
]
# EagerChunked
CASES += [
    Case(
        "EagerChunked/num_chunks=1",
        lambda gm: E.EagerChunked(torch.nn.Linear(4, 4), 0, 1),
        ValueError,
        ("EagerChunked", "num_chunks", "1"),
    ),
    Case(
        "EagerChunked/dim=str",
        lambda gm: E.EagerChunked(torch.nn.Linear(4, 4), "0", 2),  # type: ignore[arg-type]
        ValueError,
        ("EagerChunked", "dim", "'0'"),
    ),
    Case(
        "EagerChunked/module=str",
        lambda gm: E.EagerChunked("m", 0, 2),  # type: ignore[arg-type]
        TypeError,
        ("EagerChunked", "module", "nn.Module", "str"),
    ),
    Case(
        "EagerChunked/indivisible",
        lambda gm: E.EagerChunked(torch.nn.Linear(4, 4), 0, 3)(torch.randn(4, 4)),
        ChunkError,
        ("EagerChunked", "extent 4", "num_chunks=3"),
    ),
]
# trace_joint
CASES.append(
    Case(
        "trace_joint/step=str",
        lambda gm: E.trace_joint("step", torch.randn(2)),  # type: ignore[arg-type]
        TypeError,
        ("trace_joint", "step", "callable", "str"),
    )
)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_package_error_naming_the_culprit(
    case: Case, traced: tuple[Stack, torch.fx.GraphModule], monkeypatch: pytest.MonkeyPatch
) -> None:
    gm = _copy(traced[1])
    with monkeypatch.context() as mp:
        if case.setup is not None:
            case.setup(gm, mp)
        before = graph_snapshot(gm)
        with pytest.raises(case.exc) as info:
            case.call(gm)
    message = str(info.value)
    for word in case.names:
        assert word in message, f"{word!r} not in {message!r}"
    assert graph_snapshot(gm) == before


def test_catalogue_size() -> None:
    assert len(CASES) >= 40


def test_unsupported_torch_error_is_a_runtime_error() -> None:
    """Callers guarding with ``except RuntimeError`` (the previous type) keep working."""
    assert issubclass(UNSUPPORTED, RuntimeError)
