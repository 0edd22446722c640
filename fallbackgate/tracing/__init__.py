"""Joint traces: every expert and KV access, I/O and arbitration of a run on one timeline (format v1), the
planted synthetic trace CI checks the analyses on, the analyses themselves and the report built from them."""

from fallbackgate.tracing.reader import Trace, read_trace
from fallbackgate.tracing.schema import FORMAT_VERSION, TABLES, TraceTable
from fallbackgate.tracing.writer import TraceFormatError, TraceWriter

__all__ = ["FORMAT_VERSION", "TABLES", "Trace", "TraceFormatError", "TraceTable", "TraceWriter", "read_trace"]
