"""Issue 34's no-precompile expert-parallel routes at 2 gloo ranks on torchtitan's Qwen3-MoE
(``zoo.ep_routes``): ``torch.compile(step, backend=autoparallel_backend(ep_chunk=...))`` with
``capture_scalar_outputs=True``, tokens marked ``hint=N`` / ``hint=None`` / unmarked.

``hint=N`` trains like eager EP (loss and gradients within the precompile route's tolerances,
``tests/test_zoo.py::test_real_expert_parallelism_chunks_through_precompile_and_the_backend``),
every chunk exchanging its own token counts and tokens (3 all-to-alls per MoE layer and chunk
forward, 2 backward) and the EP overlap schedule pipelining each region. It used to compile and
fail at run time: the per-chunk symbols of the split sizes ignored AOTAutograd's renamings, and
the lazily compiled backward's ``repeat_interleave(..., output_size=u7 + u8)`` raised
"allocated size does not match required size". ``hint=None`` and unmarked tokens refuse at
COMPILE time with a ChunkError naming the fix; none may compile and then fail at run time.

One 2-rank spawn runs every case (Qwen3-MoE, N=2: 169 s at load ~4 on the 2-core machine);
``AP_EP_ROUTES_CASES=all`` adds DeepSeek-V3 and N=4 on the hinted route (302 s).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("torchtitan")

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

#: what each refused route's error must name
FIXES = {
    "static": ("ap_backend.precompile(module, example_args)", "hint=t.shape[0]"),
    "none": ("mark_chunk_dim(x, dim, hint=x.shape[dim])",),
}
#: the precompile route's tolerances (fp32 experts)
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def _cases() -> list[tuple[str, str, int]]:
    cases = [("tt_qwen3_moe_ep", marks, 2) for marks in ("hinted", "static", "none")]
    if os.environ.get("AP_EP_ROUTES_CASES") == "all":
        cases += [("tt_deepseek_v3_ep", "hinted", 2), ("tt_qwen3_moe_ep", "hinted", 4)]
    return cases


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    from zoo.ep_routes import run_routes

    return run_routes(_cases())


def test_hinted_route_without_precompile_trains_like_eager_ep(rows: list[dict[str, Any]]) -> None:
    hinted = [r for r in rows if r["marks"] == "hinted"]
    assert hinted
    for row in hinted:
        print(row)  # the measured numbers, shown by pytest -rA
        assert row["outcome"] == "ok", row
        assert row["loss_rel"] <= LOSS_RTOL and row["grad_rel"] <= GRAD_RTOL, row
        n, layers = row["num_chunks"], row["moe_layers"]
        assert layers >= 1, row
        # per MoE layer and chunk: counts + dispatch + combine forward, their transposes backward
        assert (row["all_to_all_fw"], row["all_to_all_bw"]) == (3 * n * layers, 2 * n * layers)
        # ChunkReport, per chunk: each forward region's body exchanges counts, tokens out and
        # back; each backward region the two token exchanges' transposes
        assert sorted(row["region_all_to_alls"]) == [2] * layers + [3] * layers, row
        # the EP overlap schedule pipelined every region with exchanges, forward and backward
        schedule = row["schedule"]
        assert sorted(bw for bw, *_ in schedule) == [False] * layers + [True] * layers, row
        for _, paired, before, after, reason in schedule:
            assert reason is None and paired >= 1 and after <= before, row
        assert sum(after for *_, after, _ in schedule) < sum(b for *_, b, _, _ in schedule), row


def test_static_and_unmarked_routes_refuse_at_compile_time(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if row["marks"] == "hinted":
            continue
        assert row["outcome"] == "refused", row
        assert row["stage"] == "compiled (no precompile)", row
        assert "ChunkError" in row["error"], row
        for fix in FIXES[row["marks"]]:
            assert fix in row["error"], row
