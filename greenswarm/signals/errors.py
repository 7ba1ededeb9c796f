"""The one error a signal source raises, and the redaction that keeps secrets out of its text."""

from __future__ import annotations

from collections.abc import Iterable

from greenswarm.errors import GreenswarmError

#: what a secret is replaced with in any text that leaves a source
REDACTED = "***"


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every non-empty secret replaced by :data:`REDACTED` (tokens, passwords)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


class FeedError(GreenswarmError):
    """A poll of a signal source failed: the feed was down, slow, refused us or sent bad data.

    ``kind`` is a short, stable name for the failure (``unreachable``, ``timeout``, ``http 503``,
    ``malformed``, ``unknown zone``, ``refused``, ``rate-limited``) so a feed can tell a new failure
    from the same one again and log it once; the message says what happened, and never holds a token.
    ``retry_after_s`` is set when the server asked us to wait (HTTP 429/503 ``Retry-After``).
    """

    def __init__(
        self, kind: str, message: str, retry_after_s: float | None = None, status: int | None = None
    ):
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.status = status  # the HTTP status, when there was one
        super().__init__(message)
