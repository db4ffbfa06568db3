"""The package's exception types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class TagError(ValueError):
    """Node-meta tags are malformed.

    ``problems`` maps each offending node's name to every problem found on it, so one
    ``validate_tags`` call reports the whole graph instead of the first bad node.
    """

    def __init__(self, problems: Mapping[str, Sequence[str]]) -> None:
        self.problems: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in problems.items()}
        lines = [f"  {name}: {'; '.join(msgs)}" for name, msgs in self.problems.items()]
        count = len(self.problems)
        super().__init__(
            f"malformed ap tags on {count} node{'s' if count != 1 else ''}:\n" + "\n".join(lines)
        )


class TagSchemaError(TagError):
    """Tags were written by an ap-tags with another tag-schema version.

    Raised, never worked around: reading keys whose meaning changed would silently change what
    a partitioner saves. Install matching ap-tags versions in the first and second compilation.
    """
