"""Carbon-intensity traces: one :class:`Trace` type, file readers, and an offline built-in model."""

from greenswarm.traces.builtin import BUILTIN_TRACES, builtin_trace
from greenswarm.traces.readers import load_trace, read_csv_trace
from greenswarm.traces.trace import Trace

__all__ = ["BUILTIN_TRACES", "Trace", "builtin_trace", "load_trace", "read_csv_trace"]
