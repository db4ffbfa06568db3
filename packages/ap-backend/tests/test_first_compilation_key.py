"""AOTAutograd's cache for the second compilation, keyed by the first compilation's content.

Why: the second ``torch.compile`` calls the first compilation through ``nonstrict_trace``;
AOTAutograd's cache could not key that call and bypassed every second compilation, so a
restarted job retraced and re-partitioned everything (``benchmarks.compile_time``: warm 3.6x
plain's). The call is now keyed by what the retrace re-executes. These tests hold the key to
its one duty: equal for the same first compilation, different whenever the retrace would
differ -- in particular when the module's *code* changes, which the second compilation's
Dynamo graph never sees (it only sees ``PrecompiledModule.forward`` call the first
compilation).
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ap_tags
import pytest
import torch
import torch.fx
from ap_backend import precompile
from ap_backend._aot_cache import (
    KEY_ATTRIBUTE,
    Unkeyable,
    call_first_compilation,
    graphs_digest,
    key_first_compilation_calls,
)
from torch import nn


class _Mlp(nn.Module):
    def __init__(self, act: str = "relu") -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h.relu() if self.act == "relu" else torch.tanh(h)
        return self.down(h).sum()


def _key(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> str:
    pm = precompile(model, (x,), **kwargs)
    key = getattr(pm.compilations[0].fn, KEY_ATTRIBUTE)
    assert isinstance(key, str)
    return key


def test_the_key_is_the_first_compilations_content() -> None:
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(4, 16)
    key = _key(model, x)
    assert _key(_Mlp(), x) == key  # other weights, the same graphs: weights are inputs
    others = {
        "code": _key(_Mlp("tanh"), x),
        "shape": _key(model, torch.randn(8, 16)),
        "AC tags": _key(model, x, joint_pass=ap_tags.ac_joint_pass()),
        "first partitioner": _key(model, x, first_partition="default"),
    }
    for what, other in others.items():
        assert other != key, f"the key did not change with the {what}"


def test_the_key_changes_with_the_code_of_ap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The retrace re-runs ap's own code (ap-tags' interpreters, ap-backend's call of the first
    compilation), which the graphs do not show: an upgraded ap on an old cache directory must
    miss. (Seen for real: editing ap-backend between the cold run and the restart of the
    SimpleFSDP restart test made the restart miss.)"""
    from ap_backend import _compat

    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(4, 16)
    key = _key(model, x)
    real = _compat.hash_package_sources
    monkeypatch.setattr(
        _compat, "hash_package_sources", lambda packages: real(packages) + b"an edited file"
    )
    assert _key(model, x) != key


def test_a_graph_the_key_cannot_describe_is_refused() -> None:
    def python_helper(t: torch.Tensor) -> torch.Tensor:  # named by qualname only
        return t + 1

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(python_helper, (x,))
    graph.output(graph.call_function(operator.getitem, ((y,), 0)))
    with pytest.raises(Unkeyable, match="python_helper"):
        graphs_digest([torch.fx.GraphModule(nn.Module(), graph)])


def _graph_with_opaque_input(val: object) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.placeholder("mesh").meta["val"] = val
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2)
    graph.output((x,))
    return torch.fx.GraphModule(nn.Module(), graph)


def test_an_opaque_input_is_keyed_by_its_class_not_its_address() -> None:
    """torch 2.15 passes a DTensor's device mesh into the first compilation as an opaque input
    (a ``FakeScriptObject`` in its placeholder's ``val``). Keyed by ``repr`` -- an address --
    every restart of a SimpleFSDP job missed; its value comes with each call, so its class is
    what the graph depends on (the mesh itself is in the key's subclass context, and
    ``tests/test_first_compilation_cache_zoo.py`` restarts such a job end to end)."""
    from torch._library.fake_class_registry import FakeScriptObject

    def fake(name: str) -> object:
        return FakeScriptObject(object(), name, None)

    one = graphs_digest([_graph_with_opaque_input(fake("DeviceMesh"))])
    assert one == graphs_digest([_graph_with_opaque_input(fake("DeviceMesh"))])
    assert one != graphs_digest([_graph_with_opaque_input(fake("ProcessGroup"))])


def _dynamo_graph(fn: Any, *args: Any) -> torch.fx.GraphModule:
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*args)
    (gm,) = graphs
    return gm


def test_only_calls_of_a_keyed_first_compilation_are_rewritten() -> None:
    @torch._dynamo.nonstrict_trace
    def foreign(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    x = torch.randn(4, 16)
    gm = _dynamo_graph(lambda t: foreign(t) + 1, x)
    before = gm.code
    assert key_first_compilation_calls(gm) == 0
    assert gm.code == before

    pm = precompile(_Mlp(), (x,))
    gm = _dynamo_graph(pm, x)
    assert key_first_compilation_calls(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert call_first_compilation in targets


def test_a_call_through_a_function_spec_is_keyed_and_runs_the_same() -> None:
    """torch 2.11 hands the nonstrict callable to ``flat_apply`` as ``func_to_graphable``'s
    spec of a ``_ConstantFunction`` instead of a ``_LeafCallable`` (2.15): that form is keyed
    too (AOTAutograd's cache bypassed every ap second compilation on 2.11), stays a spec, and
    the rewritten graph computes what the original did."""
    from ap_backend import _aot_cache
    from torch._higher_order_ops.flat_apply import func_to_graphable
    from torch.utils._pytree import TreeSpec

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    seen: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(precompile(_Mlp(), (x,)), backend=capture)(x)
    ((gm, inputs),) = seen
    (call,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == _CAPTURE]
    holder = str(call.args[0].target)
    fn = _compat_function(getattr(gm, holder))
    assert callable(fn)
    setattr(gm, holder, func_to_graphable(fn)[1])  # 2.11's form (a no-op change there)
    expected = gm(*inputs)
    assert key_first_compilation_calls(gm) == 1
    spec = getattr(gm, holder)
    assert isinstance(spec, TreeSpec)
    assert isinstance(_compat_function(spec), _aot_cache.KeyedCall)
    assert call.target is call_first_compilation
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


_CAPTURE = "flat_apply_capture"  # Dynamo's closure around a nonstrict call


def _compat_function(value: object) -> object:
    from ap_backend import _compat

    return _compat.leaf_callable_function(value)


def test_a_torch_without_the_internals_leaves_the_graph_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ap_backend import _compat

    def missing(value: object) -> None:
        raise _compat.SUPPORT.missing("torch._higher_order_ops.invoke_leaf_function._LeafCallable")

    x = torch.randn(4, 16)
    gm = _dynamo_graph(precompile(_Mlp(), (x,)), x)
    before = gm.code
    monkeypatch.setattr(_compat, "leaf_callable_function", missing)
    assert key_first_compilation_calls(gm) == 0
    assert gm.code == before
    monkeypatch.undo()
    monkeypatch.setattr(_compat, "inductor_has_option", lambda dotted: False)
    assert key_first_compilation_calls(gm) == 0
    assert gm.code == before


_RUN = """
import json
import torch
from torch import nn
from torch._dynamo.utils import counters
from ap_backend import autoparallel_backend, precompile

class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.act = act

    def forward(self, x):
        h = self.up(x)
        h = h.relu() if self.act == "relu" else torch.tanh(h)
        return self.down(h).sum()

def step(act):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, x = Mlp(act), torch.randn(4, 16)
    compiled = torch.compile(precompile(model, (x,)), backend=autoparallel_backend())
    loss = compiled(x)
    loss.backward()
    return {"act": act, "loss": loss.item(), "aot": dict(counters["aot_autograd"])}

print(json.dumps([step("relu"), step("relu"), step("tanh")]))
"""


@pytest.mark.slow  # three compiles of a two-layer MLP in a process with the caches on
def test_changed_code_misses_a_warm_cache(tmp_path: Path) -> None:
    """The same first compilation hits; the same Dynamo graph (``PrecompiledModule.forward``
    calling its first compilation) over other module code misses -- a hit there would train
    the relu graph. One process (the session forces the caches off, conftest, and torch's
    environment switch wins over ``config.patch``); the restart across processes, with equal
    training, is tests/test_first_compilation_cache_zoo.py's (torchtitan's Llama3 under
    SimpleFSDP)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cold, warm, changed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cold["aot"].get("autograd_cache_saved") == 1, cold["aot"]
    assert warm["aot"].get("autograd_cache_hit") == 1, warm["aot"]
    assert warm["loss"] == cold["loss"]
    assert "autograd_cache_hit" not in changed["aot"], changed["aot"]
    assert changed["aot"].get("autograd_cache_miss") == 1, changed["aot"]
    assert changed["loss"] != cold["loss"]
