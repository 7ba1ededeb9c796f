"""User-facing errors.

Everything a user can get wrong (a config field, a trace file, a multiaddr, an unreachable swarm)
raises a subclass of :class:`GreenswarmError`. The CLI prints such an error as one line naming the
culprit and exits non-zero, so users never see a bare traceback for their own mistakes.
"""

from __future__ import annotations


class GreenswarmError(Exception):
    """An error caused by the user's input or environment, printed as one line by the CLI."""

    exit_code = 2


class ConfigError(GreenswarmError):
    """A configuration value is missing, unknown or invalid.

    ``field`` is the dotted path of the culprit (``train.lr``); the loader adds the file and line.
    """

    def __init__(self, message: str, field: str | None = None, where: str | None = None):
        self.message = message
        self.field = field
        self.where = where
        super().__init__(self._render())

    def _render(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        name = f"{self.field}: " if self.field else ""
        return f"{prefix}{name}{self.message}"

    def located(self, field_prefix: str | None = None, where: str | None = None) -> ConfigError:
        """Return a copy with the field path prefixed by a parent and/or a file:line location."""
        field = self.field
        if field_prefix:
            field = f"{field_prefix}.{field}" if field else field_prefix
        return ConfigError(self.message, field=field, where=where or self.where)


class TraceError(GreenswarmError):
    """A trace file is malformed, or a region/time is not in it. Messages name file and line."""


class SwarmError(GreenswarmError):
    """The swarm cannot be reached or joined (bad or unreachable --initial-peers, ...)."""

    exit_code = 3


class StorageError(GreenswarmError):
    """A file the node must write cannot be written (a full disk, a read-only ``run_dir``); the message
    names the file and what is left on its disk."""

    exit_code = 4
