"""Trainer-side helpers for weight updates (protocol/SPEC.md §11): packing tensors into
flattened buckets, pushing a whole update, and the checksums the daemon reports.

    from rolloutd import Client, crc32_of, model_checksum
    with Client(endpoint) as c:
        c.hello()  # learn the daemon's limits: push_weights sizes buckets by them
        c.push_weights(state_dict.items(), weight_version=step)       # numpy arrays
        sums = c.weights_checksum()
        assert sums.model_checksum == model_checksum({n: crc32_of(a) for n, a in state_dict.items()})

numpy has no bfloat16: pass such a tensor as (name, "bfloat16", shape, bytes-like), e.g.
``(name, "bfloat16", list(t.shape), t.contiguous().view(torch.uint16).numpy())``, or as a
numpy array of ml_dtypes.bfloat16.
"""
from __future__ import annotations

import struct
import uuid
import zlib
from typing import TYPE_CHECKING, Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from .messages import WEIGHT_DTYPES, BucketEntry, RolloutdError, weight_dtype

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

__all__ = ["pack_bucket", "push_weights", "crc32_of", "model_checksum"]

# Bytes of one bucket entry in the envelope, beyond its name, dtype and shape: keys,
# headers and two uint64s (an upper bound), so buckets of many small tensors stay
# within the daemon's max_envelope_bytes.
_ENTRY_OVERHEAD = 72
_ENVELOPE_SLACK = 4096


class _Tensor:
    """One tensor to send: canonical dtype name, shape, and its bytes as a flat memoryview."""

    __slots__ = ("name", "dtype", "shape", "data")

    def __init__(self, name: str, dtype: str, shape: List[int], data: memoryview):
        self.name, self.dtype, self.shape, self.data = name, dtype, shape, data

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def envelope_bytes(self) -> int:
        return len(self.name.encode()) + len(self.dtype) + 9 * len(self.shape) + _ENTRY_OVERHEAD


def _le_bytes(array) -> memoryview:
    """The little-endian, row-major bytes of a numpy array, without copying when they already are."""
    import numpy as np

    a = np.asarray(array)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    return memoryview(a.reshape(-1).view(np.uint8))


def _as_tensor(index: int, item: Any) -> _Tensor:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 4):
        raise TypeError(f"tensors[{index}]: expected (name, array) or (name, dtype, shape, bytes), "
                        f"got {type(item).__name__}")
    name = item[0]
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensors[{index}]: the name must be a non-empty string")
    if len(item) == 2:
        import numpy as np

        array = np.asarray(item[1])
        dtype = weight_dtype(array.dtype.name)
        if dtype is None:
            raise ValueError(f"tensors[{index}] ('{name}'): numpy dtype {array.dtype} is not a weight dtype "
                             f"({', '.join(WEIGHT_DTYPES)}); cast it first")
        return _Tensor(name, dtype, [int(d) for d in array.shape], _le_bytes(array))
    _, dtype_name, shape, data = item
    dtype = weight_dtype(str(dtype_name))
    if dtype is None:
        raise ValueError(f"tensors[{index}] ('{name}'): unknown dtype '{dtype_name}'")
    shape = [int(d) for d in shape]
    if any(d < 0 for d in shape):
        raise ValueError(f"tensors[{index}] ('{name}'): negative dimension in shape {shape}")
    view = memoryview(data)
    if not view.contiguous:
        raise ValueError(f"tensors[{index}] ('{name}'): the bytes must be contiguous")
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    expected = WEIGHT_DTYPES[dtype][0]
    for d in shape:
        expected *= d
    if len(view) != expected:
        raise ValueError(f"tensors[{index}] ('{name}'): {len(view)} bytes, but shape {shape} of {dtype} is "
                         f"{expected}")
    return _Tensor(name, dtype, shape, view)


def _layout(tensors: Sequence[_Tensor], align: int) -> Tuple[List[BucketEntry], int]:
    entries, offset = [], 0
    for t in tensors:
        offset = -(-offset // align) * align
        entries.append(BucketEntry(t.name, t.dtype, list(t.shape), offset, t.nbytes))
        offset += t.nbytes
    return entries, offset


def _pack(tensors: Sequence[_Tensor], align: int) -> Tuple[List[BucketEntry], bytes]:
    entries, total = _layout(tensors, align)
    parts, end = [], 0
    for t, e in zip(tensors, entries):
        if e.byte_offset > end:
            parts.append(bytes(e.byte_offset - end))
        parts.append(t.data)
        end = e.byte_offset + e.nbytes
    return entries, b"".join(parts)  # the one copy of the tensors' bytes


def pack_bucket(tensors: Iterable[Any], align: int = 64) -> Tuple[List[BucketEntry], bytes]:
    """Packs tensors into one flattened bucket: (entries, bytes) for update_weights.

    Each item is (name, numpy array) — its numpy dtype names the wire dtype (float32,
    float16, int8, ..., ml_dtypes' bfloat16 and float8 types too) — or (name, dtype, shape,
    bytes-like) with the raw little-endian row-major bytes (bfloat16 from torch, say).
    Each tensor starts at a multiple of `align` bytes (zero padding in between)."""
    if align < 1:
        raise ValueError("align must be >= 1")
    return _pack([_as_tensor(i, t) for i, t in enumerate(tensors)], align)


def crc32_of(data: Any) -> int:
    """zlib CRC-32 of bytes-like data, or of a numpy array's little-endian row-major bytes:
    what weights_checksum reports for a parameter holding that array (SPEC §11.5)."""
    if hasattr(data, "dtype") and hasattr(data, "shape") and not isinstance(data, memoryview):
        data = _le_bytes(data)
    return zlib.crc32(data)


def model_checksum(checksums: Mapping[str, int]) -> int:
    """The whole-model checksum of SPEC §11.5 from name -> per-parameter CRC-32: CRC-32 of
    name (UTF-8) + NUL + checksum (4 bytes, little-endian), concatenated in name order."""
    crc = 0
    for name in sorted(checksums):
        crc = zlib.crc32(name.encode() + b"\0" + struct.pack("<I", checksums[name]), crc)
    return crc


def _buckets(tensors: Sequence[_Tensor], max_bytes: int, max_entries: int, max_envelope: int,
             align: int) -> List[List[_Tensor]]:
    """Greedy, in order: a bucket closes when the next tensor would take it past max_bytes (a
    bigger tensor travels alone), max_entries, or an envelope of max_envelope bytes."""
    buckets: List[List[_Tensor]] = []
    current: List[_Tensor] = []
    size = envelope = 0
    for t in tensors:
        start = -(-size // align) * align
        if current and (start + t.nbytes > max_bytes or len(current) >= max_entries
                        or envelope + t.envelope_bytes() > max_envelope):
            buckets.append(current)
            current, start, envelope = [], 0, 0
        current.append(t)
        size = start + t.nbytes
        envelope += t.envelope_bytes()
    if current:
        buckets.append(current)
    return buckets


def push_weights(client: "Client", tensors: Iterable[Any], weight_version: int, *, bucket_bytes: int = 256 << 20,
                 via: str = "inline", shm_name: Optional[str] = None, checksum: bool = False,
                 selector: Optional[Sequence[str]] = None, timeout_s: float = 60.0, align: int = 64):
    """Client.push_weights: begin, every bucket, end; aborts the session on any failure."""
    if via not in ("inline", "shm"):
        raise ValueError(f"via must be 'inline' or 'shm', got {via!r}")
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    items = [_as_tensor(i, t) for i, t in enumerate(tensors)]
    limits = client.limits
    max_bytes = bucket_bytes
    if via == "inline":
        max_bytes = min(bucket_bytes, limits.max_frame_bytes)
        for t in items:
            if t.nbytes > limits.max_frame_bytes:
                raise ValueError(f"'{t.name}' is {t.nbytes} bytes, more than the daemon's max_frame_bytes "
                                 f"({limits.max_frame_bytes}); send it with via='shm'")
    max_envelope = max(limits.max_envelope_bytes - _ENVELOPE_SLACK, 1)
    buckets = _buckets(items, max_bytes, max(limits.max_bucket_entries, 1), max_envelope, align)

    shm = None
    begun = client.begin_weight_update(selector, timeout_s)
    session = begun.session
    if weight_version < begun.weight_version:
        # end_weight_update would refuse it after every bucket was written, and the abort then
        # leaves the daemon not_ready: refuse now, with nothing written.
        client.abort_weight_update(session)
        raise RolloutdError("invalid_argument", f"weight_version {weight_version} is below the daemon's serving "
                            f"version {begun.weight_version}; versions never decrease", "weight_version")
    try:
        if via == "inline":
            for bucket in buckets:
                entries, data = _pack(bucket, align)
                client.update_weights_inline(session, entries, data, checksum=True if checksum else None)
        elif buckets:
            from multiprocessing import shared_memory

            region = max(_layout(b, align)[1] for b in buckets)
            name = (shm_name or f"/rolloutd-{uuid.uuid4().hex}").lstrip("/")
            shm = shared_memory.SharedMemory(name=name, create=True, size=max(region, 1))
            for bucket in buckets:
                entries, size = _layout(bucket, align)
                buf, end = shm.buf, 0
                for t, e in zip(bucket, entries):
                    buf[end:e.byte_offset] = bytes(e.byte_offset - end)  # padding: keep buckets deterministic
                    buf[e.byte_offset:e.byte_offset + e.nbytes] = t.data
                    end = e.byte_offset + e.nbytes
                # The daemon has copied the region and unmapped it once this returns (SPEC
                # §11.3), so the next bucket may overwrite it.
                client.update_weights_shm(session, entries, "/" + shm.name, 0, size,
                                          checksum=zlib.crc32(buf[:size]) if checksum else None)
        return client.end_weight_update(session, weight_version)
    except BaseException:
        try:
            client.abort_weight_update(session)
        except RolloutdError:
            pass  # the session may be gone already (expired, or the daemon with it)
        raise
    finally:
        if shm is not None:
            shm.close()
            shm.unlink()
