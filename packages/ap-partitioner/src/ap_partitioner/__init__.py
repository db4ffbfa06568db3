"""Save-all partitioner that replays the first compilation's saved set."""

__version__ = "0.1.0"

__all__ = ["__version__"]
