"""The backend's backward names each node's own module, so ap-bucketing's buckets are one block
wide in the backward too (issue 42 item 2).

In the second compilation torch's forward-to-backward metadata copy gave every backward node
the ``module_fqn`` of the retraced first compilation's first forward op: every gradient
reduce-scatter (and the cast feeding it) of the model kit and of torchtitan's Llama3 read
``tok_embeddings``, and the block-wide rule saw the whole backward as one block (the kit's 21
reduce-scatters in one bucket). ``ap_epchunk.restore_backward_module_fqns`` before Inductor
puts back the FQN the first compilation stamped. On torch 2.11 that stamp never reached it: the copy there
replaces a backward node's ``custom`` with its forward node's instead of merging over it (2.15),
and the second compilation's backward bucketed as one block (H200: 6.07 GiB peak against 5.19
unbucketed); the backend holds ``_compat.BACKWARD_CUSTOM_MERGE`` around its compile.

Fake process group (structure only); the kit (dim 64, 2 layers) and torchtitan's Llama3 through
the zoo's builder (1 layer, precompiled inside ``annotate_module_fqns`` of the wrapped model, as
the zoo's EP route does: its ``FsdpTrainStep`` hides the model from ``named_modules()``).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import ap_backend._compat as backend_compat
import pytest
import torch
from ap_backend import AutoParallelBackend, autoparallel_backend, precompile
from ap_bucketing import BucketingStats, collect_stats
from ap_bucketing._blocks import block_of, part_of
from ap_testing.distributed import fake_world

pytestmark = pytest.mark.slow

c10d = torch.ops._c10d_functional


Names = list[tuple[str, str | None, str | None]]


def _fqn(node: torch.fx.Node) -> str | None:
    custom = node.meta.get("custom")
    value = custom.get("module_fqn") if isinstance(custom, dict) else None
    return value if isinstance(value, str) else None


@contextlib.contextmanager
def _collective_names() -> Iterator[dict[bool, Names]]:
    """For each graph the backend hands to Inductor (before Inductor and its bucketing pass
    run): ``(collective kind, its module_fqn, its input's module_fqn)`` of every all-gather and
    reduce-scatter, keyed by ``is_backward``."""
    seen: dict[bool, Names] = {False: [], True: []}
    original = backend_compat.compile_fx_inner

    def capturing() -> Any:
        inner = original()

        def compile_inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
            for node in gm.graph.nodes:
                for kind in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                    if node.target is getattr(c10d, kind).default:
                        first = node.all_input_nodes[0]
                        seen[bool(kwargs.get("is_backward"))].append(
                            (kind, _fqn(node), _fqn(first))
                        )
            return inner(gm, example_inputs, **kwargs)

        return compile_inner

    backend_compat.compile_fx_inner = capturing  # type: ignore[assignment]
    try:
        yield seen
    finally:
        backend_compat.compile_fx_inner = original  # type: ignore[assignment]


def _compile(
    model: torch.nn.Module,
    batch: tuple[Any, ...],
    inner: torch.nn.Module | None = None,
    **options: Any,
) -> tuple[dict[bool, Names], list[BucketingStats], AutoParallelBackend]:
    """One training step's compile with the default backend (or ``autoparallel_backend(
    **options)``; fake PG): the collectives' names, the bucketing stats and the backend."""
    torch.compiler.reset()
    with contextlib.ExitStack() as stack:
        seen = stack.enter_context(_collective_names())
        stats = stack.enter_context(collect_stats())
        with contextlib.ExitStack() as tracing:
            if inner is not None:
                from ap_tags import annotate_module_fqns

                tracing.enter_context(annotate_module_fqns(inner))
            pm = precompile(model, batch)
        if options.get("activation_budget_bytes") == "half":
            options["activation_budget_bytes"] = pm.first_partition.nbytes // 2
        backend = autoparallel_backend(**options)
        torch.compile(pm, backend=backend)(*batch).backward()
    return seen, stats, backend


def _assert_each_gradient_names_its_parameters_module(
    seen: dict[bool, Names], stats: list[BucketingStats], blocks: set[str]
) -> None:
    """Every gradient reduce-scatter names its parameter's module (itself, or -- where the
    gathers ran outside any module, the zoo's wrapper -- the op producing the gradient), the
    cast feeding it names the same, the names cover the model's blocks, and the reduce-scatter
    bucketing keyed one bucket group per block, a layer's split per submodule holding two or
    more gradients (``BucketingConfig.backward_parts``: attention, feed-forward; a norm's one
    gradient rides with a neighbour)."""
    scattered = [(f, g) for kind, f, g in seen[True] if kind == "reduce_scatter_tensor"]
    names = [f if f is not None else g for f, g in scattered]
    assert scattered and None not in names, scattered
    assert all(f == g for f, g in scattered if f is not None), scattered
    assert {block_of(n) for n in names} == blocks, names
    gathered = [f for kind, f, _ in seen[False] if kind == "all_gather_into_tensor"]
    if None not in gathered:  # the gathers ran in their modules: each gradient names its own
        assert sorted(names) == sorted(n for n in gathered if n is not None), names
    (reduce_scatter,) = [s for s in stats if s.candidates == len(scattered)][-1:]
    parts = Counter(part_of(n) for n in names)
    groups = {
        block: max(1, sum(1 for p, c in parts.items() if c > 1 and block_of(p) == block))
        for block in blocks
    }
    assert reduce_scatter.keys == sum(groups.values()), (groups, reduce_scatter.log_line())
    assert any(count > 1 for count in groups.values()), groups  # the layers did split


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    with fake_world(8):
        yield


def test_model_kit_gradients_name_their_parameters_module(world: None) -> None:
    from ap_backend.models import ModelConfig, Sharding, Transformer

    model = Transformer(ModelConfig(dim=64, n_layers=2, seq_len=64), Sharding.from_world())
    seen, stats, backend = _compile(model, model.example_batch(0, 0))
    blocks = {"tok_embeddings", "layers.0", "layers.1", "norm", "output"}
    _assert_each_gradient_names_its_parameters_module(seen, stats, blocks)
    assert [c["module_fqns_lost"] for c in backend.inner_compiles] == [0, 0]


def test_an_activation_budgets_backward_gathers_each_weight_once_under_its_module(
    world: None,
) -> None:
    """With an activation budget the second partition recomputes activations in the backward,
    re-running the forward all-gathers they read. Before: the backward gathered 9 of the kit's
    21 weights twice (the recompute's gather beside the backward's own re-gather; 30 in all:
    ``ap_partitioner._regathers`` now merges them), and the backend warned that the recomputed
    ``norm`` / ``output`` / ``tok_embeddings`` gathers had lost their module name -- they carry
    their own (``partitioner_tag "is_forward"``; torch marks every backward-graph node
    ``autograd_backward``)."""
    from ap_backend.models import ModelConfig, Sharding, Transformer

    model = Transformer(ModelConfig(dim=64, n_layers=2, seq_len=64), Sharding.from_world())
    seen, stats, backend = _compile(
        model, model.example_batch(0, 0), activation_budget_bytes="half"
    )
    forward = sorted(f for kind, f, _ in seen[False] if kind == "all_gather_into_tensor")
    backward = sorted(f for kind, f, _ in seen[True] if kind == "all_gather_into_tensor")
    assert len(forward) == len(set(forward)) == 21, forward  # one module per weight
    assert backward == forward  # every weight once (the default's backward skips the embedding)
    _assert_each_gradient_names_its_parameters_module(
        seen, stats, {"tok_embeddings", "layers.0", "layers.1", "norm", "output"}
    )
    assert [c["module_fqns_lost"] for c in backend.inner_compiles] == [0, 0]


def test_torchtitan_llama3_gradients_name_their_parameters_module(world: None) -> None:
    pytest.importorskip("torchtitan")
    from zoo.fsdp import FsdpTrainStep
    from zoo.models import torchtitan_models

    zm = torchtitan_models.llama3(1, n_layers=2, seq=64)
    step = FsdpTrainStep(zm.module, zm.loss_fn, n_model_inputs=zm.n_model_inputs)
    batch = tuple(zm.batches[0])
    seen, stats, backend = _compile(step, batch, zm.module)
    blocks = {"tok_embeddings", "layers.0", "layers.1", "norm", "lm_head"}
    _assert_each_gradient_names_its_parameters_module(seen, stats, blocks)
    assert [c["module_fqns_lost"] for c in backend.inner_compiles] == [0, 0]


def _replacing_metadata_copy(fx_g: torch.fx.GraphModule) -> None:
    """torch 2.11's ``copy_fwd_metadata_to_bw_nodes``, reduced to what matters here: a backward
    node (``partitioner_tag == "is_backward"``) with a forward node of the same ``seq_nr`` gets a
    deep copy of that node's ``custom`` *in place of* its own."""
    forward: dict[int, torch.fx.Node] = {}
    for node in fx_g.graph.nodes:
        if node.meta.get("partitioner_tag") != "is_backward" and "seq_nr" in node.meta:
            forward.setdefault(node.meta["seq_nr"], node)
    for node in fx_g.graph.nodes:
        if node.meta.get("partitioner_tag") != "is_backward" or "seq_nr" not in node.meta:
            continue
        if node.meta.get("is_gradient_acc", False):
            continue
        source = forward.get(node.meta["seq_nr"])
        if source is not None and source.meta.get("custom") is not None:
            node.meta["custom"] = copy.deepcopy(source.meta["custom"])


def test_model_kit_gradients_name_their_module_where_torch_replaces_custom(
    world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a torch whose forward-to-backward copy replaces ``custom`` (2.11's, stood in for
    here), the backward still names each gradient's own module and buckets one block at a
    time."""
    from ap_backend.models import ModelConfig, Sharding, Transformer
    from torch._functorch._aot_autograd import graph_capture

    assert backend_compat.metadata_copy_replaces_custom(_replacing_metadata_copy)
    monkeypatch.setattr(graph_capture, "copy_fwd_metadata_to_bw_nodes", _replacing_metadata_copy)
    model = Transformer(ModelConfig(dim=64, n_layers=2, seq_len=64), Sharding.from_world())
    seen, stats, backend = _compile(model, model.example_batch(0, 0))
    blocks = {"tok_embeddings", "layers.0", "layers.1", "norm", "output"}
    _assert_each_gradient_names_its_parameters_module(seen, stats, blocks)
    assert graph_capture.copy_fwd_metadata_to_bw_nodes is _replacing_metadata_copy  # undone
    assert [c["module_fqns_lost"] for c in backend.inner_compiles] == [0, 0]


def test_a_backward_that_lost_its_module_names_is_reported(
    world: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the names are lost all the same (2.11's replacing copy without the backend's
    merge: what a future torch could do again), the backend says so -- a warning and
    ``module_fqns_lost`` on the backward's record -- instead of bucketing the whole backward as
    one block in silence."""
    from ap_backend.models import ModelConfig, Sharding, Transformer
    from torch._functorch._aot_autograd import graph_capture

    monkeypatch.setattr(graph_capture, "copy_fwd_metadata_to_bw_nodes", _replacing_metadata_copy)
    monkeypatch.setattr(backend_compat, "BACKWARD_CUSTOM_MERGE", contextlib.nullcontext())
    model = Transformer(ModelConfig(dim=64, n_layers=2, seq_len=64), Sharding.from_world())
    with caplog.at_level("WARNING", logger="ap_backend"):
        seen, _, backend = _compile(model, model.example_batch(0, 0))
    lost = [c["module_fqns_lost"] for c in backend.inner_compiles]
    assert lost[0] == 0 and lost[1] >= 21, lost  # the 21 gradient reduce-scatters at least
    assert "without the module FQN the first compilation stamped" in caplog.text
    scattered = {f for kind, f, _ in seen[True] if kind == "reduce_scatter_tensor"}
    assert scattered == {"tok_embeddings"}  # what the warning is about
