"""The trainer side of the GPU weight transports (protocol/SPEC.md §11.7), for PyTorch.

    import torch
    from rolloutd import Client
    from rolloutd.trainer import NcclWeightGroup, push_weights

    clients = [Client(ep) for ep in endpoints]          # one per daemon
    with NcclWeightGroup(clients, device=torch.cuda.current_device()) as group:
        for step in range(num_steps):
            ...                                           # train
            push_weights(clients, model.state_dict().items(), weight_version=step, via="nccl", group=group)

    # A daemon on this process's GPU (colocated): no group, CUDA IPC handles.
    push_weights([colocated], model.state_dict().items(), weight_version=step, via="cuda_ipc")

torch and CuPy are imported when a function needs them: importing this module needs neither,
and the planning and checksum helpers work without them (numpy for the checksums).

Why CuPy: torch.cuda.nccl.init_rank does not work on the GPU host's Python, while CuPy's
NcclCommunicator does, and it uses the NCCL that ships with PyTorch (the `nvidia-nccl` wheel),
which is the library the daemon must load too (nccl_lib_dir()).

Clients are used from the calling thread only (rolloutd.Client is not thread-safe): requests to
many daemons are kept in flight together with Client.send_request / wait=False instead of threads.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import importlib.util
import os
import re
import sys
import threading
import time
import uuid as _uuid
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from .client import Client, PendingReply
from .messages import (WEIGHT_DTYPES, AbortWeightUpdateReply, AbortWeightUpdateRequest, BeginWeightUpdateReply,
                       BeginWeightUpdateRequest, BucketEntry, EndWeightUpdateReply, EndWeightUpdateRequest,
                       HelloReply, HelloRequest, RolloutdError, PROTOCOL_VERSION, nccl_version_string, weight_dtype)
from .weights import model_checksum

__all__ = ["NcclWeightGroup", "push_weights", "pack_device_bucket", "ipc_export", "device_uuid", "find_device",
           "crc32_of_tensor", "expected_checksums", "ExpectedChecksums", "plan_buckets", "PlannedBucket",
           "TensorInfo", "unique_id_bytes", "nccl_lib_dir", "daemon_env"]

# Offsets of packed tensors: 256 bytes, the alignment cudaMalloc gives and more than any
# element needs, so a byte slice of the staging buffer can be viewed as any dtype.
DEFAULT_ALIGN = 256
DEFAULT_BUCKET_BYTES = 512 << 20
# A bucket whose tensors already lie back to back in device memory (views of one flat buffer,
# or a tensor bigger than a bucket) is sent from where it is, with no staging copy, if the
# gaps between them are at most this many bytes (allocator rounding).
_DIRECT_MAX_GAP = 4096
# Bytes of one bucket entry in the envelope beyond its name, dtype and shape (as weights.py).
_ENTRY_OVERHEAD = 72
_ENVELOPE_SLACK = 4096
# Buckets in flight per daemon: its staging is double-buffered (SPEC §11.7).
_PIPELINE_DEPTH = 2
# CUDA IPC buckets in flight per daemon: it queues each bucket's copies behind the previous
# one's and acknowledges each when its copies are done, so the device stays busy as long as the
# next request is already there. Staged (packed) buckets are also bounded by the two slots.
_IPC_PIPELINE_DEPTH = 4
# CUDA IPC: a tensor at least this big in a bucket that would be packed is sent from where it
# lies as a bucket of its own. Packing it copies its bytes once more on the same GPU (the
# daemon's copy is the other), ~2 x size / 2 TB/s; a bucket more costs ~20-40 us of messages that
# overlap the copies in flight: the two break even near 40 MB.
_IPC_SPLIT_DIRECT_BYTES = 64 << 20

# push_weights pauses Python's cyclic garbage collector from describing the tensors to the last
# reply: 10,000 small tensors make ~30,000 objects that live until the push ends, enough to set
# off collections that walk a trainer's whole heap (torch and CuPy imported: millions of objects)
# in the middle of it (describe went from 1.3 to 10+ us per tensor in such reps on the H200, and
# the push's own objects were promoted to older generations on the way). Nothing the push makes
# forms reference cycles, so they are freed by reference counting when it returns; collection
# resumes (if it was on) right after. The pause spans the push's waits for replies and
# broadcasts too: other threads' cyclic garbage waits for the end of the push (set this False
# in a process whose other threads make much of it while pushes run).
PAUSE_GC_DURING_PUSH = True
_gc_lock = threading.Lock()
_gc_depth = 0           # pushes inside _gc_paused now (pushes on several threads at once)
_gc_reenable = False    # the outermost pause found the collector on


@contextlib.contextmanager
def _gc_paused(active: bool):
    """The collector off while any push runs; back on when the last one ends, and only if it was
    on when the first one began (a pause nested or overlapping on another thread neither turns
    it on early nor leaves it off)."""
    global _gc_depth, _gc_reenable
    if not active:
        yield
        return
    with _gc_lock:
        if _gc_depth == 0:
            _gc_reenable = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_reenable:
                gc.enable()


# After a failed bucket: how long to wait for broadcasts already posted before giving the
# group up (aborting it); a broadcast that does not complete means the ranks are out of step.
_SETTLE_S = 10.0
_GROUP_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


# ----------------------------------------------------------------------------- environment --
def nccl_lib_dir() -> Optional[str]:
    """The folder of the NCCL library that PyTorch ships (`<site-packages>/nvidia/nccl/lib`), or
    None. Start the daemon with LD_LIBRARY_PATH pointing there, so that it loads the same NCCL as
    the trainer (SPEC §11.7: two NCCL versions cannot form a group). Found without importing
    torch: from the `nvidia.nccl` package, else next to torch's own install."""
    candidates = []
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [os.path.join(p, "lib") for p in (spec.submodule_search_locations or [])]
        if spec.origin:
            candidates.append(os.path.join(os.path.dirname(spec.origin), "lib"))
    try:
        torch_spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        torch_spec = None
    if torch_spec is not None and torch_spec.origin:
        site = os.path.dirname(os.path.dirname(torch_spec.origin))
        candidates.append(os.path.join(site, "nvidia", "nccl", "lib"))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "libnccl.so.2")):
            return os.path.abspath(d)
    return None


def daemon_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of `env` (default os.environ) whose LD_LIBRARY_PATH starts with nccl_lib_dir(), for
    starting a daemon that must join this trainer's NCCL groups. Unchanged when none is found."""
    out = dict(os.environ if env is None else env)
    d = nccl_lib_dir()
    if d:
        rest = [p for p in out.get("LD_LIBRARY_PATH", "").split(":") if p and p != d]
        out["LD_LIBRARY_PATH"] = ":".join([d] + rest)
    return out


def unique_id_bytes(uid: Sequence[int]) -> bytes:
    """The 128 bytes init_weight_group carries, from cupy.cuda.nccl.get_unique_id()'s 128 signed chars."""
    out = bytes((int(v) + 256) % 256 for v in uid)
    if len(out) != 128:
        raise ValueError(f"an ncclUniqueId has 128 bytes, got {len(out)}")
    return out


def _torch():
    import torch

    return torch


def _cupy():
    # torch first: its libtorch_cuda loads PyTorch's own libnccl.so.2 (by RPATH), and CuPy's NCCL
    # module, loaded after it, then binds to that same library. The other way round CuPy could
    # load the system's libnccl.so.2, and the soname being taken, torch would get it too.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    import cupy
    import cupy.cuda.nccl  # noqa: F401  (raises here if CuPy was built without NCCL)

    return cupy


def _device_index(device: Any) -> int:
    """An int CUDA ordinal from None (torch's current device), an int, "cuda:N" or a torch.device."""
    if device is None:
        return int(_torch().cuda.current_device())
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        m = re.fullmatch(r"(?:cuda:)?(\d+)", device)
        if not m:
            if device == "cuda":
                return int(_torch().cuda.current_device())
            raise ValueError(f"not a CUDA device: {device!r}")
        return int(m.group(1))
    index = getattr(device, "index", None)
    if getattr(device, "type", "cuda") != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return int(_torch().cuda.current_device()) if index is None else int(index)


def device_uuid(device: Any = None) -> bytes:
    """The 16-byte UUID of a CUDA device of this process (what hello.ok.device_uuid reports for a
    daemon's), from torch, else CuPy."""
    index = _device_index(device)
    try:
        props = _torch().cuda.get_device_properties(index)
        u = props.uuid
        raw = getattr(u, "bytes", None)
        if raw is None:
            raw = _uuid.UUID(str(u).replace("GPU-", "")).bytes
        raw = bytes(raw)
        if len(raw) == 16:
            return raw
    except (ImportError, AttributeError, ValueError):
        pass
    raw = _cupy().cuda.runtime.getDeviceProperties(index)["uuid"]
    return bytes(raw)


def find_device(uuid_bytes: bytes) -> Optional[int]:
    """The ordinal of this process's CUDA device with that UUID, or None (not visible here)."""
    torch = _torch()
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == bytes(uuid_bytes):
            return i
    return None


# -------------------------------------------------------------------------------- planning --
@dataclass
class TensorInfo:
    """What planning needs of one tensor. `ptr` is its device address when it is a contiguous
    tensor on `device` (a direct bucket may be sent from there), else None."""

    name: str
    dtype: str  # wire name ("bfloat16")
    shape: List[int]
    nbytes: int
    ptr: Optional[int] = None
    device: Optional[int] = None
    tensor: Any = None  # the object itself, for packing


@dataclass
class PlannedBucket:
    """One update_weights: its entries and buffer size. `direct_ptr` is set when the tensors already
    lie in device memory as the entries say (offsets relative to direct_ptr): the bytes are sent
    from there. Otherwise they are packed into a staging buffer at the entries' offsets."""

    items: List[TensorInfo]
    entries: List[BucketEntry]
    size: int
    direct_ptr: Optional[int] = None

    @property
    def direct(self) -> bool:
        return self.direct_ptr is not None


def _direct_layout(items: Sequence[TensorInfo], device: Optional[int]) -> Optional[Tuple[int, List[int], int]]:
    """(base pointer, offsets, size) when `items` lie back to back (in order, no overlap, gaps of at
    most _DIRECT_MAX_GAP) on `device`; None otherwise. Empty tensors fit anywhere (offset 0)."""
    placed = [t for t in items if t.nbytes > 0]
    if device is None or not placed or any(t.ptr is None or t.device != device for t in placed):
        return None
    base, end = placed[0].ptr, placed[0].ptr
    for t in placed:
        if t.ptr < end or t.ptr - end > _DIRECT_MAX_GAP:
            return None
        end = t.ptr + t.nbytes
    offsets = [0 if t.nbytes == 0 else t.ptr - base for t in items]
    return base, offsets, end - base


def plan_buckets(items: Sequence[TensorInfo], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 max_entries: int = 65536, max_envelope_bytes: int = 4 << 20, align: int = DEFAULT_ALIGN,
                 direct_device: Optional[int] = None,
                 can_direct: Optional[Callable[[Sequence[TensorInfo]], bool]] = None,
                 split_direct_bytes: Optional[int] = None) -> List[PlannedBucket]:
    """Greedy, in order: a bucket closes when the next tensor would take its aligned size past
    `bucket_bytes` (a bigger tensor travels alone), past `max_entries` entries, or its entries past
    the envelope bound. A bucket whose tensors lie back to back on `direct_device` (and that
    `can_direct` accepts) is direct; the others are packed at `align`-byte offsets.
    `split_direct_bytes`: in a bucket that would be packed, each tensor of at least that many
    bytes that could be sent from where it lies becomes a direct bucket of its own instead (CUDA
    IPC: packing costs a copy of those bytes on the same GPU, a bucket more only a message)."""
    if bucket_bytes < 1 or align < 1 or max_entries < 1:
        raise ValueError("bucket_bytes, align and max_entries must be >= 1")
    max_envelope = max(max_envelope_bytes - _ENVELOPE_SLACK, 1)
    groups: List[List[TensorInfo]] = []
    current: List[TensorInfo] = []
    size = envelope = 0
    # Once per tensor per push, so the arithmetic is inline: `start` is `size` aligned up, and
    # t_envelope the entry's bytes in the envelope at most (name, dtype, 9 per dimension, keys).
    for t in items:
        start = -(-size // align) * align
        t_envelope = len(t.name.encode()) + len(t.dtype) + 9 * len(t.shape) + _ENTRY_OVERHEAD
        if current and (start + t.nbytes > bucket_bytes or len(current) >= max_entries
                        or envelope + t_envelope > max_envelope):
            groups.append(current)
            current, start, envelope = [], 0, 0
        current.append(t)
        size = start + t.nbytes
        envelope += t_envelope
    if current:
        groups.append(current)

    layouts = [_direct_layout(g, direct_device) for g in groups]
    if split_direct_bytes is not None:
        split: List[List[TensorInfo]] = []
        split_layouts: List[Any] = []
        for g, layout in zip(groups, layouts):
            if len(g) > 1 and layout is None:
                big = [t for t in g if t.nbytes >= split_direct_bytes and _direct_layout([t], direct_device)
                       is not None and (can_direct is None or can_direct([t]))]
                if big:
                    ids = {id(t) for t in big}
                    rest = [t for t in g if id(t) not in ids]
                    split.extend([t] for t in big)
                    split_layouts.extend(_direct_layout([t], direct_device) for t in big)
                    if rest:
                        split.append(rest)
                        split_layouts.append(_direct_layout(rest, direct_device))
                    continue
            split.append(g)
            split_layouts.append(layout)
        groups, layouts = split, split_layouts

    buckets = []
    for g, layout in zip(groups, layouts):
        if layout is not None and (can_direct is None or can_direct(g)):
            base, offsets, total = layout
            entries = [BucketEntry(t.name, t.dtype, list(t.shape), off, t.nbytes) for t, off in zip(g, offsets)]
            buckets.append(PlannedBucket(list(g), entries, total, base))
            continue
        entries, offset = [], 0
        append = entries.append
        for t in g:
            offset = -(-offset // align) * align
            append(BucketEntry(t.name, t.dtype, list(t.shape), offset, t.nbytes))
            offset += t.nbytes
        buckets.append(PlannedBucket(list(g), entries, offset))
    return buckets


def _named(named_tensors: Any) -> List[Tuple[str, Any]]:
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    out = []
    for i, item in enumerate(named_tensors):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"tensors[{i}]: expected (name, tensor), got {type(item).__name__}")
        name = item[0]
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensors[{i}]: the name must be a non-empty string")
        out.append((name, item[1]))
    return out


# torch dtype -> (wire name, bytes per element), filled on first sight: str(dtype) and the
# name lookup were a measurable share of describing a small tensor.
_TORCH_DTYPES: Dict[Any, Tuple[str, int]] = {}


def _torch_dtype(index: int, name: str, dtype: Any) -> Tuple[str, int]:
    got = _TORCH_DTYPES.get(dtype)
    if got is None:
        wire = weight_dtype(str(dtype))
        if wire is None:
            raise ValueError(f"tensors[{index}] ('{name}'): torch dtype {dtype} is not a weight dtype "
                             f"({', '.join(WEIGHT_DTYPES)}); cast it first")
        got = _TORCH_DTYPES[dtype] = (wire, WEIGHT_DTYPES[wire][0])
    return got


def _describe_torch(index: int, name: str, t: Any) -> TensorInfo:
    return _describe_all_torch([(name, t)], first_index=index)[0]


def _describe_all_torch(named: Sequence[Tuple[str, Any]], first_index: int = 0) -> List[TensorInfo]:
    """TensorInfo of every (name, tensor), in one loop. NOTES: this runs once per tensor per push
    (10,000 small tensors: it was 10-12 us each, issue 7), so it asks torch only what planning
    needs, each once: no detach() unless the tensor requires grad (state_dict() tensors do not),
    the dtype through a cache, the device as an int (get_device(): no torch.device object)."""
    torch = _torch()
    tensor_type = torch.Tensor
    dtypes = _TORCH_DTYPES
    out: List[TensorInfo] = []
    append = out.append
    for i, (name, t) in enumerate(named, first_index):
        if not isinstance(t, tensor_type):
            t = torch.as_tensor(t)
        if t.requires_grad:
            t = t.detach()
        dtype = t.dtype
        wire, element_bytes = dtypes.get(dtype) or _torch_dtype(i, name, dtype)
        nbytes = t.numel() * element_bytes
        if t.is_cuda:
            append(TensorInfo(name, wire, list(t.shape), nbytes, t.data_ptr() if nbytes and t.is_contiguous() else None,
                              t.get_device(), t))
        else:
            append(TensorInfo(name, wire, list(t.shape), nbytes, None, None, t))
    return out


# ------------------------------------------------------------------------------- checksums --
def _tensor_bytes(t: Any) -> Tuple[str, Any]:
    """(wire dtype, little-endian row-major bytes as a buffer) of a torch tensor (copied to the
    host) or a numpy array."""
    torch = sys.modules.get("torch")  # a torch tensor means torch is imported already
    if torch is not None and isinstance(t, torch.Tensor):
        dtype = weight_dtype(str(t.dtype))
        if dtype is None:
            raise ValueError(f"torch dtype {t.dtype} is not a weight dtype")
        flat = t.detach().reshape(-1)
        if not flat.is_contiguous():  # reshape of a strided view may keep strides
            flat = flat.contiguous()
        return dtype, flat.view(torch.uint8).cpu().numpy()
    from .weights import _le_bytes
    import numpy as np

    a = np.asarray(t)
    dtype = weight_dtype(a.dtype.name)
    if dtype is None:
        raise ValueError(f"numpy dtype {a.dtype} is not a weight dtype")
    return dtype, _le_bytes(a)


def crc32_of_tensor(t: Any) -> int:
    """zlib CRC-32 of a tensor's bytes in its own dtype, little-endian, row-major (copied to the
    host: for tests and checks, not the hot path). A numpy array works too."""
    return zlib.crc32(_tensor_bytes(t)[1])


def _convert_like_daemon(data: Any, src: str, dst: str) -> Any:
    """The bytes of `data` (dtype `src`) as the daemon stores them in dtype `dst`: bfloat16 <-> float32
    only, exactly as core/weights/registry.cpp and kernels/bf16.hpp do it (float32 -> bfloat16
    rounds to nearest even; a NaN stays a quiet NaN with its sign and top payload bits)."""
    import numpy as np

    if src == dst:
        return data
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if (src, dst) == ("bfloat16", "float32"):
        return (raw.view("<u2").astype("<u4") << 16).tobytes()
    if (src, dst) == ("float32", "bfloat16"):
        u = raw.view("<u4")
        nan = ((u & 0x7F800000) == 0x7F800000) & ((u & 0x007FFFFF) != 0)
        with np.errstate(over="ignore"):
            rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype("<u2")
        rounded[nan] = ((u[nan] >> 16) | 0x0040).astype("<u2")
        return rounded.tobytes()
    raise ValueError(f"the daemon converts only between bfloat16 and float32, not {src} -> {dst}")


class ExpectedChecksums(dict):
    """name -> CRC-32 as weights_checksum() would report it; .model_checksum as well."""

    model_checksum: int = 0


def expected_checksums(named_tensors: Any, stored_dtypes: Any = None) -> ExpectedChecksums:
    """What weights_checksum() reports after pushing `named_tensors` (SPEC §11.5).

    The daemon checksums each parameter in the dtype it *stores* (its checkpoint dtype), not the
    one it was sent in: a bfloat16 tensor pushed into a float32 parameter (the embedded model
    stores float32) is widened exactly, a float32 tensor into a bfloat16 parameter is rounded to
    nearest even. `stored_dtypes` says which: None (each tensor's own dtype), one dtype name for
    all, a mapping name -> dtype, or a weights_checksum() result (its parameters' dtypes).
    Tensors are copied to the host (tests and checks, not the hot path)."""
    if stored_dtypes is not None and hasattr(stored_dtypes, "parameters"):
        stored_dtypes = {p.name: p.dtype for p in stored_dtypes.parameters}
    out = ExpectedChecksums()
    for name, t in _named(named_tensors):
        dtype, data = _tensor_bytes(t)
        if stored_dtypes is None:
            target = dtype
        elif isinstance(stored_dtypes, str):
            target = stored_dtypes
        else:
            target = stored_dtypes.get(name, dtype)
        target = weight_dtype(target) or target
        out[name] = zlib.crc32(_convert_like_daemon(data, dtype, target))
    out.model_checksum = model_checksum(out)
    return out


# ----------------------------------------------------------------------- device primitives --
def pack_device_bucket(buffer: Any, named_tensors: Any, align: int = DEFAULT_ALIGN,
                       stream: Any = None) -> Tuple[List[BucketEntry], int]:
    """Packs tensors into `buffer` (a 1-D uint8 CUDA tensor) at `align`-byte offsets, in order, on
    `stream` (default: the current one), and synchronizes it. Returns (entries, size) for an
    update_weights of that buffer. A building block for hand-made buckets; push_weights does this
    (and more) itself."""
    torch = _torch()
    items = _describe_all_torch(_named(named_tensors))
    bucket = plan_buckets(items, bucket_bytes=1 << 62, max_entries=1 << 62, max_envelope_bytes=1 << 62, align=align)
    if len(bucket) != 1:
        raise ValueError("nothing to pack")
    b = bucket[0]
    if b.size > buffer.numel():
        raise ValueError(f"the tensors need {b.size} bytes, the buffer has {buffer.numel()}")
    s = stream if stream is not None else torch.cuda.current_stream(buffer.device)
    with torch.cuda.stream(s):
        _pack_into(buffer, b)
    s.synchronize()
    return b.entries, b.size


# Packing small tensors: one kernel copies every (source address, offset, size) row of a table
# into the staging buffer, a thread block per tensor, 16 bytes per thread and step where both
# ends are 16-byte aligned. NOTES: the multi-tensor copy (_foreach_copy_) needs a byte view of
# every source and every destination, two Python-level torch calls per tensor that cost ~3.5 us
# of the 12 us a small tensor took (issue 7); the table needs only the addresses that describe
# already read. Tensors above _GATHER_MAX_BYTES, strided ones and those on another device take
# the torch path (one block per tensor would copy a big one at a fraction of the device's speed).
_GATHER_MAX_BYTES = 256 << 10
_GATHER_THREADS = 256
_GATHER_SOURCE = r"""
extern "C" __global__ void rolloutd_gather_bytes(const long long* __restrict__ rows,
                                                 unsigned char* __restrict__ dst, int num_rows) {
  for (int r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const unsigned char* s = reinterpret_cast<const unsigned char*>(rows[3 * r]);
    unsigned char* d = dst + rows[3 * r + 1];
    const long long n = rows[3 * r + 2];
    long long done = 0;
    if (((reinterpret_cast<unsigned long long>(s) | reinterpret_cast<unsigned long long>(d)) & 15) == 0) {
      const long long vectors = n >> 4;
      const uint4* s4 = reinterpret_cast<const uint4*>(s);
      uint4* d4 = reinterpret_cast<uint4*>(d);
      for (long long k = threadIdx.x; k < vectors; k += blockDim.x) d4[k] = s4[k];
      done = vectors << 4;
    }
    for (long long k = done + threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
  }
}
"""
_GATHER_KERNELS: Dict[int, Any] = {}  # device -> compiled kernel, or None where it cannot be had


def _gather_kernel(device: int) -> Any:
    """The gather kernel, compiled for `device` (CuPy, NVRTC; cached on disk by CuPy), or None:
    no CuPy, a failed compile, or ROLLOUTD_PACK_GATHER=0 (the torch path only)."""
    if device in _GATHER_KERNELS:
        return _GATHER_KERNELS[device]
    kernel = None
    if os.environ.get("ROLLOUTD_PACK_GATHER", "1") != "0":
        try:
            cupy = _cupy()
            with cupy.cuda.Device(device):
                kernel = cupy.RawKernel(_GATHER_SOURCE, "rolloutd_gather_bytes")
                compile_ = getattr(kernel, "compile", None)
                if compile_ is not None:
                    compile_()
                else:
                    kernel.kernel  # noqa: B018  (older CuPy: the property compiles and loads)
        except Exception:  # noqa: BLE001  (no CuPy, no NVRTC, a compile error: the torch path)
            kernel = None
    _GATHER_KERNELS[device] = kernel
    return kernel


def _gather_into(kernel: Any, buffer: Any, rows: List[int]) -> None:
    """Queues the gather of `rows` (flat: source address, offset in buffer, bytes; ...) on the
    current torch stream of the buffer's device."""
    import numpy as np

    torch = _torch()
    cupy = _cupy()
    device = buffer.get_device()
    n = len(rows) // 3
    # The table goes up on the current stream; the allocator reuses its memory only for work
    # queued after the kernel on that same stream.
    table = torch.from_numpy(np.array(rows, dtype=np.int64)).to(buffer.device, non_blocking=True)
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(int(stream.cuda_stream)):
        kernel((min(n, 65535),), (_GATHER_THREADS,),
               (np.uint64(table.data_ptr()), np.uint64(buffer.data_ptr()), np.int32(n)))


def _pack_into(buffer: Any, bucket: PlannedBucket) -> None:
    """Copies the bucket's tensors into `buffer` at their entries' offsets, on the current stream.
    Small contiguous sources on the buffer's device go by the gather kernel (one launch for all);
    other contiguous sources there as bytes by one multi-tensor copy (_foreach_copy_) where torch
    has it; the rest (strided, on the host or another GPU) one by one."""
    device = buffer.get_device()
    kernel = _gather_kernel(device) if device >= 0 else None
    rows: List[int] = []
    rest: List[Tuple[TensorInfo, BucketEntry]] = []
    for item, e in zip(bucket.items, bucket.entries):
        if not e.nbytes:
            continue
        if kernel is not None and item.ptr is not None and item.device == device and e.nbytes <= _GATHER_MAX_BYTES:
            rows += (item.ptr, e.byte_offset, e.nbytes)
        else:
            rest.append((item, e))
    if rows:
        try:
            _gather_into(kernel, buffer, rows)
        except Exception:  # noqa: BLE001  (a launch refused before it ran: the torch path, from now on)
            _GATHER_KERNELS[device] = None
            rest = [(item, e) for item, e in zip(bucket.items, bucket.entries) if e.nbytes]
    if rest:
        _copy_with_torch(buffer, rest, device)


def _copy_with_torch(buffer: Any, pairs: Sequence[Tuple[TensorInfo, BucketEntry]], device: int) -> None:
    torch = _torch()
    # Every destination view in one call (split_with_sizes over [gap, tensor, gap, tensor, ...]):
    # a Python slice per tensor was a measurable share of the per-tensor cost. Entries of a packed
    # bucket lie in increasing offset order.
    sizes, last = [], 0
    for _, e in pairs:
        sizes += [e.byte_offset - last, e.nbytes]
        last = e.byte_offset + e.nbytes
    views = buffer[:last].split_with_sizes(sizes)[1::2]
    dsts, srcs = [], []
    for (item, _), dst in zip(pairs, views):
        src = item.tensor
        if item.ptr is not None and item.device == device:  # contiguous, on the buffer's device
            dsts.append(dst)
            srcs.append((src if src.dim() == 1 else src.reshape(-1)).view(torch.uint8))
        else:
            dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)
    if not dsts:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dsts, srcs)
            return
        except (RuntimeError, TypeError):
            pass  # an older torch without this overload: plain copies below
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


_libcuda = None


def _address_range(ptr: int) -> Tuple[int, int]:
    """(base, size) of the CUDA allocation holding device address `ptr` (cuMemGetAddressRange)."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
        _libcuda.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                     ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        _libcuda.cuMemGetAddressRange_v2.restype = ctypes.c_int
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = _libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise RuntimeError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}")
    return int(base.value), int(size.value)


class _Exporter:
    """CUDA IPC handles of the allocations holding device addresses, cached by allocation base."""

    def __init__(self, device: int):
        self.device = device
        self._by_base: Dict[int, Tuple[bytes, int]] = {}

    def export(self, ptr: int) -> Tuple[bytes, int, int]:
        """(64-byte handle, offset of ptr in its allocation, allocation size). Raises for memory
        that cannot be exported (e.g. PyTorch's expandable segments, which are not cudaMalloc'd)."""
        # An address inside an allocation seen already needs no driver call (one push exports
        # every bucket of the same few allocations). Allocations are not freed during a push:
        # the caller holds the tensors.
        for base, (handle, size) in self._by_base.items():
            if base <= ptr < base + size:
                return handle, ptr - base, size
        cupy = _cupy()
        with cupy.cuda.Device(self.device):
            base, size = _address_range(ptr)
            got = self._by_base.get(base)
            if got is None:
                handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
                if len(handle) != 64:
                    raise RuntimeError(f"cudaIpcGetMemHandle gave {len(handle)} bytes, not 64")
                got = self._by_base[base] = (handle, size)
        return got[0], ptr - base, got[1]


def ipc_export(tensor: Any) -> Tuple[bytes, int]:
    """(64-byte cudaIpcMemHandle_t, byte offset) of a contiguous CUDA tensor's memory: the handle of
    the whole allocation that holds it and where the tensor starts in it, as a cuda_ipc source
    wants them. Works for tensors from PyTorch's caching allocator (not for expandable segments)."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("ipc_export needs a contiguous CUDA tensor")
    handle, offset, _ = _Exporter(tensor.device.index).export(tensor.data_ptr())
    return handle, offset


# ------------------------------------------------------------------------------- fan-out --
def _annotate(e: RolloutdError, client: Client) -> RolloutdError:
    err = RolloutdError(e.code, f"{client.endpoint}: {e.message}", e.field)
    err.endpoint = client.endpoint
    return err


def _collect(clients: Sequence[Client], pendings: Sequence[Optional[PendingReply]],
             errors: Optional[List[RolloutdError]] = None) -> List[Any]:
    """Every pending reply's result (None where it failed); raises the first failure (annotated
    with its daemon) after collecting them all, unless `errors` is given to receive them."""
    results, failed = [], []
    for c, p in zip(clients, pendings):
        if p is None:
            results.append(None)
            continue
        try:
            results.append(p.result())
        except RolloutdError as e:
            results.append(None)
            failed.append(_annotate(e, c))
    if errors is not None:
        errors.extend(failed)
    elif failed:
        raise failed[0]
    return results


def _fan_out(clients: Sequence[Client], requests: Sequence[Any], reply_type: type,
             timeout_s: Optional[float] = None) -> List[Any]:
    """Sends requests[i] to clients[i] without waiting, then collects every reply."""
    pendings, failed = [], []
    for c, req in zip(clients, requests):
        try:
            pendings.append(c.send_request(req, reply_type, timeout_s))
        except RolloutdError as e:
            pendings.append(None)
            failed.append(_annotate(e, c))
    results = _collect(clients, pendings, failed)
    if failed:
        raise failed[0]
    return results


def _abort_sessions(clients: Sequence[Client], sessions: Sequence[Optional[int]]) -> None:
    """Best effort: aborts session sessions[i] on clients[i] (None: none opened there); a
    session may be gone already."""
    pendings = []
    for c, s in zip(clients, sessions):
        try:
            pendings.append(None if s is None else c.send_request(AbortWeightUpdateRequest(s), AbortWeightUpdateReply))
        except RolloutdError:
            pendings.append(None)
    _collect(clients, pendings, [])


def _begin_all(clients: Sequence[Client], begin: BeginWeightUpdateRequest, weight_version: int) -> List[int]:
    """Opens a session on every daemon. If one refuses, or serves a version above
    `weight_version` (its end_weight_update would refuse after every bucket, and the abort then
    leave it not_ready), those that opened are aborted before the error is raised, nothing
    written: an open session stops their forward steps until its idle deadline."""
    pendings, failed = [], []
    for c in clients:
        try:
            pendings.append(c.send_request(begin, BeginWeightUpdateReply))
        except RolloutdError as e:
            pendings.append(None)
            failed.append(_annotate(e, c))
    replies = _collect(clients, pendings, failed)
    for c, r in zip(clients, replies):
        if r is not None and weight_version < r.weight_version:
            failed.append(_annotate(RolloutdError(
                "invalid_argument", f"weight_version {weight_version} is below the daemon's serving version "
                f"{r.weight_version}; versions never decrease", "weight_version"), c))
    if failed:
        _abort_sessions(clients, [None if r is None else r.session for r in replies])
        raise failed[0]
    return [r.session for r in replies]


def _hello_all(clients: Sequence[Client]) -> List[HelloReply]:
    hellos = _fan_out(clients, [HelloRequest(client=c.client_name, versions=[PROTOCOL_VERSION]) for c in clients],
                      HelloReply)
    for c, h in zip(clients, hellos):
        c.limits = h.limits  # as Client.hello() does: bucket sizes follow the daemon's limits
    return hellos


def _version_advice(endpoint: str, daemon_version: int, own_version: int) -> str:
    lib = nccl_lib_dir() or "<site-packages>/nvidia/nccl/lib"
    return (f"{endpoint} loaded NCCL {nccl_version_string(daemon_version)} ({daemon_version}) but this trainer "
            f"uses NCCL {nccl_version_string(own_version)} ({own_version}); two NCCL versions cannot form a group. "
            f"Start the daemon with the NCCL that ships with this trainer's PyTorch: "
            f"LD_LIBRARY_PATH={lib}:$LD_LIBRARY_PATH rolloutd ...")


# ------------------------------------------------------------------------------ NCCL group --
class NcclWeightGroup:
    """An NCCL broadcast group of this trainer (rank 0, the root) and the daemons behind `clients`
    (ranks 1..n), for push_weights(via="nccl") (SPEC §11.7).

    Creating it: checks every daemon's NCCL version against this process's (hello), makes the
    unique id with CuPy, sends init_weight_group to every daemon without waiting, joins as rank 0
    with cupy.cuda.nccl.NcclCommunicator meanwhile (on a helper thread: the join blocks until every
    rank is in), and waits for every reply, bounded by timeout_s. On any failure the half-made
    group is torn down and the error raised.

    Use it as a context manager, or call destroy() (cooperative, both sides at once) or abort()
    (when a peer is gone). A group that failed (a broadcast timed out, a peer died) is `broken`:
    make a new one (the same name may be reused)."""

    def __init__(self, clients: Sequence[Client], group: str = "weights", device: Any = None,
                 timeout_s: float = 120.0, *, check_version: bool = True):
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("a weight group needs at least one daemon")
        if not _GROUP_NAME.fullmatch(group):
            raise ValueError(f"{group!r} is not a weight-group name: 1 to 64 of A-Z a-z 0-9 . _ -")
        if not 0 < timeout_s <= 3600:
            raise ValueError("timeout_s must be in (0, 3600]")
        cupy = _cupy()
        self.name = group
        self.timeout_s = float(timeout_s)
        self.device = _device_index(device)
        self.root = self.rank = 0
        self.world_size = len(self.clients) + 1
        self.version = int(cupy.cuda.nccl.get_version())
        self.broken: Optional[str] = None
        self.replies: List[Any] = []
        self.init_s = 0.0
        self._comm = None

        hellos = _hello_all(self.clients)
        self.daemon_versions = [h.nccl_version for h in hellos]
        own_uuid = device_uuid(self.device)
        for c, h in zip(self.clients, hellos):
            if h.device_uuid and h.device_uuid == own_uuid:
                raise ValueError(f"{c.endpoint} runs on this trainer's GPU ({self.device}); NCCL cannot put two "
                                 "ranks on one GPU: push to it with via='cuda_ipc'")
            if not check_version:
                continue
            if h.nccl_version == 0:
                raise RolloutdError("unimplemented", f"{c.endpoint}: the daemon has no NCCL (CPU backend, or "
                                    "built without NCCL)", "nccl_version")
            if h.nccl_version != self.version:
                raise RolloutdError("failed_precondition", _version_advice(c.endpoint, h.nccl_version, self.version),
                                    "nccl_version")
        self._join()

    # ---- lifetime ----
    def _join(self) -> None:
        cupy = _cupy()
        nccl = cupy.cuda.nccl
        uid = nccl.get_unique_id()
        uid_bytes = unique_id_bytes(uid)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s + 10.0
        pendings, errors = [], []
        for rank, c in enumerate(self.clients, start=1):
            try:
                pendings.append(c.init_weight_group(self.name, uid_bytes, self.world_size, rank, self.root,
                                                    self.version, self.timeout_s, wait=False))
            except RolloutdError as e:
                pendings.append(None)
                errors.append(_annotate(e, c))
        if errors:
            # Some daemons never got the request: the others would wait for them until timeout_s.
            self._destroy_on_daemons(wait_s=2.0)
            raise errors[0]
        state: Dict[str, Any] = {}

        def join():
            try:
                with cupy.cuda.Device(self.device):
                    state["comm"] = nccl.NcclCommunicator(self.world_size, uid, self.root)
            except BaseException as e:  # noqa: BLE001  (reported by the caller's thread)
                state["error"] = e

        joiner = threading.Thread(target=join, name=f"rolloutd-nccl-join-{self.name}", daemon=True)
        joiner.start()
        # Poll every reply: on the first refusal the others are told to stop joining at once
        # (destroy_weight_group aborts a join) instead of waiting out their timeout.
        replies: List[Any] = [None] * len(self.clients)
        waiting = dict(enumerate(pendings))
        while waiting and not errors and "error" not in state and time.monotonic() < deadline:
            for i, p in list(waiting.items()):
                try:
                    replies[i] = p.result(0.02)
                except RolloutdError as e:
                    if e.code == "deadline_exceeded" and not p.done():
                        continue  # still joining
                    errors.append(_annotate(e, self.clients[i]))
                del waiting[i]
        if waiting and not errors and "error" not in state:
            errors.append(RolloutdError("deadline_exceeded", f"{len(waiting)} daemon(s) did not answer "
                                        f"init_weight_group within {self.timeout_s + 10.0:.0f} s", ""))
        self.replies = replies
        if not errors:
            joiner.join(max(0.0, deadline - time.monotonic()))
        comm = state.get("comm")
        if errors or "error" in state or comm is None:
            # Daemons that joined (or are joining) give the group up; best effort, briefly. A
            # daemon's aborted join usually makes ours fail too: give it a moment, then abort it.
            self._destroy_on_daemons(wait_s=2.0)
            if comm is None:
                joiner.join(2.0)
                comm = state.get("comm")
            if comm is not None:
                with cupy.cuda.Device(self.device):
                    comm.abort()
            if errors:
                if joiner.is_alive():
                    errors[0].message += (" (this trainer's own NCCL join is still waiting for the missing ranks; "
                                          "CuPy cannot abort a join in progress, so its helper thread stays blocked)")
                raise errors[0]
            if "error" in state:
                raise RolloutdError("unavailable", f"this trainer's NCCL join failed: {state['error']}", "")
            raise RolloutdError("deadline_exceeded", f"this trainer's NCCL join did not finish within "
                                f"{self.timeout_s + 10.0:.0f} s although every daemon joined (CuPy cannot abort a "
                                "join in progress; its helper thread stays blocked)", "")
        self._comm = comm
        self.init_s = time.monotonic() - t0

    def _destroy_on_daemons(self, wait_s: Optional[float]) -> List[RolloutdError]:
        pendings, errors = [], []
        for c in self.clients:
            try:
                pendings.append(c.destroy_weight_group(self.name, wait=False))
            except RolloutdError as e:
                pendings.append(None)
                errors.append(_annotate(e, c))
        for c, p in zip(self.clients, pendings):
            if p is None:
                continue
            try:
                p.result(wait_s)
            except RolloutdError as e:
                errors.append(_annotate(e, c))
        return errors

    def destroy(self) -> None:
        """Cooperative teardown: destroy_weight_group to every daemon, and this side's communicator
        destroyed at the same time (ncclCommDestroy on one side can wait for the other), bounded by
        timeout_s. Raises the first failure; the group is unusable afterwards either way."""
        comm, self._comm = self._comm, None
        if comm is None:
            return
        if self.broken is None:
            self.broken = "destroyed"
        pendings, errors = [], []
        for c in self.clients:
            try:
                pendings.append(c.destroy_weight_group(self.name, wait=False))
            except RolloutdError as e:
                pendings.append(None)
                errors.append(_annotate(e, c))
        done = threading.Event()

        def destroy_local():
            try:
                with _cupy().cuda.Device(self.device):
                    comm.destroy()
            finally:
                done.set()

        t = threading.Thread(target=destroy_local, name=f"rolloutd-nccl-destroy-{self.name}", daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout_s + 5.0
        for c, p in zip(self.clients, pendings):
            if p is None:
                continue
            try:
                p.result(max(0.0, deadline - time.monotonic()))
            except RolloutdError as e:
                errors.append(_annotate(e, c))
        if not done.wait(max(0.0, deadline - time.monotonic())):
            errors.append(RolloutdError("deadline_exceeded", f"this trainer's ncclCommDestroy of group '{self.name}' "
                                        f"did not return within {self.timeout_s:.0f} s", ""))
        if errors:
            raise errors[0]

    def abort(self, reason: str = "aborted by the trainer") -> None:
        """Gives the group up now: ncclCommAbort on this side (never waits for a peer), and
        destroy_weight_group sent to every daemon (best effort, replies awaited briefly)."""
        if self.broken is None or self.broken == "destroyed":
            self.broken = reason
        comm, self._comm = self._comm, None
        if comm is not None:
            with _cupy().cuda.Device(self.device):
                comm.abort()
            self._destroy_on_daemons(wait_s=1.0)

    close = destroy

    def __enter__(self) -> "NcclWeightGroup":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.destroy()
        else:
            self.abort(f"exception in the trainer: {exc_type.__name__}")

    # ---- use ----
    @property
    def usable(self) -> bool:
        return self._comm is not None and self.broken is None

    def _check_usable(self) -> None:
        if not self.usable:
            raise RolloutdError("failed_precondition", f"weight group '{self.name}' is not usable "
                                f"({self.broken or 'not joined'}); make a new NcclWeightGroup", "")

    def broadcast(self, tensor: Any, stream: Any = None) -> None:
        """Posts ncclBroadcast of the tensor's bytes (ncclUint8, from this rank, the root) on `stream`
        (default: the current stream of the group's device). Asynchronous, as any CUDA work: the
        daemon posts its side when it processes the update_weights that announced the bucket."""
        if not tensor.is_cuda or tensor.device.index != self.device:
            raise ValueError(f"the tensor must be on cuda:{self.device}, the group's device")
        if not tensor.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        self.broadcast_ptr(tensor.data_ptr(), tensor.numel() * tensor.element_size(), stream)

    def broadcast_ptr(self, ptr: int, nbytes: int, stream: Any = None) -> None:
        """broadcast() of `nbytes` at device address `ptr` (on the group's device)."""
        self._check_usable()
        cupy = _cupy()
        with cupy.cuda.Device(self.device):
            self._comm.bcast(int(ptr), int(nbytes), cupy.cuda.nccl.NCCL_UINT8, self.root, self._stream_handle(stream))

    def _stream_handle(self, stream: Any) -> int:
        if stream is None:
            return int(_torch().cuda.current_stream(self.device).cuda_stream)
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        raise TypeError(f"not a CUDA stream: {stream!r}")

    def wait(self, work: Any, timeout_s: Optional[float] = None) -> None:
        """Waits until `work` (a torch.cuda.Event or Stream; anything with query()) is complete,
        polling for NCCL's asynchronous errors; a deadline (default timeout_s) or an error aborts
        the group (a broadcast whose peer is gone never completes by itself)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pause = 50e-6
        while not work.query():
            err = self._async_error()
            if err is not None:
                self.abort(f"NCCL error: {err}")
                raise RolloutdError("unavailable", f"weight group '{self.name}': NCCL reported {err}; the group "
                                    "was aborted", "")
            if time.monotonic() > deadline:
                self.abort("a broadcast did not complete in time")
                raise RolloutdError("deadline_exceeded", f"weight group '{self.name}': a broadcast did not "
                                    f"complete within {limit:g} s; the group was aborted", "")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def _async_error(self) -> Optional[str]:
        comm = self._comm
        if comm is None:
            return "the communicator is gone"
        check = getattr(comm, "check_async_error", None)
        if check is None:
            return None
        try:
            check()
        except Exception as e:  # noqa: BLE001  (cupy's NcclError)
            return str(e)
        return None


# --------------------------------------------------------------------- transfer backends --
@dataclass
class _Prepared:
    """A bucket ready to send: its bytes at device address `ptr`, ready once `ready` completes."""

    ptr: int
    size: int
    ready: Any = None  # torch.cuda.Event on the pack stream (packed buckets)
    slot: Any = None


@dataclass
class _Slot:
    tensor: Any
    busy: Any = None  # the event after which the last broadcast from this slot is done
    user: Optional[int] = None  # index of the last bucket packed into it (IPC: reply frees it)


class _TorchBackend:
    """Staging buffers, streams and copies on one CUDA device, for push_weights."""

    def __init__(self, device: int, ipc: bool):
        torch = _torch()
        self.torch = torch
        self.device = device
        self.ipc = ipc
        self.pack_stream = torch.cuda.Stream(device)
        self.comm_stream = torch.cuda.Stream(device)
        self.slots: List[_Slot] = []
        self._keep: List[Any] = []  # CuPy allocations behind IPC staging tensors
        self._next_slot = 0
        self._last_done = None
        self.exporter = _Exporter(device) if ipc else None

    def describe(self, index: int, name: str, t: Any) -> TensorInfo:
        return _describe_torch(index, name, t)

    def describe_all(self, named: Sequence[Tuple[str, Any]]) -> List[TensorInfo]:
        return _describe_all_torch(named)

    def start(self, items: Sequence[TensorInfo]) -> None:
        """Before any bucket: writes to the tensors queued on their devices' current streams must
        be visible to the copies and broadcasts that read them."""
        torch = self.torch
        devices = {t.device for t in items if t.device is not None}
        current = torch.cuda.current_stream(self.device)
        self.pack_stream.wait_stream(current)
        self.comm_stream.wait_stream(current)
        for d in devices - {self.device}:
            torch.cuda.synchronize(d)
        if self.ipc:
            # The daemon reads on its own stream, which cannot wait for ours (SPEC §11.7).
            current.synchronize()

    def can_direct(self, items: Sequence[TensorInfo]) -> bool:
        """Tensors back to back in one allocation may be sent from where they are. (Two cudaMallocs
        can be adjacent in the address space too; a range across them is not one IPC handle, and
        NCCL is not promised to treat it as one buffer either: packed.) `items` must be in address
        order without overlap, as _direct_layout accepts them: only the first and last are looked up."""
        placed = [t for t in items if t.nbytes]
        if len(placed) <= 1 and not self.ipc:
            return True  # one tensor is one buffer
        if not placed:
            return True
        # The callers pass tensors in address order (_direct_layout), so they all lie in one
        # allocation exactly when the first and the last do: two lookups, not one per tensor
        # (10,000 small tensors of the caching allocator's segments cost ~8 us each in exports).
        first, last = placed[0], placed[-1]
        try:
            if self.ipc:
                h0, off0, size0 = self.exporter.export(first.ptr)
                h1, off1, size1 = self.exporter.export(last.ptr)
                return h0 == h1 and off0 + first.nbytes <= size0 and off1 + last.nbytes <= size1
            with _cupy().cuda.Device(self.device):
                r0, r1 = _address_range(first.ptr), _address_range(last.ptr)
            base, size = r0
            return r0 == r1 and last.ptr + last.nbytes <= base + size
        except Exception:  # noqa: BLE001  (not exportable, or no driver range: packed instead)
            return False

    def allocate(self, nbytes: int, count: int) -> None:
        torch = self.torch
        for _ in range(count):
            if self.ipc:
                # A dedicated cudaMalloc, not a caching-allocator segment: its handle exposes only
                # the staging buffer, and its offset is 0.
                cupy = _cupy()
                with cupy.cuda.Device(self.device):
                    mem = cupy.cuda.Memory(max(nbytes, 1))
                    arr = cupy.ndarray((max(nbytes, 1),), dtype=cupy.uint8,
                                       memptr=cupy.cuda.MemoryPointer(mem, 0))
                    arr.fill(0)
                self._keep.append((mem, arr))
                tensor = torch.as_tensor(arr, device=f"cuda:{self.device}")
            else:
                tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=f"cuda:{self.device}")
            self.slots.append(_Slot(tensor))
        if self.ipc:
            _cupy().cuda.Device(self.device).synchronize()

    def next_slot(self) -> _Slot:
        slot = self.slots[self._next_slot % len(self.slots)]
        self._next_slot += 1
        return slot

    def prepare(self, bucket: PlannedBucket, slot: Optional[_Slot]) -> _Prepared:
        if bucket.direct:
            return _Prepared(bucket.direct_ptr, bucket.size)
        torch = self.torch
        with torch.cuda.device(self.device), torch.cuda.stream(self.pack_stream):
            if slot.busy is not None:
                self.pack_stream.wait_event(slot.busy)
            _pack_into(slot.tensor, bucket)
            ready = torch.cuda.Event()
            ready.record(self.pack_stream)
        if self.ipc:
            ready.synchronize()
        return _Prepared(slot.tensor.data_ptr(), bucket.size, ready, slot)

    def host_bytes(self, prep: _Prepared) -> Any:
        """The bucket's bytes copied to the host (checksum=True)."""
        import numpy as np

        if prep.ready is not None:
            prep.ready.synchronize()
        else:  # a direct bucket: written on the current stream
            self.torch.cuda.synchronize(self.device)
        out = np.empty(prep.size, dtype=np.uint8)
        if prep.size:
            cupy = _cupy()
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.memcpy(out.ctypes.data, prep.ptr, prep.size, cupy.cuda.runtime.memcpyDeviceToHost)
        return out

    def export(self, prep: _Prepared) -> Tuple[bytes, int]:
        handle, offset, size = self.exporter.export(prep.ptr)
        if offset + prep.size > size:
            raise RuntimeError("a bucket runs past the end of its allocation")
        return handle, offset

    def broadcast(self, group: NcclWeightGroup, prep: _Prepared) -> None:
        torch = self.torch
        with torch.cuda.device(self.device):
            if prep.ready is not None:
                self.comm_stream.wait_event(prep.ready)
            group.broadcast_ptr(prep.ptr, prep.size, self.comm_stream)
            done = torch.cuda.Event()
            done.record(self.comm_stream)
        if prep.slot is not None:
            prep.slot.busy = done
        self._last_done = done

    def finish(self, group: NcclWeightGroup, timeout_s: float) -> None:
        """Waits (watchdog) until every broadcast posted is complete."""
        if self._last_done is not None:
            group.wait(self._last_done, timeout_s)

    def settled(self, timeout_s: float) -> bool:
        """Whether every broadcast posted completes within timeout_s (no watchdog abort)."""
        if self._last_done is None:
            return True
        deadline = time.monotonic() + timeout_s
        while not self._last_done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-3)
        return True

    def close(self) -> None:
        # Staging is freed only once nothing queued reads or writes it. After a failure a copy
        # may wait on a broadcast that never completes (its peer is gone): then the buffers are
        # left allocated rather than freed under a kernel that may still touch them.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                idle = self.pack_stream.query() and self.comm_stream.query()
            except Exception:  # noqa: BLE001  (a sticky CUDA error: nothing runs any more)
                idle = True
            if idle or time.monotonic() > deadline:
                break
            time.sleep(1e-3)
        if idle:
            self.slots.clear()
            self._keep.clear()


# ----------------------------------------------------------------------------- push_weights --
def push_weights(clients: Sequence[Client], named_tensors: Any, weight_version: int, via: str = "nccl",
                 group: Optional[NcclWeightGroup] = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum: bool = False, *, selector: Optional[Sequence[str]] = None, timeout_s: float = 60.0,
                 device: Any = None, direct: bool = True, stats: Optional[Dict[str, Any]] = None,
                 _backend: Any = None) -> List[EndWeightUpdateReply]:
    """One whole weight update on every daemon of `clients`: begin, buckets, end(weight_version).

    named_tensors: (name, tensor) pairs or a dict, any dtype the protocol has (bfloat16, float32,
    float8_e4m3fn, float4_e2m1fn_x2, ...), on any device; names as the daemon's checkpoint names.
    Tensors are grouped in order into buckets of at most `bucket_bytes` (a bigger tensor travels
    alone; the daemons' entry and envelope limits are respected). A bucket whose tensors lie back
    to back on the sending device (views of one flat buffer, a big tensor) is sent from where it
    is (`direct`); the others are packed into two staging buffers at 256-byte offsets, so packing
    bucket i+1 overlaps sending bucket i. Two NCCL buckets are in flight per daemon (its staging
    is double-buffered); four CUDA IPC buckets (the daemon queues their copies back to back).

    via="nccl": `group` (an NcclWeightGroup of exactly these daemons) broadcasts each bucket from
    its device after update_weights went to every daemon. via="cuda_ipc": every daemon runs on
    this process's GPU `device` (default: the one whose UUID the daemons report); each bucket is
    sent as the CUDA IPC handle of where it lies, and a buffer is reused only after every daemon
    replied for it. checksum=True adds a CRC-32 of every bucket (a device-to-host copy each:
    for tests). The tensors must not change until this returns.

    On any failure the session is aborted on every daemon and the error re-raised (an NCCL group
    that may be out of step is aborted too: make a new one). Returns every daemon's
    end_weight_update reply, in `clients` order. `stats`, if given, receives timings."""
    clients = list(clients)
    if not clients:
        raise ValueError("push_weights needs at least one daemon")
    if via not in ("nccl", "cuda_ipc"):
        raise ValueError(f"via must be 'nccl' or 'cuda_ipc', got {via!r}")
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    stats = {} if stats is None else stats
    t_start = time.monotonic()
    if via == "nccl":
        if group is None:
            raise ValueError("via='nccl' needs group=NcclWeightGroup(clients, ...)")
        if sorted(c.endpoint for c in group.clients) != sorted(c.endpoint for c in clients):
            raise ValueError("push_weights(via='nccl') must go to exactly the daemons of the group: each rank "
                             "posts every broadcast")
        group._check_usable()
    hellos = _hello_all(clients)
    if via == "nccl":
        dev = group.device
    else:
        uuids = {h.device_uuid for h in hellos}
        if len(uuids) != 1 or not next(iter(uuids)):
            raise ValueError("via='cuda_ipc' needs every daemon on one GPU, this process's (hello().device_uuid); "
                             "use via='nccl' for daemons on other GPUs")
        wanted = next(iter(uuids))
        if device is None and _backend is None:
            dev = find_device(wanted)
            if dev is None:
                raise RolloutdError("failed_precondition", "the daemons' GPU (uuid " + wanted.hex() + ") is not "
                                    "visible to this process; use via='nccl'", "")
        else:
            dev = _device_index(device) if _backend is None else _backend.device
            if _backend is None and device_uuid(dev) != wanted:
                raise ValueError(f"cuda:{dev} is not the daemons' GPU (uuid {wanted.hex()})")
        handle_uuid = wanted
    backend = _backend if _backend is not None else _TorchBackend(dev, ipc=(via == "cuda_ipc"))
    if via == "nccl":
        handle_uuid = None
    with _gc_paused(PAUSE_GC_DURING_PUSH):
        return _push(clients, named_tensors, weight_version, via, group, bucket_bytes, checksum, selector, timeout_s,
                     direct, stats, backend, handle_uuid, t_start)


def _push(clients: List[Client], named_tensors: Any, weight_version: int, via: str, group: Optional[NcclWeightGroup],
          bucket_bytes: int, checksum: bool, selector: Optional[Sequence[str]], timeout_s: float, direct: bool,
          stats: Dict[str, Any], backend: Any, handle_uuid: Optional[bytes],
          t_start: float) -> List[EndWeightUpdateReply]:
    """push_weights from describing the tensors to the end replies (the collector paused)."""
    t_describe = time.monotonic()
    named = _named(named_tensors)
    describe_all = getattr(backend, "describe_all", None)
    items = (describe_all(named) if describe_all is not None
             else [backend.describe(i, name, t) for i, (name, t) in enumerate(named)])
    t_plan = time.monotonic()
    stats["describe_s"] = t_plan - t_describe
    buckets = plan_buckets(items, bucket_bytes,
                           max_entries=max(1, min(c.limits.max_bucket_entries for c in clients)),
                           max_envelope_bytes=min(c.limits.max_envelope_bytes for c in clients),
                           direct_device=backend.device if direct else None,
                           can_direct=backend.can_direct,
                           split_direct_bytes=_IPC_SPLIT_DIRECT_BYTES if via == "cuda_ipc" else None)
    stats["plan_s"] = time.monotonic() - t_plan
    packed = [b.size for b in buckets if not b.direct]
    if packed:
        backend.allocate(max(packed), min(len(packed), 2))
    stats.update(num_buckets=len(buckets), num_direct=len(buckets) - len(packed),
                 num_bytes=sum(t.nbytes for t in items), num_tensors=len(items))

    begin = BeginWeightUpdateRequest(None if selector is None else list(selector), timeout_s)
    sessions = _begin_all(clients, begin, weight_version)
    stats["begin_s"] = time.monotonic() - t_start
    try:
        backend.start(items)
        stats["first_bucket_t"] = time.monotonic()
        if via == "nccl":
            _send_nccl(clients, sessions, buckets, backend, group, checksum, stats)
        else:
            _send_ipc(clients, sessions, buckets, backend, handle_uuid, checksum, stats)
        buckets_done_t = time.monotonic()
        stats["buckets_s"] = buckets_done_t - stats["first_bucket_t"]
        ends = _fan_out(clients, [EndWeightUpdateRequest(s, weight_version) for s in sessions], EndWeightUpdateReply)
        stats["end_t"] = time.monotonic()
        stats["end_s"] = stats["end_t"] - buckets_done_t
        stats["end_postprocess_s"] = max((getattr(e, "postprocess_s", 0.0) or 0.0) for e in ends)
        stats["transfer_s"] = stats["end_t"] - stats["first_bucket_t"]
        return ends
    except BaseException:
        _abort_sessions(clients, sessions)
        raise
    finally:
        backend.close()


def _reply_timeout(client: Client, group: Optional[NcclWeightGroup]) -> float:
    # The daemon answers a bucket after its broadcast, which may take up to the group's timeout.
    return max(client.timeout_s, (group.timeout_s + 10.0) if group is not None else 0.0)


def _send_nccl(clients: List[Client], sessions: List[int], buckets: List[PlannedBucket], backend: Any,
               group: NcclWeightGroup, checksum: bool, stats: Optional[Dict[str, Any]] = None) -> None:
    """Two buckets in flight per daemon. `stats` receives the trainer's time (seconds, summed over
    buckets): pack_s (queueing the staging copies: they run on the device behind the previous
    broadcast), send_s (encode and send), export_s (posting the broadcast), wait_s (blocked on replies)."""
    in_flight: Deque = collections.deque()
    posted_all = True  # every update_weights sent was followed by our broadcast
    t = dict(pack_s=0.0, send_s=0.0, export_s=0.0, wait_s=0.0)
    clock = time.perf_counter

    def collect_oldest() -> None:
        _, pendings = in_flight.popleft()
        t0 = clock()
        _collect(clients, pendings)
        t["wait_s"] += clock() - t0

    try:
        for i, b in enumerate(buckets):
            while len(in_flight) >= _PIPELINE_DEPTH:
                collect_oldest()
            t0 = clock()
            prep = backend.prepare(b, None if b.direct else backend.next_slot())
            crc = zlib.crc32(backend.host_bytes(prep)) if checksum else None
            t1 = clock()
            pendings = []
            posted_all = False
            for c, s in zip(clients, sessions):
                pendings.append(c.update_weights_nccl(s, b.entries, group.name, group.root, b.size, crc, wait=False,
                                                      timeout_s=_reply_timeout(c, group)))
            in_flight.append((i, pendings))
            t2 = clock()
            backend.broadcast(group, prep)
            posted_all = True
            t["pack_s"] += t1 - t0
            t["send_s"] += t2 - t1
            t["export_s"] += clock() - t2
        while in_flight:
            collect_oldest()
        t0 = clock()
        backend.finish(group, group.timeout_s)
        t["wait_s"] += clock() - t0
    except RolloutdError as e:
        # A refusal by a daemon keeps the group in step (it received the bytes anyway, SPEC §11.7)
        # once every bucket sent has been answered and our broadcasts completed; anything else
        # (a lost daemon, a bucket it could not take part in) leaves a broadcast that never ends.
        transport = getattr(e, "endpoint", None) is None or e.code in ("unavailable", "deadline_exceeded")
        if group.usable and not transport and posted_all:
            errors: List[RolloutdError] = []
            while in_flight:
                _, pendings = in_flight.popleft()
                _collect(clients, pendings, errors)
            transport = any(x.code in ("unavailable", "deadline_exceeded") for x in errors)
        if group.usable and (transport or not posted_all or not backend.settled(_SETTLE_S)):
            group.abort(f"push_weights failed: {e}")
        raise
    except BaseException as e:
        if group.usable:
            group.abort(f"push_weights interrupted: {type(e).__name__}")
        raise
    finally:
        if stats is not None:
            stats.update(t)


def _send_ipc(clients: List[Client], sessions: List[int], buckets: List[PlannedBucket], backend: Any,
              uuid_bytes: bytes, checksum: bool, stats: Optional[Dict[str, Any]] = None) -> None:
    """Up to _IPC_PIPELINE_DEPTH buckets in flight per daemon. `stats` receives where the time went
    (seconds, summed over buckets): pack_s (staging copies, waited for: the daemon reads on its own
    stream), export_s (IPC handles), send_s (encode and send), wait_s (blocked on replies),
    reply_latency_s (send to reply received), daemon_apply_s (the daemons' receipt-to-reply times,
    the slowest daemon's per bucket) and first_bucket_daemon_s (the first bucket's: it opens the handle)."""
    in_flight: Deque = collections.deque()
    collected = set()
    t = dict(pack_s=0.0, export_s=0.0, send_s=0.0, wait_s=0.0, reply_latency_s=0.0, daemon_apply_s=0.0)
    clock = time.perf_counter

    def collect_oldest() -> None:
        i, sent_t, pendings = in_flight.popleft()
        t0 = clock()
        replies = _collect(clients, pendings)
        t1 = clock()
        t["wait_s"] += t1 - t0
        t["reply_latency_s"] += t1 - sent_t
        daemon_s = max((getattr(r, "duration_s", 0.0) or 0.0 for r in replies if r is not None), default=0.0)
        t["daemon_apply_s"] += daemon_s
        if i == 0:
            t["first_bucket_daemon_s"] = daemon_s  # its handle's opening included
        collected.add(i)

    try:
        for i, b in enumerate(buckets):
            while len(in_flight) >= _IPC_PIPELINE_DEPTH:
                collect_oldest()
            slot = None
            if not b.direct:
                slot = backend.next_slot()
                # The daemon reads the staging buffer until its reply: reuse it only after that.
                while slot.user is not None and slot.user not in collected:
                    collect_oldest()
                slot.user = i
            t0 = clock()
            prep = backend.prepare(b, slot)
            t1 = clock()
            handle, offset = backend.export(prep)
            t2 = clock()
            crc = zlib.crc32(backend.host_bytes(prep)) if checksum else None
            t2 = clock() if checksum else t2
            pendings = [c.update_weights_cuda_ipc(s, b.entries, handle, offset, b.size, uuid_bytes, crc, wait=False)
                        for c, s in zip(clients, sessions)]
            t3 = clock()
            t["pack_s"] += t1 - t0
            t["export_s"] += t2 - t1
            t["send_s"] += t3 - t2
            in_flight.append((i, t3, pendings))
        while in_flight:
            collect_oldest()
    except BaseException:
        # The buckets still in flight are answered before the abort that follows (the daemon
        # keeps replies in order): collect them, best effort, so no reply is left behind in the
        # client and their errors do not mask the first one.
        while in_flight:
            _collect(clients, in_flight.popleft()[2], [])
        raise
    finally:
        if stats is not None:
            stats.update(t)


def _main(argv: Sequence[str]) -> int:
    """python -m rolloutd.trainer --nccl-lib-dir: prints the folder to put on the daemon's
    LD_LIBRARY_PATH (nothing, and exit 1, if PyTorch's NCCL is not installed)."""
    if list(argv) != ["--nccl-lib-dir"]:
        print("usage: python -m rolloutd.trainer --nccl-lib-dir", file=sys.stderr)
        return 2
    d = nccl_lib_dir()
    if d is None:
        print("no PyTorch NCCL (nvidia/nccl/lib/libnccl.so.2) found next to torch", file=sys.stderr)
        return 1
    print(d)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
