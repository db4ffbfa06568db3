"""Node-meta tagging schema for two-stage torch.compile pipelines."""

__version__ = "0.1.0"

__all__ = ["__version__"]
