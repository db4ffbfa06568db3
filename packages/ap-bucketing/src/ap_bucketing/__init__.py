"""Topo-span-bounded FSDP collective bucketing for Inductor."""

__version__ = "0.1.0"

__all__ = ["__version__"]
