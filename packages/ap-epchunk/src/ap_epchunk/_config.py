"""What to chunk (``ChunkConfig``) and what was done (``ChunkReport``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkConfig:
    """Options of :func:`ap_epchunk.chunk_pass`.

    * ``module_patterns``: fnmatch patterns matched against the leading components of each
      node's module FQN; ``"layers.*.moe"`` selects the roots ``layers.0.moe``,
      ``layers.1.moe``, ... and every node traced inside them (forward and backward).
    * ``dim``: the token dimension of the chunk inputs (``chunk_inputs`` or marked inputs).
    * ``num_chunks``: N >= 2 equal chunks; the chunk extent must be divisible by N.
    * ``early_grad_accumulation``: sum parameter-gradient partials (and cat backward values)
      as early as possible, before views and grad communication, and replay that suffix once.
      Off: materialize exactly where the value escapes, which is bitwise equal to
      :class:`ap_epchunk.EagerChunked`.
    * ``chunk_inputs``: placeholder names whose ``dim`` carries tokens when the graph has
      static sizes. Empty: the chunk dims are the hinted unbacked symbols of the placeholders
      (``mark_chunk_dim(..., hint=N)`` before tracing).
    """

    module_patterns: tuple[str, ...] = ()
    dim: int = 0
    num_chunks: int = 2
    early_grad_accumulation: bool = True
    chunk_inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        patterns = self.module_patterns
        if isinstance(patterns, str):
            patterns = (patterns,)
        if not isinstance(patterns, Sequence) or not patterns:
            raise ValueError(
                f"ChunkConfig.module_patterns must be a non-empty sequence of str, got {patterns!r}"
            )
        if not all(isinstance(p, str) and p.strip() for p in patterns):
            raise ValueError(f"ChunkConfig.module_patterns must hold non-empty str: {patterns!r}")
        object.__setattr__(self, "module_patterns", tuple(patterns))
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"ChunkConfig.dim must be an int >= 0, got {self.dim!r}")
        n = self.num_chunks
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"ChunkConfig.num_chunks must be an int >= 2, got {n!r}")
        if not isinstance(self.early_grad_accumulation, bool):
            raise ValueError(
                "ChunkConfig.early_grad_accumulation must be a bool, "
                f"got {self.early_grad_accumulation!r}"
            )
        inputs = self.chunk_inputs
        if isinstance(inputs, str):
            inputs = (inputs,)
        if not isinstance(inputs, Sequence):
            raise ValueError(
                f"ChunkConfig.chunk_inputs must be a sequence of placeholder names, got {inputs!r}"
            )
        if not all(isinstance(i, str) and i for i in inputs):
            raise ValueError(f"ChunkConfig.chunk_inputs must hold placeholder names: {inputs!r}")
        object.__setattr__(self, "chunk_inputs", tuple(inputs))

    def replace(self, **changes: object) -> ChunkConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RegionSummary:
    """One chunked region: its root FQN, direction and how many nodes each chunk runs."""

    root: str
    backward: bool
    body_nodes: int


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
