"""What to chunk (``ChunkConfig``) and what was done (``ChunkReport``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from ap_tags.checks import require_bool, require_instance, require_int

_WHERE = "ChunkConfig"


def _names(value: object, arg: str, what: str) -> tuple[str, ...]:
    """A str (one name) or a sequence of non-empty str, as a tuple.

    A wrong type (not a sequence, or an item that is not a str) raises ``TypeError``; an empty
    or blank name raises ``ValueError``.
    """
    if isinstance(value, str):
        value = (value,)
    expected = f"a sequence of str ({what})"
    items = require_instance(value, Sequence, where=_WHERE, arg=arg, expected=expected)
    names = tuple(require_instance(v, str, where=_WHERE, arg=arg, expected=expected) for v in items)
    blank = [n for n in names if not n.strip()]
    if blank:
        raise ValueError(f"{_WHERE}: {arg} must hold non-empty str, got {names!r}")
    return names


@dataclass(frozen=True)
class ChunkConfig:
    """Options of :func:`ap_epchunk.chunk_pass`.

    * ``module_patterns``: fnmatch patterns matched against the leading components of each
      node's module FQN; ``"layers.*.moe"`` selects the roots ``layers.0.moe``,
      ``layers.1.moe``, ... and every node traced inside them (forward and backward).
    * ``dim``: the token dimension of the chunk inputs (``chunk_inputs`` or marked inputs); with
      hinted unbacked inputs that carry several symbols (batch and width), the symbol at this
      dim is the chunk symbol.
    * ``num_chunks``: N >= 2 equal chunks; the chunk extent must be divisible by N.
    * ``early_grad_accumulation``: sum parameter-gradient partials (and cat backward values)
      as early as possible, before views and grad communication, and replay that suffix once.
      Off: materialize exactly where the value escapes, which is bitwise equal to
      :class:`ap_epchunk.EagerChunked`.
    * ``chunk_inputs``: placeholder names whose ``dim`` carries tokens when the graph has
      static sizes. Empty: the chunk dims are the hinted unbacked symbols of the placeholders
      (``mark_chunk_dim(..., hint=N)`` before tracing).
    * ``schedule_overlap``: read by ``ap_backend.autoparallel_backend(ep_chunk=...)``: after
      chunking, run :func:`ap_epchunk.schedule_chunk_overlap` (pipeline the chunks so one
      chunk's token exchange runs under another chunk's compute). On by default: chunking
      exists for that overlap, and the schedule never changes a value. ``chunk_pass`` itself
      never schedules.
    * ``exchange_lane``: read by the backend too: move the chunked exchanges that share a
      process group with another collective (FSDP all-gathers, reduce-scatters) onto a group
      of their own with the same ranks (:func:`ap_epchunk.exchange_lane`), so a parameter
      all-gather never queues behind a token exchange. On by default (same ranks, same values).
    * ``place_fsdp_collectives``: read by the backend with ``schedule_overlap``: before
      pipelining, move the FSDP all-gathers / reduce-scatters in flight inside a chunked
      region's span to the dense stretch around it, so they never compete with its exchanges
      (``schedule_chunk_overlap(place_fsdp_collectives=...)``; reported per region as
      ``fsdp_moved`` / ``fsdp_left``). On by default: it only reorders along dependencies.
    """

    module_patterns: tuple[str, ...] = ()
    dim: int = 0
    num_chunks: int = 2
    early_grad_accumulation: bool = True
    chunk_inputs: tuple[str, ...] = ()
    schedule_overlap: bool = True
    exchange_lane: bool = True
    place_fsdp_collectives: bool = True

    def __post_init__(self) -> None:
        patterns = _names(self.module_patterns, "module_patterns", "fnmatch patterns")
        if not patterns:
            raise ValueError(f"{_WHERE}: module_patterns must not be empty, got {patterns!r}")
        object.__setattr__(self, "module_patterns", patterns)
        require_int(self.dim, where=_WHERE, arg="dim", minimum=0)
        require_int(self.num_chunks, where=_WHERE, arg="num_chunks", minimum=2)
        require_bool(self.early_grad_accumulation, where=_WHERE, arg="early_grad_accumulation")
        require_bool(self.schedule_overlap, where=_WHERE, arg="schedule_overlap")
        require_bool(self.exchange_lane, where=_WHERE, arg="exchange_lane")
        require_bool(self.place_fsdp_collectives, where=_WHERE, arg="place_fsdp_collectives")
        object.__setattr__(
            self, "chunk_inputs", _names(self.chunk_inputs, "chunk_inputs", "placeholder names")
        )

    def replace(self, **changes: object) -> ChunkConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RegionSummary:
    """One chunked region: its root FQN, direction and how many nodes each chunk runs;
    ``all_to_alls``: the token exchanges (``all_to_all_single``) in the body, each now run once
    per chunk; ``whole_collectives``: the region's other collectives, each run once on the full
    value, with why (``"all_gather_into_tensor: ..."``)."""

    root: str
    backward: bool
    body_nodes: int
    all_to_alls: int = 0
    whole_collectives: list[str] = field(default_factory=list)


@dataclass
class ChunkReport:
    """What :func:`ap_epchunk.chunk_pass` did to the graph."""

    num_chunks: int
    mode: str  # "symbolic" (hinted unbacked chunk dims) or "static"
    regions: list[RegionSummary] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    split_live_ins: list[str] = field(default_factory=list)
    routed_live_ins: int = 0
    concatenated: list[str] = field(default_factory=list)
    summed: list[str] = field(default_factory=list)
    mutation_chains: list[str] = field(default_factory=list)
    chunk_symbols: dict[str, int] = field(default_factory=dict)
    #: raw SymInt arguments the pass divided and computed by FX nodes (``sym_size(x, 0) // N``)
    lifted_symints: int = 0
