"""HuggingFace causal LMs called the ordinary way -- ``model(input_ids, labels=input_ids)``,
with and without a 2-D attention mask -- precompile and match eager; HF Phi-3 runs through
the backend (its retrace used to fail in Inductor at a ``view``).

transformers asks ``is_torchdynamo_compiling()`` before its data-dependent shortcuts
(packed-sequence detection, the SDPA causal-skip check); ``precompile`` answers True while it
traces, as ``torch.compile`` does, so the traceable path is taken."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ap_backend import autoparallel_backend, precompile

from zoo.models import MODELS

pytest.importorskip("transformers")

#: the zoo's HuggingFace causal LMs (zoo/models/hf_models.py: one definition of each config)
CAUSAL = ("hf_gpt2", "hf_llama", "hf_mistral", "hf_mixtral", "hf_phi3")


def _build(name: str, attn_implementation: str | None = None) -> Any:
    model = MODELS[name](1).module  # seeded and in train mode
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mask", [False, True], ids=["input_ids_only", "2d_mask"])
@pytest.mark.parametrize("name", CAUSAL)
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
    eager = _build("hf_phi3", attn_implementation="eager")
    want = eager(ids, **kwargs)[0]
    want.backward()
    model = _build("hf_phi3", attn_implementation="eager")
    backend = autoparallel_backend()
    fn = torch.compile(precompile(model, (ids,), kwargs), backend=backend)
    loss = fn(ids, **kwargs)[0]
    loss.backward()
    torch.testing.assert_close(loss, want)
    for (n, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert [bool(r.fell_back) for r in backend.partition_reports] == [False]
