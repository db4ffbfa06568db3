"""``chunk_pass``: plan on a copy of the graph, rewrite the copy, swap it in only on success.

Working on a copy is what makes every refusal (``ChunkError`` from the planner) and every
unexpected failure leave the caller's graph exactly as it was: same code, same metas. The
cyclic garbage collector is paused for the duration (``ap_tags.scoped.paused_gc``).
"""

from __future__ import annotations

import copy
import logging

import torch.fx
from ap_tags.checks import require_graph_module, require_instance
from ap_tags.scoped import paused_gc

from ._compat import require_internals
from ._config import ChunkConfig, ChunkReport
from ._errors import ChunkError
from ._plan import make_plan
from ._regions import find_regions, module_fqns
from ._rewrite import Rewriter
from ._routes import check_route
from ._shapes import build_shapes

log = logging.getLogger(__name__)

#: ``GraphModule.meta`` key: ``{symbol name: hint}`` of the chunk symbols, for concretization.
CHUNK_SYMBOLS_META = "ap_epchunk_chunk_symbols"


def chunk_pass(gm: torch.fx.GraphModule, config: ChunkConfig) -> ChunkReport:
    """Split the regions selected by ``config`` into ``config.num_chunks`` chunks."""
    require_graph_module(gm, where="chunk_pass")
    require_instance(
        config, ChunkConfig, where="chunk_pass", arg="config", expected="a ChunkConfig"
    )
    require_internals()
    # the pass allocates tens of thousands of long-lived objects (nodes, SymNodes, fake
    # tensors); generation-2 collections over the whole heap would make its time grow faster
    # than the graph
    with paused_gc():
        return _chunk_pass(gm, config)


def _chunk_pass(gm: torch.fx.GraphModule, config: ChunkConfig) -> ChunkReport:
    work: torch.fx.Graph = copy.deepcopy(gm.graph)
    nodes_before = len(work.nodes)
    fqns = module_fqns(work)
    regions = find_regions(work, config.module_patterns, fqns)
    if not regions:
        seen = sorted({f.split(".")[0] for f in fqns.values()})
        raise ChunkError(
            f"no region matched module_patterns {list(config.module_patterns)} "
            f"(top-level module FQNs in the graph: {seen})"
        )
    shapes = build_shapes(work, config.num_chunks, config.chunk_inputs, config.dim)
    plan = make_plan(regions, shapes, config.early_grad_accumulation)
    check_route(work, plan, shapes.mode)
    report = ChunkReport(num_chunks=config.num_chunks, mode=shapes.mode)
    report.chunk_symbols = {str(s): h for s, h in shapes.symbol_hints().items()}
    Rewriter(work, plan, shapes, fqns, report).run()
    work.lint()
    gm.graph = work
    if report.chunk_symbols:
        gm.meta[CHUNK_SYMBOLS_META] = dict(report.chunk_symbols)
    gm.recompile()
    report.nodes_before = nodes_before
    report.nodes_after = len(gm.graph.nodes)
    log.info(
        "chunk_pass: %d regions x %d chunks, %d -> %d nodes",
        len(report.regions),
        config.num_chunks,
        nodes_before,
        report.nodes_after,
    )
    return report
