"""Trace format v1: the tables of a trace directory and every column's type, unit and meaning, spelled once.

A trace directory holds one Parquet file per table (``<table>.parquet``) and ``metadata.json``. The README's
"Trace format v1" table is generated from :data:`TABLES` (``markdown_table``) and a test checks that they agree.
String-valued columns with a fixed vocabulary (tiers, tags, phases, ...) are dictionary-encoded: pandas reads
them as categoricals, and writers may pass integer codes into :data:`VOCABULARIES` instead of names.
"""

from __future__ import annotations

import dataclasses
import enum

import pyarrow as pa

from fallbackgate.engine.tags import Tag, Tier

FORMAT_NAME = "fallbackgate-trace"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"


class TraceFormatError(ValueError):
    """A trace (or a batch handed to a writer) does not match trace format v1; the message says where."""


class TraceTable(str, enum.Enum):
    """The tables of a trace, in the order the README lists them."""

    STEPS = "steps"
    EXPERT_ACCESS = "expert_access"
    KV_ACCESS = "kv_access"
    IO = "io"
    ARBITRATION = "arbitration"
    REQUESTS = "requests"

    @property
    def file_name(self) -> str:
        """The table's Parquet file inside a trace directory."""
        return f"{self.value}.parquet"


class Phase(str, enum.Enum):
    """What a step computed."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # prefill and decode rows in one step


class IoOp(str, enum.Enum):
    """An I/O operation's direction."""

    READ = "read"
    WRITE = "write"


class ArbitrationOption(str, enum.Enum):
    """What a dual miss (expert and KV block both off device) can do first or instead."""

    EXPERT_FIRST = "expert_first"
    KV_FIRST = "kv_first"
    LOWBIT = "lowbit"
    RECOMPUTE = "recompute"
    DEQUANT = "dequant"
    DEFER = "defer"
    CPU_EXECUTE = "cpu_execute"  # compute the expert where its host copy is


VOCABULARIES: dict[str, tuple[str, ...]] = {
    "tier": tuple(t.value for t in Tier),
    "tag": tuple(t.value for t in Tag),
    "phase": tuple(p.value for p in Phase),
    "io_op": tuple(o.value for o in IoOp),
    "object_kind": ("expert", "kv_block"),
    "option": tuple(o.value for o in ArbitrationOption),
}
"""Fixed vocabularies by name: integer codes written to a column index these tuples."""

_DICT = pa.dictionary(pa.int32(), pa.string())


@dataclasses.dataclass(slots=True, frozen=True)
class Column:
    """One column of a trace table."""

    name: str  # the Parquet field name
    type: pa.DataType  # its Arrow type
    unit: str  # "ns", "bytes", "count", "id", "" (dimensionless) ...
    meaning: str  # one sentence for the README
    vocabulary: str = ""  # a key of VOCABULARIES for fixed-vocabulary strings ("" otherwise)
    is_nullable: bool = False  # whether a row may leave it empty

    @property
    def field(self) -> pa.Field:
        """The Arrow field."""
        return pa.field(self.name, self.type, nullable=self.is_nullable)

    @property
    def type_name(self) -> str:
        """The type as the README shows it."""
        return "string (dictionary)" if pa.types.is_dictionary(self.type) else str(self.type)


def _c(name: str, kind: pa.DataType, unit: str, meaning: str, vocabulary: str = "", nullable: bool = False) -> Column:
    return Column(name, kind, unit, meaning, vocabulary, nullable)


def _step(meaning: str = "the step (steps.step) it belongs to") -> Column:
    return _c("step", pa.int64(), "id", meaning)


_REQUEST = _c("request", _DICT, "id", "the request id (requests.request)")
_LAYER = _c("layer", pa.int16(), "index", "decoder layer")
_TIER = _c("tier_before", _DICT, "", "where the object's nearest copy was before the access (device = hit)", "tier")
_TAG = _c("tag", _DICT, "", "the fallback tag it was served with", "tag")
_WAIT = _c("ns", pa.int64(), "ns", "time the step waited for this access to be served (0 when it was resident)")

TABLES: dict[TraceTable, tuple[Column, ...]] = {
    TraceTable.STEPS: (
        _step("step id, increasing in time"),
        _c("phase", _DICT, "", "prefill, decode or mixed", "phase"),
        _c("start_ns", pa.int64(), "ns", "step start (monotonic clock of the run)"),
        _c("end_ns", pa.int64(), "ns", "step end"),
        _c("batch", pa.int32(), "count", "requests in the step"),
        _c("tokens", pa.int32(), "count", "tokens computed in the step"),
    ),
    TraceTable.EXPERT_ACCESS: (
        _step(),
        _REQUEST,
        _LAYER,
        _c("expert", pa.int32(), "index", "expert index within the layer"),
        _c("router_rank", pa.int8(), "rank", "0 = the router's first choice for this token"),
        _c("router_weight", pa.float32(), "", "the router's (normalised) weight of this expert for this token"),
        _TIER,
        _TAG,
        _c("bytes", pa.int64(), "bytes", "bytes moved to serve it (0 when resident)"),
        _WAIT,
        _c("is_predicted", pa.bool_(), "", "whether the next-layer predictor had named this expert before"),
    ),
    TraceTable.KV_ACCESS: (
        _step(),
        _REQUEST,
        _LAYER,
        _c("block", pa.int64(), "index", "block index within the request's block table"),
        _c("content_hash", pa.uint64(), "", "hash of the block's token ids (shared prefixes share it)", "", True),
        _TIER,
        _TAG,
        _c("bytes", pa.int64(), "bytes", "bytes moved to serve it (0 when resident)"),
        _WAIT,
    ),
    TraceTable.IO: (
        _step("the step that issued it"),
        _c("op", _DICT, "", "read or write", "io_op"),
        _c("object_kind", _DICT, "", "expert or kv_block", "object_kind"),
        _c("object", pa.string(), "id", "the object: 'layer:expert' or 'request:layer:block'"),
        _c("tier", _DICT, "", "the tier read from or written to", "tier"),
        _c("bytes", pa.int64(), "bytes", "bytes transferred"),
        _c("offset", pa.int64(), "bytes", "offset in the tier's file (-1: not file-backed)"),
        _c("submit_ns", pa.int64(), "ns", "when it was queued"),
        _c("start_ns", pa.int64(), "ns", "when the device started it"),
        _c("end_ns", pa.int64(), "ns", "when it completed"),
        _c("queue_depth", pa.int32(), "count", "I/Os in flight when it was submitted"),
        _c("requester", _DICT, "", "who asked: demand, prefetch, spill, ..."),
    ),
    TraceTable.ARBITRATION: (
        _c("decision", pa.int64(), "id", "one dual miss's decision; its options share it"),
        _step(),
        _REQUEST,
        _LAYER,
        _c("phase", _DICT, "", "the step's phase", "phase"),
        _c("context_tokens", pa.int32(), "count", "the request's context length at the decision"),
        _c("option", _DICT, "", "the action considered", "option"),
        _c("predicted_ns", pa.int64(), "ns", "its predicted time on the run's device"),
        _c("predicted_quality_nats", pa.float64(), "nats", "its predicted quality cost (0 for exact options)"),
        _c("bytes", pa.int64(), "bytes", "bytes it would move over the link"),
        _c("is_chosen", pa.bool_(), "", "whether the controller chose it"),
        _c("outcome_ns", pa.int64(), "ns", "measured time of the chosen option (empty for the others)", "", True),
    ),
    TraceTable.REQUESTS: (
        _c("request", pa.string(), "id", "request id"),
        _c("request_class", pa.string(), "", "its SLO class"),
        _c("slo_ttft_ns", pa.int64(), "ns", "its time-to-first-token target (empty: none)", "", True),
        _c("slo_tpot_ns", pa.int64(), "ns", "its time-per-output-token target (empty: none)", "", True),
        _c("arrival_ns", pa.int64(), "ns", "arrival"),
        _c("first_token_ns", pa.int64(), "ns", "first token (empty: none produced)", "", True),
        _c("finish_ns", pa.int64(), "ns", "finish (empty: still running when the trace closed)", "", True),
        _c("prompt_tokens", pa.int32(), "count", "prompt length"),
        _c("output_tokens", pa.int32(), "count", "tokens generated"),
    ),
}
"""Every table's columns, in file order."""


def arrow_schema(table: TraceTable) -> pa.Schema:
    """The Arrow schema a table's file must have."""
    return pa.schema([column.field for column in TABLES[table]])


def markdown_table() -> str:
    """The README's field table, one row per column of every table."""
    lines = ["| table | field | type | unit | meaning |", "|---|---|---|---|---|"]
    for table, columns in TABLES.items():
        for c in columns:
            vocab = f" ({', '.join(VOCABULARIES[c.vocabulary])})" if c.vocabulary else ""
            empty = "; may be empty" if c.is_nullable else ""
            lines.append(f"| {table.value} | {c.name} | {c.type_name} | {c.unit} | {c.meaning}{vocab}{empty} |")
    return "\n".join(lines)
