"""torchtitan's own trainer (``torchtitan.train``) on CPU ranks with gloo: the test-only swaps.

::

    uv run torchrun --standalone --nproc-per-node 2 -m zoo.graph_trainer \\
        --module ap_bucketing.torchtitan.llama3 --config graph_trainer_llama3_debugmodel_sdpa \\
        --compile.pass_pipeline ap --training.steps 2 ...

runs ``torchtitan.train.main()`` unchanged, after three things a CPU machine lacks:

* **a device.** torchtitan falls back to ``"cuda"`` when no accelerator is available
  (``torchtitan/tools/utils.py``), and several modules import ``device_type`` /
  ``device_module`` by name. :func:`use_cpu` points all of them at ``"cpu"`` and a small
  stand-in for ``torch.cuda``'s memory statistics (:class:`_CpuDeviceModule`), and makes
  torchtitan's distributed init pick gloo;
* **a tokenizer.** The debug configs read ``./tests/assets/tokenizer`` (a path inside
  torchtitan's repository, not in its wheel): :func:`write_assets` generates a word-level
  ``tokenizer.json`` from the ``tokenizers`` library, with the BOS/EOS tokens the trainer
  expects;
* **data.** ``c4_test`` reads ``tests/assets/c4_test``: :func:`write_assets` writes a
  200-line JSON dataset of generated sentences.

The assets go to ``$ZOO_GRAPH_TRAINER_ASSETS`` (default: ``ap-graph-trainer-assets`` in the
system's temporary directory; written once, atomically, so ranks may race) and the harness
points ``--hf_assets_path`` and ``--dataloader.dataset_path`` there unless the command line
names them. Nothing here is downloaded. This module is a harness for tests and the README's
CPU command; on a GPU machine the same arguments go to ``-m torchtitan.train`` directly.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "assets_dir",
    "graph_trainer_deepseek_v3_debugmodel_sdpa",
    "graph_trainer_qwen3_debugmodel_moe_sdpa",
    "graph_trainer_qwen3_debugmodel_moe_sdpa_2layers",
    "main",
    "register_test_pipelines",
    "use_cpu",
    "with_asset_args",
    "write_assets",
]

#: Words of the generated corpus; the tokenizer's vocabulary is these plus the specials.
_WORDS = (
    "the a of to and in is was for on that with as by at from it an be this which or are "
    "his her their its had has have were not but one all two can more been first new other "
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy process music market sense nation plan college interest "
    "death experience effect use class control care field development role effort rate heart "
    "drug show leader light voice wife police mind price report decision son view relationship"
).split()
_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<unk>")


ASSETS_ENV = "ZOO_GRAPH_TRAINER_ASSETS"


def assets_dir() -> Path:
    """Where the generated assets live: ``$ZOO_GRAPH_TRAINER_ASSETS`` or a fixed directory in
    the system's temporary directory."""
    import tempfile

    return Path(
        os.environ.get(ASSETS_ENV) or Path(tempfile.gettempdir()) / "ap-graph-trainer-assets"
    )


def _write_once(path: Path, text: str) -> None:
    """Write ``path`` atomically unless it exists (every rank may try at once)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_assets(root: str | os.PathLike[str] | None = None, *, lines: int = 200) -> Path:
    """Write ``tokenizer/`` (``tokenizer.json``, ``tokenizer_config.json``) and ``c4_test/``
    (one JSON-lines file) below ``root`` (default :func:`assets_dir`), each only when missing;
    the content is fixed, so concurrent writers agree. Returns the directory."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    assets = Path(root) if root is not None else assets_dir()
    vocab = {word: i for i, word in enumerate((*_SPECIALS, *_WORDS))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    _write_once(assets / "tokenizer" / "tokenizer.json", tokenizer.to_str())
    config = {
        "bos_token": _SPECIALS[0],
        "eos_token": _SPECIALS[1],
        "unk_token": _SPECIALS[2],
        "add_bos_token": True,
        "add_eos_token": True,
    }
    _write_once(assets / "tokenizer" / "tokenizer_config.json", json.dumps(config, indent=1))
    rng = random.Random(0)
    rows = (
        json.dumps({"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(60, 400)))})
        for _ in range(lines)
    )
    _write_once(assets / "c4_test" / "c4_sample.json", "\n".join(rows) + "\n")
    return assets


def with_asset_args(argv: list[str], assets: Path) -> list[str]:
    """``argv`` plus ``--hf_assets_path`` / ``--dataloader.dataset_path`` pointing at
    ``assets`` (and ``--dump_folder``, torchtitan's structured logs, below it), unless it names
    them already."""
    out = list(argv)
    for flag, path in (
        ("--hf_assets_path", assets / "tokenizer"),
        ("--dataloader.dataset_path", assets / "c4_test"),
        ("--dump_folder", assets / "outputs"),  # torchtitan's logs and traces
    ):
        if not any(a == flag or a.startswith(f"{flag}=") for a in argv):
            out += [flag, str(path)]
    return out


class _CpuDeviceModule:
    """The part of ``torch.cuda`` torchtitan's trainer calls, for the CPU: device queries
    answer for one CPU device, memory statistics are zeros (the CPU allocator keeps none)."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        del device

    @staticmethod
    def synchronize(device: Any = None) -> None:
        del device

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        del device
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        from types import SimpleNamespace

        del device
        return SimpleNamespace(total_memory=1 << 40, name="cpu")

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        del device

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        del device
        return {
            "active_bytes.all.peak": 0,
            "active_bytes.all.current": 0,
            "reserved_bytes.all.peak": 0,
            "reserved_bytes.all.current": 0,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)


def use_cpu() -> None:
    """Point torchtitan's device detection at the CPU, in every module that copied it."""
    import importlib

    import torchtitan.tools.utils as utils

    module = _CpuDeviceModule()
    # setattr: the names exist at run time on the torchtitan versions we test, not in its stubs
    setattr(utils, "device_type", "cpu")  # noqa: B010
    setattr(utils, "device_module", module)  # noqa: B010
    for name in (
        "torchtitan.components.metrics",
        "torchtitan.distributed.utils",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.models.common.token_dispatcher",
        "torchtitan.tools.profiler",
    ):
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            setattr(mod, "device_type", "cpu")  # noqa: B010
        if hasattr(mod, "device_module"):
            setattr(mod, "device_module", module)  # noqa: B010


#: Set to a directory to have every rank save its loss and every parameter's gradient after
#: each ``forward_backward_step`` (before clipping and the optimizer), as
#: ``rank<R>_step<S>.pt``: ``{"loss": float, "grads": {fqn: local shard}}``.
DUMP_ENV = "ZOO_GRAPH_TRAINER_DUMP"


def _graph_facts(traced: Any) -> dict[str, Any]:
    """What the trained graph looks like after the passes: its collectives by kind, the
    all-gathered bytes it holds at once in its order, and ap-bucketing's report if it ran."""
    gm = getattr(traced, "gm", None)
    if gm is None or not hasattr(gm, "graph"):
        return {}
    from ap_bucketing import max_gathered_bytes
    from ap_bucketing._overlap import collective_counts

    return {
        "collectives": collective_counts(gm.graph),
        "max_gathered_bytes": max_gathered_bytes(gm.graph),
        "ap_bucketing": dict(gm.meta.get("ap_bucketing", {})),
    }


def dump_gradients(directory: str) -> None:
    """Wrap ``GraphTrainer.forward_backward_step`` to save the loss and the gradients."""
    import torch
    import torch.distributed as dist
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

    original = GraphTrainer.forward_backward_step
    steps: dict[int, int] = {}

    def forward_backward_step(self: Any, **kwargs: Any) -> Any:
        loss = original(self, **kwargs)
        step = steps[id(self)] = steps.get(id(self), 0) + 1
        grads: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for part in self.model_parts:
            for fqn, param in part.named_parameters():
                grad = param.grad
                if grad is None:
                    continue
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                storages.add(local.untyped_storage().data_ptr())
                grads[fqn] = local.detach().clone()
        record = {
            "loss": float(loss.detach()),
            "grads": grads,
            "grad_storages": len(storages),
            **_graph_facts(getattr(self, "_traced_step", None)),
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(record, Path(directory) / f"rank{rank}_step{step}.pt")
        return loss

    GraphTrainer.forward_backward_step = forward_backward_step


# graph_trainer's MoE debug configs on the SDPA backend (its default FlexAttention has no CPU
# backward); ``--module zoo.graph_trainer --config <name>``. The ``"ap"`` pipeline is registered
# with them, as ``--module ap_bucketing.torchtitan.<model>`` registers it.


def graph_trainer_qwen3_debugmodel_moe_sdpa() -> Any:
    """graph_trainer's ``graph_trainer_qwen3_debugmodel_moe`` with SDPA attention."""
    from ap_bucketing.torchtitan import register_pipeline
    from torchtitan.experiments.graph_trainer.qwen3 import model_registry
    from torchtitan.experiments.graph_trainer.qwen3.config_registry import (
        graph_trainer_qwen3_debugmodel_moe,
    )

    register_pipeline()
    config = graph_trainer_qwen3_debugmodel_moe()
    config.model_spec = model_registry("debugmodel_moe", attn_backend="sdpa")
    return config


def graph_trainer_qwen3_debugmodel_moe_sdpa_2layers() -> Any:
    """``graph_trainer_qwen3_debugmodel_moe_sdpa`` with the first 2 of its 8 layers: the same
    blocks (64 experts, top-8), a quarter of the 302M expert parameters, which gloo and AdamW
    move every step (``tests/test_graph_trainer.py``)."""
    config = graph_trainer_qwen3_debugmodel_moe_sdpa()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config


def graph_trainer_deepseek_v3_debugmodel_sdpa() -> Any:
    """graph_trainer's ``graph_trainer_deepseek_v3_debugmodel`` with SDPA attention."""
    from ap_bucketing.torchtitan import register_pipeline
    from torchtitan.experiments.graph_trainer.deepseek_v3 import model_registry
    from torchtitan.experiments.graph_trainer.deepseek_v3.config_registry import (
        graph_trainer_deepseek_v3_debugmodel,
    )

    register_pipeline()
    config = graph_trainer_deepseek_v3_debugmodel()
    config.model_spec = model_registry("debugmodel", attn_backend="sdpa")
    return config


#: ``--compile.pass_pipeline ap_torch_schedule``: ap-bucketing with ``BucketingConfig()``'s
#: defaults (torch's ``"custom_ops"`` bucket form) and torch's overlap scheduler
#: (``make_bucketing_pass(reorder=True)``) in place of the ``"ap"`` pipeline's prefetch schedule.
#: The scheduler moves readers of a buffer written in place (the chunked loss's ``copy_``) with
#: no data edge to the write; tests run it to hold the write order on torchtitan's own graph.
TORCH_SCHEDULE_PIPELINE = "ap_torch_schedule"


def register_test_pipelines() -> None:
    """Register :data:`TORCH_SCHEDULE_PIPELINE` (idempotent)."""
    from ap_bucketing.torchtitan import make_bucketing_pass, pipeline_with
    from ap_bucketing.torchtitan import register_pipeline as register

    register(TORCH_SCHEDULE_PIPELINE, pipeline_with(make_bucketing_pass(reorder=True)))


def main(argv: list[str] | None = None) -> None:
    """``torchtitan.train.main()`` on CPU ranks, with the generated assets."""
    args = sys.argv[1:] if argv is None else argv
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    sys.argv = [sys.argv[0], *with_asset_args(args, write_assets())]
    use_cpu()
    if os.environ.get(DUMP_ENV):
        dump_gradients(os.environ[DUMP_ENV])
    register_test_pipelines()  # after the cache settings: it imports Inductor's config
    import torchtitan.train

    torchtitan.train.main()


if __name__ == "__main__":
    from zoo.teardown import exit_without_finalization

    main()
    exit_without_finalization(0)
