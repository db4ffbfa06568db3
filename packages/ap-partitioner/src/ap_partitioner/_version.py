"""The version of ap-partitioner, written here and nowhere else.

hatch reads it into the distribution's metadata (``[tool.hatch.version]`` in pyproject.toml);
``ap_partitioner.__version__`` reads it back from the installed metadata. Bump it together with a
``CHANGELOG.md`` section (RELEASING.md).
"""

__version__ = "0.1.0"
