"""Expert-parallel chunking of module regions and chunk-symbol concretization."""

__version__ = "0.1.0"

__all__ = ["__version__"]
