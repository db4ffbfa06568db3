"""torchtitan 0.3.0 decoder models, built with torchtitan's own config builders at tiny sizes.

Each builder mirrors the flavour's ``debugmodel`` config function (same layer builders, same
initialisers, same RoPE flavour and MoE router settings) with the sizes shrunk. Two changes
every builder makes, both recommended in ``/work/shared/reference/real_models.md``:

* torchtitan refuses ``attn_backend="sdpa"`` for language models and its flex backend wraps a
  nested ``torch.compile``; each layer's ``inner_attention`` is therefore torchtitan's own
  ``ScaledDotProductAttention`` module (causal, no masks), set on the config before building;
* the RoPE cache is built for the sequence length instead of 4096-131072 positions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from zoo.models._base import SEQ, VOCAB, ZooModel, cross_entropy_logits, token_batches

__all__ = [
    "deepseek_v3",
    "deepseek_v3_config",
    "llama3",
    "llama3_8b",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe_config",
]

LIBRARY = "torchtitan 0.3.0"
_NOTES = [
    "inner attention: torchtitan ScaledDotProductAttention (causal) on the config",
    f"RoPE cache shrunk to {SEQ} positions",
]


def _cpu_attention(layers: list[Any], seq: int = SEQ) -> None:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        att = layer.attention
        att.inner_attention = ScaledDotProductAttention.Config()
        att.rope = dataclasses.replace(att.rope, max_seq_len=seq)


def _finish(
    name: str,
    config: str,
    cfg: Any,
    steps: int,
    *,
    bf16: bool = False,
    seq: int = SEQ,
    parallelize: Callable[[Any], None] | None = None,
    configure: Callable[[Any], None] | None = None,
) -> ZooModel:
    """Build ``cfg`` (CPU attention, seed 0, torchtitan's own ``init_states``) as a zoo model;
    ``configure(cfg)`` runs after the CPU attention is set and before the build (a sharding
    config then reaches the inner attention too); ``parallelize(model)`` runs after the
    initialisation (same values on every rank)."""
    _cpu_attention(cfg.layers, seq)
    if configure is not None:
        configure(cfg)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    if parallelize is not None:
        parallelize(model)
    model.train()
    return ZooModel(
        name=name,
        library=LIBRARY,
        config=config,
        module=model,
        batches=list(token_batches(steps, seq=seq)),
        n_model_inputs=1,
        loss_fn=cross_entropy_logits,
        bf16=bf16,
        notes=list(_NOTES),
    )


def _ends(tt: Any, dim: int, vocab: int = VOCAB) -> dict[str, Any]:
    """The token embedding, final RMSNorm and LM head of a torchtitan decoder config, with the
    model module's (``tt``) own initialisers: the part Llama3 and DeepSeek-V3 share."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return {
        "tok_embeddings": Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT
        ),
        "norm": RMSNorm.Config(normalized_shape=dim, param_init=tt._NORM_INIT),
        "lm_head": Linear.Config(
            in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)
        ),
    }


def llama3(
    steps: int, *, n_layers: int = 2, dim: int = 64, seq: int = SEQ, tp_plan: bool = False
) -> ZooModel:
    """Llama3 ``debugmodel`` shape (fused QKV, complex RoPE with llama scaling), 2 layers
    (``n_layers``/``dim``/``seq`` scale it: the benchmarks' real-model section). ``tp_plan``:
    torchtitan's own Llama3 sharding config (``set_llama3_sharding_config``, no sequence
    parallelism) is set on the config, so ``model.parallelize(parallel_dims)`` applies its
    tensor-parallel plan (``zoo.meshes``); without a TP mesh it changes nothing."""
    import torchtitan.models.llama3 as tt
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim

    n_heads = 4
    cfg = tt.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        **_ends(tt, dim),
        layers=tt._build_llama3_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(
                dim=dim // n_heads, max_seq_len=seq, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )
    configure: Callable[[Any], None] | None = None
    if tp_plan:
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        configure = functools.partial(set_llama3_sharding_config, enable_sp=False)
    return _finish(
        "tt_llama3",
        f"debugmodel shape: dim {dim}, 4 heads, {n_layers} layers, vocab {VOCAB}",
        cfg,
        steps,
        seq=seq,
        configure=configure,
    )


def qwen3(steps: int) -> ZooModel:
    """Qwen3 ``debugmodel`` shape (GQA, qk-norm, cos/sin RoPE, tied embeddings), 2 layers."""
    import torchtitan.models.qwen3 as tt
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, head_dim = 64, 16
    cfg = tt.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=tt._qwen3_norm(dim),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=tt._EMBEDDING_SKIP_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=tt._LINEAR_INIT),
        layers=tt._build_qwen3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            hidden_dim=192,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
        ),
    )
    return _finish(
        "tt_qwen3",
        f"debugmodel shape: dim {dim}, 4 q / 2 kv heads, tied, 2 layers, vocab {VOCAB}",
        cfg,
        steps,
    )


def qwen3_moe_config(*, n_layers: int = 2, dim: int = 64, seq: int = SEQ) -> Any:
    """The ``tt_qwen3_moe`` config (``Qwen3Model.Config``), not yet built."""
    import torchtitan.models.qwen3 as tt
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    head_dim = 16
    return tt.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=tt._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=tt._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=tt._LINEAR_INIT),
        layers=tt._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            moe_hidden_dim=dim // 2,
            num_experts=8,
            top_k=2,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )


def qwen3_moe(
    steps: int, *, n_layers: int = 2, dim: int = 64, seq: int = SEQ, tp_plan: bool = False
) -> ZooModel:
    """Qwen3 ``debugmodel_moe`` shape (softmax top-k router, grouped bf16 experts), 2 layers
    (``n_layers``/``dim``/``seq`` scale it: the benchmarks' real-model section). ``tp_plan``:
    torchtitan's own Qwen3 sharding config (``set_qwen3_sharding_config``, no sequence or
    expert parallelism) is set on the config, so ``model.parallelize(parallel_dims)`` applies
    its tensor-parallel plan (``zoo.meshes``); without a TP mesh it changes nothing."""
    configure: Callable[[Any], None] | None = None
    if tp_plan:
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        configure = functools.partial(set_qwen3_sharding_config, enable_sp=False, enable_ep=False)
    return _finish(
        "tt_qwen3_moe",
        f"debugmodel_moe shape: dim {dim}, 8 experts top-2, {n_layers} layers, vocab {VOCAB}",
        qwen3_moe_config(n_layers=n_layers, dim=dim, seq=seq),
        steps,
        bf16=True,
        seq=seq,
        configure=configure,
    )


def deepseek_v3_config() -> Any:
    """The ``tt_deepseek_v3`` config (``DeepSeekV3Model.Config``), not yet built."""
    import torchtitan.models.deepseek_v3 as tt
    from torchtitan.models.common import ComplexRoPE

    dim, rope_dim = 64, 8
    layers = tt._build_dsv3_layers(
        n_layers=2,
        n_dense_layers=1,
        dim=dim,
        n_heads=4,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=128,
        moe_hidden_dim=32,
        num_experts=8,
        num_shared_experts=2,
        router_top_k=3,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=SEQ,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=4096,
        ),
    )
    return tt.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        **_ends(tt, dim),
        layers=layers,
    )


def deepseek_v3(steps: int) -> ZooModel:
    """DeepSeek-V3 ``debugmodel`` shape: MLA attention, yarn RoPE, one dense layer then one MoE
    layer (softmax router, shared experts, grouped bf16 experts)."""
    return _finish(
        "tt_deepseek_v3",
        "debugmodel shape: dim 64, MLA, 1 dense + 1 MoE layer (8 experts top-3, "
        f"2 shared), vocab {VOCAB}",
        deepseek_v3_config(),
        steps,
        bf16=True,
    )


def llama3_8b(steps: int, *, n_layers: int, seq: int = SEQ, vocab: int = VOCAB) -> ZooModel:
    """torchtitan's own LLaMA-3 8B config (dim 4096, 32 q / 8 kv heads, FFN 14336) cut to its
    first ``n_layers`` layers, with a ``vocab``-token embedding and head: the real per-layer
    shapes for the benchmarks' 8B projection (each layer is ~218 M parameters)."""
    import torchtitan.models.llama3 as tt
    from torchtitan.models.common import Embedding, Linear

    full = tt._8b(attn_backend="flex")
    dim = full.dim
    cfg = dataclasses.replace(
        full,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)
        ),
        layers=full.layers[:n_layers],
    )
    return _finish(
        "tt_llama3_8b",
        f"torchtitan 8B config, first {n_layers} layers, vocab {vocab}",
        cfg,
        steps,
        seq=seq,
    )
