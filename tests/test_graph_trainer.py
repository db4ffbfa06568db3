"""ap-bucketing inside torchtitan's own trainer (issue 41): ``torchtitan.train`` unmodified, its
graph_trainer on 2 gloo ranks on CPU (``zoo.graph_trainer``: the test-only device swap, a
generated tokenizer and ``c4_test`` data, no downloads), 2 steps, once with graph_trainer's
default pipeline and once with ``--compile.pass_pipeline ap`` (ap-bucketing's
``OverlapBucketingPass`` in place of its block bucketing pass). Every parameter's gradient on
every rank and step, and the loss, must equal the default pipeline's; the collectives must be
bucketed; and the bucketed graph must not hold more all-gathered bytes at once than
graph_trainer's own block buckets (``ap_bucketing.max_gathered_bytes`` on the trained graph).

The joint graph is traced without functionalization: its chunked loss writes the hidden-state
gradient with ``copy_`` into slices of a buffer the backward reads with no data edge
(``ap_bucketing._hazards`` keeps that write order through reordering). The ``"ap"`` pipeline's
prefetch schedule moves only collective issues and their waits, so it never needs the rule on
this graph; torch's overlap scheduler moves compute. ``--compile.pass_pipeline
ap_torch_schedule`` (``zoo.graph_trainer``: ``make_bucketing_pass(reorder=True)``, a public
option) runs ap-bucketing that way: without the write order (``hazard_edges`` made to return no
pairs) 44 of Llama3's 45 gradients differ from graph_trainer's own run, relative error 1.0 (all
zeros), while the loss matches (2026-11-28); with it they are equal.

Default run (``regional`` Inductor, graph_trainer's default): torchtitan's Llama3 debug model
(SDPA) and Qwen3-MoE debug model at 2 of its 8 layers (SDPA: FlexAttention has no CPU
backward); 50-55 s a run on the 2-core machine without AVX-512.
``heavy``: the same with ``--compile.inductor_compilation full`` (every node through Inductor,
~100 s a run), and DeepSeek-V3's debug model (SDPA; 193 s for both runs: equal gradients,
10.8 MB of gathered weights held at most against graph_trainer's own 33.1 MB, 2026-11-28).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.experiments.graph_trainer.registry")

from zoo.graph_trainer import TORCH_SCHEDULE_PIPELINE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

SECTION = "### In torchtitan's own trainer (graph_trainer)"
STEPS = 2
RANKS = 2
#: the zoo's fp32 tolerances (zoo/README.md): loss 1e-5, gradients 1e-4, relative
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
#: (--module, --config) of the MoE case; Llama3's is the README's own
#: (2 of its 8 layers: the 8-layer model has 302M expert parameters, and gloo's collectives and
#: AdamW over them took 46 s a step on 2 cores; 2 layers keep every pattern, at 50 s a run)
QWEN3_MOE = ("zoo.graph_trainer", "graph_trainer_qwen3_debugmodel_moe_sdpa_2layers")
#: (--module, --config) of DeepSeek-V3's debug model (SDPA), ``heavy``
DEEPSEEK_V3 = ("zoo.graph_trainer", "graph_trainer_deepseek_v3_debugmodel_sdpa")


def readme_command() -> str:
    """The README's torchtitan command, verbatim (its section's one ``bash`` block)."""
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    (command,) = [ln for ln in block.splitlines() if ln.strip()]
    return command


def _command(model: str, pipeline: str, mode: str) -> str:
    """The README command, for ``model`` and ``pipeline`` (``ap``, ``TORCH_SCHEDULE_PIPELINE`` or
    graph_trainer's ``default``) and Inductor ``mode``; unchanged for Llama3 + ``ap`` +
    ``regional``."""
    words = shlex.split(readme_command())
    assert words[:3] == ["uv", "run", "torchrun"] and "--compile.pass_pipeline" in words
    if model in ("qwen3_moe", "deepseek_v3"):
        module_config = QWEN3_MOE if model == "qwen3_moe" else DEEPSEEK_V3
        words[words.index("--module") + 1], words[words.index("--config") + 1] = module_config
    at = words.index("--compile.pass_pipeline")
    if pipeline == "default":
        del words[at : at + 2]
    else:
        words[at + 1] = pipeline
    if mode != "regional":
        words += ["--compile.inductor_compilation", mode]
    command = shlex.join(words)
    if (model, pipeline, mode) == ("llama3", "ap", "regional"):
        assert command == shlex.join(shlex.split(readme_command()))
    return command


_runs: dict[tuple[str, str, str], dict[tuple[int, int], dict[str, Any]]] = {}


@pytest.mark.parametrize("status", [0, 3])
def test_a_finished_rank_exits_with_its_status_without_interpreter_finalization(
    status: int,
) -> None:
    """The zoo's torchrun entry points (``python -m zoo.graph_trainer``, ``zoo.torchrun``,
    ``zoo.meshes``) leave through ``zoo.teardown.exit_without_finalization`` once their job
    returned: the job's status, what they printed and logged flushed, no finalization (no
    ``atexit`` handler runs). A rank's finalization once aborted in torch's C++ destructors
    after "Training completed" and "Process group destroyed" (``terminate called without an
    active exception``), and torchrun failed the job."""
    code = (
        "import atexit, logging, sys\n"
        "from zoo.teardown import exit_without_finalization\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "logging.getLogger('rank').info('trained')\n"
        "print('done', end='')\n"
        f"exit_without_finalization({status})\n"
        "print('after')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "done"  # flushed before the exit; nothing after it, no atexit
    assert "trained" in proc.stderr


def train(model: str, pipeline: str, mode: str = "regional") -> dict[tuple[int, int], Any]:
    """One ``torchrun -m zoo.graph_trainer`` job from the repository root, as the README runs
    it; ``{(rank, step): record}`` from its gradient dumps (``zoo.graph_trainer.
    dump_gradients``). Each job runs once per process."""
    key = (model, pipeline, mode)
    if key in _runs:
        return _runs[key]
    command = _command(model, pipeline, mode)
    with tempfile.TemporaryDirectory(prefix="ap-graph-trainer-") as tmp:
        dump = Path(tmp) / "dump"
        env = dict(
            os.environ,
            ZOO_GRAPH_TRAINER_DUMP=str(dump),
            TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
        )
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            pytest.fail(f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        records = {
            (rank, step): torch.load(dump / f"rank{rank}_step{step}.pt", weights_only=False)
            for rank in range(RANKS)
            for step in range(1, STEPS + 1)
        }
    _runs[key] = records
    return records


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / scale if scale > 0 else float(got.abs().max())


def assert_same_training(ours: dict[Any, Any], theirs: dict[Any, Any]) -> None:
    """Loss and every gradient of every rank and step within the zoo's fp32 tolerances."""
    for key, want in theirs.items():
        got = ours[key]
        assert abs(got["loss"] - want["loss"]) <= LOSS_RTOL * abs(want["loss"]), key
        assert got["grads"].keys() == want["grads"].keys()
        bad = {
            fqn: _rel(got["grads"][fqn], g)
            for fqn, g in want["grads"].items()
            if _rel(got["grads"][fqn], g) > GRAD_RTOL
        }
        assert not bad, (
            f"rank/step {key}: {len(bad)} of {len(want['grads'])} gradients differ: {bad}"
        )


def assert_bucketed(ours: dict[Any, Any]) -> dict[str, Any]:
    """Collectives bucketed (fewer after the pass than before, all-gathers and reduce-scatters)
    and nothing skipped; returns ap-bucketing's report."""
    report: dict[str, Any] = ours[(0, 1)]["ap_bucketing"]
    assert report["skipped"] is None
    for kind in ("all_gather", "reduce_scatter"):
        before, after = report["collectives"][kind]
        assert after < before, (kind, before, after)
    return report


def assert_bucketed_within_block_memory(ours: dict[Any, Any], theirs: dict[Any, Any]) -> None:
    """:func:`assert_bucketed`, and no more all-gathered bytes held at once than
    graph_trainer's own."""
    assert_bucketed(ours)
    assert 0 < ours[(0, 1)]["max_gathered_bytes"] <= theirs[(0, 1)]["max_gathered_bytes"]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "model", ["llama3", "qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.heavy)]
)
def test_ap_pipeline_trains_like_graph_trainers_own(model: str) -> None:
    theirs = train(model, "default")
    ours = train(model, "ap")
    assert_same_training(ours, theirs)
    assert_bucketed_within_block_memory(ours, theirs)


@pytest.mark.multirank
def test_torchs_overlap_scheduler_keeps_the_chunked_loss_write_order() -> None:
    """ap-bucketing with torch's overlap scheduler (``make_bucketing_pass(reorder=True)``,
    ``BucketingConfig()``'s ``"custom_ops"`` buckets) on Llama3's joint graph: the scheduler
    hoists the trunk's backward above the chunked loss's ``copy_`` writes unless the write order
    is restored; every gradient must still equal graph_trainer's own. (Its collectives are
    bucketed too, but torch's scheduler prefetches further than a block: 2.3x graph_trainer's
    gathered bytes here, which is why the ``"ap"`` pipeline uses ap's prefetch schedule.)"""
    theirs = train("llama3", "default")
    ours = train("llama3", TORCH_SCHEDULE_PIPELINE)
    assert_same_training(ours, theirs)
    assert assert_bucketed(ours)["hazard_reorders"] > 0


@pytest.mark.heavy
@pytest.mark.multirank
def test_ap_pipeline_with_full_inductor_trains_like_graph_trainers_own() -> None:
    """``--compile.inductor_compilation full``: the bucketed joint graph (``out=`` unpacks,
    in-place writes) through AOTAutograd's functionalization and Inductor."""
    theirs = train("llama3", "default", "full")
    ours = train("llama3", "ap", "full")
    assert_same_training(ours, theirs)
    report = ours[(0, 1)]["ap_bucketing"]
    assert report["skipped"] is None
    assert report["collectives"]["all_gather"][1] < report["collectives"]["all_gather"][0]


@pytest.mark.parametrize("model", ["llama3", "qwen3", "deepseek_v3"])
def test_adapter_modules_offer_graph_trainers_configs_and_register_the_pipeline(
    model: str,
) -> None:
    """``--module ap_bucketing.torchtitan.<model>``: every ``graph_trainer_*`` config of
    graph_trainer's module of that name, the same functions, and the ``ap`` pipeline."""
    import importlib

    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    ours = importlib.import_module(f"ap_bucketing.torchtitan.{model}")
    theirs = importlib.import_module(
        f"torchtitan.experiments.graph_trainer.{model}.config_registry"
    )
    names = sorted(n for n in vars(theirs) if n.startswith("graph_trainer_"))
    assert names and ours.__all__ == names
    assert all(getattr(ours, n) is getattr(theirs, n) for n in names)
    from ap_bucketing.torchtitan import ap_pass_pipeline

    assert PASS_PIPELINE_REGISTRY["ap"] is ap_pass_pipeline


@pytest.mark.parametrize(
    "option", ["enable_fsdp_dense_region_overlap", "ep_overlap.enabled"], ids=lambda o: o
)
def test_pipeline_refuses_options_that_need_graph_trainers_own_buckets(option: str) -> None:
    from ap_bucketing.torchtitan import ap_pass_pipeline
    from torchtitan.experiments.graph_trainer.llama3.config_registry import (
        graph_trainer_llama3_debugmodel_sdpa,
    )

    config = graph_trainer_llama3_debugmodel_sdpa()
    if option == "ep_overlap.enabled":
        config.compile.ep_overlap.enabled = True
    else:
        config.compile.enable_fsdp_dense_region_overlap = True
    with pytest.raises(ValueError, match=f"--compile.{re.escape(option)}"):
        ap_pass_pipeline(None, config)
