"""Property test (#26): random expert-parallel MoE configs at 2 gloo ranks, every accepted graph
RUN against eager.

The MoE is torchtitan 0.3.0's own ``MoE`` (``TokenChoiceTopKRouter`` + ``RoutedExperts`` with
``AllToAllTokenDispatcher``), its sharding config set by ``set_moe_sharding_config(enable_ep=
True)`` and parallelized by ``MoE.parallelize(ParallelDims(dp_shard=2, ep=2))`` with the CPU
substitutions of ``zoo.models.expert_parallel`` (each rank holds ``num_experts / 2`` experts as
a DTensor ``Shard(0)``; the dispatcher exchanges per-expert counts, reads the split sizes with
``.tolist()`` and dispatches / combines with ``all_to_all_single``).

Per drawn example (both ranks draw the same list: :func:`draw_cases` with a fixed seed, in the
parent): ``num_experts`` (even), ``top_k``, a per-expert ``capacity`` or none (dropless),
``num_chunks`` in {1, 2, 4} dividing the batch, the batch and sequence length (tokens per rank),
and a ``skew`` that biases the router (``MoE.expert_bias_E``, which only steers the top-k choice)
so that every token of both ranks goes to rank 0's experts: rank 1 then *receives zero tokens*,
in every chunk. The first example always covers that case.

torchtitan's ``AllToAllTokenDispatcher`` has no capacity / token-drop knob, so the capacity
variant is :class:`CapacityDispatcher` below: a subclass that drops, on the sending rank, every
assignment beyond the first ``capacity`` of each expert (in token order), before the exchange.
Chunked, that dispatch was accepted by the chunk pass and failed at run time, until the static
probe checked ``index_put``'s values (ap-epchunk; the second example covers it).

Each example trains 2 SGD steps three ways on each rank: eager EP (the reference), ``precompile``
+ ``autoparallel_backend(ep_chunk=ChunkConfig(("layers.*.moe",), num_chunks=N))`` through the
documented token route (``mark_chunk_dim(t, 0, hint=None)``), and ``EagerChunked`` (each chunk
routes and exchanges its own tokens, eagerly). fp32: loss rel 1e-5 and grads rel 1e-4 against
``EagerChunked``, and against eager EP where chunking does not change the maths (dropless; a
capacity drops per chunk, so there only ``num_chunks=1`` must equal eager EP). A refusal must be
``ChunkError`` or ``PrecompileError``; a refused dropless top-k config fails the test.

All examples run in ONE 2-rank spawn (partitioned graphs run as FX graphs, without Inductor
codegen, unless ``AP_EP_PROPERTY_INDUCTOR=1``); ``AP_EP_PROPERTY_EXAMPLES`` sets how many (default
:data:`DEFAULT_EXAMPLES`), ``AP_EP_PROPERTY_SEED`` the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ap_testing.errors import raised
from torch import nn

DEFAULT_EXAMPLES = 4
SEED = 20261125
WORLD = 2
DIM, HIDDEN = 8, 8
STEPS = 2
LR = 0.1
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
PATTERN = "layers.*.moe"


@dataclass(frozen=True)
class EpCase:
    num_experts: int
    top_k: int
    #: assignments each expert keeps per sending rank (and chunk); None: dropless
    capacity: int | None
    num_chunks: int
    batch: int
    seq: int
    #: every token of both ranks routed to rank 0's experts (rank 1 receives none)
    skew: bool
    seed: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def draw_cases(n: int, seed: int = SEED) -> list[EpCase]:
    """``n`` examples (at least 2): the first always the zero-receive case (skewed, dropless,
    chunked), the second a capacity dispatch chunked in 2 (its first run found an ap-epchunk
    defect, see ``test_slice_scatter_of_full_size_zeros_into_index_put_is_chunked``)."""
    rng = random.Random(seed)
    cases = [
        EpCase(4, 2, None, 2, 4, 2, skew=True, seed=rng.randrange(2**31)),
        EpCase(4, 1, 2, 2, 6, 3, skew=False, seed=1595669285),
    ]
    while len(cases) < n:
        num_experts = rng.choice((2, 4, 6, 8))
        skew = rng.random() < 0.3
        local = num_experts // WORLD
        top_k = rng.randint(1, min(local if skew else num_experts, 3))
        num_chunks = rng.choice((1, 2, 4))
        batch = num_chunks * rng.choice((2, 3))  # chunks of >= 2 sequences
        seq = rng.randint(1, 4)
        capacity = None if rng.random() < 0.5 else rng.randint(1, 3)
        seed_i = rng.randrange(2**31)
        case = EpCase(num_experts, top_k, capacity, num_chunks, batch, seq, skew, seed_i)
        if case not in cases:
            cases.append(case)
    return cases


# ------------------------------------------------------------------------------- the model


def _capacity_dispatcher_class() -> type:
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    class CapacityDispatcher(AllToAllTokenDispatcher):  # type: ignore[misc]
        """``AllToAllTokenDispatcher`` that drops, on the sending rank, every assignment beyond
        the first ``capacity`` of each expert (token order): the kept assignments go first in
        expert order, the dropped ones last; only the kept rows are exchanged
        (``sum(input_splits)``), and the combine exchange's result is padded back to all
        assignments with zero rows for the dropped ones (so the scores and token indices keep
        their static, chunk-carrying size).

        (Slicing the scores and token indices to the kept rows instead is refused by the chunk
        pass when chunked: ``ChunkError: node 'view_20': value without the chunk dim escapes
        region 'layers.0.moe' to full users (alias_7)`` -- the slice's size is a fresh unbacked
        symbol, not the chunk dim, and the view is saved for backward.)"""

        capacity: int

        def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E):  # type: ignore[no-untyped-def]
            return super().dispatch(
                x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E.clamp(max=self.capacity)
            )

        def _local_reorder(self, x_TD, topk_scores_TK, topk_expert_ids_TK):  # type: ignore[no-untyped-def]
            ids_N = topk_expert_ids_TK.reshape(-1)
            onehot_NE = F.one_hot(ids_N, self.num_experts)
            position_N = (onehot_NE.cumsum(0) * onehot_NE).sum(-1) - 1
            key_N = torch.where(position_N < self.capacity, ids_N, self.num_experts)
            order_N = torch.argsort(key_N, stable=True)
            scores_N = topk_scores_TK.reshape(-1)[order_N]
            token_N = order_N // self.top_k
            return x_TD[token_N], token_N, scores_N

        def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):  # type: ignore[no-untyped-def]
            kept = _kept(input_splits, routed_input_ND.shape[0])
            return super()._dispatch_token_exchange(
                routed_input_ND.narrow(0, 0, kept), pg, output_splits, input_splits
            )

        def combine(self, routed_output_RD, metadata, x_TD):  # type: ignore[no-untyped-def]
            self._sorted_N = metadata.token_indices_experts_sorted_N  # the rows to pad back to
            return super().combine(routed_output_RD, metadata, x_TD)

        def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):  # type: ignore[no-untyped-def]
            kept_RD = super()._combine_token_exchange(
                routed_output_RD, pg, input_splits, output_splits
            )
            # the kept rows back in place of all N (the dropped ones, last, add zero)
            sorted_N = self._sorted_N
            kept = _kept(input_splits, sorted_N.shape[0])
            full_ND = torch.zeros_like(sorted_N, dtype=kept_RD.dtype)
            full_ND = full_ND.unsqueeze(-1).expand(-1, kept_RD.shape[-1])
            return full_ND.slice_scatter(kept_RD, 0, 0, kept)

    return CapacityDispatcher


def _kept(splits: list[Any], n: int) -> Any:
    kept = sum(splits)
    if not isinstance(kept, int):
        torch._check(kept >= 0)
        torch._check(kept <= n)
    return kept


class Block(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.moe = moe


class Net(nn.Module):
    """A dense projection, torchtitan's MoE (``layers.0.moe``), residual; MSE loss."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleDict({"0": Block(moe)})

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out = h + self.layers["0"].moe(h)
        return F.mse_loss(out, y)


def build(case: EpCase, world: int) -> Net:
    """The same model on every rank (seeded), experts sharded over ``world`` ranks."""
    import spmd_types as spmd
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    from zoo.models.expert_parallel import ep_parallel_dims, fp32_experts

    # torchtitan's Qwen3 initialisers (normal, std 0.02), without importing the model package
    init = functools.partial(nn.init.normal_, std=0.02)
    cfg = make_moe_config(
        num_experts=case.num_experts,
        router=make_router_config(
            dim=DIM,
            num_experts=case.num_experts,
            gate_param_init={"weight": init, "bias": nn.init.zeros_},
            top_k=case.top_k,
            score_func="softmax",
            route_norm=True,
        ),
        routed_experts=make_routed_experts_config(
            dim=DIM,
            hidden_dim=HIDDEN,
            num_experts=case.num_experts,
            top_k=case.top_k,
            param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init},
            comm_backend="standard",
        ),
    )
    set_moe_sharding_config(
        cfg,
        enable_ep=True,
        enable_sp=False,
        # GroupedExperts' dense (TP) layout, unused with EP on (as in qwen3's sharding)
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    torch.manual_seed(case.seed)
    moe = cfg.build()
    moe.init_states()
    if case.capacity is not None:
        dispatcher = _capacity_dispatcher_class()(cfg.routed_experts.token_dispatcher)
        dispatcher.capacity = case.capacity
        moe.routed_experts.token_dispatcher = dispatcher
    if case.skew:  # only the top-k choice: every token picks among rank 0's experts
        with torch.no_grad():
            moe.expert_bias_E[: case.num_experts // world] = 10.0
    net = Net(moe)
    moe.parallelize(ep_parallel_dims(world))
    fp32_experts(net)
    net.train()
    return net


def batches(case: EpCase, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(case.seed + 1 + rank)
    shape = (case.batch, case.seq, DIM)
    return [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(STEPS)
    ]


def train(
    fn: Any, net: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    from torch.distributed.tensor import DTensor

    losses, grads = [], []
    for x, y in data:
        loss = fn(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
        step: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in net.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                step[name.replace(".moe.module.", ".moe.")] = g.detach().clone()
                p.sub_(LR * p.grad)
                p.grad = None
        grads.append(step)
    return losses, grads


def _rel(got: list[float], ref: list[float]) -> float:
    return max(abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref, strict=True))


def _grads_rel(got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]) -> float:
    """Worst normwise relative error over steps and parameters (scaled by max |ref|, floored at
    1e-3 of the step's largest |ref|: a gradient that is all but zero is judged on the step's
    scale)."""
    worst = 0.0
    for g_step, r_step in zip(got, ref, strict=True):
        assert g_step.keys() == r_step.keys(), (sorted(g_step), sorted(r_step))
        top = max((float(r.abs().max()) for r in r_step.values() if r.numel()), default=0.0)
        for name, r in r_step.items():
            scale = max(float(r.abs().max()) if r.numel() else 0.0, 1e-3 * top, 1e-30)
            worst = max(worst, float((g_step[name] - r).abs().max()) / scale if r.numel() else 0.0)
    return worst


def run_case(case: EpCase, rank: int, world: int) -> dict[str, Any]:
    """One example on this rank: eager EP, EagerChunked, then precompile + the backend."""
    import torch.distributed as dist
    from ap_backend import PrecompileError, autoparallel_backend, precompile
    from ap_epchunk import ChunkConfig, ChunkError, EagerChunked, mark_chunk_dim
    from ap_tags import annotate_module_fqns

    out: dict[str, Any] = {"case": dataclasses.asdict(case), "rank": rank}
    data = batches(case, rank)
    torch._dynamo.reset()
    start = time.perf_counter()
    ref = build(case, world)
    ref_losses, ref_grads = train(ref, ref, data)
    ec_losses, ec_grads = ref_losses, ref_grads  # one chunk: EagerChunked is eager EP
    if case.num_chunks > 1:
        ec = build(case, world)
        ec.layers["0"].moe = EagerChunked(ec.layers["0"].moe, 0, case.num_chunks)
        ec_losses, ec_grads = train(ec, ec, data)
    net = build(case, world)
    x, y = (t.clone() for t in data[0])
    mark_chunk_dim(x, 0, hint=None)
    mark_chunk_dim(y, 0, hint=None)
    chunk = ChunkConfig((PATTERN,), num_chunks=case.num_chunks) if case.num_chunks > 1 else None
    backend = autoparallel_backend(ep_chunk=chunk)
    out["eager_s"] = time.perf_counter() - start
    try:
        with annotate_module_fqns(net):
            pm = precompile(net, (x, y))
        out["precompile_s"] = time.perf_counter() - start
        losses, grads = train(torch.compile(pm, backend=backend), net, [(x, y), *data[1:]])
    except Exception as exc:  # noqa: BLE001 - a refusal wrapped by Dynamo is judged by its cause
        cause = raised(exc, (ChunkError, PrecompileError))
        if cause is None:
            raise
        out["refused"] = f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
    else:
        out["chunked_regions"] = (
            len(backend.chunk_reports[-1].regions) if backend.chunk_reports else 0
        )
        out["loss_rel_eager"] = _rel(losses, ref_losses)
        out["grad_rel_eager"] = _grads_rel(grads, ref_grads)
        out["loss_rel_eager_chunked"] = _rel(losses, ec_losses)
        out["grad_rel_eager_chunked"] = _grads_rel(grads, ec_grads)
    out["eager_chunked_vs_eager_grad"] = _grads_rel(ec_grads, ref_grads)
    # eager EP's first step: did any token reach this rank's experts?
    experts = [g for name, g in ref_grads[0].items() if ".inner_experts." in name]
    assert experts, sorted(ref_grads[0])
    out["received_tokens"] = any(bool(g.any()) for g in experts)
    out["seconds"] = time.perf_counter() - start
    dist.barrier()
    torch._dynamo.reset()
    return out


def _fx_inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Runs the partitioned graph as it is (no Inductor codegen), boxed as AOTAutograd calls."""

    def run(args: list[Any]) -> Any:
        outs = gm(*args)
        args.clear()
        return outs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _rank(rank: int, world: int, cases: list[EpCase], inductor: bool) -> list[dict[str, Any]]:
    import torch._inductor.compile_fx as cfx

    from zoo.models.expert_parallel import cpu_expert_parallel

    cpu_expert_parallel()
    if not inductor:
        cfx.compile_fx_inner = _fx_inner_compile  # type: ignore[assignment]
    rows = []
    for case in cases:
        try:
            rows.append(run_case(case, rank, world))
        except Exception as exc:
            # neither accepted-and-run nor refused: a crash names its example (both ranks stop)
            raise RuntimeError(f"{case} crashed on rank {rank}") from exc
    return rows


def _judge(case: EpCase, rows: list[dict[str, Any]]) -> list[str]:
    """What is wrong with one example's rank records (empty: it passed)."""
    problems: list[str] = []
    refused = [r.get("refused") for r in rows]
    if any(refused):
        if not all(refused):
            problems.append(f"refused on some ranks only: {refused}")
        if case.capacity is None:
            problems.append(f"a dropless top-k EP config must chunk, refused: {refused}")
        return problems
    for r in rows:
        where = f"rank {r['rank']}"
        checks = [("loss vs EagerChunked", r["loss_rel_eager_chunked"], LOSS_RTOL)]
        checks.append(("grads vs EagerChunked", r["grad_rel_eager_chunked"], GRAD_RTOL))
        if case.capacity is None or case.num_chunks == 1:  # chunking keeps eager EP's maths
            checks.append(("loss vs eager EP", r["loss_rel_eager"], LOSS_RTOL))
            checks.append(("grads vs eager EP", r["grad_rel_eager"], GRAD_RTOL))
        for what, value, tol in checks:
            if not value <= tol:
                problems.append(f"{where}: {what} {value:.3g} > {tol:g}")
        expected_regions = 2 if case.num_chunks > 1 else 0  # the MoE's forward and backward
        if r["chunked_regions"] != expected_regions:
            problems.append(f"{where}: {r['chunked_regions']} chunked regions")
    if case.skew and [r["received_tokens"] for r in rows] != [True, False]:
        problems.append(f"skew: tokens received per rank {[r['received_tokens'] for r in rows]}")
    return problems


@pytest.fixture(scope="module")
def spawned(
    spawn_from_root: Any,
) -> tuple[list[EpCase], list[list[dict[str, Any]]], float, bool]:
    """All examples in ONE 2-rank spawn."""
    n = int(os.environ.get("AP_EP_PROPERTY_EXAMPLES", DEFAULT_EXAMPLES))
    seed = int(os.environ.get("AP_EP_PROPERTY_SEED", SEED))
    inductor = os.environ.get("AP_EP_PROPERTY_INDUCTOR", "0") == "1"
    cases = draw_cases(n, seed)
    start = time.perf_counter()
    # a budget per example (Inductor codegen of each forward and backward is the slow part)
    budget = 120.0 + (120.0 if inductor else 30.0) * len(cases)
    # the ranks unpickle this module's _rank and import zoo: both from the workspace root
    per_rank = spawn_from_root(_rank, WORLD, cases, inductor, timeout_s=budget)
    wall = time.perf_counter() - start
    return cases, per_rank, wall, inductor


@pytest.mark.multirank
@pytest.mark.slow
def test_random_ep_moe_configs_run_like_eager_ep_and_eager_chunked(
    spawned: tuple[list[EpCase], list[list[dict[str, Any]]], float, bool],
) -> None:
    """Every drawn example is accepted and trains like eager EP / ``EagerChunked`` on both
    ranks, or is refused with ``ChunkError`` / ``PrecompileError`` (capacity variants only)."""
    cases, per_rank, wall, inductor = spawned
    lines, failures = [], []
    for i, case in enumerate(cases):
        rows = [ranks[i] for ranks in per_rank]
        problems = _judge(case, rows)
        outcome = rows[0].get("refused") or "ran: " + ", ".join(
            f"{k} {max(r[k] for r in rows):.1e}"
            for k in ("loss_rel_eager", "grad_rel_eager", "grad_rel_eager_chunked")
        )
        lines.append(f"{case}: {outcome} ({max(r['seconds'] for r in rows):.1f} s)")
        failures += [f"{case}: {p}" for p in problems]
    print(f"{len(cases)} examples in {wall:.1f} s (inductor={inductor})")
    print(*lines, sep="\n")
    assert not failures, "\n".join(failures)
