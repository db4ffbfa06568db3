"""``benchmarks.gpu``'s GFLOP / step column: the FLOPs of what ran, counted from the shapes the
profiler records, once per op, recomputation included -- the device-independent part of a
row's step time (what the full configuration's whole-forward recompute adds shows on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
ProfileStep = Callable[..., tuple[float, float, float]]


@pytest.fixture
def profile_step(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import gpu

    return gpu.profile_step


M, K, N = 64, 32, 16
B, H, S, D = 2, 4, 128, 16


def _mm_flops() -> int:
    return 2 * M * K * N


def _sdpa_flops() -> int:
    return 4 * B * H * S * S * D  # flop_counter's formula: QK^T and PV, causal or not


def test_each_op_is_counted_once_from_its_recorded_shapes(profile_step: ProfileStep) -> None:
    """``matmul`` has no formula and its ``mm`` is counted; ``addmm`` and attention by their
    formulas; pointwise ops add nothing."""
    a, b = torch.randn(M, K), torch.randn(K, N)
    bias = torch.randn(N)
    q = torch.randn(B, H, S, D)

    def step() -> None:
        torch.matmul(a, b)
        torch.addmm(bias, a, b)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        (a + 1).relu()

    _, _, gflops = profile_step(step, "cpu", steps=2)
    assert gflops * 1e9 == 2 * _mm_flops() + _sdpa_flops()


def test_an_op_inside_a_counted_op_is_not_counted_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, eager attention nests one op with a formula in another
    (``_scaled_dot_product_flash_attention`` calls ``_flash_attention_forward``): only the outer
    one counts. Profiler events stood in for by their three read attributes."""
    monkeypatch.syspath_prepend(str(ROOT))
    from torch._C._autograd import DeviceType

    from benchmarks import gpu

    def event(name: str, parent: object = None) -> Any:
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent)

    outer = event(
        "aten::_scaled_dot_product_flash_attention", event("aten::scaled_dot_product_attention")
    )
    inner = event("aten::_flash_attention_forward", outer)
    lone = event("aten::_flash_attention_forward", event("aten::scaled_dot_product_attention"))
    assert [gpu._counted_once(e) for e in (outer, inner, lone)] == [True, False, True]


def test_compiled_code_and_recomputation_are_counted(profile_step: ProfileStep) -> None:
    """Inductor's extern ``mm`` calls are counted, and a checkpointed region's recomputation in
    the backward counts its forward matmul again: 3 matmuls a step without checkpointing
    (forward, and the two of the backward), 4 with it."""
    w = torch.randn(K, N, requires_grad=True)
    x = torch.randn(M, K, requires_grad=True)

    def block(inp: torch.Tensor) -> torch.Tensor:
        return torch.relu(inp @ w)

    compiled = torch.compile(block)

    def plain_step() -> None:
        compiled(x).sum().backward()  # type: ignore[no-untyped-call]

    def checkpointed_step() -> None:
        out = checkpoint(block, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        out.sum().backward()  # type: ignore[no-untyped-call]

    plain_step()  # compiles
    _, _, plain = profile_step(plain_step, "cpu")
    _, _, recomputed = profile_step(checkpointed_step, "cpu")
    assert plain * 1e9 == 3 * _mm_flops()
    assert recomputed * 1e9 == 4 * _mm_flops()


def test_a_collective_is_one_cpu_kernel_not_its_process_groups_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU the fake and gloo backends chunk and copy inside a coalesced collective, per
    member and rank: that is the process group's work, so the collective counts as one kernel
    and the ``aten::`` ops inside it as none; a top-level ``mm`` still counts."""
    monkeypatch.syspath_prepend(str(ROOT))
    from torch._C._autograd import DeviceType

    from benchmarks import gpu

    def event(name: str, parent: object = None) -> Any:
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, cpu_parent=parent)

    graph = event("## Call CompiledFxGraph ##")
    call = event("_c10d_functional::all_gather_into_tensor_coalesced", graph)
    backend = event("c10d::allgather_into_tensor_coalesced_", call)
    copies = [event("aten::copy_", backend), event("aten::empty", call)]
    mm = event("aten::mm", graph)
    counted = [gpu._is_kernel_event(e, "cpu") for e in (call, backend, *copies, mm)]
    assert counted == [True, False, False, False, True]
