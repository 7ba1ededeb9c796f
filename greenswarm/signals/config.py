"""``scheduler.signal``: which live source a site reads its intensity from, and how it polls it.

A site without ``signal`` replays ``scheduler.trace`` with windows computed up front, as before. With
one, it reads the signal as it arrives, like any carbon-aware system that runs for real:

* ``trace``: ``scheduler.trace`` replayed by the clock, sample by sample (what the others are
  tested against: the same trace must give the same windows);
* ``file``: ``scheduler.trace`` re-read whenever it changes (an operator's cron job rewrites it);
* ``electricitymaps``: the Electricity Maps v3 API for ``zone``; the token comes from the
  environment variable ``token_env`` and is sent as the ``auth-token`` header;
* ``watttime``: the WattTime v3 API for ``region`` and ``signal_type`` (``co2_moer``, the
  curtail-llm anchor's signal); a login with the user and password from ``user_env`` and
  ``password_env`` gives a bearer token. Values arrive in lbs/MWh and are converted to g/kWh.

Secrets live only in the environment: the config holds the *names* of variables, and a value that
looks like a secret rather than a name is refused without being echoed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from greenswarm.configuration import check_number
from greenswarm.errors import ConfigError

SIGNAL_KINDS: tuple[str, ...] = ("trace", "file", "electricitymaps", "watttime")
#: what a site does when its signal is stale (see ``scheduler.on_signal_loss``)
ON_SIGNAL_LOSS: tuple[str, ...] = ("pause", "hold-last", "forecast")
DEFAULT_BASE_URL = {
    "electricitymaps": "https://api.electricitymaps.com",
    "watttime": "https://api.watttime.org",
}
DEFAULT_TOKEN_ENV = {"electricitymaps": "ELECTRICITYMAPS_TOKEN"}
#: WattTime signal types that are an emission rate (health_damage is in $/MWh: not an intensity)
WATTTIME_SIGNALS = ("co2_moer", "co2_aoer")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: a name that is safe to repeat in a message: conventional, upper case, in words (a token is not)
_PLAIN_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
#: WattTime forecasts reach 72 h ahead
WATTTIME_HORIZON_H = 72.0


def _env_name(value: object, name: str) -> None:
    """``value`` must name an environment variable. A value that does not look like a name may be the
    secret itself pasted into the config: refused, and never repeated in the message."""
    if not isinstance(value, str) or not _ENV_NAME.fullmatch(value):
        raise ConfigError(
            "must name an environment variable (letters, digits, _), not hold the secret itself; "
            "put the secret in that variable",
            field=name,
        )


@dataclass
class SignalConfig:
    """One live intensity source (see the module docstring for the kinds).

    ``poll_s``: seconds of clock time between polls (Electricity Maps publishes hourly, WattTime every
    5 minutes; polling faster only spends requests). ``timeout_s`` bounds each request; a request that
    fails with a connection error, a timeout, HTTP 429 or 5xx is retried ``retries`` times with
    exponential backoff from ``backoff_s``, and a ``Retry-After`` the server sends is honoured (up to
    ``poll_s``). ``forecast``: also read the source's forecast endpoint at every poll, for
    ``scheduler.on_signal_loss: forecast``. ``horizon_h``: how far ahead to ask WattTime's forecast.
    """

    kind: str = "trace"
    zone: str | None = None
    region: str | None = None
    base_url: str | None = None
    token_env: str | None = None
    user_env: str = "WATTTIME_USER"
    password_env: str = "WATTTIME_PASSWORD"
    signal_type: str = "co2_moer"
    poll_s: float = 300.0
    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.5
    forecast: bool = False
    horizon_h: float = 24.0

    def validate(self) -> None:
        if self.kind not in SIGNAL_KINDS:
            raise ConfigError(f"must be one of {', '.join(SIGNAL_KINDS)}, got {self.kind!r}", field="kind")
        for name in ("poll_s", "timeout_s", "backoff_s", "horizon_h"):
            check_number(getattr(self, name), name, minimum=0.0, inclusive=False)
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise ConfigError(f"must be an integer from 0 to 10, got {self.retries!r}", field="retries")
        if self.kind in ("trace", "file"):
            for name in ("zone", "region", "base_url", "token_env"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"is for the API kinds; a {self.kind} signal reads scheduler.trace", field=name
                    )
            if self.forecast:
                raise ConfigError(f"a {self.kind} signal has no forecast endpoint", field="forecast")
            return
        own, other = ("zone", "region") if self.kind == "electricitymaps" else ("region", "zone")
        if not isinstance(getattr(self, own), str) or not getattr(self, own).strip():
            raise ConfigError(f"a {self.kind} signal needs its {own}", field=own)
        if getattr(self, other) is not None:
            raise ConfigError(f"{self.kind} names its area by {own}, not {other}", field=other)
        if self.base_url is not None:
            parts = urlsplit(self.base_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"must be an http(s) URL, got {self.base_url!r}", field="base_url")
            if parts.username or parts.password or parts.query:
                raise ConfigError(
                    "must not hold credentials or a query; secrets go in environment variables",
                    field="base_url",
                )
        if self.token_env is not None:
            _env_name(self.token_env, "token_env")
        if self.kind == "watttime":
            if self.horizon_h > WATTTIME_HORIZON_H:
                raise ConfigError(
                    f"WattTime forecasts reach {WATTTIME_HORIZON_H:g} h at most", field="horizon_h"
                )
            _env_name(self.user_env, "user_env")
            _env_name(self.password_env, "password_env")
            if self.signal_type not in WATTTIME_SIGNALS:
                raise ConfigError(
                    f"must be one of {', '.join(WATTTIME_SIGNALS)} (a rate), got {self.signal_type!r}",
                    field="signal_type",
                )

    @property
    def is_api(self) -> bool:
        return self.kind in DEFAULT_BASE_URL

    @property
    def url(self) -> str:
        """The API's base URL (the public one unless ``base_url`` says otherwise)."""
        return (self.base_url or DEFAULT_BASE_URL[self.kind]).rstrip("/")

    @property
    def area(self) -> str:
        """The zone (Electricity Maps) or region (WattTime) this signal reads."""
        return str(self.zone if self.kind == "electricitymaps" else self.region)

    def describe(self) -> str:
        """What the logs and summaries call this signal: kind, area and host, never a secret."""
        if not self.is_api:
            return self.kind
        return f"{self.kind} {self.area} at {urlsplit(self.url).netloc}"

    def secret(self, name: str) -> str:
        """The value of the environment variable that field ``name`` names, stripped (env files leave
        newlines); a ConfigError naming the field when it is unset. The variable's name is repeated
        only when it looks like one (``ELECTRICITYMAPS_TOKEN``): a token pasted there is not."""
        variable = str(getattr(self, name) or "")
        value = os.environ.get(variable, "").strip()
        if not value:
            said = variable if _PLAIN_NAME.fullmatch(variable) else f"named by {name}"
            raise ConfigError(
                f"environment variable {said} is not set (it holds the {self.kind} "
                f"{'token' if name == 'token_env' else name.removesuffix('_env')})",
                field=f"scheduler.signal.{name}",
            )
        return value
