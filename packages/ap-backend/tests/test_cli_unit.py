"""CLI parsing and the demo table rendering (no ranks spawned)."""

from __future__ import annotations

import pytest
from ap_backend.cli import main
from ap_backend.demo import DemoOptions, render_table


@pytest.mark.parametrize("argv", [["demo", "--steps", "0"], ["demo", "--ranks", "3"], ["nope"], []])
def test_bad_arguments_exit_2_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ap-backend")


def test_version_prints_six_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [
        "ap-tags",
        "ap-partitioner",
        "ap-bucketing",
        "ap-epchunk",
        "ap-backend",
        "torch",
    ]


def test_table_renders_every_number_of_the_summary() -> None:
    saved = {"count": 3, "bytes": 1234, "all_gather_outputs_saved": 0}
    summary = {
        "options": DemoOptions().__dict__,
        "steps": [{"step": 1, "loss_eager": 1.5, "loss_compiled": 1.25, "abs_diff": 0.25}],
        "max_grad_rel_diff": 1e-7,
        "saved": {
            "first_partition": {**saved, "partitioner": "min_cut"},
            "save_all": saved,
            "min_cut_ac": {**saved, "count": 2},
            "min_cut_ac_untagged": {**saved, "all_gather_outputs_saved": 7},
            "plain_compile": {**saved, "all_gather_outputs_saved": 5},
        },
        "buckets_formed": 4,
        "compile_s": {"precompile": 1.0, "backend": 2.0, "first_step": 3.0},
    }
    table = render_table(summary)
    assert "| step 1 loss eager / compiled" in table and "1.500000 / 1.250000" in table
    assert "3 (1,234 B)" in table and "2 (1,234 B)" in table
    assert "0 / 0 / 0 / 7 / 5" in table
    assert "| saved activations: first partition (min_cut)" in table
    assert "| buckets formed (fw + bw)" in table and "| 4 " in table


def test_table_reports_the_all_to_alls_per_moe_layer_before_and_after_chunking() -> None:
    """``--chunk``: the expert-parallel rows, from ``summarize``'s ``expert_parallel`` (the
    numbers a real run gives: tests/test_multirank_gloo.py checks those)."""
    saved = {"count": 3, "bytes": 1234, "all_gather_outputs_saved": 0}
    a2a = {"regions": 2, "before": 3, "after": 6.0, "per_chunk": 3.0, "compiled_total": 12}
    summary = {
        "options": DemoOptions(chunk=True).__dict__,
        "steps": [{"step": 1, "loss_eager": 1.5, "loss_compiled": 1.25, "abs_diff": 0.25}],
        "max_grad_rel_diff": 1e-7,
        "saved": {
            **dict.fromkeys(
                ("save_all", "min_cut_ac", "min_cut_ac_untagged", "plain_compile"), saved
            ),
            "first_partition": {**saved, "partitioner": "default"},
        },
        "buckets_formed": 4,
        "expert_parallel": {
            "ranks": 2,
            "experts": 8,
            "experts_per_rank": 4,
            "top_k": 2,
            "moe_layers": 2,
            "num_chunks": 2,
            "chunked_regions": 4,
            "all_to_alls_forward": a2a,
            "all_to_alls_backward": {**a2a, "before": 2, "after": 4.0, "per_chunk": 2.0},
        },
        "compile_s": {"precompile": 1.0, "backend": 2.0, "first_step": 3.0},
    }
    table = render_table(summary)
    assert "chunk on (MoE, expert parallel)" in table
    rows = {
        cells[0]: cells[1]
        for line in table.splitlines()[3:]
        if len(cells := [c.strip() for c in line.strip().strip("|").split("|")]) == 2
    }
    assert rows["expert parallelism (experts per rank x ranks, top-k)"] == "4 x 2 = 8, top-2"
    assert rows["MoE regions chunked (fw + bw) / MoE layers"] == "4 / 2"
    fw = "all-to-alls per MoE layer, fw: before / after chunking (per chunk)"
    bw = "all-to-alls per MoE layer, bw: before / after chunking (per chunk)"
    assert rows[fw] == "3 / 6 (3 x 2 chunks)"
    assert rows[bw] == "2 / 4 (2 x 2 chunks)"
    del summary["expert_parallel"]  # chunk off: no such rows
    assert "all-to-alls" not in render_table(summary)
