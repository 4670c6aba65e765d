"""msgpack codec for the v1 messages (protocol/SPEC.md).

A message is a list of frames: the envelope, a msgpack map {v, type, id, body},
then payload frames (routed-expert rows, an inline weight bucket). Encoders write SPEC's canonical form
(keys in SPEC order, floats as float64, integers in their smallest form), the
same bytes as the C++ encoders. They check only what the wire can carry (types,
integer widths) and leave range rules to the daemon, which answers with a typed
error. Decoders apply SPEC's rules and raise RolloutdError naming the field.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import msgpack

from .messages import (CUDA_IPC_HANDLE_BYTES, DEVICE_UUID_BYTES, MAX_DEVICE_BUCKET_BYTES, MAX_WEIGHT_GROUP_SIZE,
                       MAX_DEADLINE_S, MAX_TOP_LOGPROBS, MEMORY_TAGS, MIN_WEIGHT_GROUP_SIZE, NCCL_UNIQUE_ID_BYTES, PAUSE_MODES, PROTOCOL_VERSION,
                       ROUTED_EXPERTS_DTYPES, WEIGHT_DTYPES, AbortReply, AbortRequest, AbortWeightUpdateReply,
                       AbortWeightUpdateRequest, BeginWeightUpdateReply, BeginWeightUpdateRequest, BucketChecksum,
                       BucketEntry, ContinueGenerationReply, ContinueGenerationRequest, CudaIpcSource,
                       DestroyWeightGroupReply, DestroyWeightGroupRequest, EndWeightUpdateReply,
                       EndWeightUpdateRequest, ErrorInfo, FailedEvent, FinishedEvent, GenerateReply, GenerateRequest,
                       GetWeightsByNameReply, GetWeightsByNameRequest, HelloReply, HelloRequest, InitWeightGroupReply,
                       InitWeightGroupRequest, InlineSource, Limits, ModelInfo, NcclSource, ParameterChecksum,
                       PauseGenerationReply, PauseGenerationRequest, ReleaseMemoryReply, ReleaseMemoryRequest,
                       ResumeMemoryReply, ResumeMemoryRequest, RetractedEvent, RolloutdError, RoutedExperts,
                       ShmSource, ShutdownReply, ShutdownRequest, StatusReply, StatusRequest, TokensEvent,
                       UpdateWeightsReply, UpdateWeightsRequest, WeightsChecksumReply, WeightsChecksumRequest,
                       weight_dtype)

__all__ = ["Decoded", "encode", "decode", "type_name", "REQUEST_TYPES", "REPLY_TYPES", "EVENT_TYPES"]

# SPEC §9: parse-time bounds on any container, before a field is read.
_MAX_MAP_ENTRIES = 128
# SPEC §4.1: fixed bounds of the weight-update messages.
MAX_TENSOR_RANK = 8
MAX_TENSOR_DIM = 2**40
MAX_GET_WEIGHTS_TRUNCATE = 1_000_000
_SHM_NAME = re.compile(r"/[A-Za-z0-9._-]{1,250}")
_GROUP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass
class Decoded:
    """One received message: envelope type and id, and the decoded body."""

    type: str
    id: int
    body: Any


class _Ctx:
    """What a field codec may need besides its value: payload frames and limits."""

    def __init__(self, frames: List[bytes], limits: Limits):
        self.frames, self.limits = frames, limits


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _wrong_type(expected: str, v: Any, path: str) -> RolloutdError:
    return RolloutdError("wrong_type", f"expected {expected}, got {type(v).__name__}", path)


# ---- field kinds: each encodes a Python value to a msgpack object and back --
class _Kind:
    def encode(self, v: Any, path: str, ctx: _Ctx) -> Any:
        raise NotImplementedError

    def decode(self, v: Any, path: str, ctx: _Ctx) -> Any:
        raise NotImplementedError


class _Int(_Kind):
    """An integer of a wire width [lo, hi]; decoders also apply SPEC's [min, max] and a limit."""

    def __init__(self, lo: int, hi: int, min: Optional[int] = None, max: Optional[int] = None,
                 limit: Optional[str] = None):
        self.lo, self.hi, self.min, self.max, self.limit = lo, hi, min, max, limit

    def encode(self, v, path, ctx):
        if isinstance(v, (bool, float)) or not hasattr(v, "__index__"):
            raise _wrong_type("an integer", v, path)
        v = int(v)  # numpy / torch integers too
        if not self.lo <= v <= self.hi:
            raise RolloutdError("out_of_range", f"{v} does not fit in [{self.lo}, {self.hi}]", path)
        return v

    def decode(self, v, path, ctx):
        if isinstance(v, bool) or not isinstance(v, int):
            raise _wrong_type("an integer", v, path)
        lo = self.lo if self.min is None else self.min
        hi = self.hi if self.max is None else self.max
        if self.limit is not None:
            hi = min(hi, getattr(ctx.limits, self.limit))
        if not lo <= v <= hi:
            raise RolloutdError("out_of_range", f"must be in [{lo}, {hi}], got {v}", path)
        return v


class _Float(_Kind):
    """float64 on the wire; decoders check [lo, hi] (or (lo, hi]) when given, which NaN fails."""

    def __init__(self, lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def encode(self, v, path, ctx):
        if isinstance(v, bool) or not hasattr(v, "__float__"):
            raise _wrong_type("a number", v, path)
        return float(v)

    def decode(self, v, path, ctx):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _wrong_type("a number", v, path)
        v = float(v)
        if self.lo is not None:
            inside = (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi
            if not inside or math.isnan(v):
                bounds = f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}]"
                raise RolloutdError("out_of_range", f"must be in {bounds}, got {v}", path)
        return v


class _Bool(_Kind):
    def encode(self, v, path, ctx):
        if isinstance(v, (str, bytes)) or not hasattr(v, "__bool__"):
            raise _wrong_type("a bool", v, path)
        return bool(v)  # numpy bools too

    def decode(self, v, path, ctx):
        if not isinstance(v, bool):
            raise _wrong_type("a bool", v, path)
        return v


class _Str(_Kind):
    def __init__(self, limit: str = "max_string_bytes", non_empty: bool = False, values: Sequence[str] = ()):
        self.limit, self.non_empty, self.values = limit, non_empty, tuple(values)

    def encode(self, v, path, ctx):
        if not isinstance(v, str):
            raise _wrong_type("a string", v, path)
        return v

    def decode(self, v, path, ctx):
        if not isinstance(v, str):
            raise _wrong_type("a string", v, path)
        limit = getattr(ctx.limits, self.limit)
        if len(v.encode()) > limit:
            raise RolloutdError("too_large", f"longer than {limit} bytes", path)
        if self.non_empty and not v:
            raise RolloutdError("invalid_argument", "must not be empty", path)
        if self.values and v not in self.values:
            raise RolloutdError("invalid_argument", f"unknown value '{v}'; expected {', '.join(self.values)}", path)
        return v


class _Bin(_Kind):
    """Raw bytes as msgpack bin (handles, ids, uuids); decoders want one of `sizes` bytes."""

    def __init__(self, *sizes: int):
        self.sizes = sizes

    def encode(self, v, path, ctx):
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise _wrong_type("bytes", v, path)
        return bytes(v)

    def decode(self, v, path, ctx):
        if not isinstance(v, bytes):
            raise _wrong_type("bin", v, path)
        if len(v) not in self.sizes:
            raise RolloutdError("invalid_argument", f"{len(v)} bytes; must be exactly "
                                f"{' or '.join(map(str, self.sizes))}", path)
        return v


class _GroupName(_Str):
    """An NCCL weight group's name: ^[A-Za-z0-9._-]{1,64}$."""

    def decode(self, v, path, ctx):
        v = super().decode(v, path, ctx)
        if not _GROUP_NAME.fullmatch(v):
            raise RolloutdError("invalid_argument", f"'{v}' is not a weight-group name: 1 to 64 of "
                                "A-Z a-z 0-9 . _ -", path)
        return v


class _List(_Kind):
    """An array; `limit` names a Limits field bounding its length, `max_len` is a fixed bound."""

    def __init__(self, item: _Kind, limit: Optional[str] = None, non_empty: bool = False,
                 max_len: Optional[int] = None, scale: int = 1):
        self.item, self.limit, self.non_empty, self.max_len, self.scale = item, limit, non_empty, max_len, scale

    def encode(self, v, path, ctx):
        if hasattr(v, "tolist"):  # numpy arrays, torch tensors
            v = v.tolist()
        if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
            raise _wrong_type("a sequence", v, path)
        return [self.item.encode(x, f"{path}[{i}]", ctx) for i, x in enumerate(v)]

    def decode(self, v, path, ctx):
        if not isinstance(v, list):
            raise _wrong_type("an array", v, path)
        limit = getattr(ctx.limits, self.limit) * self.scale if self.limit is not None else self.max_len
        if limit is not None and len(v) > limit:
            raise RolloutdError("too_large", f"{len(v)} entries, limit {limit}", path)
        if self.non_empty and not v:
            raise RolloutdError("invalid_argument", "must not be empty", path)
        return [self.item.decode(x, f"{path}[{i}]", ctx) for i, x in enumerate(v)]


class _Nullable(_Kind):
    """nil or the inner kind (SPEC's "nil ok"); written as nil when None, absent reads as None."""

    def __init__(self, inner: _Kind):
        self.inner = inner

    def encode(self, v, path, ctx):
        return None if v is None else self.inner.encode(v, path, ctx)

    def decode(self, v, path, ctx):
        return None if v is None else self.inner.decode(v, path, ctx)


def _equals_default(value: Any, default: Any) -> bool:
    # Sequences by length, so numpy arrays and tensors compare without an ambiguous truth value.
    if isinstance(default, list):
        return len(value) == 0
    return value == default


class _Struct(_Kind):
    """A map for dataclass `cls`: fields [(name, kind)] in wire order. Fields named in
    `optional` may be absent (dataclass default); unknown keys are ignored."""

    def __init__(self, cls, fields, optional: Sequence[str] = (), omitted_when: Optional[Dict[str, Any]] = None):
        self.cls, self.fields = cls, tuple(fields)
        # Fields added to a message later that encoders leave out at these values, so a message
        # that does not use them keeps its older bytes (they are optional for decoders too).
        self.omitted_when = dict(omitted_when or {})
        self.optional = frozenset(optional) | frozenset(self.omitted_when)

    def encode(self, v, path, ctx):
        if not isinstance(v, self.cls):
            raise _wrong_type(self.cls.__name__, v, path)
        return {name: kind.encode(getattr(v, name), _join(path, name), ctx) for name, kind in self.fields
                if name not in self.omitted_when or not _equals_default(getattr(v, name), self.omitted_when[name])}

    def decode(self, v, path, ctx):
        if not isinstance(v, dict):
            raise _wrong_type("a map", v, path)
        values = {}
        for name, kind in self.fields:
            if name in v:
                values[name] = kind.decode(v[name], _join(path, name), ctx)
            elif isinstance(kind, _Nullable):
                values[name] = None
            elif name not in self.optional:
                raise RolloutdError("missing_field", f"'{name}' is required", _join(path, name))
        return self.cls(**values)


class _AbortBody(_Struct):
    """abort: {rid, all}, rid omitted when absent; decoders want exactly one of rid and all: true."""

    def __init__(self):
        super().__init__(AbortRequest, [("rid", _Nullable(_Str("max_rid_bytes", non_empty=True))), ("all", _Bool())],
                         optional=("all",))

    def encode(self, v, path, ctx):
        body = super().encode(v, path, ctx)
        if body["rid"] is None:
            del body["rid"]
        return body

    def decode(self, v, path, ctx):
        r = super().decode(v, path, ctx)
        if (r.rid is None) == (not r.all):
            raise RolloutdError("invalid_argument", "give either rid or all=true, not both" if r.all
                                else "give rid or all=true", path)
        return r


class _RoutedExpertsKind(_Kind):
    """{dtype, num_tokens, num_layers, top_k, start_pos, frame}; the rows are payload frame
    `frame`, which is nil when they are 0 bytes."""

    _FIELDS = (("dtype", _Str(values=tuple(ROUTED_EXPERTS_DTYPES))), ("num_tokens", _Int(0, 2**32 - 1)),
               ("num_layers", _Int(0, 2**32 - 1)), ("top_k", _Int(0, 2**32 - 1)),
               ("start_pos", _Int(0, 2**32 - 1)), ("frame", _Nullable(_Int(0, 2**32 - 1))))

    def encode(self, v, path, ctx):
        if not isinstance(v, RoutedExperts):
            raise _wrong_type("RoutedExperts", v, path)
        tokens, layers, k = v.shape
        if v.dtype not in ROUTED_EXPERTS_DTYPES:
            raise RolloutdError("invalid_argument", f"unknown routed-experts dtype '{v.dtype}'", _join(path, "dtype"))
        if len(v.data) != tokens * layers * k * ROUTED_EXPERTS_DTYPES[v.dtype][0]:
            raise RolloutdError("invalid_argument", f"{len(v.data)} bytes do not match shape {tuple(v.shape)} "
                                f"of {v.dtype}", _join(path, "frame"))
        frame = None
        if v.data:
            frame = len(ctx.frames)
            ctx.frames.append(bytes(v.data))
        values = (v.dtype, tokens, layers, k, v.start_pos, frame)
        return {name: kind.encode(x, _join(path, name), ctx) for (name, kind), x in zip(self._FIELDS, values)}

    def decode(self, v, path, ctx):
        if not isinstance(v, dict):
            raise _wrong_type("a map", v, path)
        d = {}
        for name, kind in self._FIELDS:
            if name not in v and not isinstance(kind, _Nullable):
                raise RolloutdError("missing_field", f"'{name}' is required", _join(path, name))
            d[name] = kind.decode(v.get(name), _join(path, name), ctx)
        shape = (d["num_tokens"], d["num_layers"], d["top_k"])
        expected = shape[0] * shape[1] * shape[2] * ROUTED_EXPERTS_DTYPES[d["dtype"]][0]
        frame_path = _join(path, "frame")
        if d["frame"] is None:
            if expected:
                raise RolloutdError("missing_field", f"{expected} bytes of rows need a payload frame", frame_path)
            data = b""
        else:
            if d["frame"] >= len(ctx.frames):
                raise RolloutdError("out_of_range", f"payload frame {d['frame']} of {len(ctx.frames)}", frame_path)
            data = bytes(ctx.frames[d["frame"]])
            if len(data) != expected:
                raise RolloutdError("invalid_argument", f"frame holds {len(data)} bytes, shape needs {expected}",
                                    frame_path)
        return RoutedExperts(dtype=d["dtype"], shape=shape, start_pos=d["start_pos"], data=data)


class _TokensBody(_Struct):
    """tokens: per-token arrays must agree in length (logprobs may be empty)."""

    def decode(self, v, path, ctx):
        r = super().decode(v, path, ctx)
        if r.logprobs and len(r.logprobs) != len(r.token_ids):
            raise RolloutdError("invalid_argument", f"{len(r.logprobs)} logprobs for {len(r.token_ids)} tokens",
                                _join(path, "logprobs"))
        if len(r.weight_versions) != len(r.token_ids):
            raise RolloutdError("invalid_argument", f"{len(r.weight_versions)} weight versions for "
                                f"{len(r.token_ids)} tokens", _join(path, "weight_versions"))
        want = len(r.token_ids) * r.top_logprobs_num
        for name in ("top_token_ids", "top_logprobs"):
            n = len(getattr(r, name))
            if n != want:
                raise RolloutdError("invalid_argument", f"{n} entries for {len(r.token_ids)} tokens of "
                                    f"{r.top_logprobs_num} (top_logprobs_num)", _join(path, name))
        return r

    def encode(self, v, path, ctx):
        # The three top-log-prob keys travel together: all written when n > 0, none otherwise (the
        # C++ encoder's rule, so both write the same bytes).
        body = super().encode(v, path, ctx)
        if v.top_logprobs_num > 0:
            body.setdefault("top_token_ids", [])
            body.setdefault("top_logprobs", [])
        else:
            body.pop("top_token_ids", None)
            body.pop("top_logprobs", None)
        return body


# ---- weight updates (SPEC §11) ----
class _DType(_Str):
    """A weight dtype name, PyTorch or safetensors spelling; written and read back as the PyTorch name."""

    def encode(self, v, path, ctx):
        v = super().encode(v, path, ctx)
        return weight_dtype(v) or v  # an unknown name is the daemon's to refuse

    def decode(self, v, path, ctx):
        v = super().decode(v, path, ctx)
        canonical = weight_dtype(v)
        if canonical is None:
            raise RolloutdError("invalid_argument", f"unknown dtype '{v}'; expected a PyTorch or safetensors name",
                                path)
        return canonical


def _shape_bytes(shape: Sequence[int], element_bytes: int) -> int:
    n = element_bytes
    for d in shape:
        n *= d
    return n


class _BucketEntryKind(_Struct):
    """One entry: nbytes must be product(shape) * dtype size, and the end must fit 64 bits."""

    def decode(self, v, path, ctx):
        e = super().decode(v, path, ctx)
        expected = _shape_bytes(e.shape, WEIGHT_DTYPES[e.dtype][0])
        if expected >= 2**64:
            raise RolloutdError("out_of_range", f"shape {e.shape} of {e.dtype} is more than 2^64 bytes",
                                _join(path, "shape"))
        if e.nbytes != expected:
            raise RolloutdError("invalid_argument", f"{e.nbytes} bytes, but shape {e.shape} of {e.dtype} is "
                                f"{expected}", _join(path, "nbytes"))
        if e.byte_offset + e.nbytes >= 2**64:
            raise RolloutdError("out_of_range", "byte_offset + nbytes overflows 64 bits", _join(path, "byte_offset"))
        return e


_U64_MAX = 2**64 - 1
_DIM_MAX = min(_U64_MAX, MAX_TENSOR_DIM)
# Any accepted dtype spelling -> its canonical name, filled on first sight from weight_dtype()
# (only names it accepts are kept, so the table stays as small as the set of spellings).
_CANONICAL_DTYPE: Dict[str, str] = {}


def _canonical_dtype(name: Any) -> Optional[str]:
    """weight_dtype(name) for a str (None for anything else), memoized."""
    if type(name) is not str:
        return None
    canonical = _CANONICAL_DTYPE.get(name)
    if canonical is None:
        canonical = weight_dtype(name)
        if canonical is not None:
            _CANONICAL_DTYPE[name] = canonical
    return canonical


class _BucketEntries(_List):
    """update_weights.entries: a bucket may hold 65,536 entries, and the generic walk (a kind
    call and a path string per field) cost ~0.4 us per field on the trainer's hot path (issue 7:
    3-4 us of a 12 us per-tensor push). Entries whose fields are already the plain types (str,
    list of int, int in range) are written directly, with the same keys in the same order, so
    the bytes are unchanged; any other entry goes through the generic kind, which converts it
    (numpy integers, tuples) or raises the error naming its field. Decoding mirrors every check
    of _BucketEntryKind the same way: an entry that fails one is decoded again by the generic
    kind, which raises the error with its path."""

    def encode(self, v, path, ctx):
        if hasattr(v, "tolist") or isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
            return super().encode(v, path, ctx)
        out = []
        append = out.append
        canonical = _CANONICAL_DTYPE
        for i, e in enumerate(v):
            if type(e) is BucketEntry:
                name, shape, off, nb = e.name, e.shape, e.byte_offset, e.nbytes
                dtype = canonical.get(e.dtype) if type(e.dtype) is str else None
                if dtype is None:
                    dtype = _canonical_dtype(e.dtype)
                if (type(name) is str and dtype is not None and type(shape) is list and type(off) is int
                        and type(nb) is int and 0 <= off <= _U64_MAX and 0 <= nb <= _U64_MAX):
                    for d in shape:
                        if type(d) is not int or not 0 <= d <= _U64_MAX:
                            break
                    else:
                        append({"name": name, "dtype": dtype, "shape": shape, "byte_offset": off, "nbytes": nb})
                        continue
            append(self.item.encode(e, f"{path}[{i}]", ctx))
        return out

    def decode(self, v, path, ctx):
        if not isinstance(v, list):
            raise _wrong_type("an array", v, path)
        limit = getattr(ctx.limits, self.limit)
        if len(v) > limit:
            raise RolloutdError("too_large", f"{len(v)} entries, limit {limit}", path)
        if not v:
            raise RolloutdError("invalid_argument", "must not be empty", path)
        # A name of at most max_string_bytes / 4 characters is within the byte limit whatever
        # its UTF-8 length; longer ones are measured.
        max_bytes = ctx.limits.max_string_bytes
        short = max_bytes // 4
        sizes = {name: size for name, (size, _) in WEIGHT_DTYPES.items()}
        out = []
        append = out.append
        for i, m in enumerate(v):
            e = None
            if type(m) is dict:
                name, dtype, shape, off, nb = (m.get("name"), m.get("dtype"), m.get("shape"), m.get("byte_offset"),
                                               m.get("nbytes"))
                canonical = _canonical_dtype(dtype)
                if (type(name) is str and name and (len(name) <= short or len(name.encode()) <= max_bytes)
                        and canonical is not None and (len(dtype) <= short or len(dtype.encode()) <= max_bytes)
                        and type(shape) is list and len(shape) <= MAX_TENSOR_RANK
                        and type(off) is int and type(nb) is int and 0 <= off <= _U64_MAX and 0 <= nb <= _U64_MAX):
                    expected = sizes[canonical]
                    for d in shape:
                        if type(d) is not int or not 0 <= d <= _DIM_MAX:
                            expected = -1
                            break
                        expected *= d
                    if 0 <= expected < 2**64 and nb == expected and off + nb < 2**64:
                        e = BucketEntry(name, canonical, shape, off, nb)
            append(e if e is not None else self.item.decode(m, f"{path}[{i}]", ctx))
        return out


class _SourceKind(_Kind):
    """{kind: "inline", frame} | {kind: "shm", name, offset, size} | {kind: "nccl", group, root, size}
    | {kind: "cuda_ipc", handle, offset, size, device_uuid}."""

    def encode(self, v, path, ctx):
        if isinstance(v, InlineSource):
            frame = v.frame
            if v.data is not None:
                frame = len(ctx.frames)
                ctx.frames.append(v.data)
            return {"kind": "inline", "frame": _U32.encode(frame, _join(path, "frame"), ctx)}
        if isinstance(v, ShmSource):
            return {"kind": "shm", "name": _STR.encode(v.name, _join(path, "name"), ctx),
                    "offset": _U64.encode(v.offset, _join(path, "offset"), ctx),
                    "size": _U64.encode(v.size, _join(path, "size"), ctx)}
        if isinstance(v, NcclSource):
            return {"kind": "nccl", "group": _STR.encode(v.group, _join(path, "group"), ctx),
                    "root": _U32.encode(v.root, _join(path, "root"), ctx),
                    "size": _U64.encode(v.size, _join(path, "size"), ctx)}
        if isinstance(v, CudaIpcSource):
            return {"kind": "cuda_ipc", "handle": _HANDLE.encode(v.handle, _join(path, "handle"), ctx),
                    "offset": _U64.encode(v.offset, _join(path, "offset"), ctx),
                    "size": _U64.encode(v.size, _join(path, "size"), ctx),
                    "device_uuid": _UUID.encode(v.device_uuid, _join(path, "device_uuid"), ctx)}
        raise _wrong_type("InlineSource, ShmSource, NcclSource or CudaIpcSource", v, path)

    def decode(self, v, path, ctx):
        if not isinstance(v, dict):
            raise _wrong_type("a map", v, path)

        def field(name, kind):
            if name not in v:
                raise RolloutdError("missing_field", f"'{name}' is required", _join(path, name))
            return kind.decode(v[name], _join(path, name), ctx)

        kind = field("kind", _STR)
        if kind == "inline":
            frame = field("frame", _U32)
            if frame >= len(ctx.frames):
                raise RolloutdError("out_of_range", f"payload frame {frame} of {len(ctx.frames)}",
                                    _join(path, "frame"))
            return InlineSource(frame=frame, data=ctx.frames[frame])
        if kind == "shm":
            name = field("name", _STR)
            if not _SHM_NAME.fullmatch(name) or name in ("/.", "/.."):
                raise RolloutdError("invalid_argument", f"'{name}' is not a shared-memory name: '/' then 1 to 250 "
                                    "of A-Z a-z 0-9 . _ -", _join(path, "name"))
            offset, size = field("offset", _U64), field("size", _U64)
            if offset + size >= 2**64:
                raise RolloutdError("out_of_range", "offset + size overflows 64 bits", _join(path, "size"))
            return ShmSource(name=name, offset=offset, size=size)
        if kind == "nccl":
            group = field("group", _GroupName())
            return NcclSource(group=group, root=field("root", _U32), size=field("size", _DEVICE_SIZE))
        if kind == "cuda_ipc":
            handle, offset, size = field("handle", _HANDLE), field("offset", _U64), field("size", _DEVICE_SIZE)
            if offset + size >= 2**64:
                raise RolloutdError("out_of_range", "offset + size overflows 64 bits", _join(path, "size"))
            return CudaIpcSource(handle=handle, offset=offset, size=size, device_uuid=field("device_uuid", _UUID))
        raise RolloutdError("invalid_argument", f"unknown source kind '{kind}'; expected inline, shm, nccl or "
                            "cuda_ipc", _join(path, "kind"))


class _UpdateWeightsBody(_Struct):
    """update_weights: after the fields, the checks that need every entry (SPEC §11.2), in the
    C++ decoder's order: inside the buffer, no shared byte, no name twice."""

    def decode(self, v, path, ctx):
        r = super().decode(v, path, ctx)
        entries = _join(path, "entries")
        if isinstance(r.source, InlineSource):
            size, what = len(r.source.data), f"payload frame {r.source.frame}"
        elif isinstance(r.source, ShmSource):
            size, what = r.source.size, "shared-memory region"
        elif isinstance(r.source, NcclSource):
            size, what = r.source.size, "broadcast buffer"
        else:
            size, what = r.source.size, "CUDA IPC range"
        for i, e in enumerate(r.entries):
            if e.byte_offset + e.nbytes > size:
                raise RolloutdError("out_of_range", f"bytes [{e.byte_offset}, {e.byte_offset + e.nbytes}) lie "
                                    f"outside the {what} of {size} bytes", f"{entries}[{i}].byte_offset")
        order = sorted((e.byte_offset, i) for i, e in enumerate(r.entries) if e.nbytes > 0)
        furthest_end, furthest = 0, None
        for offset, i in order:
            end = offset + r.entries[i].nbytes
            if furthest is not None and offset < furthest_end:
                raise RolloutdError("invalid_argument", f"bytes [{offset}, {end}) overlap entries[{furthest}]",
                                    f"{entries}[{i}]")
            if furthest is None or end > furthest_end:
                furthest_end, furthest = end, i
        seen = {}
        for i, e in enumerate(r.entries):
            if e.name in seen:
                raise RolloutdError("invalid_argument", f"'{e.name}' is also entries[{seen[e.name]}]",
                                    f"{entries}[{i}].name")
            seen[e.name] = i
        return r


class _InitGroupBody(_Struct):
    """init_weight_group: after the fields, the rank checks (the C++ decoder's order)."""

    def decode(self, v, path, ctx):
        r = super().decode(v, path, ctx)
        if r.rank >= r.world_size:
            raise RolloutdError("out_of_range", f"rank {r.rank} is not below world_size {r.world_size}",
                                _join(path, "rank"))
        if r.root >= r.world_size:
            raise RolloutdError("out_of_range", f"root {r.root} is not below world_size {r.world_size}",
                                _join(path, "root"))
        if r.rank == r.root:
            raise RolloutdError("invalid_argument", f"rank {r.rank} is the root's: the daemon receives, the "
                                "trainer (root) broadcasts", _join(path, "rank"))
        return r


_U32 = _Int(0, 2**32 - 1)
_U64 = _Int(0, 2**64 - 1)
_I32 = _Int(-(2**31), 2**31 - 1)
_TOKEN = _Int(-(2**31), 2**31 - 1, min=0)
_F64, _BOOL, _STR = _Float(), _Bool(), _Str()
_RID = _Str("max_rid_bytes")
_HANDLE = _Bin(CUDA_IPC_HANDLE_BYTES)
_UUID = _Bin(DEVICE_UUID_BYTES)
_DEVICE_SIZE = _Int(0, 2**64 - 1, max=MAX_DEVICE_BUCKET_BYTES)

_MODEL = _Struct(ModelInfo, [("name", _STR), ("family", _STR), ("vocab_size", _U32), ("num_layers", _U32),
                             ("num_moe_layers", _U32), ("num_experts", _U32), ("top_k", _U32),
                             ("routed_experts_dtype", _STR)])
# Fields added after the first v1 daemons (with the weight-update messages) are optional
# for decoders: an older daemon omits them.
_LIMITS = _Struct(Limits, [("max_envelope_bytes", _U64), ("max_frame_bytes", _U64), ("max_frames", _U32),
                           ("max_rid_bytes", _U32), ("max_string_bytes", _U32), ("max_input_tokens", _U32),
                           ("max_new_tokens", _U32), ("max_stop_token_ids", _U32), ("max_versions", _U32),
                           ("max_bucket_entries", _U32)], optional=("max_bucket_entries",))
# Codes are an open set: a newer daemon's code passes through.
_ERROR = _Struct(ErrorInfo, [("code", _STR), ("message", _STR), ("field", _STR)])
_SHAPE = _List(_Int(0, 2**64 - 1, max=MAX_TENSOR_DIM), max_len=MAX_TENSOR_RANK)
class _DistinctNames(_List):
    """weights_checksum.names: the first name (in list order) seen before is refused."""

    def decode(self, v, path, ctx):
        names = super().decode(v, path, ctx)
        seen = set()
        for i, name in enumerate(names):
            if name in seen:
                raise RolloutdError("invalid_argument", f"'{name}' is listed twice", f"{path}[{i}]")
            seen.add(name)
        return names


# nil = all; an empty list is refused (it would select nothing by accident).
_NAMES = _Nullable(_List(_Str(non_empty=True), limit="max_bucket_entries", non_empty=True))
_DISTINCT_NAMES = _Nullable(_DistinctNames(_Str(non_empty=True), limit="max_bucket_entries", non_empty=True))

class _MemoryTags(_DistinctNames):
    """release_memory/resume_memory.tags: distinct (checked first, as the C++ decoder does), then known."""

    def decode(self, v, path, ctx):
        tags = super().decode(v, path, ctx)
        for i, tag in enumerate(tags):
            if tag not in MEMORY_TAGS:
                raise RolloutdError("invalid_argument", f"unknown memory tag '{tag}'; expected weights, kv_cache or "
                                    "cuda_graph", f"{path}[{i}]")
        return tags


_MEMORY_TAGS = _Nullable(_MemoryTags(_Str(non_empty=True), limit="max_bucket_entries", non_empty=True))

# Wire type name -> body kind, by direction.
REQUEST_TYPES: Dict[str, _Kind] = {
    "hello": _Struct(HelloRequest, [("client", _STR),
                                    ("versions", _List(_U32, limit="max_versions", non_empty=True))],
                     optional=("client",)),
    "status": _Struct(StatusRequest, []),
    "generate": _Struct(GenerateRequest, [
        ("rid", _Str("max_rid_bytes", non_empty=True)),
        ("input_ids", _List(_TOKEN, limit="max_input_tokens", non_empty=True)),
        ("max_new_tokens", _Int(0, 2**32 - 1, min=1, limit="max_new_tokens")),
        ("temperature", _Float(0.0, 100.0)), ("top_p", _Float(0.0, 1.0, lo_open=True)),
        ("top_k", _Int(-(2**31), 2**31 - 1, min=0)), ("min_p", _Float(0.0, 1.0)), ("seed", _Nullable(_U64)),
        ("stop_token_ids", _List(_TOKEN, limit="max_stop_token_ids")), ("return_logprob", _BOOL),
        ("return_routed_experts", _BOOL), ("routed_experts_start_len", _U32), ("stream", _BOOL),
        ("top_logprobs_num", _Int(0, 2**32 - 1, max=MAX_TOP_LOGPROBS)),
        ("deadline_s", _Float(0.0, MAX_DEADLINE_S))],
        optional=("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "return_logprob",
                  "return_routed_experts", "routed_experts_start_len", "stream"),
        omitted_when={"top_logprobs_num": 0, "deadline_s": 0.0}),
    "abort": _AbortBody(),
    "shutdown": _Struct(ShutdownRequest, [("drain", _BOOL), ("deadline_s", _Float(0.0, 3600.0))],
                        optional=("drain", "deadline_s")),
    "begin_weight_update": _Struct(BeginWeightUpdateRequest, [
        ("selector", _NAMES), ("timeout_s", _Float(0.0, 3600.0, lo_open=True))], optional=("timeout_s",)),
    "update_weights": _UpdateWeightsBody(UpdateWeightsRequest, [
        ("session", _U64), ("load_format", _Str(values=("flattened_bucket",))),
        ("entries", _BucketEntries(_BucketEntryKind(BucketEntry, [
            ("name", _Str(non_empty=True)), ("dtype", _DType()), ("shape", _SHAPE), ("byte_offset", _U64),
            ("nbytes", _U64)]),
            limit="max_bucket_entries", non_empty=True)),
        ("source", _SourceKind()),
        ("checksum", _Nullable(_Struct(BucketChecksum, [("algo", _Str(values=("crc32",))), ("value", _U32)])))]),
    "end_weight_update": _Struct(EndWeightUpdateRequest, [("session", _U64), ("weight_version", _U64)]),
    "abort_weight_update": _Struct(AbortWeightUpdateRequest, [("session", _U64)]),
    "get_weights_by_name": _Struct(GetWeightsByNameRequest, [
        ("name", _Str(non_empty=True)), ("truncate", _Int(0, 2**32 - 1, max=MAX_GET_WEIGHTS_TRUNCATE))],
        optional=("truncate",)),
    "weights_checksum": _Struct(WeightsChecksumRequest, [("names", _DISTINCT_NAMES)]),
    "pause_generation": _Struct(PauseGenerationRequest, [("mode", _Str(values=PAUSE_MODES))]),
    "continue_generation": _Struct(ContinueGenerationRequest, []),
    "init_weight_group": _InitGroupBody(InitWeightGroupRequest, [
        ("group", _GroupName()), ("unique_id", _Bin(NCCL_UNIQUE_ID_BYTES)),
        ("world_size", _Int(0, 2**32 - 1, min=MIN_WEIGHT_GROUP_SIZE, max=MAX_WEIGHT_GROUP_SIZE)),
        ("rank", _U32), ("root", _U32), ("nccl_version", _U32), ("timeout_s", _Float(0.0, 3600.0, lo_open=True))],
        optional=("root", "timeout_s")),
    "destroy_weight_group": _Struct(DestroyWeightGroupRequest, [("group", _GroupName())]),
    "release_memory": _Struct(ReleaseMemoryRequest, [("tags", _MEMORY_TAGS)]),
    "resume_memory": _Struct(ResumeMemoryRequest, [("tags", _MEMORY_TAGS)]),
}
REPLY_TYPES: Dict[str, _Kind] = {
    # nccl_version and device_uuid came with the GPU weight transports (SPEC §11.7): optional.
    "hello.ok": _Struct(HelloReply, [("version", _U32), ("daemon", _STR), ("build", _STR), ("gpu", _I32),
                                     ("model", _MODEL), ("weight_version", _U64), ("limits", _LIMITS),
                                     ("nccl_version", _U32), ("device_uuid", _Bin(0, DEVICE_UUID_BYTES))],
                        optional=("nccl_version", "device_uuid")),
    "status.ok": _Struct(StatusReply, [
        ("state", _STR), ("ready", _BOOL), ("reason", _STR), ("weight_version", _U64), ("num_waiting", _U32),
        ("num_running", _U32), ("num_requests_total", _U64), ("num_tokens_generated_total", _U64),
        ("uptime_s", _F64), ("build", _STR), ("model", _MODEL), ("paused", _BOOL), ("update_session", _U64)],
        optional=("paused", "update_session")),
    "generate.ok": _Struct(GenerateReply, [("rid", _RID)]),
    "abort.ok": _Struct(AbortReply, [("num_aborted", _U32)]),
    "shutdown.ok": _Struct(ShutdownReply, [("accepted", _BOOL)]),
    "error": _ERROR,
    "begin_weight_update.ok": _Struct(BeginWeightUpdateReply, [
        ("session", _U64), ("weight_version", _U64), ("num_parameters_restored", _U32)]),
    "update_weights.ok": _Struct(UpdateWeightsReply, [
        ("session", _U64), ("num_entries", _U32), ("num_bytes", _U64), ("duration_s", _F64)]),
    "end_weight_update.ok": _Struct(EndWeightUpdateReply, [
        ("session", _U64), ("weight_version", _U64), ("num_buckets", _U32), ("num_entries", _U64),
        ("num_bytes", _U64), ("num_parameters_updated", _U32), ("duration_s", _F64), ("postprocess_s", _F64)]),
    "abort_weight_update.ok": _Struct(AbortWeightUpdateReply, [("session", _U64), ("state", _STR)]),
    "get_weights_by_name.ok": _Struct(GetWeightsByNameReply, [
        ("name", _STR), ("dtype", _STR), ("shape", _SHAPE),
        ("values", _List(_F64, max_len=MAX_GET_WEIGHTS_TRUNCATE))]),  # any float, NaN included
    "weights_checksum.ok": _Struct(WeightsChecksumReply, [
        ("algo", _Str(values=("crc32",))), ("weight_version", _U64), ("model_checksum", _U32),
        ("parameters", _List(_Struct(ParameterChecksum, [("name", _STR), ("dtype", _STR), ("shape", _SHAPE),
                                                         ("checksum", _U32)]), limit="max_bucket_entries"))]),
    "pause_generation.ok": _Struct(PauseGenerationReply, [
        ("num_aborted", _U32), ("num_retracted", _U32), ("num_paused", _U32)]),
    "continue_generation.ok": _Struct(ContinueGenerationReply, [("num_resumed", _U32)]),
    "init_weight_group.ok": _Struct(InitWeightGroupReply, [
        ("group", _STR), ("nccl_version", _U32), ("rank", _U32), ("world_size", _U32), ("duration_s", _F64)]),
    "destroy_weight_group.ok": _Struct(DestroyWeightGroupReply, [("group", _STR)]),
    "release_memory.ok": _Struct(ReleaseMemoryReply, [
        ("tags", _List(_STR, max_len=len(MEMORY_TAGS))), ("num_bytes", _U64), ("duration_s", _F64)]),
    "resume_memory.ok": _Struct(ResumeMemoryReply, [
        ("tags", _List(_STR, max_len=len(MEMORY_TAGS))), ("num_bytes", _U64), ("duration_s", _F64)]),
}
EVENT_TYPES: Dict[str, _Kind] = {
    "tokens": _TokensBody(TokensEvent, [
        ("rid", _RID), ("token_ids", _List(_TOKEN, limit="max_new_tokens")),
        ("logprobs", _List(_F64, limit="max_new_tokens")),  # any float, -inf included
        ("weight_versions", _List(_U64, limit="max_new_tokens")),
        ("routed_experts", _Nullable(_RoutedExpertsKind())),
        # SPEC §4.3: only in events of requests with top_logprobs_num > 0.
        ("top_logprobs_num", _Int(0, 2**32 - 1, max=MAX_TOP_LOGPROBS)),
        ("top_token_ids", _List(_TOKEN, limit="max_new_tokens", scale=MAX_TOP_LOGPROBS)),
        ("top_logprobs", _List(_F64, limit="max_new_tokens", scale=MAX_TOP_LOGPROBS))],  # any float, -inf included
        omitted_when={"top_logprobs_num": 0, "top_token_ids": [], "top_logprobs": []}),
    "finished": _Struct(FinishedEvent, [("rid", _RID), ("reason", _Str(values=("stop", "length", "abort"))),
                                        ("abort_reason", _STR), ("prompt_tokens", _U32),
                                        ("completion_tokens", _U32)]),
    "failed": _Struct(FailedEvent, [("rid", _RID), ("error", _ERROR)]),
    "retracted": _Struct(RetractedEvent, [("rid", _RID), ("num_tokens_discarded", _U32), ("reason", _STR)]),
}
_KINDS: Dict[str, _Kind] = {**REQUEST_TYPES, **REPLY_TYPES, **EVENT_TYPES}
_TYPE_OF = {kind.cls: name for name, kind in _KINDS.items()}


def type_name(message: Any) -> str:
    """The envelope type of a message object ("generate", "hello.ok", "error", "tokens", ...)."""
    try:
        return _TYPE_OF[type(message)]
    except KeyError:
        raise TypeError(f"not a rolloutd message: {type(message).__name__}") from None


def encode(msg_id: int, message: Any) -> List[bytes]:
    """Frames of one message: the envelope, then its payload frames."""
    ctx = _Ctx([], Limits())
    body = _KINDS[type_name(message)].encode(message, "body", ctx)
    envelope = {"v": PROTOCOL_VERSION, "type": type_name(message), "id": _U64.encode(msg_id, "id", ctx),
                "body": body}
    return [msgpack.packb(envelope, use_bin_type=True)] + ctx.frames


class _DuplicateKey(Exception):
    pass


def _map_from_pairs(pairs):
    # Decoders that keep the first and those that keep the last duplicate would read
    # different messages (SPEC §3): refuse both.
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _DuplicateKey()
    return d


def _unpack(data: bytes, limits: Limits) -> Any:
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, object_pairs_hook=_map_from_pairs,
            max_array_len=max(limits.max_input_tokens, limits.max_stop_token_ids, limits.max_versions,
                              limits.max_new_tokens, limits.max_bucket_entries, MAX_GET_WEIGHTS_TRUNCATE),
            max_map_len=_MAX_MAP_ENTRIES, max_str_len=max(limits.max_string_bytes, limits.max_rid_bytes),
            max_bin_len=limits.max_string_bytes, max_ext_len=limits.max_string_bytes)
    except _DuplicateKey:
        raise RolloutdError("bad_message", "duplicate map key", "") from None
    except UnicodeDecodeError as e:
        raise RolloutdError("invalid_argument", f"invalid UTF-8: {e}", "") from None
    except Exception as e:  # msgpack raises several unrelated types on bad input
        if "exceeds max_" in str(e):  # the parse-time bounds of SPEC §9
            raise RolloutdError("too_large", str(e), "") from None
        raise RolloutdError("bad_message", f"not msgpack: {e or type(e).__name__}", "") from None


def decode(frames: Sequence[bytes], limits: Optional[Limits] = None) -> Decoded:
    """Decodes one message (any direction); raises RolloutdError naming the bad field."""
    limits = limits or Limits()
    if not frames:
        raise RolloutdError("bad_message", "a message needs an envelope frame", "")
    if len(frames[0]) > limits.max_envelope_bytes:
        raise RolloutdError("too_large", f"envelope of {len(frames[0])} bytes, limit {limits.max_envelope_bytes}",
                            "")
    if len(frames) - 1 > limits.max_frames:
        raise RolloutdError("too_large", f"{len(frames) - 1} payload frames, limit {limits.max_frames}", "")
    env = _unpack(frames[0], limits)
    if not isinstance(env, dict):
        raise RolloutdError("bad_message", "envelope is not a map", "")
    ctx = _Ctx(list(frames[1:]), limits)
    if "v" not in env:
        raise RolloutdError("missing_field", "'v' is required", "v")
    if isinstance(env["v"], bool) or not isinstance(env["v"], int):
        raise _wrong_type("an integer", env["v"], "v")
    if env["v"] != PROTOCOL_VERSION:
        raise RolloutdError("unsupported_version", f"protocol version {env['v']}; this side speaks "
                            f"{PROTOCOL_VERSION}", "v")
    for key in ("id", "type"):
        if key not in env:
            raise RolloutdError("missing_field", f"'{key}' is required", key)
    msg_id = _U64.decode(env["id"], "id", ctx)
    type_ = _STR.decode(env["type"], "type", ctx)
    kind = _KINDS.get(type_)
    if kind is None:
        raise RolloutdError("unknown_type", f"unknown message type '{type_}'", "type")
    return Decoded(type=type_, id=msg_id, body=kind.decode(env.get("body", {}), "body", ctx))
