"""The first partition and its replay never save more than torch's min-cut on the same tagged
graph, and less than plain ``torch.compile`` wherever that keeps all-gathered weights.

Why a sweep: which partition wins depends on the regime. Where few tokens meet large weights
the all-gathered weights plain ``torch.compile`` keeps dominate; at the token counts people
train with (>= 2048 tokens per rank) the activations do, and a first partition that saves every
intermediate the backward reads (torch's ``default_partition``) lost to plain compile there. So
every regime is measured: tokens per rank 64 to 8192, dim 128 to 1024, 2 to 8 layers, AC on
and off (in the first compilation too), fp32 and bf16 gathers, and torchtitan's Llama3 at seq
1024 (a model nobody here wrote).

Per point, on the fake process group (world 8; structure only, the bytes are exact):

* ``plain``: stock Inductor's partition of the untagged model (min-cut, no AC);
* ``tagged``: torch's min-cut on ``precompile``'s output, AC as in the first compilation;
* ``first``: what ``precompile``'s first partition saved (min-cut by default);
* ``replay``: the backend's save-all replay of it.

The replay must save the first partition's storages exactly, no all-gathered weight, no more
than ``tagged``, and less than ``plain`` when ``plain`` saves all-gather outputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import ap_backend
import ap_tags
import pytest
import torch
from ap_backend.models import ModelConfig, Sharding, Transformer
from ap_testing.distributed import fake_world
from torch import nn


@dataclass(frozen=True)
class Point:
    batch: int
    seq: int
    dim: int
    layers: int
    ac: bool
    gather_dtype: torch.dtype | None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def __str__(self) -> str:
        dtype = "bf16" if self.gather_dtype is torch.bfloat16 else "fp32"
        ac = "ac" if self.ac else "noac"
        return f"t{self.tokens}-d{self.dim}-l{self.layers}-{ac}-{dtype}"


#: The default run measures the two ends that decide the design (weights dominate; the issue's
#: CPU shape, activations dominate); the rest of the sweep is ``heavy`` (``uv run pytest -m
#: heavy``: ~6 min on 2 cores).
_HEAVY = pytest.mark.heavy
POINTS = (
    pytest.param(Point(1, 64, 512, 2, False, None)),  # weights dominate
    pytest.param(Point(2, 512, 256, 2, False, torch.bfloat16)),  # the CPU shape
    pytest.param(Point(2, 512, 256, 2, True, torch.bfloat16), marks=_HEAVY),
    pytest.param(Point(1, 2048, 128, 4, True, None), marks=_HEAVY),
    pytest.param(Point(4, 2048, 128, 2, False, torch.bfloat16), marks=_HEAVY),  # 8192 tokens
    pytest.param(Point(1, 2048, 1024, 2, False, None), marks=_HEAVY),
    pytest.param(Point(2, 128, 128, 8, False, torch.bfloat16), marks=_HEAVY),
)


@dataclass(frozen=True)
class Measured:
    plain: ap_backend.SavedSummary
    tagged: ap_backend.SavedSummary
    first: ap_backend.SavedSummary
    replay: ap_backend.SavedSummary
    first_partitioner: str


def measure(module: nn.Module, batch: tuple[Any, ...], ac: bool) -> Measured:
    """The four saved sets of one model (see the module docstring)."""
    plain = ap_backend.measure_saved(module, batch, partitioner="min_cut", enable_ac=False)
    torch.compiler.reset()
    joint_pass = ap_tags.ac_joint_pass() if ac else None
    pm = ap_backend.precompile(module, batch, joint_pass=joint_pass)
    torch.compiler.reset()
    replay = ap_backend.measure_saved(pm, batch, partitioner="save_all", enable_ac=ac)
    torch.compiler.reset()
    tagged = ap_backend.measure_saved(pm, batch, partitioner="min_cut", enable_ac=ac)
    torch.compiler.reset()
    return Measured(plain, tagged, pm.first_partition, replay, pm.first_partitioner)


def check(m: Measured) -> None:
    detail = {k: (getattr(m, k).count, getattr(m, k).nbytes) for k in ("plain", "tagged", "first")}
    detail["replay"] = (m.replay.count, m.replay.nbytes)
    assert m.first_partitioner == "min_cut_fusible"  # the default
    assert m.replay.storage_keys == m.first.storage_keys, detail
    assert m.replay.all_gather_outputs == (), m.replay.all_gather_outputs
    assert m.replay.nbytes <= m.tagged.nbytes, detail
    if m.plain.all_gather_outputs:
        assert m.replay.nbytes < m.plain.nbytes, detail


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS, ids=lambda p: str(p))
def test_replay_saves_no_more_than_tagged_min_cut_and_less_than_plain(point: Point) -> None:
    with fake_world(8):
        cfg = ModelConfig(
            dim=point.dim,
            n_layers=point.layers,
            n_heads=4,
            ffn_dim=2 * point.dim,
            vocab=1024,
            seq_len=point.seq,
            batch=point.batch,
        )
        model = Transformer(cfg, Sharding.from_world(gather_dtype=point.gather_dtype))
        check(measure(model, model.example_batch(0, 0), point.ac))


@pytest.mark.slow
@pytest.mark.parametrize("ac", [False, pytest.param(True, marks=_HEAVY)], ids=["noac", "ac"])
def test_torchtitan_llama3_at_seq_1024(ac: bool) -> None:
    """torchtitan's Llama3 (2 layers, dim 256), FSDP-sharded by the zoo's ``FsdpTrainStep``."""
    pytest.importorskip("torchtitan")
    from zoo.fsdp import FsdpTrainStep
    from zoo.models import torchtitan_models

    with fake_world(8):
        zm = torchtitan_models.llama3(1, n_layers=2, dim=256, seq=1024)
        step = FsdpTrainStep(zm.module, zm.loss_fn, n_model_inputs=zm.n_model_inputs)
        check(measure(step, tuple(zm.batches[0]), ac))


def test_default_partition_stays_an_option() -> None:
    """``first_partition="default"`` runs torch's ``default_partition`` (AutoParallel's choice),
    says so, and is replayed exactly too; a name that is neither is refused."""
    with fake_world(8):
        model = Transformer(ModelConfig(), Sharding.from_world())
        batch = model.example_batch(0, 0)
        pm = ap_backend.precompile(model, batch, first_partition="default")
        assert pm.first_partitioner == "default"
        replay = ap_backend.measure_saved(pm, batch, partitioner="save_all", enable_ac=False)
        assert replay.storage_keys == pm.first_partition.storage_keys
        with pytest.raises(
            ValueError,
            match="first_partition must be 'min_cut' or 'min_cut_fusible' or 'default'",
        ):
            ap_backend.precompile(model, batch, first_partition="greedy")  # type: ignore[arg-type]


def test_chunk_marked_calls_keep_default_partition() -> None:
    """``first_partition=None``: min-cut without torch's ban on recomputing what a backward matmul
    reads (``"min_cut_fusible"``), except for a call whose tensors carry chunk-dim marks
    (the EP chunk route, measured on ``default_partition``: with min-cut's recomputation the
    chunk pass mis-ordered a wait on torchtitan's Qwen3-MoE with real EP)."""
    import ap_epchunk

    with fake_world(8):
        model = Transformer(ModelConfig(), Sharding.from_world())
        tokens, targets = model.example_batch(0, 0)
        first = ap_backend.precompile(model, (tokens, targets)).first_partitioner
        assert first == "min_cut_fusible"
        ap_epchunk.mark_chunk_dim(tokens, 0, hint=None)
        assert ap_backend.precompile(model, (tokens, targets)).first_partitioner == "default"


def _hidden_saves(summary: ap_backend.SavedSummary, hidden: int) -> int:
    """Saved storages as wide as the FFN's hidden dim (SwiGLU's ``w1 x``, ``w3 x`` and their
    product ``silu(w1 x) * w3 x``)."""
    return sum(1 for shape, _ in summary.signatures if shape and shape[-1] == hidden)


@pytest.mark.slow
def test_min_cut_fusible_recomputes_what_a_backward_matmul_reads_on_torchtitan_llama3() -> None:
    """``first_partition="min_cut_fusible"`` (torch's min-cut without
    ``ban_recompute_materialized_backward``) on torchtitan's Llama3, 2 layers, unsharded and in
    fp32 so the numbers are real: the first partition no longer saves SwiGLU's product (the
    input of ``w2``'s weight gradient, recomputed in the backward from ``w1 x`` and ``w3 x``,
    which are saved either way), it saves fewer bytes than ``"min_cut"``, the replay keeps
    exactly its storages, and loss and every gradient equal eager's."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.common import compute_ffn_hidden_dim

    from zoo.bucketing import _LossOf
    from zoo.models import torchtitan_models

    dim, layers = 64, 2
    hidden = compute_ffn_hidden_dim(dim, multiple_of=32)
    runs = {}
    for which in ("min_cut", "min_cut_fusible"):
        torch.manual_seed(0)
        zm = torchtitan_models.llama3(1, n_layers=layers, dim=dim, seq=64)
        batch = tuple(zm.batches[0])
        eager = copy.deepcopy(zm.module)
        ref = zm.loss_fn(eager(*batch[: zm.n_model_inputs]), *batch[zm.n_model_inputs :])
        ref.backward()

        step = _LossOf(zm.module, zm.loss_fn, zm.n_model_inputs)
        torch.compiler.reset()
        pm = ap_backend.precompile(step, batch, first_partition=which)
        assert pm.first_partitioner == which
        backend = ap_backend.autoparallel_backend()
        loss = torch.compile(pm, backend=backend)(*batch)
        loss.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for (name, got), want in zip(zm.module.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert backend.saved[-1].storage_keys == pm.first_partition.storage_keys
        runs[which] = pm.first_partition
    min_cut, fusible = runs["min_cut"], runs["min_cut_fusible"]
    # per layer: w1 x, w3 x and the product under min-cut; the product is recomputed without
    # the ban
    assert _hidden_saves(min_cut, hidden) == 3 * layers, min_cut.signatures
    assert _hidden_saves(fusible, hidden) == 2 * layers, fusible.signatures
    assert fusible.nbytes < min_cut.nbytes, (fusible.nbytes, min_cut.nbytes)
