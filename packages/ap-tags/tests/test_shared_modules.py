"""ap_tags.checks, ap_tags.scoped and ap_tags.torch_support: the conventions every package
shares (argument errors, scoped process-wide patches, the torch-support error)."""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch
import torch.fx
from ap_tags import checks, scoped, torch_support
from ap_testing.concurrency import Boom, hammer

# ----------------------------------------------------------------------------- checks


def test_wrong_type_is_type_error_naming_entry_point_and_argument() -> None:
    with pytest.raises(TypeError, match=r"^f: gm must be a torch.fx.GraphModule, got str 'x'$"):
        checks.require_graph_module("x", where="f", arg="gm")
    with pytest.raises(TypeError, match=r"^f: flag must be a bool, got int 1$"):
        checks.require_bool(1, where="f", arg="flag")
    with pytest.raises(TypeError, match=r"^f: n must be an int, got bool True$"):
        checks.require_int(True, where="f", arg="n")
    with pytest.raises(TypeError, match=r"^f: cb must be a callable or None, got int 3$"):
        checks.require_callable(3, where="f", arg="cb", optional=True)
    with pytest.raises(TypeError, match=r"^f: nodes must be an iterable of torch.fx.Node"):
        checks.require_nodes("ab", where="f", arg="nodes")
    with pytest.raises(TypeError, match=r"got GraphModule$"):
        checks.require_node(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), where="f")


def test_wrong_value_is_value_error() -> None:
    with pytest.raises(ValueError, match=r"^f: n must be >= 2, got 1$"):
        checks.require_int(1, where="f", arg="n", minimum=2)


def test_checks_return_the_value() -> None:
    g = torch.fx.Graph()
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert checks.require_graph(gm, where="f") is gm.graph
    assert checks.require_graph(g, where="f") is g
    assert checks.require_int(3, where="f", arg="n", minimum=0) == 3
    assert checks.require_callable(None, where="f", arg="cb", optional=True) is None
    assert checks.describe("x" * 100).endswith("...")


# ----------------------------------------------------------------------------- scoped

_state = {"patched": False, "applies": 0}


def _apply() -> scoped.Undo:
    assert not _state["patched"], "applied twice without an undo in between"
    _state["patched"] = True
    _state["applies"] += 1

    def undo() -> None:
        _state["patched"] = False

    return undo


def test_scoped_patch_applies_once_and_undoes_on_last_exit() -> None:
    patch = scoped.ScopedPatch("demo", _apply)
    before = _state["applies"]
    with patch:
        assert _state["patched"] and patch.active
        with patch:
            assert _state["applies"] == before + 1  # nested entry does not re-apply
        assert _state["patched"]
    assert not _state["patched"] and not patch.active


def test_scoped_patch_is_undone_when_the_body_raises() -> None:
    patch = scoped.ScopedPatch("demo", _apply)
    with pytest.raises(Boom), patch:
        raise Boom()
    assert not _state["patched"] and not patch.active


def test_scoped_patch_apply_that_raises_leaves_nothing_applied() -> None:
    def failing() -> scoped.Undo:
        raise RuntimeError("cannot apply")

    patch = scoped.ScopedPatch("failing", failing)
    with pytest.raises(RuntimeError, match="cannot apply"), patch:
        pass
    assert not patch.active


def test_scoped_patch_under_concurrency() -> None:
    patch = scoped.ScopedPatch("demo", _apply)
    violations: list[str] = []

    def one_round(rng: random.Random) -> None:
        with patch:
            if not _state["patched"]:
                violations.append("inside the scope but not patched")
            if rng.random() < 0.2:
                raise Boom()
            with patch:
                pass

    hammer(one_round, threads=8, rounds=300)
    assert not violations, violations[:3]
    assert not _state["patched"] and not patch.active


def test_paused_gc_restores_previous_state() -> None:
    assert gc.isenabled()
    with scoped.paused_gc():
        assert not gc.isenabled()
        with scoped.paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with scoped.paused_gc():
            pass
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()


def test_quiet_logger_restores_level() -> None:
    logger = logging.getLogger("ap_tags.test.quiet")
    logger.setLevel(logging.INFO)
    with scoped.quiet_logger("ap_tags.test.quiet"):
        assert logger.level == logging.CRITICAL
        with scoped.quiet_logger("ap_tags.test.quiet"):
            assert logger.level == logging.CRITICAL
    assert logger.level == logging.INFO


# ----------------------------------------------------------------------------- torch_support


class _PkgError(torch_support.UnsupportedTorchError):
    pass


def test_unsupported_torch_error_names_internal_and_tested_versions() -> None:
    support = torch_support.TorchSupport("ap-demo", ("2.13.0", "2.15.0"), _PkgError)
    with pytest.raises(_PkgError) as info:
        support.attr("torch.fx", "no_such_thing")
    err = info.value
    assert isinstance(err, torch_support.UnsupportedTorchError)
    assert isinstance(err, RuntimeError)
    assert (err.package, err.internal, err.tested) == (
        "ap-demo",
        "torch.fx.no_such_thing",
        ("2.13.0", "2.15.0"),
    )
    assert str(err) == (
        f"ap-demo needs torch.fx.no_such_thing, which torch {torch.__version__} does not "
        "provide (tested torch versions: 2.13.0, 2.15.0)"
    )
    with pytest.raises(_PkgError, match="needs torch.no_such_module,"):
        support.module("torch.no_such_module")
    with pytest.raises(_PkgError, match="needs torch.fx.a, torch.fx.b,"):
        support.attrs("torch.fx", ("Graph", "a", "b"))
    assert support.attr("torch.fx", "Graph") is torch.fx.Graph
