"""Every message that crosses a socket, as msgspec Structs: the public client protocol and the internal
frontend <-> scheduler protocol. No pickle anywhere.

A message is two ZMQ frames: one byte naming its type, then its msgpack body. Bodies are msgpack *arrays*
(`array_like`): fields in declaration order, trailing defaults may be omitted. The public half is documented
field by field in docs/protocol.md; keep the two in step and bump PROTOCOL_VERSION on any incompatible change
(new optional fields go at the end of a struct and need no bump).
"""

from __future__ import annotations

import enum

import msgspec

from specstep.scheduler.server.decode_errors import describe, guess_request_id

PROTOCOL_VERSION = 1


class Wire(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True, gc=False):
    """Base of every wire struct (the options are inherited)."""


# ---- public protocol: upstream router (DEALER) <-> frontend (ROUTER) -------------------------------------------
class MsgType(enum.IntEnum):
    """Frame 0 of every public message (one byte)."""

    GENERATE = 0x01
    ABORT = 0x02
    HEALTH = 0x03
    STATS = 0x04
    DELTA = 0x81
    FINAL = 0x82
    ERROR = 0x83
    HEALTH_REPLY = 0x84
    STATS_REPLY = 0x85


class ErrorCode(enum.IntEnum):
    MALFORMED = 1  # wrong frame count, not msgpack, wrong shape or field types, a required field missing
    UNKNOWN_TYPE = 2  # frame 0 is not a known client message type
    INVALID_PARAMS = 3  # a field's value is out of range
    PROMPT_TOO_LONG = 4
    DUPLICATE_REQUEST_ID = 5  # this client already has an unfinished request with this id
    ENGINE_DIED = 6  # the scheduler process died while the request was in flight; safe to retry
    UNAVAILABLE = 7  # no scheduler process (restarts exhausted or start-up failed)
    SHUTTING_DOWN = 8  # the server is draining and takes no new requests
    OVERLOADED = 9  # too many unfinished requests in the server
    INTERNAL = 10  # a bug; the message says what
    TOO_LARGE = 11  # the body is over MAX_FRAME_BYTES (a client can tell it apart from a bug in its encoder)


class GenerateRequest(Wire):
    request_id: str
    prompt: str | None = None  # exactly one of prompt / prompt_token_ids
    prompt_token_ids: list[int] | None = None
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = True
    num_spec_tokens: int | None = None  # None = server policy, 0 = no speculation, k = k draft tokens


class AbortRequest(Wire):
    request_id: str


class HealthRequest(Wire):
    pass


class StatsRequest(Wire):
    pass


class Delta(Wire):
    request_id: str
    token_ids: list[int]
    text: str


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int


class SpecStats(Wire):
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_steps: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    acceptance_per_position: list[float] = msgspec.field(default_factory=list)
    drafted_per_position: list[int] = msgspec.field(default_factory=list)  # counts behind the rates above
    accepted_per_position: list[int] = msgspec.field(default_factory=list)
    # How the adaptive policy treated it (docs/protocol.md): drafts in its last decode step, its acceptance
    # estimate (per draft position), decode steps it drafted nothing, and steps it drafted only as a probe.
    last_k: int = 0
    acceptance_estimate: float = 0.0
    steps_off: int = 0
    steps_probing: int = 0


class Timings(Wire):
    """Seconds, measured by the server: arrival at the frontend -> scheduled, -> first token, between tokens."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    mean_itl_s: float = 0.0  # (last token time - first token time) / (completion tokens - 1)
    max_itl_s: float = 0.0  # largest gap between two consecutive outputs carrying tokens
    total_s: float = 0.0


class Final(Wire):
    """The last message of a request. Its token_ids/text are those not already sent in a Delta."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    token_ids: list[int]
    text: str
    usage: Usage
    spec: SpecStats
    timings: Timings
    num_preemptions: int = 0


class Error(Wire):
    code: int
    message: str  # starts with "FIELD: " when one field is at fault
    request_id: str | None = None
    # True only on DUPLICATE_REQUEST_ID: the request already running under this id goes on, so this error must
    # not end it in a client that routes replies by id.
    request_continues: bool = False


class HealthReply(Wire):
    protocol_version: int
    status: str  # "ok" | "starting" | "restarting" | "failed" | "draining"
    model: str = ""
    spec: str = ""
    max_model_len: int = 0
    max_prompt_len: int = 0
    max_tokens: int = 0
    vocab_size: int = 0  # 3-7 are "" / 0 until the scheduler first reports ready
    address: str = ""  # the ROUTER's bound address (the real port when started on port 0)


class EngineStats(Wire):
    """The scheduler's view, taken between two steps."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_usable_pages: int = 0
    num_pages: int = 0
    page_size: int = 0
    integrity_ok: bool = True
    integrity_error: str = ""
    num_preemptions: int = 0
    num_steps: int = 0
    num_finished: int = 0
    num_output_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    pid: int = 0
    tag: int = 0  # internal: matches a reply to its query
    spec_policy: str = ""
    k_distribution: dict[int, int] = msgspec.field(default_factory=dict)  # requests per k at the last decode step
    step_costs_ms: dict[str, float] = msgspec.field(default_factory=dict)  # measured "bucket/k/refill" -> ms
    spec_governor: str = ""  # on | off | disabled
    spec_governor_ratio: float = 0.0  # realised speculative / plain throughput in its window (0: no samples)
    spec_governor_switches: int = 0
    spec_probes: int = 0  # decisions that probed
    spec_decisions: dict[str, int] = msgspec.field(default_factory=dict)  # decisions by reason
    spec_requests_off: int = 0  # policy-chosen requests drafting nothing at the last decode step
    tensor_parallel_size: int = 1  # ranks of the engine's tensor-parallel group
    # chunked prefill's pacer at the current batch (`Pacing`; zeros with whole-prompt prefill)
    prefill_budget_tokens: int = 0  # prompt tokens a step takes at context 0 beside the running streams
    prefill_itl_target_ms: float = 0.0  # the longest gap a mixed step is planned to give the streams
    prefill_efficient_tokens: int = 0  # the compute-efficient prompt forward
    mixed_step_share: float = 0.0  # of the steps run so far, those mixing decode rows and prompt chunks


class StatsReply(Wire):
    protocol_version: int
    status: str
    restarts: int
    num_inflight: int  # unfinished requests in the frontend
    engine: EngineStats | None = None  # None while no scheduler is ready
    metrics: dict[str, float] = msgspec.field(default_factory=dict)  # the Prometheus counters and gauges


CLIENT_TYPES: dict[int, type[Wire]] = {
    MsgType.GENERATE: GenerateRequest, MsgType.ABORT: AbortRequest, MsgType.HEALTH: HealthRequest,
    MsgType.STATS: StatsRequest,
}
SERVER_TYPES: dict[int, type[Wire]] = {
    MsgType.DELTA: Delta, MsgType.FINAL: Final, MsgType.ERROR: Error, MsgType.HEALTH_REPLY: HealthReply,
    MsgType.STATS_REPLY: StatsReply,
}


# ---- internal protocol: frontend (PUSH/PULL, bound) <-> scheduler process (PULL/PUSH, connected) -------------
class EngineMsgType(enum.IntEnum):
    ADD = 0x01
    ABORT = 0x02
    STATS = 0x03
    SHUTDOWN = 0x04
    READY = 0x81
    OUTPUTS = 0x82
    REJECT = 0x83
    STATS_REPLY = 0x84


class EngineRequest(Wire):
    request_id: str  # the frontend's id, unique within one scheduler incarnation
    prompt_token_ids: list[int]
    seed: int  # the request's sampling seed (drawn by the frontend when the client gave none)
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    num_spec_tokens: int | None = None
    client_seed: int | None = None  # the client's seed, as given


class EngineAbort(Wire):
    request_ids: list[str]


class EngineStatsQuery(Wire):
    tag: int


class EngineShutdown(Wire):
    drain: bool = True  # finish in-flight requests first


class Ready(Wire):
    """Values learned at start-up; the frontend validates against these."""

    protocol_version: int
    pid: int
    num_pages: int
    page_size: int
    max_model_len: int
    max_prompt_len: int  # min(model limit, what the KV pool can hold, --max-prompt-len)
    vocab_size: int
    max_batch_size: int
    device: str
    dtype: str
    spec: str
    num_spec_tokens: int
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    kv_cache: str = ""  # how the KV cache was sized (`MemoryPlan.describe()`), for the ready line
    tensor_parallel_size: int = 1  # ranks of the engine's tensor-parallel group
    prefill: str = ""  # chunked prefill's step budget and how it was chosen, for the ready line
    graphs: str = ""  # graph capture's count and seconds (`describe_capture`), for the ready line
    kernels: str = ""  # CPU: the linears' weights and kernels and the attention, and why, for the ready line


class EngineOutput(Wire):
    """One step's tokens for one request. The frontend sums the per-step counts into the request's stats, so
    they survive a request it cuts short itself (a stop string)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the request's last output
    num_draft: int = 0  # drafts proposed for this request in the step that produced these tokens
    num_accepted: int = 0  # of which accepted
    queue_s: float = 0.0  # on the request's first output: arrival at the scheduler -> first scheduled
    num_preemptions: int = 0  # so far
    spec_acceptance: float = 0.0  # the policy's acceptance estimate for this request, now
    spec_steps_off: int = 0  # so far: decode steps without drafts
    spec_steps_probing: int = 0  # so far: decode steps drafting only as a probe


class EngineOutputs(Wire):
    outputs: list[EngineOutput]  # one message per engine step


class EngineReject(Wire):
    request_id: str
    code: int
    message: str


TO_ENGINE_TYPES: dict[int, type[Wire]] = {
    EngineMsgType.ADD: EngineRequest, EngineMsgType.ABORT: EngineAbort, EngineMsgType.STATS: EngineStatsQuery,
    EngineMsgType.SHUTDOWN: EngineShutdown,
}
FROM_ENGINE_TYPES: dict[int, type[Wire]] = {
    EngineMsgType.READY: Ready, EngineMsgType.OUTPUTS: EngineOutputs, EngineMsgType.REJECT: EngineReject,
    EngineMsgType.STATS_REPLY: EngineStats,
}


class SchedulerProcessConfig(msgspec.Struct, frozen=True):
    """How the supervisor starts a scheduler process: JSON on the child's command line (not a socket message)."""

    engine: dict  # EngineConfig's fields
    input_address: str  # the frontend's bound PUSH
    output_address: str  # the frontend's bound PULL
    parent_pid: int
    max_prompt_len: int | None = None
    trace: str | None = None


# ---- encoding / decoding ------------------------------------------------------------------------------------------
class ProtocolError(Exception):
    """A message that cannot be served; becomes an `Error` reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def to_wire(self) -> Error:
        # A duplicate is refused on its own: the request already running under that id is untouched.
        return Error(int(self.code), self.message, self.request_id, self.code == ErrorCode.DUPLICATE_REQUEST_ID)


_TYPE_BYTE: dict[type, bytes] = {
    **{cls: bytes([code]) for code, cls in CLIENT_TYPES.items()},
    **{cls: bytes([code]) for code, cls in SERVER_TYPES.items()},
}
_ENGINE_TYPE_BYTE: dict[type, bytes] = {
    **{cls: bytes([code]) for code, cls in TO_ENGINE_TYPES.items()},
    **{cls: bytes([code]) for code, cls in FROM_ENGINE_TYPES.items()},
}
_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in (*CLIENT_TYPES.values(), *SERVER_TYPES.values(), *TO_ENGINE_TYPES.values(), *FROM_ENGINE_TYPES.values())
}
MAX_FRAME_BYTES = 16 << 20
_CARRY_ID = (GenerateRequest, EngineRequest)  # messages whose decode errors report their request id


def encode(msg: Wire) -> list[bytes]:
    """A public message as its two frames."""
    return [_TYPE_BYTE[type(msg)], _encoder.encode(msg)]


def encode_engine(msg: Wire) -> list[bytes]:
    return [_ENGINE_TYPE_BYTE[type(msg)], _encoder.encode(msg)]


def _decode(frames: list[bytes], types: dict[int, type[Wire]]) -> Wire:
    if len(frames) != 2:
        raise ProtocolError(ErrorCode.MALFORMED, f"expected 2 frames (type byte, msgpack body), got {len(frames)}")
    kind, body = frames
    if len(kind) != 1 or kind[0] not in types:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {bytes(kind[:8]).hex()!r}")
    cls = types[kind[0]]
    # Only a request's own error carries its id: one for a bad ABORT naming a running request would end that
    # request in a client that routes replies by id.
    rid = guess_request_id(body) if cls in _CARRY_ID else None
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}", rid)
    try:
        return _decoders[cls].decode(body)
    except Exception as e:  # DecodeError, ValidationError; anything else from garbage input is the same thing
        raise ProtocolError(ErrorCode.MALFORMED, describe(cls, body, e), rid) from None


def decode_client(frames: list[bytes]) -> Wire:
    """A client message (frames after the ROUTER identity); raises ProtocolError and nothing else."""
    return _decode(frames, CLIENT_TYPES)


def decode_server(frames: list[bytes]) -> Wire:
    return _decode(frames, SERVER_TYPES)


def decode_to_engine(frames: list[bytes]) -> Wire:
    return _decode(frames, TO_ENGINE_TYPES)


def decode_from_engine(frames: list[bytes]) -> Wire:
    return _decode(frames, FROM_ENGINE_TYPES)

