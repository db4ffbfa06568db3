"""Bucketing's peak memory, measured without a GPU (issue 42 item 4).

``python -m benchmarks.peak``: each row compiles and trains the model kit in its own process
(fake process group of world 8, bf16 gathers) and its peak is the largest running sum of the
CPU profiler's allocation events over one steady step. The rule held here: the default
(block-wide buckets) peaks at most one block's gathered bytes above the same backend with
``bucketing=False``. With model-wide buckets it did not: every weight was gathered before the
first block ran (the H200 table of issue 42: 6.07 GiB against 5.19 GiB unbucketed; on CPU at
dim 1024, 1.42x).

Default run: the kit at dim 256, 4 layers and 64 tokens, where the gathered weights are a large
share of the peak, so a bucket spanning more than a block shows. (At 2 layers the test took as
long in CI, 140.5 s against 139.7 s at 4 layers, 2026-12-04: a row's process start, imports and
``precompile`` outweigh the layers' compile; so it stays at 4, the stronger check. At 2 layers
the default peaked +756,736 B over ``bucketing=False``'s 2,753,224 B, model-wide buckets at
10,526,984 B.) ``heavy``: the kit at dim 256 / 2 layers / seq 512 (1,024 tokens, activations
dominate) with the issue's ratios.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def _peaks(shape: str, rows: list[str]) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="ap-peak-test-") as tmp:
        out = Path(tmp) / "peak.json"
        cmd = [sys.executable, "-m", "benchmarks.peak", "--shape", shape, "--rows", *rows]
        cmd.append("--share-kernels")  # the session's kernel cache: rows load each other's
        proc = subprocess.run(
            [*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return {r["row"]: r for r in json.loads(out.read_text())}


def _one_block_gathered_bytes(dim: int, ffn_dim: int) -> int:
    """The bf16 bytes of one transformer block's weights (4 attention, 3 FFN, 2 norms)."""
    return 2 * (4 * dim * dim + 3 * dim * ffn_dim + 2 * dim)


def _largest_part_gathered_bytes(dim: int, ffn_dim: int) -> int:
    """The bf16 bytes of a block's largest submodule: the feed-forward's three weights (the
    attention's four are ``4 * dim * dim``)."""
    return 2 * max(3 * dim * ffn_dim, 4 * dim * dim)


#: How many blocks of gathered bytes the default may hold above ``bucketing=False``: the block
#: being gathered (issue 42's rule). The default's copy-free buckets hold no flat buffer beside
#: the members (measured 1.6 MiB above, one block 2.0 MiB, at this shape); the ``"custom_ops"``
#: form, the default before, held one more block while its unpack copied out (3.1 MiB above).
BLOCKS_ABOVE_UNBUCKETED = 1


def test_bucketing_peaks_within_a_block_of_unbucketed() -> None:
    """The kit at dim 256, 4 layers, 64 tokens: the default within
    ``BLOCKS_ABOVE_UNBUCKETED`` blocks' gathered bytes of ``bucketing=False`` (issue 42's
    rule), and within the block's largest submodule's: the backward buckets one submodule at a
    time (``BucketingConfig.backward_parts``; measured +1,180,096 B against the FFN's 1,572,864
    and the block's 2,098,176; block-wide backward buckets: +1,770,496). (The bucketing of
    before, bytes and span only, peaked at 5.1x unbucketed here, far above the bound: the
    ``heavy`` test below holds that the measure tells the two apart.)"""
    peaks = _peaks("weights", ["ap_default", "ap_unbucketed"])
    unbucketed = peaks["ap_unbucketed"]["peak_bytes"]
    bound = unbucketed + BLOCKS_ABOVE_UNBUCKETED * _one_block_gathered_bytes(256, 1024)
    assert 0 < unbucketed
    assert peaks["ap_default"]["peak_bytes"] <= bound, peaks
    part_bound = unbucketed + _largest_part_gathered_bytes(256, 1024)
    assert peaks["ap_default"]["peak_bytes"] <= part_bound, peaks


@pytest.mark.heavy
def test_stock_compile_with_the_pass_peaks_within_a_block_of_plain() -> None:
    """ap-bucketing alone on stock ``torch.compile`` (``post_grad_custom_post_pass``; blocks
    from Dynamo's module paths, none stamped): within a block of plain ``torch.compile``, and
    under the model-wide bucketing the pass gave there before it read the backward's
    ``fwd_nn_module_stack`` (18.0 MiB against plain's 11.2, measured 2026-11-29; block-wide
    12.4)."""
    peaks = _peaks("weights", ["plain", "stock_bucketed", "stock_modelwide"])
    plain = peaks["plain"]["peak_bytes"]
    bound = plain + BLOCKS_ABOVE_UNBUCKETED * _one_block_gathered_bytes(256, 1024)
    assert peaks["stock_bucketed"]["peak_bytes"] <= bound, peaks
    assert peaks["stock_modelwide"]["peak_bytes"] > bound, peaks


@pytest.mark.heavy
def test_model_wide_buckets_break_the_bound() -> None:
    """The same measure on the bucketing of before (``block_buckets=False``, no prefetch
    window): far above the bound the default holds."""
    peaks = _peaks("weights", ["ap_unbucketed", "ap_modelwide"])
    unbucketed = peaks["ap_unbucketed"]["peak_bytes"]
    bound = unbucketed + BLOCKS_ABOVE_UNBUCKETED * _one_block_gathered_bytes(256, 1024)
    assert peaks["ap_modelwide"]["peak_bytes"] > bound, peaks


@pytest.mark.heavy
def test_issue_42_ratios_at_the_dim_256_kit() -> None:
    peaks = _peaks("kit_256", ["plain", "ap_default", "ap_unbucketed"])
    plain = peaks["plain"]["peak_bytes"]
    default = peaks["ap_default"]["peak_bytes"]
    assert default <= 0.9 * plain, (default, plain)
    assert default <= 1.05 * peaks["ap_unbucketed"]["peak_bytes"]
    assert peaks["ap_default"]["kernels"] <= peaks["plain"]["kernels"]


@pytest.mark.heavy
def test_full_configuration_at_the_dim_256_kit() -> None:
    """The full configuration (first-compile AC, AC, bucketing, the prefetch schedule) at or
    under 0.6x plain's peak (issue 42). It holds because the backend compiles AC graphs without
    Inductor's buffer reuse (``ap_backend._backend.AC_INDUCTOR_PATCHES``): with reuse the last
    layer's feed-forward buffers stayed allocated through its attention backward, to be reused
    by the next layer's (measured 20,540,040 B, 0.70x, against 16,061,960 B, 0.54x)."""
    peaks = _peaks("kit_256", ["plain", "ap_full_prefetch"])
    plain = peaks["plain"]["peak_bytes"]
    assert peaks["ap_full_prefetch"]["peak_bytes"] <= 0.6 * plain, peaks
