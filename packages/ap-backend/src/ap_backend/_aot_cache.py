"""AOTAutograd's cache for the second compilation: what a first compilation is, as a key.

Why: the second ``torch.compile`` sees ``PrecompiledModule.forward`` call the first
compilation through ``nonstrict_trace``, which Dynamo records as a call of a closure of its
own (``flat_apply_capture``) on a graph attribute holding the callable. AOTAutograd's cache
cannot key that call (the closure is not importable, the callable not picklable), so it
bypassed every second compilation: a restarted job retraced, re-partitioned and re-bucketed
what an identical job had compiled before (the FX-graph cache still spared Inductor's codegen).

What makes the call keyable without making it unsound: the first compilation's own content.
:func:`first_compilation_key` hashes what the retrace re-executes -- the partitioned forward and
backward graphs, node by node, with every meta field the retrace copies or ap reads (``custom``,
``recompute``, the output descriptors, each value's shape / strides / dtype), their constants'
bytes -- plus the call signature, the placements and mesh of DTensor parameters and buffers
(which the runtime wrappers that rebuild their gradients hold, not the graphs; an opaque input
such as the mesh is described in the graphs by its class, its value coming with each call),
the first compilation's options, the source of the ap packages that tag and re-run those
graphs, and torch's version. Two first compilations with the
same key retrace to the same joint graph; anything that changes what the retrace produces
changes the key (a graph the key cannot describe deterministically -- a value with an address in
its ``repr`` -- only misses the cache, it never hits a stale entry).

:func:`key_first_compilation_calls` rewrites, in the Dynamo graph the backend receives, each
such call whose callable is a keyed first compilation: the target becomes
:func:`call_first_compilation` (importable; it runs Dynamo's closure) and the callable a
:class:`KeyedCall` that pickles as its key. :func:`first_compilation_calls_cacheable` marks that
one function cacheable (``torch._inductor.config.unsafe_marked_cacheable_functions``) for the
backend's compile only. Any other ``nonstrict_trace`` call is left as it is, and the graph
bypasses the cache as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from ap_backend import _compat

__all__ = [
    "KeyedCall",
    "Unkeyable",
    "call_first_compilation",
    "first_compilation_calls_cacheable",
    "first_compilation_key",
    "graphs_digest",
    "key_first_compilation_calls",
    "stamp_first_compilation",
]

log = logging.getLogger(__name__)

#: The attribute a first compilation's callable carries its key in.
KEY_ATTRIBUTE = "__ap_first_compilation_key__"
#: Bumped when what the key covers changes meaning.
_KEY_VERSION = "ap-first-compilation-v1"

#: Node meta left out of the key: provenance that does not change what a node computes
#: (``stack_trace`` moves with any edit of the user's file; ``from_node`` is a chain of
#: objects), and the tensor metadata ``val`` already describes.
_UNKEYED_META = frozenset({"stack_trace", "from_node", "tensor_meta", "example_value"})


def _value_key(value: object) -> object:
    """A deterministic description of a node's ``val``: tensor metadata, not its data."""
    if isinstance(value, torch.Tensor):
        strided = value.layout == torch.strided
        return (
            "tensor",
            tuple(str(s) for s in value.shape),
            tuple(str(s) for s in value.stride()) if strided else (),
            str(value.storage_offset()) if strided else "",
            str(value.dtype),
            value.device.type,
            bool(value.requires_grad),
            type(value).__qualname__,
        )
    if isinstance(value, (list, tuple)):
        return tuple(_value_key(v) for v in value)
    opaque = _compat.fake_script_object_class(value)
    if opaque is not None:
        # an opaque input (a DTensor's device mesh): its value comes with each call; what the
        # trace read from it is in the graph, and the mesh itself in the key's subclass context
        return ("opaque", opaque)
    return repr(value)


class Unkeyable(Exception):
    """A graph the key cannot describe soundly (its call then keeps bypassing the cache)."""


def _constant_digest(value: torch.Tensor) -> str:
    """Hash of a graph constant's bytes (a constant's value is part of what the graph does)."""
    try:
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        raw = bytes(data.numpy().tobytes())
    except Exception as exc:  # a fake or an exotic layout: no bytes to hash
        raise Unkeyable(f"constant {type(value).__qualname__} has no readable bytes") from exc
    return hashlib.sha256(raw).hexdigest()


def _is_keyed_target(target: object) -> bool:
    """Targets whose name says what they compute: operators (aten, prims, collectives, custom
    ops: their schema is global) and Python's own builtins (``operator.getitem``). A Python
    function is named by its qualname only, which stays the same when its code changes."""
    if isinstance(target, _compat.operator_types()):
        return True
    return type(target).__name__ == "builtin_function_or_method"


def _graph_lines(
    gm: torch.fx.GraphModule, seq_nrs: dict[object, int], prefix: str = ""
) -> Iterator[str]:
    """``gm`` as text: each node, its meta (``seq_nr``, a process-wide autograd counter, as the
    order in which it first appears: what pairs a forward node with its backward survives, the
    counter's start does not), its constants' digests and its subgraphs."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and not _is_keyed_target(node.target):
            raise Unkeyable(f"{node.name} calls the Python function {node.target!r}")
        if node.op == "call_module":
            raise Unkeyable(f"{node.name} calls a submodule")
        yield prefix + node.format_node()
        for key in sorted(node.meta):
            if key in _UNKEYED_META:
                continue
            value = node.meta[key]
            if key == "seq_nr":
                value = seq_nrs.setdefault(value, len(seq_nrs))
            yield f"{prefix}  {key} = {_value_key(value) if key == 'val' else repr(value)}"
        if node.op == "get_attr":
            attr = getattr(gm, str(node.target), None)
            if isinstance(attr, torch.fx.GraphModule):  # a higher-order op's body
                yield f"{prefix}  subgraph {node.target}"
                yield from _graph_lines(attr, seq_nrs, prefix + "    ")
            elif isinstance(attr, torch.Tensor):
                yield f"{prefix}  constant {_value_key(attr)} {_constant_digest(attr)}"
            else:
                raise Unkeyable(f"{node.name} reads a {type(attr).__qualname__} attribute")


def graphs_digest(graphs: Sequence[torch.fx.GraphModule]) -> str:
    """Hash of ``graphs`` (the partition's forward and backward, taken before the compilers
    tag them), node by node with their meta and constants; :class:`Unkeyable` for a graph it
    cannot describe soundly (a Python function's call, a submodule, an opaque attribute)."""
    digest = hashlib.sha256()
    seq_nrs: dict[object, int] = {}
    for gm in graphs:
        digest.update(b"\0graph\0")
        for line in _graph_lines(gm, seq_nrs):
            digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def first_compilation_key(digest: str, *context: object) -> str:
    """The key of a first compilation whose graphs hash to ``digest`` (:func:`graphs_digest`),
    made under ``context`` (call signature, options; each ``repr``'d), by this torch and this
    code of the ap packages."""
    key = hashlib.sha256()
    key.update(_KEY_VERSION.encode())
    key.update(str(torch.__version__).encode())
    # the packages whose code tags the first compilation's graphs and re-runs them in the
    # retrace (ap-tags' compilers, ap-epchunk's region tags, this package)
    import ap_epchunk
    import ap_tags

    import ap_backend

    key.update(_compat.hash_package_sources((ap_tags, ap_epchunk, ap_backend)))
    for item in context:
        key.update(b"\0context\0" + repr(item).encode())
    key.update(b"\0graphs\0" + digest.encode())
    return key.hexdigest()


def stamp_first_compilation(fn: Callable[..., Any], key: str) -> None:
    """Record ``key`` on a first compilation's callable (what Dynamo's graph will call)."""
    setattr(fn, KEY_ATTRIBUTE, key)


def _first_compilation_key_of(fn: Callable[..., Any]) -> str | None:
    """The key of the first compilation ``fn`` (Dynamo's wrapper around the nonstrict call)
    calls, found among the wrapper's closure cells; None when it calls anything else."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        key = getattr(inner, KEY_ATTRIBUTE, None)
        if isinstance(key, str):
            return key
    return None


class KeyedCall:
    """Calls what Dynamo's callable called; pickles (for AOTAutograd's cache key) as the first
    compilation's key. ``capture`` is Dynamo's own closure for the call, kept to run it."""

    def __init__(self, fn: Callable[..., Any], key: str, capture: Callable[..., Any]) -> None:
        self.fn = fn
        self.key = key
        self.capture = capture

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (str, (f"{_KEY_VERSION}:{self.key}",))


def call_first_compilation(callable_: Any, *args: Any) -> list[object]:
    """The rewritten call, importable (what AOTAutograd's cacheability check asks): runs
    Dynamo's own closure for it (``flat_apply_capture``, kept on the :class:`KeyedCall`), so
    what the call computes is torch's, not a copy of it."""
    keyed = _compat.leaf_callable_function(callable_)
    if not isinstance(keyed, KeyedCall):
        raise TypeError(
            f"call_first_compilation: expected the KeyedCall the backend put in the graph, got "
            f"{type(keyed).__qualname__}"
        )
    result: list[object] = keyed.capture(callable_, *args)
    return result


#: The name AOTAutograd's cacheability check builds for :func:`call_first_compilation`.
CALL_NAME = f"{call_first_compilation.__module__}.{call_first_compilation.__name__}"


def key_first_compilation_calls(gm: torch.fx.GraphModule) -> int:
    """Rewrite each call of a keyed first compilation in Dynamo's graph ``gm`` (see the module
    docstring); the number rewritten. Nothing changes when it returns 0."""
    if not _compat.inductor_has_option("unsafe_marked_cacheable_functions"):
        return 0  # nothing to mark the rewritten call cacheable with
    try:
        plan = _rewrites(gm)
    except _compat.UnsupportedTorchError as exc:  # another torch's nonstrict call: leave it
        log.info("autoparallel_backend: AOTAutograd's cache bypasses this graph: %s", exc)
        return 0
    for node, attr, keyed in plan:
        setattr(gm, attr, keyed)
        node.target = call_first_compilation
    if plan:
        gm.recompile()
    return len(plan)


def _rewrites(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, str, Any]]:
    """(node, attribute, keyed callable) for each call of a keyed first compilation."""
    plan: list[tuple[torch.fx.Node, str, Any]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        if not _compat.is_nonstrict_capture(node.target):
            continue
        holder = node.args[0]
        if not isinstance(holder, torch.fx.Node) or holder.op != "get_attr":
            continue
        original = getattr(gm, str(holder.target), None)
        fn = _compat.leaf_callable_function(original)
        key = None if fn is None else _first_compilation_key_of(fn)
        if fn is None or key is None:
            continue
        keyed = KeyedCall(fn, key, node.target)
        plan.append((node, str(holder.target), _compat.leaf_callable_like(original, keyed)))
    return plan


@contextlib.contextmanager
def first_compilation_calls_cacheable() -> Iterator[None]:
    """:func:`call_first_compilation` cacheable for AOTAutograd, for this block only."""
    marked = _compat.marked_cacheable_functions()
    marked[CALL_NAME] = _KEY_VERSION
    with _compat.inductor_config_patch({"unsafe_marked_cacheable_functions": marked}):
        yield
