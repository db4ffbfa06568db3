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
    ("overlap_scheduling", "no", TypeError),
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
    # the model kit: a missing process group, bad shardings and configs
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
        "Sharding/world_size=0",
        lambda: M.Sharding("dp", 0, 0),
        ValueError,
        ("Sharding", "world_size", "0"),
    ),
    Case(
        "Sharding/world_size=str",
        lambda: M.Sharding("dp", "2", 0),  # type: ignore[arg-type]
        TypeError,
        ("Sharding", "world_size", "int", "str '2'"),
    ),
    Case(
        "Sharding/rank=bool",
        lambda: M.Sharding("dp", 2, True),
        TypeError,
        ("Sharding", "rank", "bool"),
    ),
    Case(
        "Sharding/gather_dtype=str",
        lambda: M.Sharding("dp", 2, 0, "bf16"),  # type: ignore[arg-type]
        TypeError,
        ("Sharding", "gather_dtype", "torch.dtype", "str"),
    ),
    Case(
        "Sharding/rank_out_of_range",
        lambda: M.Sharding("dp", 2, 5),
        ValueError,
        ("Sharding", "rank", "5", "2"),
    ),
    Case(
        "shard_param/uneven",
        lambda: M.shard_param(torch.randn(3, 2), M.Sharding("dp", 2, 0)),
        ValueError,
        ("shard_param", "3", "world size 2"),
    ),
    Case(
        "ModelConfig/dim=-1",
        lambda: M.ModelConfig(dim=-1),
        ValueError,
        ("ModelConfig", "dim", "-1"),
    ),
    Case(
        "ModelConfig/dim=str",
        lambda: M.ModelConfig(dim="64"),  # type: ignore[arg-type]
        TypeError,
        ("ModelConfig", "dim", "int", "str"),
    ),
    Case(
        "ModelConfig/attention=3",
        lambda: M.ModelConfig(attention=3),  # type: ignore[arg-type]
        TypeError,
        ("ModelConfig", "attention", "str", "int"),
    ),
    Case(
        "shard_param/full=list",
        lambda: M.shard_param([1, 2], M.Sharding("dp", 2, 0)),  # type: ignore[arg-type]
        TypeError,
        ("shard_param", "full", "tensor", "list"),
    ),
    Case(
        "ModelConfig/heads_do_not_divide",
        lambda: M.ModelConfig(dim=64, n_heads=5),
        ValueError,
        ("ModelConfig", "n_heads", "5", "64"),
    ),
    Case(
        "ModelConfig/attention=flash",
        lambda: M.ModelConfig(attention="flash"),  # type: ignore[arg-type]
        ValueError,
        ("ModelConfig", "attention", "'flash'"),
    ),
    Case(
        "ModelConfig/top_k>n_experts",
        lambda: M.ModelConfig(moe=True, n_experts=2, top_k=3),
        ValueError,
        ("ModelConfig", "top_k", "3", "n_experts"),
    ),
]


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
    assert B.TESTED_TORCH == ("2.13.0", "2.14.1", "2.15.0")
    monkeypatch.delattr(aot, "aot_export_joint_with_descriptors")
    with pytest.raises(B.UnsupportedTorchError) as info:
        B.precompile(torch.nn.Linear(2, 2), (torch.randn(2, 2),))
    assert info.value.package == "ap-backend"
    assert "aot_export_joint_with_descriptors" in str(info.value)
    assert "2.15.0" in str(info.value)
