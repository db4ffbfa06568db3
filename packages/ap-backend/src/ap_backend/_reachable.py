"""The Python a backward can run that the forward trace never shows: the source files reachable
from the backward's entry points, and the gradient hooks a forward registers.

Why: the program key (:mod:`ap_backend._program_key`) lets a restarted job reuse a recorded
first compilation, and on a warm cache nothing of that compilation is made again -- so a key
that misses a change trains the old graph with no error. The forward is covered exactly by its
trace. The backward's Python is not in that trace: a custom ``autograd.Function``'s
``backward``, a hook. Its own file is not enough either: a backward that calls
``helpers.scale(grad)`` runs ``helpers.py``, which an edit can change while every file the key
named stays the same. So the key takes every file reachable from those entry points (and from
a custom function's ``forward`` and ``setup_context``, whose effects on ``ctx`` show only in
the backward) by the names their code reads:

* a function's global names (its nested code's too), resolved in its ``__globals__``;
* of a module or class so found, the members the same code names (``helpers.scale``);
* closure cells, ``functools.partial``'s function, a bound or static method's function;

and from each function found, the same again. torch's files are left out (its version is in
the key), and so is the standard library (the interpreter's). The constants those functions
read from global names and closure cells (numbers, strings, dtypes, enums, and tuples, lists,
sets and dicts of them) are written into the key by value: a hook's ``grad * FACTOR`` is
traced into the backward with the number in it. What stays outside: other values read at run
time (an object's attributes, a tensor a hook closes over, a function saved on ``ctx``), which
no name resolution pins down; ``precompile(..., first_compilation_cache=False)`` is for such
code.

The hooks a forward registers on its intermediate tensors (``Tensor.register_hook``) run in
the backward and are traced into it, yet the forward's trace has no trace of them:
:class:`HookRecorder` notes each one while the key's forward trace runs.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import os
import sysconfig
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ap_backend._aot_cache import Unkeyable

__all__ = [
    "HookRecorder",
    "Reachable",
    "code_key",
    "constant_repr",
    "hash_sources",
    "reachable",
    "source_file",
]

#: How many functions, classes and modules one walk may visit before the key gives up: past
#: it, the backward reaches into a library this key would hash file by file (``Unkeyable``,
#: and ``precompile`` compiles as it always did).
MAX_VISITED = 5000


@functools.cache
def _versioned_dirs() -> tuple[str, tuple[str, ...]]:
    """torch's directory, and the standard library's: code that comes with a version."""
    torch_dir = os.path.dirname(os.path.abspath(str(torch.__file__))) + os.sep
    paths = sysconfig.get_paths()
    stdlib = {
        os.path.abspath(paths[name]) + os.sep for name in ("stdlib", "platstdlib") if name in paths
    }
    return torch_dir, tuple(sorted(stdlib))


def source_file(obj: object) -> str | None:
    """The source file defining ``obj``, or None for torch's, the standard library's and
    anything without one (a builtin, an instance)."""
    try:
        path = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except (TypeError, OSError):
        return None
    if path is None:
        return None
    path = os.path.abspath(path)
    torch_dir, stdlib = _versioned_dirs()
    if path.startswith(torch_dir):
        return None
    # an interpreter's own site-packages lies inside its standard library's directory
    third_party = (
        f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path
    )
    if path.startswith(stdlib) and not third_party:
        return None
    return path


def _function(obj: object) -> object:
    """The function behind a bound, static or class method, a ``functools.partial`` or a
    decorated function (``__wrapped__``)."""
    for _ in range(100):  # a chain of wrappers, never a cycle
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            obj = obj.__func__
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.FunctionType) and hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        else:
            return obj
    return obj


def _names(code: types.CodeType) -> set[str]:
    """Every global and attribute name ``code`` and its nested code read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _members(owner: object, names: Iterable[str]) -> Iterator[object]:
    """The members of a module or class that ``names`` name, read without running a
    descriptor or a module's ``__getattr__``."""
    for name in names:
        if isinstance(owner, types.ModuleType):
            value = owner.__dict__.get(name)
        else:
            value = inspect.getattr_static(owner, name, None)
        if value is not None:
            yield value


#: Values the key writes down by ``repr``: immutable, and their ``repr`` is their value.
_SCALARS: tuple[type, ...] = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def constant_repr(value: object, depth: int = 0) -> str | None:
    """``value`` written down, when it is a constant: a scalar of :data:`_SCALARS`, or a
    tuple, list, set or dict of constants (sets and dicts in sorted order, so that string
    hashing does not reorder them from one process to the next); None for anything else."""
    if depth > 8:
        return None
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [constant_repr(v, depth + 1) for v in value]
        if any(item is None for item in items):
            return None
        return f"{type(value).__name__}({', '.join(str(i) for i in items)})"
    if isinstance(value, (set, frozenset)):
        members = [constant_repr(v, depth + 1) for v in value]
        if any(m is None for m in members):
            return None
        return f"{type(value).__name__}({', '.join(sorted(str(m) for m in members))})"
    if isinstance(value, dict):
        pairs = [
            (constant_repr(k, depth + 1), constant_repr(v, depth + 1)) for k, v in value.items()
        ]
        if any(k is None or v is None for k, v in pairs):
            return None
        return f"dict({', '.join(sorted(f'{k}: {v}' for k, v in pairs))})"
    return None


@dataclass(frozen=True)
class Reachable:
    """What :func:`reachable` found: source files, and the constants the walked functions read
    from global names and closure cells (``"<file or module>:<name>=<repr>"``, see
    :func:`constant_repr`: a module-level ``FACTOR = 3.0`` that a hook multiplies by is traced
    into the backward as a number)."""

    files: frozenset[str]
    constants: frozenset[str]


def reachable(roots: Iterable[object]) -> Reachable:
    """The source files (see :func:`source_file`) of every function, class and module reachable
    from ``roots`` (see the module docstring), and the global constants those functions read;
    :class:`Unkeyable` past :data:`MAX_VISITED`.

    A root's own closure cells are followed wherever it is defined (a torch helper such as
    ``register_multi_grad_hook`` wraps the user's function in one); below the roots, torch's and
    the standard library's functions are not walked."""
    files: set[str] = set()
    constants: set[str] = set()
    seen: set[int] = set()
    keep: list[object] = []  # what ``seen`` holds ids of stays alive for the walk
    stack: list[tuple[object, bool]] = [(root, True) for root in roots]
    while stack:
        obj, is_root = stack.pop()
        obj = _function(obj)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        keep.append(obj)
        if len(seen) > MAX_VISITED:
            raise Unkeyable(
                f"the backward's Python reaches more than {MAX_VISITED} functions, classes "
                "and modules"
            )
        path = source_file(obj)
        if path is not None:
            files.add(path)
        if not isinstance(obj, types.FunctionType) or (path is None and not is_root):
            continue  # below the roots, torch's and the standard library's code is not walked
        where = f"{path or obj.__globals__.get('__name__')}:{obj.__qualname__}"
        for cell_name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            written = constant_repr(content)
            if written is not None:
                constants.add(f"{where}:{cell_name}={written}")
            else:
                stack.append((content, False))
        names = _names(obj.__code__)
        for name in sorted(names):
            if name not in obj.__globals__:
                continue  # an attribute's name, a builtin
            value = obj.__globals__[name]
            written = constant_repr(value)
            if written is not None:
                constants.add(f"{where}:{name}={written}")
            elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
                stack.append((value, False))
            elif isinstance(value, (types.ModuleType, type)):
                stack.append((value, False))
                stack.extend((member, False) for member in _members(value, sorted(names)))
    return Reachable(frozenset(files), frozenset(constants))


def hash_sources(paths: Iterable[str]) -> str:
    """Hash of the files' paths and contents, read now (no cache: an edit between two keys of
    one process shows)."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()


def code_key(fn: Callable[..., Any]) -> str:
    """A callable's code, by value (bytecode, constants, names, nested code) and file."""
    target = inspect.unwrap(_function(fn))  # type: ignore[arg-type]
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType):
        raise Unkeyable(f"backward hook {fn!r} has no Python code to key")

    def walk(c: types.CodeType) -> Iterator[str]:
        yield c.co_qualname if hasattr(c, "co_qualname") else c.co_name
        yield c.co_code.hex()
        yield repr(c.co_names)
        for const in c.co_consts:
            yield from walk(const) if isinstance(const, types.CodeType) else (repr(const),)

    return f"{source_file(target)}:" + hashlib.sha256("\n".join(walk(code)).encode()).hexdigest()


class HookRecorder(TorchFunctionMode):
    """Notes the gradient hooks registered on tensors while it is active, in order
    (``hooks``). Only ``Tensor.register_hook`` is looked at; every call runs as it would."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: list[Callable[..., Any]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.register_hook:
            hook = args[1] if len(args) > 1 else (kwargs or {}).get("hook")
            if hook is not None:
                self.hooks.append(hook)
        return func(*args, **(kwargs or {}))
