"""The zoo's model builders: ``MODELS[name](steps) -> ZooModel``.

Every builder constructs a real architecture from its library's own classes and config objects
at a tiny size, with deterministic seeds, and never downloads weights.
"""

from __future__ import annotations

from collections.abc import Callable

from zoo.models import hf_models, torch_models, torchtitan_models, vision_models
from zoo.models._base import ZooModel

__all__ = ["BF16", "FAST", "MODELS", "ZooModel"]

Builder = Callable[[int], ZooModel]

MODELS: dict[str, Builder] = {
    "tt_llama3": torchtitan_models.llama3,
    "tt_qwen3": torchtitan_models.qwen3,
    "tt_qwen3_moe": torchtitan_models.qwen3_moe,
    "tt_deepseek_v3": torchtitan_models.deepseek_v3,
    "hf_gpt2": hf_models.gpt2,
    "hf_llama": hf_models.llama,
    "hf_mistral": hf_models.mistral,
    "hf_mixtral": hf_models.mixtral,
    "hf_phi3": hf_models.phi3,
    "hf_bert": hf_models.bert,
    "hf_t5": hf_models.t5,
    "tv_resnet18": vision_models.resnet18,
    "timm_resnet10t": vision_models.resnet10t,
    "timm_vit": vision_models.vit,
    "nn_transformer_encoder": torch_models.transformer_encoder,
}

#: The fast subset ``tests/test_zoo.py`` runs: one torchtitan model, one HF model with
#: LayerNorm, a BatchNorm CNN (timm's resnet10t: half of ResNet-18's compile time) and torch's
#: own TransformerEncoder.
FAST: tuple[str, ...] = ("tt_llama3", "hf_bert", "timm_resnet10t", "nn_transformer_encoder")

#: Models that compute partly in bfloat16 (torchtitan's grouped experts run in bf16): judged
#: against stock Inductor's own gap, and given a ``stock`` case automatically.
BF16: frozenset[str] = frozenset({"tt_qwen3_moe", "tt_deepseek_v3"})
