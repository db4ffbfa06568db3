"""HuggingFace ``transformers`` 5.x models, built from config objects (never a hub download).

Every model computes its own loss (``labels=``), exactly as a HuggingFace training loop calls
it; the zoo takes element 0 of the ``return_dict=False`` tuple. Changes made for the zoo, all
configuration values, none to the model code:

* dropout probabilities are 0 (eager and compiled runs must see the same computation);
* ``use_cache=False`` (a training step; a cache object would be a model output);
* token ids that the configs default outside a 256-token vocabulary are set inside it;
* every model is called the ordinary way: ``input_ids`` and ``labels`` (GPT-2, Llama,
  Mixtral: nothing else), plus an all-ones 2-D ``attention_mask`` (Mistral, Phi-3, BERT, T5's
  encoder) -- so both of transformers' mask paths are exercised. ``precompile`` traces with
  ``torch.compiler.is_compiling()`` True, as ``torch.compile`` does, so transformers takes its
  traceable paths (before, its packed-sequence detection and SDPA causal-skip check called
  ``.item()`` on fake tensors and the zoo had to pass prepared 4-D masks).
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.models._base import SEQ, VOCAB, ZooModel, first_output, token_batches

__all__ = ["bert", "gpt2", "llama", "mistral", "mixtral", "phi3", "t5"]

_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _library() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


def _causal_batches(steps: int, *, mask_2d: bool) -> list[tuple[torch.Tensor, ...]]:
    """``(input_ids, [attention_mask,] labels)`` per step; labels = input ids (the model
    shifts them itself)."""
    out: list[tuple[torch.Tensor, ...]] = []
    for tokens, _ in token_batches(steps):
        mask = (torch.ones_like(tokens),) if mask_2d else ()
        out.append((tokens, *mask, tokens.clone()))
    return out


def _causal(
    name: str, config: str, model: torch.nn.Module, steps: int, *, mask_2d: bool = False
) -> ZooModel:
    model.train()
    names = ("input_ids", "attention_mask", "labels") if mask_2d else ("input_ids", "labels")
    call = "input_ids, 2-D attention_mask (all ones), labels" if mask_2d else "input_ids, labels"
    return ZooModel(
        name=name,
        library=_library(),
        config=config,
        module=model,
        batches=_causal_batches(steps, mask_2d=mask_2d),
        n_model_inputs=len(names),
        loss_fn=first_output,
        input_names=names,
        model_kwargs={"return_dict": False},
        notes=[
            f"called the ordinary way: model({call})",
            "loss: the model's own (labels=), return_dict=False, use_cache=False",
        ],
    )


def _decoder_kwargs(**extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2 * SEQ,
        "use_cache": False,
        **_TOKENS,
        **extra,
    }


def gpt2(steps: int) -> ZooModel:
    """GPT-2: learned positions, LayerNorm, Conv1D projections, GELU, tied LM head."""
    import transformers as hf

    torch.manual_seed(0)
    cfg = hf.GPT2Config(
        vocab_size=VOCAB,
        n_positions=2 * SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal(
        "hf_gpt2", "GPT2Config: n_embd 64, 4 heads, 2 layers", hf.GPT2LMHeadModel(cfg), steps
    )


def _decoder(
    name: str, arch: str, summary: str, steps: int, *, mask_2d: bool = False, **extra: Any
) -> ZooModel:
    """transformers' ``<arch>Config`` at the zoo's decoder size (plus ``extra``) and its
    ``<arch>ForCausalLM``, seeded; ``summary`` describes the config in the zoo's tables."""
    import transformers as hf

    torch.manual_seed(0)
    cfg = getattr(hf, f"{arch}Config")(**_decoder_kwargs(**extra))
    model = getattr(hf, f"{arch}ForCausalLM")(cfg)
    return _causal(name, f"{arch}Config: {summary}", model, steps, mask_2d=mask_2d)


def llama(steps: int) -> ZooModel:
    """Llama: RMSNorm, GQA, RoPE, SwiGLU."""
    return _decoder("hf_llama", "Llama", "hidden 64, 4 q / 2 kv heads, 2 layers", steps)


def mistral(steps: int) -> ZooModel:
    """Mistral: Llama-like with a sliding attention window (8 < sequence 16)."""
    summary = "hidden 64, 4 q / 2 kv heads, sliding window 8, 2 layers"
    return _decoder("hf_mistral", "Mistral", summary, steps, mask_2d=True, sliding_window=8)


def mixtral(steps: int) -> ZooModel:
    """Mixtral: sparse MoE (4 experts, top-2 router) on a Mistral backbone."""
    summary = "hidden 64, 4 experts top-2, 2 layers"
    return _decoder(
        "hf_mixtral", "Mixtral", summary, steps, num_local_experts=4, num_experts_per_tok=2
    )


def phi3(steps: int) -> ZooModel:
    """Phi-3: fused qkv and gate_up projections, partial RoPE."""
    summary = "hidden 64, 4 q / 2 kv heads, 2 layers"
    return _decoder(
        "hf_phi3", "Phi3", summary, steps, mask_2d=True, resid_pdrop=0.0, embd_pdrop=0.0
    )


def bert(steps: int) -> ZooModel:
    """BERT masked LM: LayerNorm, GELU, absolute positions, token types; ~15% of positions
    carry labels (the rest -100)."""
    import transformers as hf

    torch.manual_seed(0)
    cfg = hf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=2 * SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    model = hf.BertForMaskedLM(cfg)
    model.train()
    gen = torch.Generator().manual_seed(1)
    batches: list[tuple[torch.Tensor, ...]] = []
    for tokens, _ in token_batches(steps):
        labels = torch.where(torch.rand(tokens.shape, generator=gen) < 0.15, tokens, -100)
        labels[:, 0] = tokens[:, 0]  # at least one labelled position per row
        batches.append((tokens, torch.ones_like(tokens), torch.zeros_like(tokens), labels))
    return ZooModel(
        name="hf_bert",
        library=_library(),
        config="BertConfig: hidden 64, 4 heads, 2 layers (masked LM)",
        module=model,
        batches=batches,
        n_model_inputs=4,
        loss_fn=first_output,
        input_names=("input_ids", "attention_mask", "token_type_ids", "labels"),
        model_kwargs={"return_dict": False},
        notes=[
            "called with input_ids, 2-D attention_mask (all ones), token_type_ids, "
            "labels (15% masked-LM)",
            "loss: the model's own (labels=), return_dict=False",
        ],
    )


def t5(steps: int) -> ZooModel:
    """T5 encoder-decoder: RMS-style T5LayerNorm, relative position buckets, cross-attention;
    the decoder inputs are the labels shifted right by the model itself."""
    import transformers as hf

    torch.manual_seed(0)
    cfg = hf.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    cfg.decoder_start_token_id = 0  # T5's convention: the pad token starts the decoder
    model = hf.T5ForConditionalGeneration(cfg)
    model.train()
    batches: list[tuple[torch.Tensor, ...]] = []
    for tokens, targets in token_batches(steps):
        batches.append((tokens, torch.ones_like(tokens), targets))
    return ZooModel(
        name="hf_t5",
        library=_library(),
        config="T5Config: d_model 64, 4 heads, 2+2 layers",
        module=model,
        batches=batches,
        n_model_inputs=3,
        loss_fn=first_output,
        input_names=("input_ids", "attention_mask", "labels"),
        model_kwargs={"return_dict": False},
        notes=[
            "called with input_ids, 2-D attention_mask (all ones), labels (decoder inputs = "
            "shifted labels, the decoder's causal mask built by the model)",
            "loss: the model's own (labels=), return_dict=False, use_cache=False",
        ],
    )
