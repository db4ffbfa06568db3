"""A first compilation's key *before* it is made: what lets a restarted job skip it.

Why: on a warm cache AOTAutograd serves the second compilation by the first compilation's
content key (:mod:`ap_backend._aot_cache`), so the first compilation's callable never runs --
yet ``precompile`` made it anyway (the joint export, Inductor's joint passes, min-cut: about
6 s of a 8 s warm start at 8 layers of the model kit, against 3.6 s for all of plain
``torch.compile``'s). A record (:mod:`ap_backend._first_record`) maps the key computed here to
the content key the cold run produced; a warm ``precompile`` that finds it defers the first
compilation until something calls it (a cache miss of the second compilation, or an eager call).

What the key covers, and why that determines the first compilation:

* **the forward, exactly**: an aten-level trace of the module's forward (``make_fx`` on fake
  tensors, in the very mode the export traces in: ``torch.compiler.is_compiling()`` True) --
  every op, argument, shape, stride and dtype. The export runs the same Python the same way, so
  whatever steers it (module attributes, helper functions in any file, global flags read in
  Python) shows in this trace or does not matter to the forward;
* **the backward's Python**, which the forward trace does not run: the code of every custom
  ``autograd.Function`` class in the trace's autograd graph (its file's bytes), the Python
  implementations of custom ops in the trace (``torch.library.custom_op``: their files), the
  files defining every submodule's class (where hooks and custom functions usually live), the
  backward hooks registered on the modules and parameters (their code) and the hooks the forward
  registers on its intermediate tensors (their code, in order); from all of these, every file
  their code reaches by the names it reads, and the constants it reads from global names and
  closure cells (:mod:`ap_backend._reachable`). aten's own backward formulas come with torch's
  version;
* the module's layout (every submodule's class, every parameter's and buffer's name, metadata
  and subclass context -- a DTensor's placements), the call signature, ``precompile``'s options,
  Inductor's and functorch's portable config (the first partition runs Inductor's joint passes
  and min-cut), torch's version and the ap packages' sources (:func:`first_compilation_key`).

What it does not cover (documented in ``docs/``): what the backward's Python reads from objects
at run time rather than by name (an object's attributes, a tensor a hook closes over, a
function saved on ``ctx``), and hooks registered on autograd nodes (``grad_fn.register_hook``)
in the forward. Pass ``precompile(..., first_compilation_cache=False)`` for code like that. A
record whose deferred first compilation is made after all is checked: a content key
other than the recorded one is an error, never a silent mix.

Anything the key cannot describe deterministically raises :class:`Unkeyable`; ``precompile``
then compiles as it always did.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from ap_backend import _compat
from ap_backend._aot_cache import Unkeyable, first_compilation_key, graphs_digest
from ap_backend._reachable import HookRecorder, code_key, hash_sources, reachable, source_file
from ap_backend._signature import CallSignature, subclass_key
from ap_backend._trace import tracing_like_compile

__all__ = ["OutputSpec", "describe_outputs", "program_key"]

log = logging.getLogger(__name__)

#: v2: the backward's reachable files and constants and the forward's tensor hooks are keyed
_KEY_VERSION = "ap-program-v2"
#: Operator namespaces whose Python (if any) comes with torch's version.
_TORCH_NAMESPACES = frozenset(
    {"aten", "prims", "_c10d_functional", "c10d_functional", "_dtensor", "c10d", "higher_order"}
)


class _Flat:
    """A tensor subclass taken apart: its class, flatten context, outer size and stride,
    ``requires_grad``, and its inner tensors (each a tensor or another :class:`_Flat`)."""

    def __init__(self, value: torch.Tensor) -> None:
        attrs, self.ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
        self.cls = type(value.data) if isinstance(value, nn.Parameter) else type(value)
        self.size, self.stride = value.size(), value.stride()
        self.requires_grad = value.requires_grad
        self.inner = {name: _flat(getattr(value, name)) for name in attrs}

    def rebuild(self, inner: dict[str, Any]) -> torch.Tensor:
        out: torch.Tensor = self.cls.__tensor_unflatten__(  # type: ignore[attr-defined]
            inner, self.ctx, self.size, self.stride
        )
        return out.requires_grad_(self.requires_grad) if self.requires_grad else out


def _flat(value: object) -> Any:
    """A subclass taken apart; a plain tensor detached (a leaf of the trace); anything else
    (an opaque inner attribute: the device mesh) kept as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return _Flat(value) if subclass_key(value) else value.detach()


def _inner_leaves(flat: Any) -> list[torch.Tensor]:
    if isinstance(flat, _Flat):
        return [t for inner in flat.inner.values() for t in _inner_leaves(inner)]
    return [flat] if isinstance(flat, torch.Tensor) else []


def _rebuild(flat: Any, leaves: Iterator[torch.Tensor]) -> Any:
    if isinstance(flat, _Flat):
        return flat.rebuild({name: _rebuild(inner, leaves) for name, inner in flat.inner.items()})
    return next(leaves) if isinstance(flat, torch.Tensor) else flat


def forward_trace(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.fx.GraphModule, Any, list[Callable[..., Any]]]:
    """The module's forward as ``make_fx`` traces it on fake tensors, parameters and buffers
    lifted to inputs (as the export lifts them); with the outputs, whose autograd graph names
    the backward's Python, and the gradient hooks the forward registered on tensors
    (:class:`~ap_backend._reachable.HookRecorder`: they run only in the backward).

    A tensor subclass parameter or buffer (SimpleFSDP's DTensors) enters as its inner tensors,
    rebuilt into the subclass inside the trace -- as AOTAutograd's export desugars them. Lifted
    whole, the ops the subclass runs on its inner tensors would read them as constants."""
    named_params = list(module.named_parameters(remove_duplicate=False))
    named = [*named_params, *module.named_buffers(remove_duplicate=False)]
    n_params = len(named_params)
    # a tied tensor (GPT-2's embedding and head) enters once and every name of it gets that one
    # input: the trace then shows the tie, and functional_call accepts the names together
    first: dict[int, int] = {}
    index_of = [first.setdefault(id(value), len(first)) for _, value in named]
    uniques = list({id(value): value for _, value in named}.values())
    # plain parameters keep requires_grad (a leaf of the trace each); a subclass's inner
    # tensors enter detached and the rebuilt subclass takes the parameter's requires_grad
    flats = [value if not subclass_key(value) else _Flat(value) for value in uniques]
    leaves = [t for flat in flats for t in _inner_leaves(flat)]
    outputs: list[Any] = []
    recorder = HookRecorder()

    def run(inner: list[torch.Tensor], a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        it = iter(inner)
        rebuilt = [_rebuild(flat, it) for flat in flats]
        values = {name: rebuilt[i] for (name, _), i in zip(named, index_of, strict=True)}
        params = dict(list(values.items())[:n_params])
        buffers = dict(list(values.items())[n_params:])
        with recorder:
            out = torch.func.functional_call(module, (params, buffers), a, k)
        outputs.append(out)
        return out

    inputs = _compat.fake_tree(
        ([t.detach().requires_grad_(t.requires_grad) for t in leaves], args, kwargs),
        _compat.fake_mode_with_shape_env(),
    )
    try:
        with tracing_like_compile():
            gm = _compat.make_fx()(run, tracing_mode="real")(*inputs)
    except Exception as exc:
        raise Unkeyable(f"the forward does not trace on fake tensors: {exc}") from exc
    return gm, outputs[-1] if outputs else None, recorder.hooks


def _autograd_nodes(outputs: Any) -> Iterator[Any]:
    """Every node of the autograd graph behind ``outputs``."""
    stack = [
        t.grad_fn for t in _compat.pytree().tree_leaves(outputs) if isinstance(t, torch.Tensor)
    ]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(fn for fn, _ in node.next_functions)


def backward_code(
    module: nn.Module,
    gm: torch.fx.GraphModule,
    outputs: Any,
    tensor_hooks: Sequence[Callable[..., Any]] = (),
) -> list[str]:
    """What of the backward's Python the key names (see the module docstring): the entry points'
    code by value, the files of everything reachable from them by name, hashed as they are now,
    and the global constants that code reads (:func:`~ap_backend._reachable.reachable`)."""
    files: set[str] = set()
    codes: set[str] = set()
    entries: list[object] = []  # where the Python the backward depends on starts
    for node in _autograd_nodes(outputs):
        cls = getattr(node, "_forward_cls", None)  # a custom autograd.Function's backward node
        if cls is not None:
            codes.add(f"function {cls.__module__}.{cls.__qualname__}")
            codes.add(code_key(cls.backward))
            # the forward and setup_context run in the key's trace, but what they put on ctx
            # (a number the backward multiplies by, a mark_non_differentiable) shows only in
            # the backward: the Python they reach is keyed too
            entries.extend(
                inspect.getattr_static(cls, name)
                for name in ("backward", "forward", "setup_context")
                if hasattr(cls, name)
            )
            path = source_file(cls)
            if path:
                files.add(path)
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, _compat.op_overload_type()):
            continue
        namespace = str(getattr(target, "namespace", ""))
        if namespace in _TORCH_NAMESPACES:
            continue
        opname = str(getattr(target, "_opname", ""))
        for fn in _compat.custom_op_functions(f"{namespace}::{opname}"):
            codes.add(code_key(fn))
            entries.append(fn)
    for name, sub in module.named_modules(remove_duplicate=False):
        for klass in type(sub).__mro__:
            path = source_file(klass)
            if path:
                files.add(path)
        hooks = (*sub._backward_hooks.values(), *sub._backward_pre_hooks.values())
        codes.update(f"{name}: {code_key(h)}" for h in hooks)
        entries.extend(hooks)
    for name, param in module.named_parameters(remove_duplicate=False):
        for hook in (getattr(param, "_backward_hooks", None) or {}).values():
            codes.add(f"{name}: {code_key(hook)}")
            entries.append(hook)
    if _compat.global_module_backward_hooks():
        raise Unkeyable("a global module backward hook is registered")
    # in registration order: the backward runs a tensor's hooks in that order
    ordered = [f"tensor hook {i}: {code_key(h)}" for i, h in enumerate(tensor_hooks)]
    found = reachable([*entries, *tensor_hooks])
    files |= found.files
    digest = hash_sources(files) if files else ""
    constants = [f"constant {c}" for c in sorted(found.constants)]
    return sorted(codes) + ordered + constants + [f"files {sorted(files)} {digest}"]


def _layout(module: nn.Module) -> list[str]:
    """Every submodule's class, every parameter's and buffer's name, metadata and subclass
    context, in registration order (the export's input order)."""
    lines = [
        f"module {name} {type(sub).__module__}.{type(sub).__qualname__} {sub.training}"
        for name, sub in module.named_modules(remove_duplicate=False)
    ]
    for kind, named in (
        ("parameter", module.named_parameters(remove_duplicate=False)),
        ("buffer", module.named_buffers(remove_duplicate=False)),
    ):
        for name, value in named:
            lines.append(
                f"{kind} {name} {tuple(value.shape)} {value.stride()} {value.dtype} "
                f"{value.device.type} {value.requires_grad} {subclass_key(value)!r}"
            )
    return lines


def _config_state() -> str:
    """Inductor's and functorch's portable config (what the first partition's joint passes and
    min-cut read); an address in it (a callable set as an option) cannot be keyed."""
    state = repr(_compat.portable_configs())
    if " at 0x" in state:
        raise Unkeyable("Inductor's or functorch's config holds a callable")
    return state


@dataclass(frozen=True)
class OutputSpec:
    """What a call of the first compilation returns, as metadata: the pytree spec, and per
    leaf either a tensor's ``(shape, stride, dtype, device, requires_grad)`` or a constant.

    Why: Dynamo runs a ``nonstrict_trace``'d callable on fake tensors to learn its outputs
    while it traces the second compilation -- also when AOTAutograd's cache then serves that
    compilation. A deferred first compilation answers that call from this description instead
    of being made for it."""

    spec: Any
    leaves: tuple[Any, ...]

    def fakes(self, fake_mode: Any) -> Any:
        """Fresh outputs of this description in ``fake_mode``; a tensor that requires grad is
        the non-leaf result of an op, as the first compilation's are."""
        out: list[Any] = []
        with fake_mode:
            for leaf in self.leaves:
                if not isinstance(leaf, _TensorLeaf):
                    out.append(leaf)
                    continue
                shape, stride, dtype, device, requires_grad = leaf
                t = torch.empty_strided(
                    shape, stride, dtype=dtype, device=device, requires_grad=requires_grad
                )
                out.append(t.clone() if requires_grad else t)
        return _compat.pytree().tree_unflatten(out, self.spec)


class _TensorLeaf(tuple):  # type: ignore[type-arg]
    """``(shape, stride, dtype, device, requires_grad)`` of one output tensor."""


def describe_outputs(outputs: Any) -> OutputSpec:
    """:class:`OutputSpec` of a forward trace's outputs; :class:`Unkeyable` for a leaf it
    cannot rebuild (a tensor subclass, a view with an offset, an arbitrary object)."""
    leaves, spec = _compat.pytree().tree_flatten(outputs)
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if subclass_key(leaf) or leaf.layout != torch.strided or leaf.storage_offset():
                raise Unkeyable(f"an output {type(leaf).__qualname__} cannot be described")
            described.append(
                _TensorLeaf(
                    (
                        tuple(int(d) for d in leaf.shape),
                        tuple(int(d) for d in leaf.stride()),
                        leaf.dtype,
                        leaf.device,
                        bool(leaf.requires_grad),
                    )
                )
            )
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            described.append(leaf)
        else:
            raise Unkeyable(f"an output of type {type(leaf).__qualname__} cannot be described")
    return OutputSpec(spec, tuple(described))


def program_key(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    signature: CallSignature,
    options: Mapping[str, object],
) -> tuple[str, OutputSpec]:
    """The key of the first compilation ``module(*args, **kwargs)`` would get with
    ``options`` (see the module docstring), and what that compilation returns;
    :class:`Unkeyable` when it has no key."""
    for name, value in options.items():
        if " at 0x" in repr(value):
            raise Unkeyable(f"precompile's {name}={value!r} has no stable description")
    gm, outputs, tensor_hooks = forward_trace(module, args, kwargs)
    returned = describe_outputs(outputs)
    digest = hashlib.sha256()
    digest.update(graphs_digest((gm,)).encode())
    backward = backward_code(module, gm, outputs, tensor_hooks)
    for line in (*backward, *_layout(module), _config_state()):
        digest.update(line.encode() + b"\n")
    key = first_compilation_key(
        digest.hexdigest(),
        _KEY_VERSION,
        signature.modes,
        str(signature.spec),
        signature.leaves,
        sorted(options.items()),
    )
    return key, returned
