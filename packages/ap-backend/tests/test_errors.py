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
for option, value in [
    ("enable_ac", "yes"),
    ("enable_ac", 1),
    ("enable_ac", None),
    ("ac_stage_size_gib", -1),
    ("ac_stage_size_gib", 0),
    ("ac_stage_size_gib", "big"),
    ("ac_stage_size_gib", float("nan")),
    ("ac_stage_size_gib", True),
    ("overlap_scheduling", 1),
    ("overlap_scheduling", "no"),
    ("bucketing", "x"),
    ("bucketing", 1500),
    ("ep_chunk", {}),
    ("ep_chunk", "layers.*.moe"),
    ("partitioner", "mincut"),
    ("partitioner", 3),
    ("partitioner", print),
]:
    CASES.append(
        Case(
            f"autoparallel_backend/{option}={value!r}",
            lambda o=option, v=value: B.autoparallel_backend(**{o: v}),
            ValueError,
            ("autoparallel_backend", option, repr(value)),
        )
    )
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
        ("precompile", "joint_pass", "3"),
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
