"""``PrecompiledModule`` behaves like the module it wraps: train/eval, new shapes, marked
dynamic dims, graph breaks (``.item()``, ``print``), parametrized parameters, and views the
retrace cannot keep."""

from __future__ import annotations

import logging

import pytest
import torch
from ap_backend import PrecompileError, autoparallel_backend, precompile
from ap_backend._trace import reshape_views
from torch import nn
from torch.nn.utils import parametrize


def _dropout_bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.BatchNorm1d(32), nn.Linear(32, 1))


@pytest.mark.slow
def test_eval_after_a_training_step_matches_eager_eval() -> None:
    """The issue's case: train one step compiled, then ``eval()``: dropout off, running
    statistics used -- the compiled module agrees with eager (it gave 0.199 vs 0.0154)."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    model = _dropout_bn()
    pm = precompile(model, (x,))
    fn = torch.compile(pm, backend=autoparallel_backend())
    fn(x).sum().backward()  # a training step: dropout on, batch statistics, running stats move
    assert int(model[2].num_batches_tracked) == 1
    eager = _dropout_bn()
    eager.load_state_dict(model.state_dict())  # the trained state (Inductor's dropout RNG
    # is not eager's, so the two cannot train in lockstep)
    eager.eval()
    pm.eval()
    want = eager(x)
    torch.testing.assert_close(fn(x), want)  # eval, grads enabled: its own first compilation
    assert [c.signature.training for c in pm.compilations] == [True, False]
    with torch.no_grad():
        torch.testing.assert_close(fn(x), want)  # no grad: the module itself
    pm.train()
    eager.train()
    assert fn(x).requires_grad  # back to the training compilation, not a new one
    assert len(pm.compilations) == 2


def test_a_new_batch_size_gets_its_own_first_compilation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    pm = precompile(model, (torch.randn(4, 16),))
    x6 = torch.randn(6, 16)
    with caplog.at_level(logging.INFO, logger="ap_backend._precompile"):
        out = pm(x6)
    torch.testing.assert_close(out, model(x6))
    out.sum().backward()
    assert [c.signature.leaves[0][1] for c in pm.compilations] == [(4, 16), (6, 16)]
    assert "first compilation #2 (of at most 8)" in caplog.text
    assert "compiled for tensor (4, 16)" in caplog.text and "got tensor (6, 16)" in caplog.text
    pm(torch.randn(4, 16))  # cached: no third compilation
    assert len(pm.compilations) == 2


def test_the_signature_bound_names_the_argument_and_the_way_out() -> None:
    model = nn.Linear(16, 1)
    pm = precompile(model, (torch.randn(4, 16),), max_signatures=1)
    with pytest.raises(PrecompileError) as info:
        pm(torch.randn(6, 16))
    msg = str(info.value)
    assert "max_signatures=1" in msg
    assert "input (args[0]): compiled for tensor (4, 16)" in msg and "got tensor (6, 16)" in msg
    assert "pad inputs" in msg


@pytest.mark.slow
def test_a_new_batch_size_through_the_backend() -> None:
    """The issue's case: compiled on (4, 16), called with (6, 16): it crashed in Inductor."""
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
    pm = precompile(model, (torch.randn(4, 16),))
    fn = torch.compile(pm, backend=autoparallel_backend())
    fn(torch.randn(4, 16)).sum().backward()
    x6 = torch.randn(6, 16)
    torch.testing.assert_close(fn(x6), model(x6))


def test_marked_dynamic_dims_are_refused_at_precompile_time() -> None:
    x = torch.randn(4, 16)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(ValueError, match=r"precompile: x \(args\[0\]\) has dim\(s\) \[0\]") as e:
        precompile(_Named(), (x,))
    assert "torch._dynamo.mark_dynamic" in str(e.value)
    assert "gets its own first compilation" in str(e.value)


def test_marked_dynamic_dims_are_refused_on_a_later_call_too() -> None:
    pm = precompile(_Named(), (torch.randn(4, 16),))
    x = torch.randn(8, 16)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(ValueError, match=r"PrecompiledModule: x \(args\[0\]\) has dim"):
        pm(x)


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Item(nn.Module):
    """Reads two values into Python and only computes with them (no decision on them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        scale = y.abs().max().item()
        rows = (x > 0).sum().item()
        return (y / scale).sum() * rows


class _BranchOnItem(_Item):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.abs().max().item() > 1:  # the line the error must name
            y = y / 2
        return y


class _Print(_Item):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        print("activation norm", y.norm())  # the line the error must name
        return y


class _GuardedPrint(_Item):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if not torch.compiler.is_compiling():
            print("never printed while precompile traces")
        return y


def test_values_read_with_item_are_symbols_in_one_graph_that_matches_eager() -> None:
    """``.item()`` used only in arithmetic traces (an unbacked symbol, as Dynamo does with
    ``capture_scalar_outputs``), and the backend compiles the recorded reads into one graph
    without that setting."""
    torch.manual_seed(0)
    model, x = _Item(), torch.randn(2, 4)
    ref = model(x)
    ref.backward()  # type: ignore[no-untyped-call]
    ref_grad = model.lin.weight.grad.clone()  # type: ignore[union-attr]
    model.zero_grad()
    assert not torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = torch.compile(precompile(model, (x,)), backend=autoparallel_backend())
        out = compiled(x)
    out.backward()  # type: ignore[no-untyped-call]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.lin.weight.grad, ref_grad, rtol=1e-6, atol=1e-7)


def test_branch_on_item_names_the_decision_and_the_source_line() -> None:
    with pytest.raises(PrecompileError) as info:
        precompile(_BranchOnItem(), (torch.randn(2, 4),))
    err = info.value
    assert err.op == "GuardOnDataDependentSymNode"
    assert err.location is not None and err.location.startswith(__file__)
    msg = str(err)
    assert "if t.item() > 0:" in msg
    assert "if y.abs().max().item() > 1:" in msg
    assert "graph break" in msg and "pass it in as an argument" in msg


def test_print_in_forward_is_an_error_not_a_silent_one_time_print(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(PrecompileError) as info:
        precompile(_Print(), (torch.randn(2, 4),))
    assert info.value.op == "print"
    assert 'print("activation norm", y.norm())' in str(info.value)
    assert "torch.compiler.is_compiling()" in str(info.value)
    assert capsys.readouterr().out == ""
    print("printing works again")  # the guard is scoped to the trace
    assert capsys.readouterr().out == "printing works again\n"


def test_is_compiling_is_true_while_precompile_traces(capsys: pytest.CaptureFixture[str]) -> None:
    pm = precompile(_GuardedPrint(), (torch.randn(2, 4),))
    assert capsys.readouterr().out == ""
    assert not torch.compiler.is_compiling()
    pm(torch.randn(2, 4))


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def test_parametrized_parameters_are_passed_as_stored() -> None:
    """``torch.nn.utils.parametrize``: ``lin.weight`` is a property computing ``2 * original``;
    the export lifts the stored ``original``, and each call must pass that (it raised
    ``AttributeError: 'weight' is not an nn.Parameter``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    parametrize.register_parametrization(model[0], "weight", _Doubled())
    x = torch.randn(3, 4)
    pm = precompile(model, (x,))
    torch.testing.assert_close(pm(x), model(x))
    pm(x).sum().backward()
    original = model[0].parametrizations.weight.original
    assert original.grad is not None
    with torch.no_grad():
        original.add_(1.0)  # an update to the stored parameter is seen by the next call
    torch.testing.assert_close(pm(x), model(x))


def test_reshape_views_keeps_nodes_and_meta() -> None:
    """The retrace runs with Inductor's decompositions, whose strides may differ from eager's
    (see test_hf_models.py for HF Phi-3): every ``view`` becomes ``reshape``, same node."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    t = g.call_function(torch.ops.aten.t.default, (x,))
    v = g.call_function(torch.ops.aten.view.default, (t, [6]))
    v.meta["custom"] = {"ap_must_save": True}
    g.output(v)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(torch.randn(2, 3))
    assert reshape_views(gm) == 1
    assert v.target is torch.ops.aten.reshape.default and v.meta["custom"]["ap_must_save"]
    torch.testing.assert_close(gm(torch.arange(6.0).view(2, 3)), torch.tensor([0.0, 3, 1, 4, 2, 5]))


class _PropertyLinear(nn.Linear):
    """SimpleFSDP's pattern (``data_parallel`` swaps each module's class for a subclass): the
    parameter's name is a property that computes from ``self._parameters[name]``."""

    @property  # type: ignore[override]
    def weight(self) -> torch.Tensor:
        return 2 * self._parameters["weight"]  # type: ignore[operator]


def test_a_property_shadowing_a_parameter_reads_the_stored_parameter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model[0].__class__ = _PropertyLinear
    x = torch.randn(3, 4)
    pm = precompile(model, (x,))
    torch.testing.assert_close(pm(x), model(x))
    pm(x).sum().backward()
    assert model[0]._parameters["weight"].grad is not None


def test_a_dtensor_context_flattened_as_torch_2_11_does_reads_as_its_placements() -> None:
    """torch 2.11 flattens a DTensor's context as ``(DTensorSpec, requires_grad)``, whose repr
    leads with the mesh (the matrix cell of ap-backend on 2.11 printed the whole spec); the
    message shows its placements and tensor metadata as 2.15's flattening does."""
    from ap_backend._signature import _describe_leaf
    from ap_testing.distributed import single_rank_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    with single_rank_gloo():
        mesh = init_device_mesh("cpu", (1,))
        meta = TensorMeta(torch.Size([4, 16]), (16, 1), torch.float32)
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        subclass = ("torch.distributed.tensor.DTensor", (spec, False), ())
        text = _describe_leaf(("tensor", (4, 16), (16, 1), "torch.float32", "cpu", False, subclass))
    assert text.startswith(f"DTensor ((Shard(dim=0),), {meta!r}, False) (4, 16) float32 on cpu")
    assert "DeviceMesh" not in text


def test_a_dtensor_arguments_placements_are_part_of_the_signature() -> None:
    """A first compilation traced for a ``Shard(0)`` DTensor argument rebuilds its outputs and
    gradients with the placements it traced; a call with the same global shape placed
    ``Replicate()`` (the same local shape at one rank) is another signature, named as such."""
    from ap_backend._signature import call_signature
    from ap_testing.distributed import single_rank_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with single_rank_gloo():
        mesh = init_device_mesh("cpu", (1,))
        x = torch.randn(4, 16)
        sharded = call_signature(nn.Identity(), (distribute_tensor(x, mesh, [Shard(0)]),), {})
        again = call_signature(nn.Identity(), (distribute_tensor(x, mesh, [Shard(0)]),), {})
        replicated = call_signature(nn.Identity(), (distribute_tensor(x, mesh, [Replicate()]),), {})
        plain = call_signature(nn.Identity(), (x,), {})
    assert sharded == again and hash(sharded) == hash(again)
    assert sharded != replicated and sharded != plain
    message = sharded.difference(replicated)
    assert "DTensor ((Shard(dim=0),)" in message and "got DTensor ((Replicate(),)" in message
    assert (
        plain.describe()
        == "train mode; input (args[0]): tensor (4, 16) float32 on cpu (strides (16, 1))"
    )
