"""Messages between scheduler, runner, controller and whoever records them (the ledger).

Ledger rows are built from these dataclasses only, never from engine internals.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from fallbackgate.engine.experts.read_ahead import TransferClock
from fallbackgate.engine.sequence import TokenLogprobs
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


class StepKind(str, enum.Enum):
    """What a step's forward pass contained."""

    PREFILL = "prefill"  # only prompt tokens
    DECODE = "decode"  # only one new token per running request
    MIXED = "mixed"  # prefill chunks and decode tokens together
    RECOMPUTE = "recompute"  # a re-run over evicted tokens to rebuild their KV blocks


@dataclasses.dataclass(slots=True)
class Event:
    """One aggregated fact: what was done to objects of one kind, for one request, in one layer."""

    step_id: int  # engine step the event belongs to
    request_id: str  # request whose tokens used the objects
    layer: int  # decoder layer index
    object_kind: ObjectKind  # expert or kv_block
    tag: Tag  # the action taken
    count: int  # number of objects (experts, or KV blocks) this row covers
    bytes_moved: int = 0  # bytes copied over a link for these objects (0 when resident or omitted)
    source_tier: Tier | None = None  # tier the bytes came from (host/disk), None when nothing moved
    predicted_cost: float = 0.0  # predicted quality cost in nats (approximate tags only; set by controller)
    modeled_s: float = 0.0  # modeled time of this action from the hardware profile, seconds
    note: str = ""  # free text, e.g. "checksum mismatch on disk page; recovered from host"
    object_ids: list[int] = dataclasses.field(default_factory=list)  # expert ids or KV block indices, for
    # approximate and rebuild actions (what the replay baseline repeats); empty for exact ones
    bits: int = 0  # precision of the low-bit copy served (expert_lowbit, kv_dequant); 0 otherwise
    is_rebuild: bool = False  # done inside a KV rebuild pass (a recompute forward before the step's own)


@dataclasses.dataclass(frozen=True, slots=True)
class Verification:
    """One in-memory weight copy checked against the checkpoint."""

    step_id: int | None  # step after which it was checked (None: before an audit)
    object_kind: str  # "expert" or "dense"
    name: str  # "layer:expert" or the dense weight's name
    tier: Tier | None  # where the checked copy lives (None for dense weights)
    passed: bool  # bytes equal to the checkpoint's
    note: str = ""  # what was wrong and what was done about it


@dataclasses.dataclass(frozen=True, slots=True)
class KVStaging:
    """When one off-device KV block a step read became usable, measured from the step's start."""

    request_id: str  # owner
    layer: int  # decoder layer
    block_index: int  # index in the request's block table
    tag: Tag  # how it was made usable: exact_load, kv_dequant or recompute
    bytes_moved: int  # bytes read for it (0 for recompute)
    ready_s: float  # seconds from the step's start until usable (a recompute: its rebuild pass ended)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertArrival:
    """When one expert a step fetched for a request became usable, measured from the step's start."""

    request_id: str  # a request that computed with it
    layer: int  # decoder layer
    expert_id: int  # expert index in the layer
    tag: Tag  # how it was served: exact_load, expert_lowbit, cpu_execute (resident ones are not listed)
    bytes_moved: int  # bytes read for it (0 when none were)
    ready_s: float  # seconds from the step's start until usable: its last disk read's end, else the fetch's


class CopyAction(str, enum.Enum):
    """What happened to a KV block's copy in a tier other than the device."""

    WRITTEN = "written"  # the copy's bytes landed in the tier (a spill or a swap)
    READ = "read"  # the copy was read to serve a step (exact_load, kv_dequant, a resumed tail block)
    FREED = "freed"  # the copy was released (stale, request ended, failed its checksum)
    MOVED_OUT = "moved_out"  # the copy left this owner's table with its block (a kept or adopted prefix block)
    MOVED_IN = "moved_in"  # ... and joined this one's: the copy the journal's last moved_out named, unchanged


@dataclasses.dataclass(slots=True)
class KVCopyChange:
    """Consecutive changes of one kind to copies of one request's KV blocks of one layer, in one tier and
    precision, as the KV store made them: what the audit checks each off-device KV event against."""

    seq: int  # ordinal of the first change among all the store's copy changes (member i: seq + i)
    request_id: str  # owner of the blocks
    layer: int  # decoder layer
    action: CopyAction  # written, read or freed
    tier: Tier  # host or disk
    bits: int  # 0: a full-precision copy; 8 or 4: a quantized one
    block_ids: list[int]  # block indices in the request's table, in change order
    num_bytes: int = 0  # bytes written or read (0 for frees)
    checksums: list[int] = dataclasses.field(default_factory=list)  # quantized copies written: codes' xxh3-64
    # per block, as block_ids (kv.codec.codes_checksum); empty for other changes


@dataclasses.dataclass(slots=True)
class RoutingCall:
    """One routed-experts call of a step's forward: the router's choices as it made them (tensors as produced,
    not copied; they may live on the device)."""

    layer: int  # decoder layer
    request_ids: list[str]  # the forward's requests in packing order; token_owner indexes them
    token_owner: torch.Tensor  # [T] int: each packed token's request (index into request_ids)
    top_k_index: torch.Tensor  # [T, k] int: the experts each token was routed to, router rank order
    top_k_weights: torch.Tensor  # [T, k] float: their router weights as the experts were weighted
    named_ids: list[int] | None = None  # experts of this layer the read-ahead predictor had named from the
    # previous layer's hidden state (None: no predictor ran for this layer)


@dataclasses.dataclass(slots=True)
class StepCapture:
    """Every expert and KV access of one step as plain tensors and columns, for a recorder that asked for them
    (``Engine.is_capturing``): the engine fills it and never reads it. Uses not listed in ``expert_served``
    were served resident from device; blocks not in ``kv_served`` were read where they live on device."""

    start_ns: int  # step start, time.monotonic_ns() (the I/O scheduler's clock)
    end_ns: int = 0  # step end, same clock
    routing: list[RoutingCall] = dataclasses.field(default_factory=list)  # every routed-experts call, in order
    expert_served: list[tuple[int, int, str, Tier, Tag, int, int]] = dataclasses.field(default_factory=list)
    # per (expert, request) use not served resident: (routing call index, expert id, request id, tier before,
    # tag served, bytes moved, measured wait ns) -- the same uses, tags and bytes the step's events carry
    kv_reads: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # per request of the step's
    # forward: (request id, blocks of its table read in every layer, i.e. blocks 0..n-1)
    kv_served: dict[tuple[str, int, int], tuple[Tier, Tag, int, int]] = dataclasses.field(default_factory=dict)
    # per off-device block made usable (request id, layer, block index): (tier before, tag, bytes moved,
    # measured wait ns)
    named: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # layer -> experts the predictor named
    # for it, until that layer's routing call takes them
    kv_hashes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # request id -> uint64 content
    # hashes of the full blocks among its reads (block 0 on; the partial tail has none)


@dataclasses.dataclass(slots=True)
class StepPlan:
    """What the scheduler decided to run in one step."""

    step_id: int  # monotonically increasing step number within an engine
    kind: StepKind  # prefill, decode, mixed or recompute
    request_ids: list[str]  # requests with tokens in this step, in packing order
    num_tokens: dict[str, int]  # request id -> tokens fed this step (prefill chunk or 1)
    start_positions: dict[str, int]  # request id -> position of its first token this step
    preempted_ids: list[str] = dataclasses.field(default_factory=list)  # requests swapped/dropped before step
    resumed_ids: list[str] = dataclasses.field(default_factory=list)  # requests brought back this step
    is_observe: bool = False  # controller decisions recorded but exact actions served


@dataclasses.dataclass(slots=True)
class StepResult:
    """What one step did and produced."""

    step_id: int  # same as the plan's
    kind: StepKind  # same as the plan's
    request_ids: list[str]  # requests that had tokens in the step
    sampled_token_ids: dict[str, int]  # request id -> token sampled at its last position (if it emits one)
    logits: dict[str, torch.Tensor]  # request id -> fp32 logits [vocab] that produced the sampled token (requests
    # whose logits are kept only)
    events: list[Event]  # every fallback taken in this step, aggregated per request × layer × kind × tag (exact
    # zero-byte uses are counts instead: expert_resident_uses, kv_resident_reads)
    wall_s: float  # measured wall time of the step, seconds
    modeled_s: float  # modeled time of the step from the hardware profile, seconds
    finished_ids: list[str] = dataclasses.field(default_factory=list)  # requests that ended this step
    num_device_bytes_expert: int = 0  # device bytes held by expert copies after the step: slots, and on a CPU the
    # low-bit copies kept in the one RAM budget
    num_device_bytes_kv: int = 0  # device bytes held by KV blocks after the step
    transfer: TransferClock | None = None  # measured expert disk-read time of the step, hidden and exposed
    verifications: list[Verification] = dataclasses.field(default_factory=list)  # sampled copies checked
    kv_resident_reads: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # request -> layer
    # -> KV blocks read on device (off-device reads are events: exact_load, kv_dequant, recompute)
    kv_stagings: list[KVStaging] = dataclasses.field(default_factory=list)  # off-device KV blocks made usable,
    # with when (what an arbitration's measured arrival is)
    expert_resident_uses: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # request -> layer
    # -> experts used resident as decided, no bytes moved (every other expert use is an event)
    routing_digests: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # request -> layer ->
    # digest of the experts its own forward routed to (experts.routing.request_digests), for the audit's replay
    expert_arrivals: list[ExpertArrival] = dataclasses.field(default_factory=list)  # experts fetched (not
    # resident), per request, with when (an expert arbitration's measured arrival)
    kv_copies: list[KVCopyChange] = dataclasses.field(default_factory=list)  # KV copies written, read and freed
    # since the previous step, in the order the store made the changes
    capture: StepCapture | None = None  # every access of the step, when the engine was asked to capture them
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> why it ended failed this step
    # (a quarantined expert or unreadable KV block only it needed; its output is in `Engine.failed`)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """A finished request, as returned to the caller."""

    request_id: str  # caller's id
    request_class: str  # policy request class name ("default" when none)
    prompt_token_ids: list[int]  # tokenised prompt
    output_token_ids: list[int]  # generated tokens (without the prompt)
    output_logits: torch.Tensor | None  # [num_output_tokens, vocab] fp32 logits that produced each output token;
    # None when the request was submitted with is_logits_kept=False (servers keep them for audited requests only)
    arrival_s: float  # wall clock when submitted (time.perf_counter)
    first_token_s: float  # wall clock when the first output token was sampled
    finish_s: float  # wall clock when the last output token was sampled
    modeled_ttft_s: float  # modeled time to first token
    modeled_tpot_s: float  # modeled mean time per output token after the first
    tag_counts: dict[str, int]  # tag value -> objects served with it for this request
    num_preemptions: int = 0  # how often the request was swapped out or dropped
    prompt_logits: torch.Tensor | None = None  # [num_scored_tokens, vocab] fp32 prefill logits at the last prompt
    # positions (row i at position len(prompt) - num_scored_tokens + i; the last row produced the first output
    # token); None unless scoring was requested
    output_logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.num_top_logprobs is set
    prompt_logprobs: list[TokenLogprobs] | None = None  # per prompt token after the first, when
    # SamplingParams.num_prompt_logprobs is set (row i: token i + 1 given tokens 0..i)
    num_reused_tokens: int = 0  # prompt positions whose KV was adopted from kept prefix blocks (prefill skipped)

    @property
    def ttft_s(self) -> float:
        """Measured time to first token, seconds."""
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Measured mean time per output token after the first, seconds."""
        n = len(self.output_token_ids)
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else 0.0
