"""graph_trainer's qwen3 configs (every ``graph_trainer_*``, unchanged) with the ``"ap"`` pass
pipeline registered: ``--module ap_bucketing.torchtitan.qwen3 --compile.pass_pipeline ap``."""

from __future__ import annotations

from . import reexport_configs

__all__ = reexport_configs("qwen3", globals())
