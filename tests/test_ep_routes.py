"""Issue 34's no-precompile expert-parallel routes at 2 gloo ranks on torchtitan's Qwen3-MoE
(``zoo.ep_routes``): ``torch.compile(step, backend=autoparallel_backend(ep_chunk=...))`` with
``capture_scalar_outputs=True``, tokens marked ``hint=N`` / ``hint=None`` / unmarked. Each
either trains like eager EP or refuses at COMPILE time with a ChunkError naming the fix;
none may compile and then fail at run time (``hint=N`` did: the lazily compiled backward
raised "allocated size does not match required size")."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

FIXES = {
    "hinted": "ap_backend.precompile(module, example_args)",
    "static": "ap_backend.precompile(module, example_args)",
    "none": "mark_chunk_dim(x, dim, hint=x.shape[dim])",
}


def test_no_precompile_ep_routes_refuse_at_compile_time_or_match_eager() -> None:
    from zoo.ep_routes import run_routes

    cases = [("tt_qwen3_moe_ep", marks, 2) for marks in FIXES]
    rows = run_routes(cases)
    for row in rows:
        assert row["outcome"] in ("refused", "ok"), row
        if row["outcome"] == "ok":
            assert row["loss_rel"] <= 1e-5 and row["grad_rel"] <= 1e-4, row
        else:
            assert row["stage"] == "compiled (no precompile)", row
            assert "ChunkError" in row["error"] and FIXES[row["marks"]] in row["error"], row
