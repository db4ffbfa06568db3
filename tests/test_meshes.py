"""The meshes and loops users train with (``zoo.meshes``, issue #23 item 2), at real ranks:
torchtitan's Llama3 debug model on torchtitan's ``ParallelDims`` + ``apply_simple_fsdp`` (and
its own TP plan), eager against ``precompile`` + the full ``autoparallel_backend``.

In the default run (2 gloo ranks, ~1 min): gradient accumulation (2 micro-batches per step,
one compiled training graph) with a ``torch.no_grad()`` evaluation between the steps.

Marked ``meshes`` (deselected by default; ``.ci/run`` runs ``uv run pytest -m meshes`` once):
bf16 mixed precision (2 ranks, judged against stock ``torch.compile``'s gap in the same run),
HSDP on a (2, 2) mesh and FSDP + TP on a (2, 2) mesh (4 ranks each), and the README's
multi-process (``torchrun``) section run verbatim.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")

from zoo.meshes import (  # noqa: E402
    BF16_MULTIPLIER,
    GRAD_RTOL,
    LOSS_RTOL,
    ROWS,
    RowResult,
    bucketed_axes,
    evaluate,
    run_row,
)

ROOT = Path(__file__).resolve().parent.parent

_rows: dict[str, RowResult] = {}


def _row(name: str) -> RowResult:
    """Each row runs once per test process (its tests share it)."""
    if name not in _rows:
        _rows[name] = run_row(name, timeout_s=900.0)
    return _rows[name]


def _fp32_numerics(res: RowResult) -> None:
    assert res.loss_rel <= LOSS_RTOL, (res.loss_rel, res.to_dict())
    assert res.grad_rel <= GRAD_RTOL, (res.grad_rel, res.grad_worst)


def _structure(res: RowResult) -> None:
    assert res.fallbacks == 0
    assert res.graph_breaks == 0
    assert res.all_gather_saved == 0
    assert res.fsdp_chains >= res.n_params > 0  # every SimpleFSDP parameter tagged


# ----------------------------------------------------------------------------------------------
# default run: gradient accumulation + no_grad evaluation, 2 ranks


@pytest.mark.multirank
@pytest.mark.slow
def test_accumulation_and_no_grad_eval_match_eager() -> None:
    res = _row("accum_eval")
    row = ROWS["accum_eval"]
    assert (res.micro, res.steps, res.eval) == (2, 2, True)
    _fp32_numerics(res)
    _structure(res)
    assert evaluate(res) == [], evaluate(res)


@pytest.mark.multirank
@pytest.mark.slow
def test_accumulation_compiles_one_training_graph_and_one_eval_graph() -> None:
    """Four micro-batch calls and an evaluation: the backend compiles the training graph once
    (no recompile per micro-batch or after the evaluation) and the no_grad graph once."""
    res = _row("accum_eval")
    assert res.graphs == 2, res.graphs
    # the FSDP collectives of the training graph (forward + backward) and the evaluation graph
    fsdp = bucketed_axes(res)["fsdp"]
    before, after = fsdp["reduce_scatter"]
    assert before == res.n_params and after < before
    assert fsdp["all_gather"][1] < fsdp["all_gather"][0]
    assert set(bucketed_axes(res)) == {"fsdp"}
    assert ROWS["accum_eval"].world == res.ranks == 2


# ----------------------------------------------------------------------------------------------
# marked: bf16 mixed precision, HSDP 2x2, FSDP + TP 2x2, torchrun


@pytest.mark.meshes
@pytest.mark.multirank
@pytest.mark.slow
def test_bf16_mixed_precision_within_twice_stock_gap() -> None:
    res = _row("bf16")
    assert res.bf16 and res.stock_loss_rel is not None and res.stock_grad_rel is not None
    _structure(res)
    assert res.stock_graph_breaks == 0
    assert res.grad_rel <= BF16_MULTIPLIER * max(res.stock_grad_rel, GRAD_RTOL), res.to_dict()
    assert res.loss_rel <= BF16_MULTIPLIER * max(res.stock_loss_rel, LOSS_RTOL), res.to_dict()


@pytest.mark.meshes
@pytest.mark.multirank
@pytest.mark.slow
def test_hsdp_2x2_matches_eager() -> None:
    res = _row("hsdp_2x2")
    assert res.ranks == 4 and res.mesh == "dp_replicate 2 x fsdp 2"
    _fp32_numerics(res)
    _structure(res)
    axes = bucketed_axes(res)
    rs_before, rs_after = axes["fsdp"]["reduce_scatter"]
    assert rs_before == res.n_params and rs_after < rs_before
    assert evaluate(res) == [], evaluate(res)


@pytest.mark.meshes
@pytest.mark.multirank
@pytest.mark.slow
def test_fsdp_tp_2x2_matches_eager_and_buckets_only_the_fsdp_dim() -> None:
    res = _row("fsdp_tp_2x2")
    assert res.ranks == 4 and res.mesh == "fsdp 2 x tp 2"
    _fp32_numerics(res)
    _structure(res)
    axes = bucketed_axes(res)
    rs_before, rs_after = axes["fsdp"]["reduce_scatter"]
    assert rs_before > 0 and rs_after < rs_before
    tp: dict[str, Any] = axes["tp"]
    assert any(before for before, _ in tp.values())  # TP issues collectives of its own
    for kind, (before, after) in tp.items():
        assert before == after, (kind, before, after)  # ... which bucketing leaves alone
    assert "other" not in axes
    assert evaluate(res) == [], evaluate(res)


def _readme_torchrun_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Multi-process (torchrun)", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.mark.meshes
@pytest.mark.multirank
@pytest.mark.slow
def test_readme_torchrun_section_runs_verbatim() -> None:
    commands = _readme_torchrun_commands()
    assert any("-m zoo.torchrun demo" in c for c in commands)
    assert any("-m zoo.torchrun zoo" in c for c in commands)
    for command in commands:
        assert command.startswith("uv run torchrun --standalone --nproc-per-node 2 "), command
        proc = subprocess.run(
            ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        out = proc.stdout
        assert proc.returncode == 0, (command, out[-3000:], proc.stderr[-3000:])
        assert "launched by torchrun" in out, out
        if "zoo.torchrun demo" in command:
            assert re.search(r"max grad rel diff.*\| \d", out), out
        else:
            assert re.search(r"\| full \| .* \| ok \|", out), out
