"""A small FSDP-style model kit: sharded parameters all-gathered in forward with autograd-aware
functional collectives, LLaMA-style dense blocks and an MoE variant (``layers.*.moe``), with or without expert
parallelism (``ModelConfig(ep=True)``: experts over the ranks, tokens exchanged all-to-all)."""

from ap_backend.models._fsdp import Sharding, gather, shard_param, single_rank_sharding
from ap_backend.models._llama import (
    Attention,
    ExpertParallelMoE,
    ModelConfig,
    MoE,
    RMSNorm,
    ShardedEmbedding,
    ShardedLinear,
    SwiGLU,
    Transformer,
    TransformerBlock,
)

__all__ = [
    "Attention",
    "ExpertParallelMoE",
    "ModelConfig",
    "MoE",
    "RMSNorm",
    "ShardedEmbedding",
    "ShardedLinear",
    "Sharding",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "gather",
    "shard_param",
    "single_rank_sharding",
]
