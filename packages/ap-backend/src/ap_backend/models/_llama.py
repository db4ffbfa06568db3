"""A small LLaMA-style transformer whose every parameter is FSDP-sharded (see ``_fsdp``).

Sized for CPU: the point is the graph structure (one all-gather chain per parameter, a
forward that the backward partially recomputes), not the arithmetic. Parameters are
initialised from a seed on every rank identically and then sharded, so the eager model, the
compiled model and every rank agree on the full weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from ap_tags.checks import require_bool, require_instance, require_int
from torch import nn

from ap_backend import _compat
from ap_backend.models._fsdp import Sharding, gather, shard_param


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the demo model. Every dim-0 size must divide by the world size (8 covers the
    fake-PG tests and 2 the gloo runs)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    vocab: int = 128
    seq_len: int = 16
    batch: int = 2
    attention: Literal["sdpa", "matmul"] = "sdpa"
    moe: bool = False
    #: expert parallelism (needs ``moe``): each rank holds ``n_experts / world`` whole experts
    #: and the MoE exchanges tokens with ``all_to_all_single`` (:class:`ExpertParallelMoE`)
    ep: bool = False
    n_experts: int = 8
    top_k: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        where = "ModelConfig"
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab", "seq_len", "batch"):
            require_int(getattr(self, name), where=where, arg=name, minimum=1)
        for name in ("n_experts", "top_k", "seed"):
            require_int(getattr(self, name), where=where, arg=name)
        require_bool(self.moe, where=where, arg="moe")
        require_bool(self.ep, where=where, arg="ep")
        require_instance(self.attention, str, where=where, arg="attention", expected="a str")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelConfig: n_heads {self.n_heads} must divide dim {self.dim}")
        if self.attention not in ("sdpa", "matmul"):
            raise ValueError(
                f"ModelConfig: attention must be 'sdpa' or 'matmul', got {self.attention!r}"
            )
        if self.ep and not self.moe:
            raise ValueError("ModelConfig: ep=True needs moe=True (it shards the MoE's experts)")
        if self.moe and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"ModelConfig: top_k {self.top_k} must be between 1 and n_experts {self.n_experts}"
            )

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def _init(shape: tuple[int, ...], fan_in: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


class ShardedLinear(nn.Module):
    """``y = x @ W.T`` with ``W`` (out, in) sharded on ``out``."""

    def __init__(self, d_in: int, d_out: int, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        self.sharding = sharding
        self.weight = shard_param(_init((d_out, d_in), d_in, gen), sharding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = gather(self.weight, self.sharding)
        return F.linear(x.to(w.dtype), w)


class ShardedEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        self.sharding = sharding
        self.weight = shard_param(torch.randn((vocab, dim), generator=gen), sharding)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, gather(self.weight, self.sharding))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, sharding: Sharding, eps: float = 1e-6) -> None:
        super().__init__()
        self.sharding = sharding
        self.eps = eps
        self.weight = shard_param(torch.ones(dim), sharding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = gather(self.weight, self.sharding)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(w.dtype) * w


class Attention(nn.Module):
    """Causal multi-head attention: ``F.scaled_dot_product_attention`` or the explicit
    matmul-softmax-matmul form (whose intermediates give the partitioners more to decide)."""

    def __init__(self, cfg: ModelConfig, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.kind = cfg.attention
        self.wq = ShardedLinear(cfg.dim, cfg.dim, sharding, gen)
        self.wk = ShardedLinear(cfg.dim, cfg.dim, sharding, gen)
        self.wv = ShardedLinear(cfg.dim, cfg.dim, sharding, gen)
        self.wo = ShardedLinear(cfg.dim, cfg.dim, sharding, gen)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (matmul form only): a (seq, seq) bool causal mask, built once per model
        forward so every layer shares one tensor (the partitions then agree on it)."""
        b, s, d = x.shape
        hd = d // self.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, hd).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        if self.kind == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            if mask is None:
                mask = causal_mask(s, x.device)
            scores = scores.masked_fill(mask, float("-inf"))
            o = scores.softmax(-1) @ v
        out: torch.Tensor = self.wo(o.transpose(1, 2).reshape(b, s, d))
        return out


def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal: the positions a query may not attend to."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        self.w1 = ShardedLinear(cfg.dim, cfg.ffn_dim, sharding, gen)
        self.w3 = ShardedLinear(cfg.dim, cfg.ffn_dim, sharding, gen)
        self.w2 = ShardedLinear(cfg.ffn_dim, cfg.dim, sharding, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class MoE(nn.Module):
    """Top-k routed experts, computed densely per token so the region is token-parallel (every
    output row depends only on its own input row): that is what lets ap-epchunk split it along
    the token dimension. Expert weights are stored flattened (E*ffn, dim) so they shard on dim 0
    like every other parameter and are viewed back to (E, ffn, dim) after the all-gather."""

    def __init__(self, cfg: ModelConfig, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        self.sharding = sharding
        self.n_experts, self.top_k, self.ffn = cfg.n_experts, cfg.top_k, cfg.ffn_dim
        self.router = ShardedLinear(cfg.dim, cfg.n_experts, sharding, gen)
        e, f, d = cfg.n_experts, cfg.ffn_dim, cfg.dim
        self.w1 = shard_param(_init((e * f, d), d, gen), sharding)
        self.w3 = shard_param(_init((e * f, d), d, gen), sharding)
        self.w2 = shard_param(_init((e * d, f), f, gen), sharding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is (tokens, dim)."""
        e, f = self.n_experts, self.ffn
        t, d = x.shape
        probs = self.router(x).float().softmax(-1)
        # Top-k gates without zeros/scatter: the threshold keeps every op derived from x, so
        # a static-shape chunk probe sees the token dim flow through (no literal shapes).
        kth = probs.topk(self.top_k, dim=-1).values[:, -1:]
        kept = probs * (probs >= kth).to(probs.dtype)
        gates = kept / kept.sum(-1, keepdim=True)
        w1 = gather(self.w1, self.sharding).view(e, f, d)
        w3 = gather(self.w3, self.sharding).view(e, f, d)
        w2 = gather(self.w2, self.sharding).view(e, d, f)
        xe = x.to(w1.dtype).unsqueeze(0).expand(e, t, d)
        h = F.silu(torch.bmm(xe, w1.transpose(1, 2))) * torch.bmm(xe, w3.transpose(1, 2))
        y = torch.bmm(h, w2.transpose(1, 2))  # (E, T, D)
        out: torch.Tensor = (y * gates.t().unsqueeze(-1).to(y.dtype)).sum(0)
        return out


class ExpertParallelMoE(nn.Module):
    """Top-k routed experts with real expert parallelism over the sharding's group, the token
    exchange of torchtitan's ``AllToAllTokenDispatcher`` (torch + functional collectives only):

    1. route: softmax router (FSDP-sharded like every dense parameter), top-k, gates
       renormalised over the k chosen experts; per-expert token counts of this rank;
    2. reorder this rank's (token, expert) pairs by expert (stable ``argsort``);
    3. ``all_to_all_single`` of the per-expert counts, then ``.tolist()`` of the input and
       output split sizes (data-dependent: unbacked symbols when traced);
    4. dispatch ``all_to_all_single`` with those uneven splits, then permute the received rows
       from rank-major to local-expert-major;
    5. the local experts' SwiGLU as three grouped matmuls (``torch._grouped_mm``);
    6. unpermute, combine ``all_to_all_single`` (splits swapped), scale by the gates and
       ``scatter_add`` back onto the tokens.

    Each rank holds experts ``rank * e .. (rank + 1) * e - 1`` (``e = n_experts / world``) as
    whole (e, ffn, dim) / (e, dim, ffn) parameters, not FSDP-sharded: their gradients come back
    through the exchange's backward (two more all-to-alls). The full expert weights are drawn
    from the seed exactly as :class:`MoE` draws them, so the other parameters initialise alike.
    A world of 1 holds every expert and exchanges nothing."""

    def __init__(self, cfg: ModelConfig, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        world = sharding.world_size
        if cfg.n_experts % world != 0:
            raise ValueError(
                f"ExpertParallelMoE: n_experts {cfg.n_experts} does not divide by the world "
                f"size {world} (each rank holds n_experts / world experts)"
            )
        _compat.require_grouped_mm()
        self.sharding = sharding
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = ShardedLinear(cfg.dim, cfg.n_experts, sharding, gen)
        e, f, d = cfg.n_experts, cfg.ffn_dim, cfg.dim
        local = slice(sharding.rank * (e // world), (sharding.rank + 1) * (e // world))
        self.w1 = nn.Parameter(_init((e * f, d), d, gen).view(e, f, d)[local].clone())
        self.w3 = nn.Parameter(_init((e * f, d), d, gen).view(e, f, d)[local].clone())
        self.w2 = nn.Parameter(_init((e * d, f), f, gen).view(e, d, f)[local].clone())

    def _exchange(
        self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        sh = self.sharding
        return _compat.all_to_all_wait(x, output_splits, input_splits, sh.group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is (tokens, dim)."""
        world, k = self.sharding.world_size, self.top_k
        dim = x.shape[1]
        scores = self.router(x).float().softmax(-1)
        top_scores, top_ids = scores.topk(k, dim=-1)
        top_scores = top_scores / top_scores.sum(-1, keepdim=True)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, top_ids, True)
        counts = routing_map.sum(0)  # this rank's tokens per expert, (E,)
        order = torch.argsort(top_ids.view(-1), stable=True)
        sorted_scores = top_scores.view(-1)[order]
        token_idx = order // k
        routed = x[token_idx].to(self.w1.dtype)  # (T*k, D), expert-major
        permuted: torch.Tensor | None = None
        if world == 1:
            local_counts = counts
        else:
            with torch.no_grad():
                ones = [1] * world
                received = self._exchange(counts.view(world, -1), ones, ones).reshape(-1)
                input_splits: list[int] = counts.view(world, -1).sum(1).tolist()
                output_splits: list[int] = received.view(world, -1).sum(1).tolist()
            routed = self._exchange(routed, output_splits, input_splits)
            permuted, local_counts = _rank_major_to_expert_major(received, world, routed.shape[0])
            routed = routed[permuted]
        offs = torch.cumsum(local_counts, dim=0, dtype=torch.int32)
        h = F.silu(_compat.grouped_mm(routed, self.w1.transpose(-2, -1), offs))
        h = h * _compat.grouped_mm(routed, self.w3.transpose(-2, -1), offs)
        y = _compat.grouped_mm(h, self.w2.transpose(-2, -1), offs)
        if permuted is not None:
            unpermuted = y.new_empty(y.shape)
            unpermuted[permuted, :] = y
            y = self._exchange(unpermuted, input_splits, output_splits)
        y = y.float() * sorted_scores.reshape(-1, 1)
        index = token_idx.reshape(-1, 1).expand(-1, dim)
        out: torch.Tensor = torch.zeros_like(x).scatter_add(0, index, y.to(x.dtype))
        return out


def _rank_major_to_expert_major(
    received: torch.Tensor, world: int, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's ``AllToAllTokenDispatcher._permute``: ``received`` (world * e,) holds, for
    each source rank, how many of its tokens each local expert gets (rank-major rows after the
    dispatch); returns the row order that groups them by local expert, and the per-local-expert
    totals."""
    e = received.shape[0] // world
    t_mat = received.view(world, e)
    input_starts = (received.cumsum(0) - received).view(world, e).t().reshape(-1)
    segment_lens = t_mat.t().reshape(-1)
    seg_ids = torch.arange(segment_lens.shape[0], device=received.device).repeat_interleave(
        segment_lens, output_size=total
    )
    output_starts = segment_lens.cumsum(0) - segment_lens
    permuted = (
        input_starts[seg_ids]
        + torch.arange(seg_ids.shape[0], device=received.device)
        - output_starts[seg_ids]
    )
    return permuted, t_mat.sum(0)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, sharding: Sharding, gen: torch.Generator) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, sharding)
        self.attention = Attention(cfg, sharding, gen)
        self.ffn_norm = RMSNorm(cfg.dim, sharding)
        moe = ExpertParallelMoE if cfg.ep else MoE
        self.moe: nn.Module | None = moe(cfg, sharding, gen) if cfg.moe else None
        self.feed_forward: nn.Module | None = None if cfg.moe else SwiGLU(cfg, sharding, gen)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        attended: torch.Tensor = self.attention(self.attention_norm(x), mask)
        h = x + attended
        normed: torch.Tensor = self.ffn_norm(h)
        if self.moe is not None:
            b, s, d = normed.shape
            routed: torch.Tensor = self.moe(normed.reshape(b * s, d))
            return h + routed.view(b, s, d)
        assert self.feed_forward is not None
        dense: torch.Tensor = self.feed_forward(normed)
        return h + dense


class Transformer(nn.Module):
    """``forward(tokens, targets)`` returns the mean cross-entropy loss (fp32); without targets
    it returns the logits."""

    def __init__(self, cfg: ModelConfig, sharding: Sharding) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.tok_embeddings = ShardedEmbedding(cfg.vocab, cfg.dim, sharding, gen)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, sharding, gen) for _ in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, sharding)
        self.output = ShardedLinear(cfg.dim, cfg.vocab, sharding, gen)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        mask = (
            causal_mask(tokens.shape[1], tokens.device) if self.cfg.attention == "matmul" else None
        )
        for layer in self.layers:
            h = layer(h, mask)
        logits: torch.Tensor = self.output(self.norm(h)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def example_batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic per-(step, rank) tokens and next-token targets."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(1000 * step + rank + 1)
        seq = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
