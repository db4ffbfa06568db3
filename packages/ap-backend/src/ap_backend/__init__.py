"""The torch.compile backend composing the ap passes."""

__version__ = "0.1.0"

__all__ = ["__version__"]
