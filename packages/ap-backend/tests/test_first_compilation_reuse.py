"""A restarted job skips ``precompile``'s first compilation (``ap_backend._reuse``).

The rules held here:

* the program key is equal for the same program and differs for a change of the forward (a
  module attribute steering it, an input shape), of the backward's Python (a custom
  ``autograd.Function``'s backward, a helper module that backward calls -- and the module that
  helper calls --, a hook the forward registers on an intermediate tensor), of the module's
  layout and of the options;
* a cold run records its first compilation; a second ``precompile`` of the same program hands
  back a stand-in that makes nothing until called, answers Dynamo's fake-tensor call from the
  key's trace, and, called for real (eagerly, or by the second compilation's retrace on a cache
  miss), makes the first compilation and trains exactly like the module itself;
* a record whose content key the program no longer makes is an error, and is dropped.

In this process the session forces Inductor's caches off (conftest), so ``caches_on`` is
patched on and the record directory pointed at ``tmp_path``; the restart with the caches really
on, across the cache's hit and miss, is the ``slow`` test at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from ap_backend import _compat, autoparallel_backend, precompile
from ap_backend._aot_cache import KEY_ATTRIBUTE, Unkeyable
from ap_backend._first_record import load_record, record_path, save_record
from ap_backend._program_key import program_key
from ap_backend._reuse import _key_options, deferred_of
from ap_backend._signature import call_signature
from ap_backend._trace import PrecompileError
from ap_tags import ac_joint_pass
from torch import nn


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _Mlp(nn.Module):
    def __init__(self, act: str = "relu", scale: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.act = act
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h.relu() if self.act == "relu" else torch.tanh(h)
        if self.scale:
            h = _Scale.apply(h)
        out: torch.Tensor = self.down(h).sum()
        return out


def _key(model: nn.Module, x: torch.Tensor, **options: Any) -> str:
    from ap_backend._first_compilation import FirstOptions

    opts = FirstOptions(
        options.get("reshard_after_forward", True), options.get("joint_pass"), 8, "min_cut"
    )
    key, _ = program_key(model, (x,), {}, call_signature(model, (x,), {}), _key_options(opts))
    return key


def test_the_program_key_follows_the_forward_the_backward_layout_and_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    base = _key(_Mlp(), x)
    assert _key(_Mlp(), x) == base  # other values, same program
    assert _key(_Mlp("tanh"), x) != base  # an attribute steering the forward
    assert _key(_Mlp(), torch.randn(8, 16)) != base  # a shape
    assert _key(_Mlp(), x, reshard_after_forward=False) != base  # an option
    assert _key(_Mlp(), x, joint_pass=ac_joint_pass()) == _key(
        _Mlp(), x, joint_pass=ac_joint_pass()
    )  # a joint pass by what it does (its uuid), not its address
    assert _key(_Mlp(), x, joint_pass=ac_joint_pass()) != base

    wider = _Mlp()
    wider.extra = nn.Parameter(torch.zeros(3))  # a parameter the forward never reads
    assert _key(wider, x) != base  # the export's inputs differ: the layout is in the key

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # AOTAutograd's cache keys on it; the key has it through Inductor's `deterministic`
        assert _key(_Mlp(), x) != base
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])

    scaled = _key(_Mlp(scale=True), x)

    def other_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3

    monkeypatch.setattr(_Scale, "backward", staticmethod(other_backward))
    # the forward trace is the same; only the Python the backward runs changed
    assert _key(_Mlp(scale=True), x) != scaled


def _load(path: Path, source: str) -> types.ModuleType:
    """``source`` written to ``path`` and executed as a module of that file (not registered in
    ``sys.modules``: each call is a fresh module, as a restarted job imports one)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The helper module ``_HelperScale.backward`` calls (set by the test).
_HELPERS: Any = None


class _HelperScale(torch.autograd.Function):
    """A custom function whose backward's arithmetic lives in another file."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _HELPERS.scale(grad)
        return out


class _ContextScale(torch.autograd.Function):
    """A custom function whose forward leaves the backward's factor on ``ctx``, from a helper
    in another file: the forward's trace is the same whatever the factor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.factor = _HELPERS.inner.factor()
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * ctx.factor


class _HelperMlp(nn.Module):
    def __init__(self, function: Any = _HelperScale) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.function.apply(self.up(x)).sum()
        return out


def test_the_program_key_follows_the_helper_modules_a_custom_backward_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart after an edit of a file only the backward runs must not reuse the record: the
    key covers the files reachable from the backward by its global names (and theirs)."""
    helper_source = "def scale(grad):\n    return grad * inner.factor()\n"
    inner_path = tmp_path / "ap_test_grad_inner.py"

    def load(factor: str) -> None:
        inner = _load(inner_path, f"def factor():\n    return {factor}\n")
        helpers = _load(tmp_path / "ap_test_grad_helpers.py", helper_source)
        helpers.inner = inner  # what ``from . import inner`` would bind
        monkeypatch.setattr(sys.modules[__name__], "_HELPERS", helpers)

    x = torch.randn(4, 16)
    load("2.0")
    base = _key(_HelperMlp(), x)
    load("2.0")  # the same files again (a restart): the same key
    assert _key(_HelperMlp(), x) == base
    load("3.0")  # an edit two calls away from the backward, invisible to the forward
    assert _key(_HelperMlp(), x) != base

    load("2.0")
    through_ctx = _key(_HelperMlp(_ContextScale), x)
    load("3.0")  # the same forward trace; only what the forward left on ctx differs
    assert _key(_HelperMlp(_ContextScale), x) != through_ctx


def _scaled_by(factor: float) -> Any:
    return lambda grad: grad * factor  # the factor is a closure cell: the code is the same


#: Factors the ``"table"`` hook reads from a global dict.
_FACTORS = {"table": 2.0}

#: Gradient hooks the forward of :class:`_Hooked` registers, by name.
_TENSOR_HOOKS: dict[str, Any] = {
    "double": lambda grad: grad * 2,
    "triple": lambda grad: grad * 3,
    "closure_2": _scaled_by(2.0),
    "closure_3": _scaled_by(3.0),
    "table": lambda grad: grad * _FACTORS["table"],
}


class _Hooked(nn.Module):
    def __init__(self, hook: str) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.hook = hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h.register_hook(_TENSOR_HOOKS[self.hook])
        out: torch.Tensor = h.relu().sum()
        return out


def test_the_program_key_follows_the_hooks_the_forward_registers_on_intermediates(
    records: Path,
) -> None:
    """The forward trace is the same for both hooks (a hook runs only in the backward); the key
    differs, so a restart with the other hook makes its own first compilation, which trains
    like the module."""
    x = torch.randn(4, 16)
    assert _key(_Hooked("double"), x) == _key(_Hooked("double"), x)
    assert _key(_Hooked("double"), x) != _key(_Hooked("triple"), x)
    assert _key(_Hooked("closure_2"), x) != _key(_Hooked("closure_3"), x)
    table = _key(_Hooked("table"), x)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_FACTORS, "table", 3.0)
        assert _key(_Hooked("table"), x) != table

    torch.manual_seed(0)
    precompile(_Hooked("double"), (x,))
    model, reference = _Hooked("triple"), _Hooked("triple")
    reference.load_state_dict(model.state_dict())
    pm = precompile(model, (x,))
    assert not pm.compilations[0].reused
    pm(x).backward()
    reference(x).backward()
    want = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name])


def test_what_the_key_cannot_describe_is_refused() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(Unkeyable, match="joint_pass"):
        _key(_Mlp(), x, joint_pass=lambda gm, inputs: gm)  # a callable known only by address

    class _ReturnsAView(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> Any:
            return self.lin(x)[1]  # a view at an offset: not rebuilt for Dynamo's fake call

    with pytest.raises(Unkeyable, match="output"):
        _key(_ReturnsAView(), x)


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Caches 'on' and the record directory in ``tmp_path`` (see the module docstring)."""
    monkeypatch.setattr(_compat, "caches_on", lambda: True)
    monkeypatch.setattr(_compat, "inductor_cache_dir", lambda: str(tmp_path))
    return tmp_path


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_recorded_first_compilation_is_made_only_when_called_and_trains_the_same(
    records: Path,
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    cold = precompile(_Mlp(scale=True), (x,))
    assert not cold.compilations[0].reused
    content = getattr(cold.compilations[0].fn, KEY_ATTRIBUTE)
    assert list((records / "ap_first_compilation").glob("*.pkl"))

    torch.manual_seed(1)
    model = _Mlp(scale=True)
    warm = precompile(model, (x,))
    first = warm.compilations[0]
    assert first.reused
    deferred = deferred_of(first.fn)
    assert deferred is not None and deferred.made is None
    assert getattr(first.fn, KEY_ATTRIBUTE) == content
    assert first.first_partition == cold.compilations[0].first_partition

    # Dynamo's fake-tensor call (fakes, under a compile's TracingContext) is answered from the
    # key's trace: nothing is made
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = [mode.from_tensor(getattr(owner, n)) for owner, n in first.param_slots]
    with tracing(TracingContext(mode)):
        out = first.fn(*params, mode.from_tensor(x))
    assert out.shape == () and out.requires_grad and deferred.made is None

    # the same fakes outside any compile (a user's own fake-tensor run) get the real thing
    torch.manual_seed(2)
    other = precompile(_Mlp(scale=True), (x,))
    other_deferred = deferred_of(other.compilations[0].fn)
    assert other_deferred is not None
    other_params = [mode.from_tensor(getattr(o, n)) for o, n in other.compilations[0].param_slots]
    other.compilations[0].fn(*other_params, mode.from_tensor(x))
    assert other_deferred.made is not None

    # an eager call makes it, with the recorded content key, and trains as the module does
    reference = _Mlp(scale=True)
    reference.load_state_dict(model.state_dict())
    reference(x).backward()
    loss = warm(x)
    loss.backward()
    assert deferred.made is not None
    assert getattr(deferred.made.fn, KEY_ATTRIBUTE) == content
    assert loss.item() == pytest.approx(reference(x).item(), rel=1e-6)
    want = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name])


def test_the_second_compilations_retrace_makes_a_recorded_first_compilation(
    records: Path,
) -> None:
    """With AOTAutograd's cache off (this session), the retrace is what a cache miss runs:
    the stand-in makes the first compilation inside it, and the compiled step is exact."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    precompile(_Mlp(), (x,))
    torch.manual_seed(1)
    model = _Mlp()
    reference = _Mlp()
    reference.load_state_dict(model.state_dict())
    pm = precompile(model, (x,))
    assert pm.compilations[0].reused
    torch._dynamo.reset()
    loss = torch.compile(pm, backend=autoparallel_backend())(x)
    loss.backward()
    deferred = deferred_of(pm.compilations[0].fn)
    assert deferred is not None and deferred.made is not None
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    want = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name])


def test_a_record_the_program_no_longer_makes_is_an_error_and_is_dropped(
    records: Path,
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    precompile(_Mlp(), (x,))
    (path,) = (records / "ap_first_compilation").glob("*.pkl")
    key = path.stem
    record = load_record(key)
    assert record is not None
    from dataclasses import replace

    save_record(key, replace(record, content_key="0" * 64))  # a stale record
    pm = precompile(_Mlp(), (x,))
    assert pm.compilations[0].reused
    with pytest.raises(PrecompileError, match="is not the one it makes now"):
        pm(x)
    assert not record_path(key).exists()
    assert not precompile(_Mlp(), (x,)).compilations[0].reused  # made and recorded again
    assert record_path(key).exists()


def test_no_record_without_the_caches_or_when_switched_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_compat, "inductor_cache_dir", lambda: str(tmp_path))
    x = torch.randn(4, 16)
    precompile(_Mlp(), (x,))  # this session's caches are off
    assert not (tmp_path / "ap_first_compilation").exists()
    monkeypatch.setattr(_compat, "caches_on", lambda: True)
    precompile(_Mlp(), (x,), first_compilation_cache=False)
    assert not (tmp_path / "ap_first_compilation").exists()
    with pytest.raises(TypeError, match="first_compilation_cache"):
        precompile(_Mlp(), (x,), first_compilation_cache="yes")  # type: ignore[arg-type]


_RUN = """
import json, shutil, sys
import torch
from torch import nn
from torch._dynamo.utils import counters
from ap_backend import autoparallel_backend, precompile
from ap_backend._reuse import deferred_of

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.up(x).relu()).sum()

torch._dynamo.reset()
torch.manual_seed(0)
model, x = Mlp(), torch.randn(4, 16)
pm = precompile(model, (x,))
loss = torch.compile(pm, backend=autoparallel_backend())(x)
loss.backward()
deferred = deferred_of(pm.compilations[0].fn)
print(json.dumps({
    "reused": pm.compilations[0].reused,
    "made_late": deferred is not None and deferred.made is not None,
    "loss": loss.item(),
    "grad": [p.grad.sum().item() for p in model.parameters()],
    "aot": dict(counters["aot_autograd"]),
}))
"""


@pytest.mark.slow  # four fresh processes compiling a two-layer MLP with the caches on
def test_a_restart_skips_the_first_compilation_on_a_hit_and_makes_it_on_a_miss(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")

    def run() -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out

    cold = run()
    assert not cold["reused"] and cold["aot"].get("autograd_cache_saved") == 1, cold
    warm = run()  # the record and AOTAutograd's entry: nothing of the first compilation is made
    assert warm["reused"] and warm["aot"].get("autograd_cache_hit") == 1, warm
    assert not warm["made_late"], "a cache hit made the first compilation"
    for aot_dir in tmp_path.glob("aotautograd"):
        import shutil

        shutil.rmtree(aot_dir)
    miss = run()  # the record, no entry: the retrace makes the first compilation
    assert miss["reused"] and miss["aot"].get("autograd_cache_miss") == 1, miss
    assert miss["aot"].get("autograd_cache_saved") == 1, miss
    assert miss["made_late"], miss
    for got in (warm, miss):
        assert got["loss"] == pytest.approx(cold["loss"], rel=1e-6)
        assert got["grad"] == pytest.approx(cold["grad"], rel=1e-5, abs=1e-6)


_RUN_HOOKED = """
import json, os
import torch
from torch import nn
from torch._dynamo.utils import counters
from ap_backend import autoparallel_backend, precompile

FACTOR = float(os.environ["AP_TEST_HOOK_FACTOR"])  # the only thing two runs differ in


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        h = self.up(x)
        h.register_hook(lambda grad: grad * FACTOR)
        return self.down(h.relu()).sum()


torch.manual_seed(0)
model, reference, x = Hooked(), Hooked(), torch.randn(4, 16)
reference.load_state_dict(model.state_dict())
reference(x).backward()
pm = precompile(model, (x,))
torch.compile(pm, backend=autoparallel_backend())(x).backward()
print(json.dumps({
    "reused": pm.compilations[0].reused,
    "grad_error": max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
    ),
    "aot": dict(counters["aot_autograd"]),
}))
"""


@pytest.mark.slow  # two fresh processes compiling a two-layer MLP with the caches on
def test_a_restart_with_another_backward_hook_constant_trains_the_new_one(
    tmp_path: Path,
) -> None:
    """The silent failure this key exists to prevent: the second run's forward is the same
    Python and the same trace, but the hook it registers multiplies by another module-level
    constant. A reused record would hand AOTAutograd's cache the first run's key and train the
    first run's backward; the key covers the constant, so the restart compiles its own."""
    script = tmp_path / "train_hooked.py"
    script.write_text(_RUN_HOOKED)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")

    def run(factor: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, str(script)],
            env=dict(env, AP_TEST_HOOK_FACTOR=factor),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out

    cold = run("2.0")
    assert not cold["reused"] and cold["grad_error"] < 1e-5, cold
    again = run("2.0")  # the same program: the record and AOTAutograd's entry serve it
    assert again["reused"] and again["aot"].get("autograd_cache_hit") == 1, again
    assert again["grad_error"] < 1e-5, again
    other = run("3.0")
    assert not other["reused"], other
    assert other["grad_error"] < 1e-5, other


class _TiedLm(nn.Module):
    """A language model's tied embedding and head (GPT-2, BERT, T5): one parameter, two names."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        out: torch.Tensor = logits.logsumexp(-1).mean()
        return out


def test_a_model_with_tied_weights_has_a_key_and_is_reused_exactly(records: Path) -> None:
    """Tied weights were unkeyable (each name entered the key's trace as its own input, which
    ``functional_call`` refuses), so GPT-2, BERT, T5 and tied Qwen3 never reused a record."""
    tokens = torch.randint(0, 32, (2, 8))
    assert _key(_TiedLm(), tokens) == _key(_TiedLm(), tokens)
    assert _key(_TiedLm(), tokens) != _key(_TiedLm(tied=False), tokens)  # the tie is keyed

    torch.manual_seed(0)
    cold = precompile(_TiedLm(), (tokens,))
    assert not cold.compilations[0].reused
    model, reference = _TiedLm(), _TiedLm()
    reference.load_state_dict(model.state_dict())
    warm = precompile(model, (tokens,))
    assert warm.compilations[0].reused
    warm(tokens).backward()
    reference(tokens).backward()
    want = _grads(reference)
    assert set(_grads(model)) == set(want)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name])
