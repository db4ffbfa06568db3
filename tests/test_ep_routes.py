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

The route matrix (issue 34, ``zoo.ep_routes``: {precompile, torch.compile} x marks {hinted,
static, chunk_inputs names} x loss {inside, outside} x {real EP, local MoE} x {default, full}
x N {1, 2, 4} on Qwen3-MoE, DeepSeek-V3 and the ap model kit) as a property: every case either
trains like eager or is refused at compile time by a ``ChunkError`` / ``PrecompileError`` whose
text names a fix; none compiles and then fails. ``-m heavy`` runs
``zoo.ep_routes.DEFAULT_CASES`` (2 cases that, with the three above, cover every value of every
axis) and the pairwise sample (``pairwise_cases()``: every pair of values of
every two axes, 12 cases) in a spawn of its own; ``python -m zoo.ep_routes --cases all`` the
whole product (``zoo/RESULTS-ep-routes.md``).

The default run spawns 2 ranks for the hinted case alone. The three legacy cases in one
spawn took 213 s of a 2-worker run on the 2-core machine (2026-12-04), over the CI budget, so
the two refusals (``static``, ``none``) now run under ``-m heavy``, in a spawn of their own. A
refusal's text naming its fix is also tested in the default run, on a user MoE through the
backend (``tests/test_ep_chunk_backend.py``: the unmarked and static-route refusals).
``AP_EP_ROUTES_CASES=all`` adds DeepSeek-V3 and N=4 on the hinted route.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest

pytest.importorskip("torchtitan")

from zoo.ep_routes import AXES, DEFAULT_CASES, GRAD_RTOL, LOSS_RTOL, Case, pairwise_cases  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

#: what each refused route's error must name
FIXES = {
    "static": ("ap_backend.precompile(module, example_args)", "hint=t.shape[0]"),
    "none": ("mark_chunk_dim(x, dim, hint=x.shape[dim])",),
}
#: a refusal's text must spell one of these remedies (a call or an option to change)
FIX_SPELLINGS = (
    "mark_chunk_dim(",
    "hint=",
    "ap_backend.precompile(",
    "precompile(",
    "ChunkConfig(",
    "chunk_inputs",
)
#: the three legacy cases (model, marks, N) on the no-precompile route, Qwen3-MoE real EP
LEGACY = [("tt_qwen3_moe_ep", marks, 2) for marks in ("hinted", "static", "none")]
#: the default run's: the hinted route (the refusals are ``heavy``)
HINTED = [case for case in LEGACY if case[1] == "hinted"]
REFUSED = [case for case in LEGACY if case[1] != "hinted"]


def _cases() -> list[Case | tuple[str, str, int]]:
    cases: list[Case | tuple[str, str, int]] = [*HINTED]
    if os.environ.get("AP_EP_ROUTES_CASES") == "all":
        cases += [("tt_deepseek_v3_ep", "hinted", 2), ("tt_qwen3_moe_ep", "hinted", 4)]
    return cases


@pytest.fixture(scope="module")
def all_rows() -> list[dict[str, Any]]:
    from zoo.ep_routes import run_routes

    return run_routes(_cases(), port=29655)  # not the CLI's default port


@pytest.fixture(scope="module")
def rows(all_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hinted legacy case's rows."""
    return all_rows[: len(HINTED)]


def route_problems(row: dict[str, Any]) -> list[str]:
    """What is wrong with a route-matrix row: the property is ``ok`` within the tolerances or
    ``refused`` (``ChunkError`` / ``PrecompileError``) with a fix named; never ``failed``."""
    outcome = row["outcome"]
    if outcome == "ok":
        if not (row["loss_rel"] <= LOSS_RTOL and row["grad_rel"] <= GRAD_RTOL):
            return [f"numerics: loss rel {row['loss_rel']:.2e}, grad rel {row['grad_rel']:.2e}"]
        n, real = row["num_chunks"], row.get("ep") == "real"
        if n > 1 and row["chunked_regions"] < 2:
            return [f"N={n} but {row['chunked_regions']} regions chunked"]
        if real and n > 1 and row["all_to_all_fw"] != 3 * n * row["moe_layers"]:
            return [f"{row['all_to_all_fw']} forward all-to-alls, not 3 * N per MoE layer"]
        return []
    if outcome == "refused":
        error = row["error"]
        problems = []
        if "ChunkError" not in error and "PrecompileError" not in error:
            problems.append(f"refused without a ChunkError / PrecompileError: {error[:300]}")
        if not any(fix in error for fix in FIX_SPELLINGS):
            problems.append(f"the refusal names no fix: {error[:300]}")
        if row.get("compiled_before_error"):
            problems.append("refused after a graph compiled")
        return problems
    return [f"{outcome} at {row.get('stage')}: {str(row.get('error'))[:500]}"]


def _assert_matrix(rows: list[dict[str, Any]]) -> None:
    bad = {r["key"]: p for r in rows if (p := route_problems(r))}
    for r in rows:
        print(r["key"], r["outcome"], r.get("loss_rel"), r.get("grad_rel"), r.get("stage"))
    assert not bad, bad


def test_the_default_sample_covers_every_value_of_every_axis() -> None:
    legacy = [Case("qwen3", False, m, "inside", "real", "default", 2) for m in ("hinted", "static")]
    for axis, values in AXES.items():
        seen = {getattr(c, axis) for c in [*legacy, *DEFAULT_CASES]}
        assert seen >= set(values), (axis, set(values) - seen)


def test_the_pairwise_sample_covers_every_pair_of_values() -> None:
    cases = pairwise_cases()
    for (a, va), (b, vb) in itertools.combinations(AXES.items(), 2):
        got = {(getattr(c, a), getattr(c, b)) for c in cases}
        assert got == set(itertools.product(va, vb)), (a, b)


@pytest.mark.heavy
def test_the_route_matrix_sample_trains_or_refuses_with_a_fix() -> None:
    """The two matrix cases that, with the legacy three, cover every axis value (a spawn of
    their own: 184 s at load 4-5, so ``-m heavy``)."""
    from zoo.ep_routes import run_routes

    matrix = run_routes(list(DEFAULT_CASES), port=29657)
    assert [r["key"] for r in matrix] == [c.key for c in DEFAULT_CASES]
    _assert_matrix(matrix)


@pytest.mark.heavy
def test_the_pairwise_route_matrix_trains_or_refuses_with_a_fix() -> None:
    """12 cases, every pair of axis values (minutes: ``-m heavy``)."""
    from zoo.ep_routes import run_routes

    _assert_matrix(run_routes(pairwise_cases(), port=29660))


def test_route_problems_flags_a_run_time_failure_a_bare_refusal_and_bad_numerics() -> None:
    ok = {"outcome": "ok", "loss_rel": 0.0, "grad_rel": 0.0, "num_chunks": 1, "ep": "local"}
    assert route_problems(ok) == []
    assert route_problems({**ok, "grad_rel": 2 * GRAD_RTOL})
    assert route_problems({"outcome": "failed", "stage": "step 1 backward", "error": "boom"})
    assert route_problems({"outcome": "refused", "error": "ChunkError: no chunk dim"})
    fixed = "ChunkError: mark the tokens: mark_chunk_dim(x, 0, hint=x.shape[0])"
    assert route_problems({"outcome": "refused", "error": fixed}) == []
    assert route_problems({"outcome": "refused", "error": fixed, "compiled_before_error": True})


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


@pytest.mark.heavy
def test_static_and_unmarked_routes_refuse_at_compile_time() -> None:
    """``static`` and ``none`` marks on real EP: a ``ChunkError`` at the first call, naming the
    fix (a spawn of its own: about 80 s of a CI run, so ``-m heavy``)."""
    from zoo.ep_routes import run_routes

    rows = run_routes(REFUSED, port=29663)
    assert [r["marks"] for r in rows] == [marks for _, marks, _ in REFUSED]
    for row in rows:
        assert row["outcome"] == "refused", row
        assert row["stage"] == "step 1 forward", row  # the first call: Dynamo + the backend
        assert "ChunkError" in row["error"], row
        for fix in FIXES[row["marks"]]:
            assert fix in row["error"], row
