"""Error catalogue: every public entry point of ap-backend, given bad input.

Each case checks the exception type is the package's documented one and that the message names
the option / argument / process group at fault. No compile runs: options are validated when
the backend is built, arguments before any tracing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ap_backend as B
import pytest
import torch
import torch.distributed as dist
from ap_backend import models as M
from ap_backend.cli import main


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], object]
    exc: type[BaseException]
    names: tuple[str, ...]


CASES: list[Case] = []
# (option, value, exception): a value of the wrong type is a TypeError naming the option and
# the type; a value of the right type that is not allowed is a ValueError naming the value.
for option, value, exc in [
    ("enable_ac", "yes", TypeError),
    ("enable_ac", 1, TypeError),
    ("enable_ac", None, TypeError),
    ("ac_stage_size_gib", -1, ValueError),
    ("ac_stage_size_gib", 0, ValueError),
    ("ac_stage_size_gib", "big", ValueError),
    ("ac_stage_size_gib", float("nan"), ValueError),
    ("ac_stage_size_gib", True, TypeError),
    ("ac_stage_size_gib", [1], TypeError),
    ("overlap_scheduling", 1, TypeError),
    ("overlap_scheduling", "no", ValueError),
    ("bucketing", "x", TypeError),
    ("bucketing", 3, TypeError),
    ("bucketing", 1500, TypeError),
    ("ep_chunk", {}, TypeError),
    ("ep_chunk", "x", TypeError),
    ("ep_chunk", "layers.*.moe", TypeError),
    ("partitioner", "mincut", ValueError),
    ("partitioner", "foo", ValueError),
    ("partitioner", 3, TypeError),
    ("partitioner", print, TypeError),
]:
    shown = repr(value) if exc is ValueError else type(value).__name__
    CASES.append(
        Case(
            f"autoparallel_backend/{option}={value!r}",
            lambda o=option, v=value: B.autoparallel_backend(**{o: v}),
            exc,
            ("autoparallel_backend", option, shown),
        )
    )
CASES += [
    Case(
        "measure_saved/partitioner=3",
        lambda: B.measure_saved(torch.nn.Linear(2, 2), (torch.randn(2, 2),), partitioner=3),
        TypeError,
        ("measure_saved", "partitioner", "int"),
    ),
    Case(
        "measure_saved/ac_stage_size_gib=-1",
        lambda: B.measure_saved(torch.nn.Linear(2, 2), (torch.randn(2, 2),), ac_stage_size_gib=-1),
        ValueError,
        ("measure_saved", "ac_stage_size_gib", "-1"),
    ),
    Case(
        "measure_saved/module=str",
        lambda: B.measure_saved("m", ()),  # type: ignore[arg-type]
        TypeError,
        ("measure_saved", "module", "nn.Module", "str"),
    ),
]
CASES += [
    Case(
        "autoparallel_backend/unknown_option",
        lambda: B.autoparallel_backend(foo=1),  # type: ignore[call-arg]
        TypeError,
        ("foo",),
    ),
    Case(
        "autoparallel_backend/positional_option",
        lambda: B.autoparallel_backend(True),  # type: ignore[misc]
        TypeError,
        ("positional",),
    ),
    Case(
        "backend_call/gm=str",
        lambda: B.autoparallel_backend()("gm", []),  # type: ignore[arg-type]
        TypeError,
        ("gm", "GraphModule", "str"),
    ),
    Case(
        "backend_call/example_inputs=int",
        lambda: B.autoparallel_backend()(torch.fx.symbolic_trace(torch.nn.ReLU()), 3),  # type: ignore[arg-type]
        TypeError,
        ("example_inputs", "int"),
    ),
    Case(
        "precompile/module=str",
        lambda: B.precompile("m", ()),  # type: ignore[arg-type]
        TypeError,
        ("precompile", "module", "nn.Module", "str"),
    ),
    Case(
        "precompile/example_args=int",
        lambda: B.precompile(torch.nn.Linear(2, 2), 3),  # type: ignore[arg-type]
        TypeError,
        ("precompile", "example_args", "int"),
    ),
    Case(
        "precompile/joint_pass=3",
        lambda: B.precompile(torch.nn.Linear(2, 2), (torch.randn(2, 2),), joint_pass=3),  # type: ignore[arg-type]
        TypeError,
        ("precompile", "joint_pass", "callable", "int 3"),
    ),
    Case(
        "precompile/reshard_after_forward=str",
        lambda: B.precompile(
            torch.nn.Linear(2, 2), (torch.randn(2, 2),), reshard_after_forward="no"
        ),  # type: ignore[arg-type]
        TypeError,
        ("reshard_after_forward", "bool", "str"),
    ),
    Case(
        "precompile/unknown_option",
        lambda: B.precompile(torch.nn.Linear(2, 2), (torch.randn(2, 2),), ac=True),  # type: ignore[call-arg]
        TypeError,
        ("ac",),
    ),
    Case(
        "is_all_gather_output/node=str",
        lambda: B.is_all_gather_output("n"),  # type: ignore[arg-type]
        TypeError,
        ("is_all_gather_output", "torch.fx.Node", "str"),
    ),
    # the model kit without a process group
    Case(
        "Sharding.from_world/no_process_group",
        lambda: M.Sharding.from_world(),
        RuntimeError,
        ("Sharding.from_world", "not initialised"),
    ),
    Case(
        "gather/no_process_group",
        lambda: M.gather(torch.randn(2, 2), M.Sharding("dp", 2, 0)),
        RuntimeError,
        ("gather", "'dp'", "process group"),
    ),
    Case(
        "shard_param/uneven",
        lambda: M.shard_param(torch.randn(3, 2), M.Sharding("dp", 2, 0)),
        ValueError,
        ("shard_param", "3", "world size 2"),
    ),
    Case(
        "shard_param/full=list",
        lambda: M.shard_param([1, 2], M.Sharding("dp", 2, 0)),  # type: ignore[arg-type]
        TypeError,
        ("shard_param", "full", "tensor", "list"),
    ),
]
# Sharding(group_name, world_size, rank, gather_dtype): (args, exception, the message names)
for args, exc, names in [
    (("dp", 0, 0), ValueError, ("world_size", "0")),
    (("dp", "2", 0), TypeError, ("world_size", "int", "str '2'")),
    (("dp", 2, True), TypeError, ("rank", "bool")),
    (("dp", 2, 5), ValueError, ("rank", "5", "2")),
    (("dp", 2, 0, "bf16"), TypeError, ("gather_dtype", "torch.dtype", "str")),
]:
    CASES.append(
        Case(f"Sharding{args!r}", lambda a=args: M.Sharding(*a), exc, ("Sharding", *names))
    )
# ModelConfig(**kwargs): (kwargs, exception, the message names)
for kwargs, exc, names in [
    ({"dim": -1}, ValueError, ("dim", "-1")),
    ({"dim": "64"}, TypeError, ("dim", "int", "str")),
    ({"dim": 64, "n_heads": 5}, ValueError, ("n_heads", "5", "64")),
    ({"attention": "flash"}, ValueError, ("attention", "'flash'")),
    ({"attention": 3}, TypeError, ("attention", "str", "int")),
    ({"moe": True, "n_experts": 2, "top_k": 3}, ValueError, ("top_k", "3", "n_experts")),
    ({"ep": True}, ValueError, ("ep=True", "moe=True")),
    ({"moe": True, "ep": 1}, TypeError, ("ep", "bool", "int")),
]:
    CASES.append(
        Case(
            f"ModelConfig{kwargs!r}",
            lambda k=kwargs: M.ModelConfig(**k),
            exc,
            ("ModelConfig", *names),
        )
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_package_error_naming_the_culprit(case: Case) -> None:
    assert not dist.is_initialized()
    with pytest.raises(case.exc) as info:
        case.call()
    message = str(info.value)
    for word in case.names:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["demo", "--layers", "0"], ["--layers", "'0'"]),
        (["demo", "--steps", "-1"], ["--steps", "'-1'"]),
        (["demo", "--ranks", "x"], ["--ranks", "'x'"]),
        (["demo", "--frob"], ["--frob"]),
        ([], ["demo"]),
    ],
    ids=["layers=0", "steps=-1", "ranks=x", "unknown_flag", "no_command"],
)
def test_cli_bad_arguments_exit_2_naming_the_option(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_catalogue_size() -> None:
    assert len(CASES) + 5 >= 40


def test_missing_torch_internal_raises_the_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Feature detection, not version checks: a torch without the joint-export API fails at
    ``precompile`` with ap-backend's ``UnsupportedTorchError`` naming the internal."""
    import ap_tags
    import torch._functorch.aot_autograd as aot

    assert issubclass(B.UnsupportedTorchError, ap_tags.torch_support.UnsupportedTorchError)
    assert B.TESTED_TORCH == ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
    monkeypatch.delattr(aot, "aot_export_joint_with_descriptors")
    with pytest.raises(B.UnsupportedTorchError) as info:
        B.precompile(torch.nn.Linear(2, 2), (torch.randn(2, 2),))
    assert info.value.package == "ap-backend"
    assert "aot_export_joint_with_descriptors" in str(info.value)
    assert "2.15.0" in str(info.value)
