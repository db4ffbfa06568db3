"""HuggingFace causal LMs called the ordinary way -- ``model(input_ids, labels=input_ids)``,
with and without a 2-D attention mask -- precompile and match eager; HF Phi-3 runs through
the backend (its retrace used to fail in Inductor at a ``view``).

transformers asks ``is_torchdynamo_compiling()`` before its data-dependent shortcuts
(packed-sequence detection, the SDPA causal-skip check); ``precompile`` answers True while it
traces, as ``torch.compile`` does, so the traceable path is taken."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ap_backend import autoparallel_backend, precompile

hf = pytest.importorskip("transformers")

_DECODER = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "use_cache": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_DECODER)),
    "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**_DECODER, sliding_window=8)),
    "mixtral": lambda: hf.MixtralForCausalLM(
        hf.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    ),
    "phi3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**_DECODER, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt2": lambda: hf.GPT2LMHeadModel(
        hf.GPT2Config(
            vocab_size=256,
            n_positions=32,
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
    ),
}


def _build(name: str, attn_implementation: str | None = None) -> Any:
    torch.manual_seed(0)
    model = BUILDERS[name]()
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.train()
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mask", [False, True], ids=["input_ids_only", "2d_mask"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_causal_lm_called_the_ordinary_way_precompiles(name: str, mask: bool) -> None:
    ids = _ids()
    kwargs: dict[str, Any] = {"labels": ids, "return_dict": False}
    if mask:
        kwargs["attention_mask"] = torch.ones_like(ids)
    model = _build(name)
    pm = precompile(model, (ids,), kwargs)
    loss = pm(ids, **kwargs)[0]
    torch.testing.assert_close(loss, model(ids, **kwargs)[0])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_phi3_through_the_backend_matches_eager() -> None:
    """The retrace of Phi-3's first compilation (eager attention: ``matmul`` on 4-D tensors,
    which records ``view``s to 3-D for ``bmm``): Inductor's ``cat`` decomposition returns a
    stride-preserving clone of the one non-empty input of the partial-rotary ``cat`` (eager's
    ``cat`` is contiguous), so the attention ``view(8, 16, 16)`` recorded by the first
    compilation was impossible (``Cannot view a tensor with shape [2,4,16,16] and strides
    (1024,16,64,1)``). The first compilation's graphs now carry ``reshape`` instead."""
    ids = _ids()
    kwargs = {"labels": ids, "return_dict": False}
    eager = _build("phi3", attn_implementation="eager")
    want = eager(ids, **kwargs)[0]
    want.backward()
    model = _build("phi3", attn_implementation="eager")
    backend = autoparallel_backend()
    fn = torch.compile(precompile(model, (ids,), kwargs), backend=backend)
    loss = fn(ids, **kwargs)[0]
    loss.backward()
    torch.testing.assert_close(loss, want)
    for (n, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert [bool(r.fell_back) for r in backend.partition_reports] == [False]
