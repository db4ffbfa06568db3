"""Error catalogue: every public entry point of ap-epchunk, given bad input.

Each case checks the exception type is the documented one (``TypeError`` for an argument of
the wrong type, ``ValueError`` -- ``ChunkError`` for a refused graph -- for a wrong value,
``UnsupportedTorchError`` for a missing torch internal), that the message names the argument /
option / node at fault, and that a refused call left the graph exactly as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ap_epchunk as E
import ap_tags.torch_support
import pytest
import torch
import torch.fx
from ap_epchunk import ChunkConfig, ChunkError, UnsupportedTorchError
from ap_testing.chunking import Stack
from ap_testing.graphs import snapshot
from torch.fx.experimental.symbolic_shapes import ShapeEnv

#: how an UnsupportedTorchError names the torch versions the package is tested on
TESTED = ", ".join(E.TESTED_TORCH)

Setup = Callable[[pytest.MonkeyPatch], None]


@pytest.fixture(scope="module")
def traced(trace: Any) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return trace(Stack(4, 1), torch.randn(4, 4), torch.randn(4, 4), symbolic=False)  # type: ignore[no-any-return]


CFG = ChunkConfig(module_patterns=("layers.*",), chunk_inputs=("x_1", "y_1"))


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[torch.fx.GraphModule], object]
    exc: type[BaseException]
    names: tuple[str, ...]
    setup: Setup | None = None


def _without(owner: Callable[[], Any], name: str) -> Setup:
    """Setup: ``owner()`` (imported lazily) loses attribute ``name`` for the test."""

    def setup(mp: pytest.MonkeyPatch) -> None:
        mp.delattr(owner(), name)

    return setup


def _dynamo_decorators() -> Any:
    import torch._dynamo.decorators

    return torch._dynamo.decorators


CASES: list[Case] = []

# ChunkConfig options: (option, value, exception, words in the message)
for opt, value, exc, words in [
    ("module_patterns", (), ValueError, ("module_patterns", "empty")),
    ("module_patterns", 3, TypeError, ("module_patterns", "int 3")),
    ("module_patterns", ("",), ValueError, ("module_patterns", "''")),
    ("module_patterns", ("a", 1), TypeError, ("module_patterns", "int 1")),
    ("dim", -1, ValueError, ("dim", ">= 0", "-1")),
    ("dim", "0", TypeError, ("dim", "an int", "str '0'")),
    ("dim", 1.5, TypeError, ("dim", "an int", "float 1.5")),
    ("dim", True, TypeError, ("dim", "bool True")),
    ("num_chunks", 1, ValueError, ("num_chunks", ">= 2", "1")),
    ("num_chunks", 2.0, TypeError, ("num_chunks", "float 2.0")),
    ("num_chunks", "2", TypeError, ("num_chunks", "str '2'")),
    ("num_chunks", False, TypeError, ("num_chunks", "bool False")),
    ("early_grad_accumulation", "yes", TypeError, ("early_grad_accumulation", "str 'yes'")),
    ("chunk_inputs", 3, TypeError, ("chunk_inputs", "int 3")),
    ("chunk_inputs", ("x", ""), ValueError, ("chunk_inputs", "non-empty")),
]:
    kwargs: dict[str, Any] = {"module_patterns": ("layers.*",), opt: value}
    CASES.append(
        Case(
            f"ChunkConfig/{opt}={value!r}",
            lambda gm, k=kwargs: ChunkConfig(**k),
            exc,
            ("ChunkConfig", *words),
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

# chunk_pass: arguments of the wrong type
for bad in ["gm", None, torch.fx.Graph()]:
    CASES.append(
        Case(
            f"chunk_pass/gm={type(bad).__name__}",
            lambda gm, b=bad: E.chunk_pass(b, CFG),
            TypeError,
            ("chunk_pass", "gm", "GraphModule", type(bad).__name__),
        )
    )
CASES.append(
    Case(
        "chunk_pass/config=dict",
        lambda gm: E.chunk_pass(gm, {"module_patterns": "x"}),  # type: ignore[arg-type]
        TypeError,
        ("chunk_pass", "config", "ChunkConfig", "dict"),
    )
)
# chunk_pass: graphs (and configs) it must refuse, leaving the graph untouched
for cid, changes, words in [
    (
        "no_region_matches",
        {"module_patterns": ("nope.*",)},
        ("no region matched", "nope.*", "layers"),
    ),
    ("unknown_chunk_input", {"chunk_inputs": ("zzz",)}, ("chunk_inputs", "zzz", "x_1")),
    ("indivisible_extent", {"num_chunks": 3}, ("x_1", "not divisible", "num_chunks=3")),
    ("dim_out_of_range", {"dim": 5}, ("x_1", "no dim 5")),
    ("no_chunk_inputs_static_graph", {"chunk_inputs": ()}, ("no chunk dimension",)),
]:
    CASES.append(
        Case(
            f"chunk_pass/{cid}",
            lambda gm, c=changes: E.chunk_pass(gm, CFG.replace(**c)),
            ChunkError,
            words,
        )
    )
CASES.append(
    Case(
        "chunk_pass/unsupported_torch",
        lambda gm: E.chunk_pass(gm, CFG),
        UnsupportedTorchError,
        ("ap-epchunk", "ShapeEnv.create_unbacked_symint", TESTED),
        setup=_without(lambda: ShapeEnv, "create_unbacked_symint"),
    )
)

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
CASES += [
    Case(
        "concretize_chunk_symbols/example_inputs=str",
        lambda gm: E.concretize_chunk_symbols(gm, example_inputs="x"),  # type: ignore[arg-type]
        TypeError,
        ("concretize_chunk_symbols", "example_inputs", "str"),
    ),
    Case(
        "concretize_chunk_symbols/unknown_option",
        lambda gm: E.concretize_chunk_symbols(gm, hints={}),  # type: ignore[call-arg]
        TypeError,
        ("hints",),
    ),
]

# mark_chunk_dim: (id, positional args, hint, exception, words in the message)
VECTOR = torch.randn(4)
for cid, args, hint, exc, words in [
    ("tensor=str", ("x", 0), 4, TypeError, ("tensor", "torch.Tensor", "str 'x'")),
    ("0-d", (torch.tensor(1.0), 0), 4, ChunkError, ("0-d",)),
    ("dim=3", (VECTOR, 3), 4, ChunkError, ("dim 3", "(4,)")),
    ("dim=str", (VECTOR, "0"), 4, TypeError, ("dim", "an int", "str '0'")),
    ("dim=1.5", (VECTOR, 1.5), 4, TypeError, ("dim", "an int", "float 1.5")),
    ("hint=1", (VECTOR, 0), 1, ChunkError, ("hint", ">= 2", "1")),
    ("hint=str", (VECTOR, 0), "4", TypeError, ("hint", "an int", "str '4'")),
]:
    CASES.append(
        Case(
            f"mark_chunk_dim/{cid}",
            lambda gm, a=args, h=hint: E.mark_chunk_dim(*a, hint=h),
            exc,
            ("mark_chunk_dim", *words),
        )
    )
CASES.append(
    Case(
        "mark_chunk_dim/unsupported_torch",
        lambda gm: E.mark_chunk_dim(torch.randn(4), 0, hint=4),
        UnsupportedTorchError,
        ("ap-epchunk", "torch._dynamo.decorators.mark_unbacked", TESTED),
        setup=_without(_dynamo_decorators, "mark_unbacked"),
    )
)

# EagerChunked: (id, constructor args, exception, words in the message)
LINEAR = torch.nn.Linear(4, 4)
for cid, args, exc, words in [
    ("num_chunks=1", (LINEAR, 0, 1), ValueError, ("num_chunks", ">= 2", "1")),
    ("num_chunks=str", (LINEAR, 0, "2"), TypeError, ("num_chunks", "an int", "str '2'")),
    ("dim=str", (LINEAR, "0", 2), TypeError, ("dim", "an int", "str '0'")),
    ("module=str", ("m", 0, 2), TypeError, ("module", "nn.Module", "str 'm'")),
]:
    CASES.append(
        Case(
            f"EagerChunked/{cid}",
            lambda gm, a=args: E.EagerChunked(*a),
            exc,
            ("EagerChunked", *words),
        )
    )
CASES.append(
    Case(
        "EagerChunked/indivisible",
        lambda gm: E.EagerChunked(LINEAR, 0, 3)(torch.randn(4, 4)),
        ChunkError,
        ("EagerChunked", "extent 4", "num_chunks=3"),
    )
)

# trace_joint
CASES.append(
    Case(
        "trace_joint/step=str",
        lambda gm: E.trace_joint("step", torch.randn(2)),  # type: ignore[arg-type]
        TypeError,
        ("trace_joint", "step", "callable", "str"),
    )
)


def _fresh(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph (and meta) a failing call may be caught modifying."""
    new = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta.update(gm.meta)
    return new


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_bad_input_raises_the_documented_error(
    case: Case, traced: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    gm = _fresh(traced)
    before = snapshot(gm)
    with monkeypatch.context() as mp, pytest.raises(case.exc) as raised:
        if case.setup:
            case.setup(mp)
        case.call(gm)
    assert type(raised.value) is case.exc, f"{type(raised.value).__name__}: {raised.value}"
    unnamed = [word for word in case.names if word not in str(raised.value)]
    assert not unnamed, f"message {str(raised.value)!r} does not name {unnamed}"
    assert snapshot(gm) == before, "a refused call modified the graph"


def test_catalogue_size() -> None:
    assert len(CASES) >= 44


def test_unsupported_torch_error_follows_the_shared_convention() -> None:
    """One error type per package, deriving from ap-tags' convention (a RuntimeError, so
    callers guarding with ``except RuntimeError`` keep working), exported with TESTED_TORCH."""
    assert issubclass(UnsupportedTorchError, ap_tags.torch_support.UnsupportedTorchError)
    assert issubclass(UnsupportedTorchError, RuntimeError)
    assert E.UnsupportedTorchError is UnsupportedTorchError
    assert {"TESTED_TORCH", "UnsupportedTorchError"} <= set(E.__all__)
    err = E._compat.SUPPORT.missing("torch.thing")
    assert type(err) is UnsupportedTorchError
    assert (err.package, err.internal, err.tested) == ("ap-epchunk", "torch.thing", E.TESTED_TORCH)
