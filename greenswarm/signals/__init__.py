"""Live grid signals: where a running site learns its region's intensity (and forecasts) from.

A *source* (:mod:`~greenswarm.signals.sources`) answers "what samples are there after ``since``, up to
``now``" for one zone: a replayed trace, a file a cron job rewrites, the Electricity Maps v3 API or
the WattTime v3 API. A :class:`~greenswarm.signals.feed.LiveFeed` polls it on its own thread, checks
what comes back and keeps what the site has observed; the scheduler turns that into windows.
"""

from greenswarm.signals.config import ON_SIGNAL_LOSS, SIGNAL_KINDS, SignalConfig
from greenswarm.signals.errors import FeedError

__all__ = ["FeedError", "ON_SIGNAL_LOSS", "SIGNAL_KINDS", "SignalConfig"]
