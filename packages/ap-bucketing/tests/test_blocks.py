"""Buckets one block wide, the prefetch window, and the gathered bytes a graph holds.

* A bucket never spans two transformer blocks (the block from the module FQN a node carries:
  ``custom["module_fqn"]`` or ``nn_module_stack``), nor a joint graph's forward and backward,
  and never gathers one parameter twice (``BucketingConfig.block_buckets``); a graph without
  FQNs still buckets, by bytes and span.
* ``prefetch_depth=1``: after ``OverlapBucketingPass`` (bucketing + torch's overlap scheduler),
  no all-gather is issued before the previous block's all-gather is waited, though the
  scheduler left it earlier; the numbers are unchanged.
* ``max_gathered_bytes`` is the peak of all-gathered bytes alive at once in graph order.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.fx as fx
from ap_bucketing import (
    BucketingConfig,
    OverlapBucketingPass,
    bucket_collectives,
    collect_stats,
    max_gathered_bytes,
)
from ap_bucketing._blocks import (
    BlockContext,
    block_context,
    block_of,
    collective_block,
    module_fqn,
    part_of,
)
from ap_testing.collectives import GraphBuilder, aten, c10d, runnable_block_gathers
from ap_testing.distributed import single_rank_gloo

AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default


def _stamp(node: fx.Node, fqn: str, backward: bool = False) -> fx.Node:
    node.meta.setdefault("custom", {})["module_fqn"] = fqn
    if backward:
        node.meta["autograd_backward"] = True
    return node


def _gather_args(cap_mb: float = 1000.0) -> tuple[object, ...]:
    def cap(_index: int) -> float:
        return cap_mb

    def is_ag(node: fx.Node) -> bool:
        return node.target is AG

    def key(node: fx.Node) -> object:
        return (node.args[2], node.meta["val"].dtype)

    return cap, is_ag, key


@pytest.mark.parametrize(
    ("fqn", "block"),
    [
        ("layers.3.attention.wq", "layers.3"),
        ("model.layers.0.mlp.up_proj", "model.layers.0"),
        ("layers.1.moe.experts", "layers.1"),
        ("tok_embeddings", "tok_embeddings"),
        ("model.embed_tokens", "model.embed_tokens"),
        ("lm_head", "lm_head"),
    ],
)
def test_block_of_a_module_fqn(fqn: str, block: str) -> None:
    assert block_of(fqn) == block


def test_module_fqn_from_custom_meta_or_nn_module_stack_or_the_input_chain() -> None:
    b = GraphBuilder()
    p = b.placeholder((4, 8))
    cast = b.call(aten._to_copy.default, (p,), (4, 8))
    ag, _ = b.all_gather(cast)
    assert module_fqn(ag) is None and collective_block(ag) is None
    cast.meta["nn_module_stack"] = {"k": ("L['self'].layers[2].attention.wq", torch.nn.Linear)}
    assert collective_block(ag) == "layers.2"  # found up the cast chain
    _stamp(ag, "layers.5.feed_forward.w1")
    assert collective_block(ag) == "layers.5"  # its own stamp first


@pytest.mark.parametrize(
    ("stack", "fqn"),
    [
        ({"a": ("L['self'].layers[2].attention.wq", None)}, "layers.2.attention.wq"),
        # a ModuleDict with numeric keys (torchtitan's layers) under a wrapper's ModuleList
        (
            {"a": ("getattr(L['self']._model[0].layers, '0').attention.wo", None)},
            "_model.0.layers.0.attention.wo",
        ),
        ({"a": ("L['self']._modules['layers']._modules['3'].mlp", None)}, "layers.3.mlp"),
        ({"a": ("layers.1.mlp", None)}, "layers.1.mlp"),  # export's paths are FQNs already
        # SimpleFSDP's parametrization: the module owning the parameter, one entry out
        (
            {
                "a": ("L['self'].layers.0.attention_norm", None),
                "b": (
                    "dict(type(L['self'].layers.0.attention_norm).__dict__)['weight']"
                    ".fget.__closure__[0].cell_contents",
                    None,
                ),
            },
            "layers.0.attention_norm",
        ),
        ({"a": ("L['self']", None)}, None),  # the root is no module
    ],
)
def test_module_fqn_reads_every_dynamo_spelling(stack: dict[str, object], fqn: str | None) -> None:
    b = GraphBuilder()
    node = b.placeholder((4, 8))
    node.meta["nn_module_stack"] = stack
    assert module_fqn(node) == fqn
    del node.meta["nn_module_stack"]
    node.meta["fwd_nn_module_stack"] = stack  # a stock backward node: its forward's stack
    assert module_fqn(node) == fqn


@pytest.mark.parametrize(
    ("fqns", "blocks"),
    [
        # a wrapper holding the whole model at one index: the blocks are below it
        (
            ["_model.0.tok_embeddings", "_model.0.layers.0.wq", "_model.0.layers.1.wq"],
            ["_model.0.tok_embeddings", "_model.0.layers.0", "_model.0.layers.1"],
        ),
        (["_model.0.layers.0.wq", "_model.0.norm"], ["_model.0.layers.0", "_model.0.norm"]),
        # a graph of one block (or compiled per block): one block
        (["layers.3.attention.wq", "layers.3.feed_forward.w1"], ["layers.3", "layers.3"]),
        (["attention.wq", "feed_forward.w1"], ["", ""]),
        (["model.layers.0.mlp.up_proj", "lm_head"], ["model.layers.0", "lm_head"]),
    ],
)
def test_blocks_below_the_graphs_shared_prefix(fqns: list[str], blocks: list[str]) -> None:
    b = GraphBuilder()
    nodes = [b.placeholder((4, 8)) for _ in fqns]
    for node, fqn in zip(nodes, fqns, strict=True):
        _stamp(node, fqn)
    context = block_context(b.module([]).graph)
    assert [block_of(fqn, context) for fqn in fqns] == blocks
    assert block_context(GraphBuilder().module([]).graph) == BlockContext()


def _blocks_graph(
    blocks: int = 3, per_block: int = 2, backward: bool = False
) -> tuple[fx.GraphModule, list[list[fx.Node]]]:
    """``blocks`` blocks of ``per_block`` FSDP-style gathers each, stamped ``layers.<k>.w<j>``;
    with ``backward`` a re-gather of every weight in a backward section, stamped the same."""
    b = GraphBuilder(dtype=torch.float32)
    x = b.placeholder((8, 8))
    shards = [[b.placeholder((1, 8)) for _ in range(per_block)] for _ in range(blocks)]
    gathers: list[list[fx.Node]] = []
    for k, block in enumerate(shards):
        row = []
        for j, shard in enumerate(block):
            ag, w = b.all_gather(shard)
            _stamp(ag, f"layers.{k}.w{j}")
            row.append(ag)
            x = b.mm(x, b.call(aten.t.default, (w,), (8, 8)))
        gathers.append(row)
    if backward:
        for k, block in reversed(list(enumerate(shards))):
            row = []
            for j, shard in enumerate(block):
                ag, w = b.all_gather(shard)
                _stamp(ag, f"layers.{k}.w{j}", backward=True)
                row.append(ag)
                x = b.mm(x, w.meta and b.call(aten.t.default, (w,), (8, 8)))
            gathers.append(row)
    return b.module([x]), gathers


def test_a_bucket_never_spans_two_blocks() -> None:
    gm, gathers = _blocks_graph()
    buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    assert buckets == gathers  # one bucket per block
    whole = bucket_collectives(gm, *_gather_args(), config=BucketingConfig(block_buckets=False))
    assert whole == [[ag for row in gathers for ag in row]]  # the rule is what splits them


def test_a_wrapped_model_spelled_as_dynamo_does_is_bucketed_per_block() -> None:
    """The zoo's ``FsdpTrainStep`` holds the model at ``_model[0]``; torchtitan's ``layers``
    is a ``ModuleDict``, which Dynamo spells ``getattr(L['self']._model[0].layers, '1')``.
    Read as ``_model.0`` (its first number) or not read at all, every gather was one block."""
    gm, gathers = _blocks_graph()
    for k, row in enumerate(gathers):
        for j, ag in enumerate(row):
            del ag.meta["custom"]
            path = f"getattr(L['self']._model[0].layers, '{k}').w{j}"
            ag.meta["nn_module_stack"] = {"m": (path, torch.nn.Linear)}
    assert bucket_collectives(gm, *_gather_args(), config=BucketingConfig()) == gathers


def test_forward_and_backward_gathers_of_a_block_never_share_a_bucket() -> None:
    gm, gathers = _blocks_graph(blocks=2, backward=True)
    buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    assert sorted(map(tuple, buckets), key=str) == sorted(map(tuple, gathers), key=str)


def test_without_direction_meta_one_parameter_is_never_gathered_twice_in_a_bucket() -> None:
    gm, gathers = _blocks_graph(blocks=1, backward=True)
    for row in gathers[1:]:
        for ag in row:
            del ag.meta["autograd_backward"]
    with collect_stats() as stats:
        buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    assert buckets == gathers
    assert stats[-1].closed_by_repeat == 1


def test_a_graph_without_module_fqns_still_buckets_by_bytes() -> None:
    gm, gathers = _blocks_graph()
    for row in gathers:
        for ag in row:
            del ag.meta["custom"]
    flat = [ag for row in gathers for ag in row]
    assert bucket_collectives(gm, *_gather_args(), config=BucketingConfig()) == [flat]
    # 8 x 8 float32 = 256 B gathered each: a 600 B cap closes every second one
    capped = bucket_collectives(gm, *_gather_args(600 / 2**20), config=BucketingConfig())
    assert capped == [flat[0:2], flat[2:4], flat[4:6]]


@pytest.fixture(scope="module")
def group() -> Iterator[str]:
    with single_rank_gloo(subgroups=0) as (name,):
        yield name


def _gather_issue_order(graph: fx.Graph) -> list[tuple[int, int]]:
    """``(position of bucket i's wait, position of bucket i+1's first issue node)`` pairs, in
    wait order, for the merged all-gathers (``_out`` form) of the graph."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gathers = [n for n in nodes if "all_gather_into_tensor_out" in str(n.target)]
    waits = {g: next(u for u in g.users if u.target is WAIT) for g in gathers}
    gathers.sort(key=lambda g: pos[waits[g]])
    pairs = []
    for earlier, later in zip(gathers, gathers[1:], strict=False):
        issue = min([later, *later.all_input_nodes], key=pos.__getitem__)
        pack = [n for n in later.all_input_nodes if "_pre_bucket" in str(n.target)]
        issue = min([issue, *(p for n in pack for p in [n])], key=pos.__getitem__)
        pairs.append((pos[waits[earlier]], pos[issue]))
    return pairs


@pytest.mark.parametrize("depth", [1, None])
def test_prefetch_window_bounds_how_far_ahead_a_block_is_gathered(
    group: str, depth: int | None
) -> None:
    gm = runnable_block_gathers(group)
    inputs = [torch.randn(n.meta["val"].shape) for n in gm.graph.find_nodes(op="placeholder")]
    expected = gm(*inputs)
    bucketing = OverlapBucketingPass(
        BucketingConfig(prefetch_depth=depth, bucket_cap_mb=1000.0),
        cpu=True,
        max_compute_pre_fetch=50,
    )
    bucketing(gm.graph)
    gm.recompile()
    assert bucketing.reports[-1]["collectives"]["all_gather"] == (8, 4)
    pairs = _gather_issue_order(gm.graph)
    assert len(pairs) == 3
    held = all(wait < issue for wait, issue in pairs)
    if depth == 1:
        assert held, pairs
    else:  # the scheduler alone gathers further ahead: the window is what holds it
        assert not held, pairs
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def _gathered_graph(overlap: bool) -> fx.GraphModule:
    """Two gathers of 8 x 16 float32 (512 B each); with ``overlap`` the first is still read
    after the second is gathered."""
    b = GraphBuilder(dtype=torch.float32)
    x = b.placeholder((4, 16))
    _, w1 = b.all_gather(b.placeholder((1, 16)))
    y = b.mm(x, b.call(aten.t.default, (w1,), (16, 8)))
    _, w2 = b.all_gather(b.placeholder((1, 16)))
    z = b.mm(y, w2)
    if overlap:
        z = b.add(z, b.call(aten.sum.default, (w1,), ()))
    return b.module([z])


def test_max_gathered_bytes_is_the_peak_of_gathers_alive_at_once() -> None:
    assert max_gathered_bytes(_gathered_graph(overlap=False)) == 512
    assert max_gathered_bytes(_gathered_graph(overlap=True)) == 1024
    empty = GraphBuilder().module([])
    assert max_gathered_bytes(empty) == 0


def test_prefetch_schedule_issues_each_block_right_after_the_previous_wait(group: str) -> None:
    """``reorder="prefetch"``: ap's own FSDP schedule (no cost model) gathers block k+1 while
    block k computes -- its pack and all-gather right after block k's wait -- and moves
    nothing else; without it (``reorder=False``) each block is gathered where it is used."""
    orders = {}
    for reorder in (False, "prefetch"):
        gm = runnable_block_gathers(group)
        inputs = [torch.randn(n.meta["val"].shape) for n in gm.graph.find_nodes(op="placeholder")]
        expected = gm(*inputs)
        OverlapBucketingPass(BucketingConfig(bucket_cap_mb=1000.0), cpu=True, reorder=reorder)(
            gm.graph
        )
        gm.recompile()
        torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)
        orders[reorder] = _gather_issue_order(gm.graph)
    assert all(issue - wait <= 3 for wait, issue in orders["prefetch"]), orders
    assert all(issue - wait > 3 for wait, issue in orders[False]), orders


@pytest.mark.parametrize(
    ("fqn", "part"),
    [
        ("layers.3.attention.wq", "layers.3.attention"),
        ("model.layers.0.mlp.up_proj", "model.layers.0.mlp"),
        ("layers.1.moe.experts", "layers.1.moe"),
        ("layers.2.w1", "layers.2.w1"),
        ("layers.2", "layers.2"),
        ("tok_embeddings", "tok_embeddings"),
    ],
)
def test_part_of_a_module_fqn_is_the_blocks_direct_submodule(fqn: str, part: str) -> None:
    assert part_of(fqn) == part


#: one Llama block's weights as (submodule, weight, shard shape): bf16 shards of world 8
_LLAMA_BLOCK = (
    ("attention_norm", "weight", (8, 1)),
    ("attention", "wq", (8, 64)),
    ("attention", "wk", (8, 64)),
    ("attention", "wv", (8, 64)),
    ("attention", "wo", (8, 64)),
    ("ffn_norm", "weight", (8, 1)),
    ("feed_forward", "w1", (16, 64)),
    ("feed_forward", "w3", (16, 64)),
    ("feed_forward", "w2", (8, 128)),
)


def _llama_block_graph(
    backward_order: tuple[int, ...] = (8, 6, 7, 5, 4, 1, 2, 3, 0),
    block: tuple[tuple[str, str, tuple[int, int]], ...] = _LLAMA_BLOCK,
) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """One stamped Llama block: the forward gathers its nine weights in module order, the
    backward re-gathers them in ``backward_order`` (by default the backward's: the FFN, its
    norm, the attention, its norm). Returns the graph and both directions' gathers."""
    b = GraphBuilder()
    shards = [b.placeholder(shape) for _, _, shape in block]
    outputs = []
    forward, backward = [], []
    for index in range(len(block)):
        module, weight, _ = block[index]
        ag, w = b.all_gather(shards[index])
        forward.append(_stamp(ag, f"layers.0.{module}.{weight}"))
        outputs.append(b.relu(w))
    for index in backward_order:
        module, weight, _ = block[index]
        ag, w = b.all_gather(shards[index])
        backward.append(_stamp(ag, f"layers.0.{module}.{weight}", backward=True))
        outputs.append(b.relu(w))
    return b.module(outputs), forward, backward


def test_a_backward_bucket_stays_within_one_submodule_of_its_block() -> None:
    """The backward runs the feed-forward, then the attention: one bucket each (a norm with
    the submodule before it), so neither holds the other's weights; the forward gathers the
    block in one bucket."""
    gm, forward, backward = _llama_block_graph()
    buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    ffn_and_norm, attention_and_norm = backward[:4], backward[4:]
    assert buckets == [forward, ffn_and_norm, attention_and_norm]
    whole = bucket_collectives(gm, *_gather_args(), config=BucketingConfig(backward_parts=False))
    assert whole == [forward, backward]  # the rule is what splits them


def test_a_small_first_part_joins_the_part_after_it() -> None:
    """In module order, the attention's norm is waited first: it joins the attention's bucket
    (the part after it) instead of making a collective of its own; the FFN's norm, waited
    after the attention, joins the part before it."""
    gm, forward, backward = _llama_block_graph((0, 1, 2, 3, 4, 5, 6, 7, 8))
    buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    assert buckets == [forward, backward[:6], backward[6:]]


def test_a_block_of_bare_weights_keeps_one_backward_bucket() -> None:
    """Weights that are the block's direct children (``layers.0.w1``: every part one
    collective) do not split a backward bucket into one collective each."""
    gm, gathers = _blocks_graph(blocks=2, per_block=3, backward=True)
    buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    assert sorted(map(tuple, buckets), key=str) == sorted(map(tuple, gathers), key=str)


def test_adjacent_runs_keep_block_wide_backward_buckets() -> None:
    """``non_adjacent=False`` (torch's runs of equal keys) has no merge of small parts: there a
    part key would make each norm a run of its own, so the backward stays block-wide."""
    gm, forward, backward = _llama_block_graph()
    config = BucketingConfig(non_adjacent=False)
    assert bucket_collectives(gm, *_gather_args(), config=config) == [forward, backward]


def test_a_part_under_an_eighth_of_the_blocks_bytes_joins_its_neighbour() -> None:
    """A LayerNorm's weight and bias are two collectives but a few bytes: the norm joins the
    feed-forward's bucket instead of making a bucket of its own."""
    block = (
        ("feed_forward", "w1", (16, 64)),
        ("feed_forward", "w2", (8, 128)),
        ("norm", "weight", (8, 1)),
        ("norm", "bias", (8, 1)),
        ("attention", "wq", (8, 64)),
        ("attention", "wo", (8, 64)),
    )
    gm, forward, backward = _llama_block_graph(tuple(range(6)), block)
    buckets = bucket_collectives(gm, *_gather_args(), config=BucketingConfig())
    assert buckets == [forward, backward[:4], backward[4:]]
