"""What a compile really raised: Dynamo wraps a backend's exception before it reaches the caller.

``torch._dynamo.exc.BackendCompilerFailed`` is raised ``from None`` and keeps the backend's
error as ``inner_exception``; other layers chain it as ``__cause__`` / ``__context__``. A test
that expects, say, ``ap_partitioner.BudgetError`` or ``ap_epchunk.ChunkError`` from
``torch.compile`` has to look through all three.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


def raised(exc: BaseException, kind: type[E] | tuple[type[E], ...]) -> E | None:
    """``exc`` or the first exception it wraps (``inner_exception``, ``__cause__``,
    ``__context__``, depth first) that is a ``kind`` (a class or a tuple of them); ``None`` when there is none."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        todo += [e.__context__, e.__cause__, getattr(e, "inner_exception", None)]
    return None
