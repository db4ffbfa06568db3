"""graph_trainer's llama3 configs (every ``graph_trainer_*``, unchanged) with the ``"ap"`` pass
pipeline registered: ``--module ap_bucketing.torchtitan.llama3 --compile.pass_pipeline ap``."""

from __future__ import annotations

from . import reexport_configs

__all__ = reexport_configs("llama3", globals())
