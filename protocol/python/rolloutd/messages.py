"""The v1 wire messages as dataclasses (mirrors protocol/messages.hpp; SPEC.md is normative).

Field order is wire order: rolloutd.wire writes map keys in the order fields are
declared here, which is the order SPEC.md and the C++ encoders use.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

PROTOCOL_VERSION = 1

# Routed-expert dtype name -> (bytes per element, numpy dtype string, little-endian).
ROUTED_EXPERTS_DTYPES = {"uint8": (1, "<u1"), "uint16": (2, "<u2"), "int32": (4, "<i4")}

# Weight dtypes of update_weights entries (mirrors kernels/dtype.cpp): PyTorch name ->
# (bytes per stored element, safetensors name). float4_e2m1fn_x2 stores two E2M1 values
# per element (byte), so a shape counts bytes, as torch.float4_e2m1fn_x2 does.
WEIGHT_DTYPES = {
    "float32": (4, "F32"), "bfloat16": (2, "BF16"), "float16": (2, "F16"),
    "float8_e4m3fn": (1, "F8_E4M3"), "float8_e8m0fnu": (1, "F8_E8M0"), "float4_e2m1fn_x2": (1, "F4"),
    "uint8": (1, "U8"), "int8": (1, "I8"), "uint16": (2, "U16"), "int16": (2, "I16"), "uint32": (4, "U32"),
    "int32": (4, "I32"), "int64": (8, "I64"), "bool": (1, "BOOL"),
}
_DTYPE_ALIASES = {**{st: name for name, (_, st) in WEIGHT_DTYPES.items()}, "float": "float32", "half": "float16"}

PAUSE_MODES = ("abort", "retract", "in_place")
# Memory tags of release_memory / resume_memory (SPEC §12), in canonical order; None = all.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
MAX_TOP_LOGPROBS = 20  # generate.top_logprobs_num
MAX_DEADLINE_S = 86400.0  # generate.deadline_s

# GPU weight transports (SPEC §11.7): sizes fixed by NCCL and CUDA.
NCCL_UNIQUE_ID_BYTES = 128  # ncclUniqueId
CUDA_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t
DEVICE_UUID_BYTES = 16  # cudaDeviceProp.uuid
MAX_DEVICE_BUCKET_BYTES = 1 << 40  # NcclSource.size, CudaIpcSource.size
MIN_WEIGHT_GROUP_SIZE, MAX_WEIGHT_GROUP_SIZE = 2, 65536


def nccl_version_string(code: int) -> str:
    """"2.28.9" for NCCL_VERSION_CODE 22809 (X*10000 + Y*100 + Z from 2.9 on, X*1000 + Y*100 + Z before)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def weight_dtype(name: str) -> Optional[str]:
    """The canonical (PyTorch) name of a weight dtype given by its PyTorch name, with or
    without "torch.", or its safetensors name; None if it is not one."""
    if name.startswith("torch."):
        name = name[len("torch."):]
    return name if name in WEIGHT_DTYPES else _DTYPE_ALIASES.get(name)


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
    max_bucket_entries: int = 65536


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
    # [0, MAX_TOP_LOGPROBS]: n > 0 adds the n most likely tokens of every sampled token (SPEC §4.1);
    # written only when n > 0.
    top_logprobs_num: int = 0
    # Seconds from the daemon's receipt, [0, MAX_DEADLINE_S]; then the request ends with
    # finished{abort, deadline} wherever it is. 0 = none; written only when > 0.
    deadline_s: float = 0.0


@dataclass
class AbortRequest:
    rid: Optional[str] = None  # exactly one of rid / all
    all: bool = False


@dataclass
class ShutdownRequest:
    drain: bool = True
    deadline_s: float = 30.0


# ---- weight updates and generation control (SPEC §11) ----
@dataclass
class BeginWeightUpdateRequest:
    selector: Optional[List[str]] = None  # parameter-name prefixes; None = every parameter
    timeout_s: float = 60.0  # idle deadline of the session


@dataclass
class BucketEntry:
    """One tensor of a bucket: its bytes are [byte_offset, byte_offset + nbytes) of the bucket buffer."""

    name: str
    dtype: str  # PyTorch name ("bfloat16"); safetensors names are accepted
    shape: List[int]
    byte_offset: int
    nbytes: int


@dataclass
class InlineSource:
    """The bucket buffer travels as a payload frame of the update_weights message. Encoding
    appends `data` as a payload frame (and sets `frame`); decoding sets `data` to that frame."""

    frame: int = 0
    data: Any = None  # bytes-like


@dataclass
class ShmSource:
    """The bucket buffer is [offset, offset + size) of POSIX shared memory `name` ("/...")."""

    name: str
    offset: int = 0
    size: int = 0


@dataclass
class NcclSource:
    """The bucket buffer is `size` bytes that rank `root` (the trainer) broadcasts over the NCCL
    group `group` (joined with init_weight_group) into the daemon's staging buffer."""

    group: str
    root: int = 0
    size: int = 0


@dataclass
class CudaIpcSource:
    """The bucket buffer is [offset, offset + size) of the CUDA allocation exported as `handle`
    (64-byte cudaIpcMemHandle_t) on the GPU `device_uuid` (16 bytes), the daemon's own."""

    handle: bytes
    offset: int = 0
    size: int = 0
    device_uuid: bytes = b""


@dataclass
class BucketChecksum:
    algo: str = "crc32"
    value: int = 0  # zlib.crc32 of the whole bucket buffer


@dataclass
class UpdateWeightsRequest:
    session: int = 0
    load_format: str = "flattened_bucket"
    entries: List[BucketEntry] = field(default_factory=list)
    source: Union[InlineSource, ShmSource, NcclSource, CudaIpcSource] = field(default_factory=InlineSource)
    checksum: Optional[BucketChecksum] = None


@dataclass
class EndWeightUpdateRequest:
    session: int
    weight_version: int


@dataclass
class AbortWeightUpdateRequest:
    session: int


@dataclass
class GetWeightsByNameRequest:
    name: str
    truncate: int = 100


@dataclass
class WeightsChecksumRequest:
    names: Optional[List[str]] = None  # None = every parameter


@dataclass
class PauseGenerationRequest:
    mode: str  # "abort" | "retract" | "in_place"


@dataclass
class ContinueGenerationRequest:
    pass


@dataclass
class InitWeightGroupRequest:
    """Join the NCCL group the trainer (rank `root`) created; the reply comes once joined."""

    group: str
    unique_id: bytes  # 128 bytes: bytes((v + 256) % 256 for v in cupy.cuda.nccl.get_unique_id())
    world_size: int
    rank: int
    root: int = 0
    nccl_version: int = 0  # NCCL_VERSION_CODE of the trainer's NCCL (cupy.cuda.nccl.get_version())
    timeout_s: float = 120.0  # bounds the join and each broadcast


@dataclass
class DestroyWeightGroupRequest:
    group: str


@dataclass
class ReleaseMemoryRequest:
    """Give the GPU memory of these tags back (addresses stay reserved); the daemon must be idle."""

    tags: Optional[List[str]] = None  # subset of MEMORY_TAGS; None = every tag


@dataclass
class ResumeMemoryRequest:
    """Map memory again under these tags, at the same addresses (static state written back)."""

    tags: Optional[List[str]] = None


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
    nccl_version: int = 0  # the NCCL the daemon loaded; 0 = none (SPEC §11.7)
    device_uuid: bytes = b""  # 16 bytes of the daemon's GPU; empty on the CPU backend


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
    paused: bool = False  # pause_generation in effect
    update_session: int = 0  # open weight-update session, 0 = none


@dataclass
class GenerateReply:
    rid: str = ""


@dataclass
class AbortReply:
    num_aborted: int = 0


@dataclass
class ShutdownReply:
    accepted: bool = True


@dataclass
class BeginWeightUpdateReply:
    session: int = 0
    weight_version: int = 0  # serving when the session began
    num_parameters_restored: int = 0


@dataclass
class UpdateWeightsReply:
    session: int = 0
    num_entries: int = 0
    num_bytes: int = 0
    duration_s: float = 0.0


@dataclass
class EndWeightUpdateReply:
    session: int = 0
    weight_version: int = 0
    num_buckets: int = 0
    num_entries: int = 0
    num_bytes: int = 0
    num_parameters_updated: int = 0
    duration_s: float = 0.0
    postprocess_s: float = 0.0


@dataclass
class AbortWeightUpdateReply:
    session: int = 0
    state: str = ""  # "ready" | "not_ready"


@dataclass
class GetWeightsByNameReply:
    name: str = ""
    dtype: str = ""
    shape: List[int] = field(default_factory=list)
    values: List[float] = field(default_factory=list)  # first `truncate` elements, flattened


@dataclass
class ParameterChecksum:
    name: str
    dtype: str
    shape: List[int]
    checksum: int  # zlib.crc32 of the checkpoint-layout bytes


@dataclass
class WeightsChecksumReply:
    algo: str = "crc32"
    weight_version: int = 0
    model_checksum: int = 0
    parameters: List[ParameterChecksum] = field(default_factory=list)  # sorted by name


@dataclass
class PauseGenerationReply:
    num_aborted: int = 0
    num_retracted: int = 0
    num_paused: int = 0


@dataclass
class ContinueGenerationReply:
    num_resumed: int = 0


@dataclass
class InitWeightGroupReply:
    group: str = ""
    nccl_version: int = 0  # the daemon's loaded NCCL
    rank: int = 0
    world_size: int = 0
    duration_s: float = 0.0


@dataclass
class DestroyWeightGroupReply:
    group: str = ""


@dataclass
class ReleaseMemoryReply:
    tags: List[str] = field(default_factory=list)  # tags this call released (already released ones not listed)
    num_bytes: int = 0  # physical bytes given back
    duration_s: float = 0.0


@dataclass
class ResumeMemoryReply:
    tags: List[str] = field(default_factory=list)  # tags this call resumed
    num_bytes: int = 0  # physical bytes mapped
    duration_s: float = 0.0


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
    # The request's top_logprobs_num n (0: not asked, both lists empty); token j's n most likely
    # tokens are entries [j*n, (j+1)*n), raw logit descending, id ascending on ties (SPEC §4.1, §4.3).
    top_logprobs_num: int = 0
    top_token_ids: List[int] = field(default_factory=list)
    top_logprobs: List[float] = field(default_factory=list)


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


@dataclass
class RetractedEvent:
    """Not final: the request restarts from its prompt under new weights; everything received
    for this rid so far is void. More events follow."""

    rid: str
    num_tokens_discarded: int = 0
    reason: str = ""  # "weight_update"


Request = Union[HelloRequest, StatusRequest, GenerateRequest, AbortRequest, ShutdownRequest,
                BeginWeightUpdateRequest, UpdateWeightsRequest, EndWeightUpdateRequest, AbortWeightUpdateRequest,
                GetWeightsByNameRequest, WeightsChecksumRequest, PauseGenerationRequest, ContinueGenerationRequest,
                InitWeightGroupRequest, DestroyWeightGroupRequest, ReleaseMemoryRequest, ResumeMemoryRequest]
Reply = Union[HelloReply, StatusReply, GenerateReply, AbortReply, ShutdownReply, ErrorInfo, BeginWeightUpdateReply,
              UpdateWeightsReply, EndWeightUpdateReply, AbortWeightUpdateReply, GetWeightsByNameReply,
              WeightsChecksumReply, PauseGenerationReply, ContinueGenerationReply, InitWeightGroupReply,
              DestroyWeightGroupReply, ReleaseMemoryReply, ResumeMemoryReply]
Event = Union[TokensEvent, FinishedEvent, FailedEvent, RetractedEvent]
