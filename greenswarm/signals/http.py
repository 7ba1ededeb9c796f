"""JSON over HTTP for the API sources, on ``requests`` with urllib3's retry machinery.

Every request has a timeout; connection errors, timeouts, HTTP 429 and 5xx are retried with
exponential backoff, and a server's ``Retry-After`` is honoured (capped, so one header cannot stall a
site for hours). Whatever still fails becomes one :class:`~greenswarm.signals.errors.FeedError` with a
short kind and a message from which every secret has been removed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import InvalidHeader, ReadTimeoutError
from urllib3.util.retry import Retry

from greenswarm.signals.errors import FeedError, redact

log = logging.getLogger("greenswarm.signal")

#: statuses worth asking again: rate limits and a server's own trouble
RETRY_STATUSES = (429, 500, 502, 503, 504)
#: how much of an error body a message quotes
QUOTE_CHARS = 120


def _capped_retry(cap_s: float) -> type[Retry]:
    """Retry that honours ``Retry-After`` up to ``cap_s`` seconds."""

    class CappedRetry(Retry):
        def get_retry_after(self, response: Any) -> float | None:
            try:
                seconds = super().get_retry_after(response)
            except InvalidHeader:  # "1.5" or garbage: back off as if none was sent
                return None
            return None if seconds is None else min(seconds, cap_s)

    return CappedRetry


class _QuietRetries(logging.Filter):
    """Drops urllib3's line per retry: a feed says a failure once, itself (:mod:`greenswarm.signals.feed`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Retrying")


logging.getLogger("urllib3.connectionpool").addFilter(_QuietRetries())


def _cause(err: Exception) -> BaseException | None:
    """What lies under a requests error: urllib3's MaxRetryError carries the last failure as ``reason``."""
    inner = err.args[0] if err.args else None
    return getattr(inner, "reason", inner) if isinstance(inner, BaseException) else None


def _retry_after(response: requests.Response) -> float | None:
    """A response's ``Retry-After`` in seconds (the seconds form; dates are rare in APIs)."""
    try:
        seconds = float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class JsonClient:
    """GETs JSON from one API. ``secrets``: strings (tokens, passwords) no message may contain."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        max_retry_after_s: float,
        secrets: Iterable[str] = (),
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retry_after_s = float(max_retry_after_s)
        parts = urlsplit(self.base_url)
        if parts.scheme == "http" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            log.warning("%s is plain http: the API's credentials cross the network unencrypted", parts.netloc)
        self.secrets = [s for s in secrets if s]
        retry = _capped_retry(max_retry_after_s)(
            total=retries,
            connect=retries,
            read=retries,
            status=retries,
            backoff_factor=backoff_s,
            backoff_max=max(backoff_s, max_retry_after_s),
            status_forcelist=RETRY_STATUSES,
            allowed_methods=frozenset({"GET"}),
            respect_retry_after_header=True,
            raise_on_status=False,  # the last response comes back, and is judged below
        )
        self.session = requests.Session()
        self.session.trust_env = False  # no proxies or .netrc credentials picked up from the environment
        adapter = HTTPAdapter(max_retries=retry)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def add_secret(self, secret: str) -> None:
        if secret:
            self.secrets.append(secret)

    def get(
        self,
        path: str,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        auth: tuple[str, str] | None = None,
    ) -> Any:
        """The parsed JSON body of ``GET base_url + path``; a FeedError for anything else."""
        url = self.base_url + path
        try:
            response = self.session.get(
                url, params=params, headers=headers, auth=auth, timeout=self.timeout_s, allow_redirects=False
            )  # no redirects: requests would carry the auth-token header to wherever they point
        except requests.exceptions.Timeout:
            raise FeedError("timeout", f"no answer from {path} within {self.timeout_s:g} s") from None
        except requests.exceptions.RetryError as err:  # retries spent on a retried status
            raise FeedError("http error", self._clean(f"{path}: gave up retrying ({err})")) from None
        except requests.exceptions.ConnectionError as err:
            reason = _cause(err)
            if isinstance(reason, ReadTimeoutError):  # requests files a read timeout after retries here
                raise FeedError("timeout", f"no answer from {path} within {self.timeout_s:g} s") from None
            name = type(reason).__name__ if reason is not None else "connection error"
            raise FeedError("unreachable", f"cannot reach {self.base_url} ({name})") from None
        except requests.exceptions.RequestException as err:
            raise FeedError("unreachable", self._clean(f"{path}: {type(err).__name__}")) from None
        if response.status_code != 200:
            raise self._status_error(path, response)
        try:
            return json.loads(response.content.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            head = response.content[:40].decode("utf-8", "replace")
            raise FeedError(
                "malformed",
                self._clean(f"{path}: not JSON ({err.msg if hasattr(err, 'msg') else err}; begins {head!r})"),
            ) from None

    def _status_error(self, path: str, response: requests.Response) -> FeedError:
        status = response.status_code
        body = self._clean(response.text[:QUOTE_CHARS].replace("\n", " ").strip())
        said = f": {body}" if body else ""
        wait = _retry_after(response)
        wait = None if wait is None else min(wait, self.max_retry_after_s)
        if status == 429:
            return FeedError("rate-limited", f"{path}: HTTP 429, rate-limited{said}", wait, status)
        if status in (401, 403):
            return FeedError("refused", f"{path}: HTTP {status}, credentials refused{said}", status=status)
        if status in (400, 404):
            return FeedError("unknown area", f"{path}: HTTP {status}{said}", status=status)
        return FeedError(f"http {status}", f"{path}: HTTP {status}{said}", wait, status)

    def _clean(self, text: str) -> str:
        return redact(text, self.secrets)

    def close(self) -> None:
        self.session.close()
