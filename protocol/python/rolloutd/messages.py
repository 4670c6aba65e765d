"""The v1 wire messages as dataclasses (mirrors protocol/messages.hpp; SPEC.md is normative).

Field order is wire order: rolloutd.wire writes map keys in the order fields are
declared here, which is the order SPEC.md and the C++ encoders use.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

PROTOCOL_VERSION = 1

# Routed-expert dtype name -> (bytes per element, numpy dtype string, little-endian).
ROUTED_EXPERTS_DTYPES = {"uint8": (1, "<u1"), "uint16": (2, "<u2"), "int32": (4, "<i4")}


class RolloutdError(Exception):
    """A typed error: an error reply or failed event from the daemon, or a local failure
    (transport, timeout, undecodable message). `code` is the stable wire name."""

    def __init__(self, code: str, message: str, field: str = ""):
        super().__init__(code, message, field)
        self.code = code
        self.message = message
        self.field = field

    def __str__(self) -> str:
        s = f"{self.code}: {self.message}"
        return f"{s} (field={self.field})" if self.field else s


@dataclass
class ErrorInfo:
    code: str
    message: str
    field: str = ""

    def to_exception(self) -> RolloutdError:
        return RolloutdError(self.code, self.message, self.field)


@dataclass
class Limits:
    max_envelope_bytes: int = 4 << 20
    max_frame_bytes: int = 256 << 20
    max_frames: int = 16
    max_rid_bytes: int = 256
    max_string_bytes: int = 4096
    max_input_tokens: int = 131072
    max_new_tokens: int = 65536
    max_stop_token_ids: int = 256
    max_versions: int = 16


@dataclass
class ModelInfo:
    name: str = ""
    family: str = ""
    vocab_size: int = 0
    num_layers: int = 0
    num_moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    routed_experts_dtype: str = ""


# ----------------------------------------------------------------- requests --
@dataclass
class HelloRequest:
    client: str = "rolloutd-py"
    versions: List[int] = field(default_factory=lambda: [PROTOCOL_VERSION])


@dataclass
class StatusRequest:
    pass


@dataclass
class GenerateRequest:
    rid: str
    input_ids: List[int]
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: Optional[int] = None  # None: the daemon picks one
    stop_token_ids: List[int] = field(default_factory=list)
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = True


@dataclass
class AbortRequest:
    rid: Optional[str] = None  # exactly one of rid / all
    all: bool = False


@dataclass
class ShutdownRequest:
    drain: bool = True
    deadline_s: float = 30.0


# ------------------------------------------------------------------ replies --
@dataclass
class HelloReply:
    version: int = PROTOCOL_VERSION
    daemon: str = "rolloutd"
    build: str = ""
    gpu: int = -1
    model: ModelInfo = field(default_factory=ModelInfo)
    weight_version: int = 0
    limits: Limits = field(default_factory=Limits)


@dataclass
class StatusReply:
    state: str = ""
    ready: bool = False
    reason: str = ""
    weight_version: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_requests_total: int = 0
    num_tokens_generated_total: int = 0
    uptime_s: float = 0.0
    build: str = ""
    model: ModelInfo = field(default_factory=ModelInfo)


@dataclass
class GenerateReply:
    rid: str = ""


@dataclass
class AbortReply:
    num_aborted: int = 0


@dataclass
class ShutdownReply:
    accepted: bool = True


# ------------------------------------------------------------------- events --
@dataclass
class RoutedExperts:
    """Logical expert ids of `shape` = (tokens, moe_layers, top_k), raw little-endian bytes;
    row i is sequence position start_pos + i."""

    dtype: str  # "uint8" | "uint16" | "int32"
    shape: Tuple[int, int, int]
    start_pos: int
    data: bytes

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    @property
    def num_layers(self) -> int:
        return self.shape[1]

    @property
    def top_k(self) -> int:
        return self.shape[2]

    def to_numpy(self):
        """A read-only numpy view of the rows with `shape` (needs numpy)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=ROUTED_EXPERTS_DTYPES[self.dtype][1]).reshape(self.shape)

    def to_list(self) -> List[List[List[int]]]:
        """The rows as nested lists [tokens][layers][top_k] (no numpy needed)."""
        tokens, layers, k = self.shape
        fmt = {"uint8": "B", "uint16": "H", "int32": "i"}[self.dtype]
        values = struct.unpack(f"<{tokens * layers * k}{fmt}", self.data)
        return [[list(values[(t * layers + l) * k:(t * layers + l + 1) * k]) for l in range(layers)]
                for t in range(tokens)]


@dataclass
class TokensEvent:
    rid: str
    token_ids: List[int]
    logprobs: List[float] = field(default_factory=list)  # empty unless return_logprob
    weight_versions: List[int] = field(default_factory=list)  # one per token
    routed_experts: Optional[RoutedExperts] = None


@dataclass
class FinishedEvent:
    rid: str
    reason: str  # "stop" | "length" | "abort"
    abort_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class FailedEvent:
    rid: str
    error: ErrorInfo


Request = Union[HelloRequest, StatusRequest, GenerateRequest, AbortRequest, ShutdownRequest]
Reply = Union[HelloReply, StatusReply, GenerateReply, AbortReply, ShutdownReply, ErrorInfo]
Event = Union[TokensEvent, FinishedEvent, FailedEvent]
