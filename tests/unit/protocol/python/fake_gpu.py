"""Stand-ins for the few torch and CuPy calls rolloutd.trainer makes, over host memory, so its
device code paths (NcclWeightGroup, _TorchBackend, push_weights, pack_device_bucket, ipc_export)
run where neither is installed. Device memory is numpy bytes at made-up addresses; a broadcast
hands its bytes to the fake daemons through BROADCASTS; an IPC handle names an allocation.

It checks the calls' shapes and the data flow, not CUDA's semantics (streams here complete at
once): the GPU host's tests (tests/gpu/transports) check the real thing.

install() puts the fakes in sys.modules; use it in a subprocess (test_trainer_device.py does)."""
import ctypes
import queue
import sys
import types

import numpy as np

_ALLOCS = {}  # base address -> (device, numpy uint8 array)
_NEXT = {0: 0x7F0000000000, 1: 0x7F1000000000, None: 0x500000000000}
_CURRENT = {"device": 0}
BROADCASTS = {r: queue.Queue() for r in range(1, 9)}  # rank -> bytes of every bcast of rank 0
HANDLES = {}  # 64-byte handle -> base address
GATHER_LAUNCHES = []  # (device, rows) of every launch of the trainer's gather kernel
UUIDS = {0: bytes(range(16)), 1: bytes(range(16, 32))}


def _alloc(nbytes, device):
    base = _NEXT[device]
    _NEXT[device] += max(nbytes, 1) + (1 << 20)  # never adjacent: separate allocations
    _ALLOCS[base] = (device, np.zeros(max(nbytes, 1), dtype=np.uint8))
    return base


def find(ptr):
    for base, (dev, mem) in _ALLOCS.items():
        if base <= ptr < base + len(mem):
            return base, dev, mem
    raise KeyError(f"no allocation holds {ptr:#x}")


def read(ptr, n):
    base, _, mem = find(ptr)
    return mem[ptr - base:ptr - base + n].tobytes()


# --------------------------------------------------------------------------------- torch --
class _DType:
    def __init__(self, name, itemsize, np_dtype):
        self.name, self.itemsize, self.np = name, itemsize, np.dtype(np_dtype)

    def __str__(self):
        return "torch." + self.name

    __repr__ = __str__


class _Device:
    def __init__(self, index):
        self.type, self.index = ("cuda", index) if index is not None else ("cpu", None)

    def __eq__(self, other):
        return isinstance(other, _Device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))


class Size(tuple):
    pass


class Tensor:
    """A contiguous tensor: `nbytes` bytes at `ptr` of a fake allocation, viewed as dtype/shape."""

    def __init__(self, ptr, shape, dtype):
        self.ptr, self.shape, self.dtype = ptr, Size(int(d) for d in shape), dtype
        self._dev = find(ptr)[1]

    requires_grad = False

    # properties and queries
    @property
    def device(self):
        return _Device(self._dev)

    @property
    def is_cuda(self):
        return self._dev is not None

    def is_contiguous(self):
        return True

    def numel(self):
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def element_size(self):
        return self.dtype.itemsize

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return -1 if self._dev is None else self._dev

    def dim(self):
        return len(self.shape)

    def _bytes(self):
        base, _, mem = find(self.ptr)
        return mem[self.ptr - base:self.ptr - base + self.numel() * self.element_size()]

    # views
    def detach(self):
        return self

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if tuple(shape) == (-1,):
            shape = (self.numel(),)
        return Tensor(self.ptr, shape, self.dtype)

    def view(self, what):
        if isinstance(what, _DType):
            assert self.dim() >= 1, "view(dtype) of a 0-dim tensor"
            last = self.shape[-1] * self.dtype.itemsize
            assert last % what.itemsize == 0 and self.ptr % what.itemsize == 0, "misaligned dtype view"
            return Tensor(self.ptr, self.shape[:-1] + (last // what.itemsize,), what)
        shape = tuple(what)
        assert int(np.prod(shape, dtype=np.int64)) == self.numel(), "view of another size"
        return Tensor(self.ptr, shape, self.dtype)

    def __getitem__(self, key):
        assert isinstance(key, slice) and self.dim() == 1 and key.step is None
        start, stop, _ = key.indices(self.shape[0])
        return Tensor(self.ptr + start * self.dtype.itemsize, (max(stop - start, 0),), self.dtype)

    def split_with_sizes(self, sizes):
        assert self.dim() == 1 and sum(sizes) == self.shape[0], "split_with_sizes must cover the tensor"
        out, start = [], 0
        for n in sizes:
            out.append(self[start:start + n])
            start += n
        return out

    # data
    def copy_(self, src, non_blocking=False):
        data = src._bytes().tobytes() if src.dtype is self.dtype else _convert(src, self.dtype)
        assert len(data) == self.numel() * self.element_size(), "copy_ between sizes"
        self._bytes()[:] = np.frombuffer(data, dtype=np.uint8)
        return self

    def fill_(self, value):
        self.numpy()[...] = value
        return self

    def numpy(self):
        return self._bytes().view(self.dtype.np).reshape(self.shape)

    def cpu(self):
        out = empty(self.shape, dtype=self.dtype)
        return out.copy_(self)

    def to(self, what, non_blocking=False):
        if isinstance(what, _DType):
            out = empty(self.shape, dtype=what, device=self.device)
            return out.copy_(self)
        index = _parse_device(what)
        out = empty(self.shape, dtype=self.dtype, device=index)
        return out.copy_(self)

    def float(self):
        return self.to(float32)

    def tolist(self):
        return self.numpy().tolist()


def _convert(src, dst_dtype):
    if (src.dtype.name, dst_dtype.name) == ("float32", "bfloat16"):  # truncation is enough here
        return (src.numpy().view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if (src.dtype.name, dst_dtype.name) == ("bfloat16", "float32"):
        return (src.numpy().astype(np.uint32) << 16).tobytes()
    return src.numpy().astype(dst_dtype.np).tobytes()


def _parse_device(device):
    if device is None or device == "cpu":
        return None
    if isinstance(device, _Device):
        return device.index
    if isinstance(device, int):
        return device
    return int(str(device).split(":")[1])


float32 = _DType("float32", 4, np.float32)
bfloat16 = _DType("bfloat16", 2, np.uint16)  # raw bits
float16 = _DType("float16", 2, np.float16)
uint8 = _DType("uint8", 1, np.uint8)
int8 = _DType("int8", 1, np.int8)
int64 = _DType("int64", 8, np.int64)
complex64 = _DType("complex64", 8, np.complex64)
_NP_TO_DTYPE = {np.dtype(np.float32): float32, np.dtype(np.float16): float16, np.dtype(np.uint8): uint8,
                np.dtype(np.int8): int8, np.dtype(np.int64): int64}


def empty(*shape, dtype=float32, device=None):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
    return Tensor(_alloc(nbytes, _parse_device(device)), shape, dtype)


def zeros(*shape, dtype=float32, device=None):
    return empty(*shape, dtype=dtype, device=device)


def from_numpy(a):
    a = np.ascontiguousarray(a)
    t = empty(a.shape, dtype=_NP_TO_DTYPE[a.dtype])
    t._bytes()[:] = a.reshape(-1).view(np.uint8)
    return t


def as_tensor(data, device=None):
    if hasattr(data, "memptr"):  # a fake CuPy array: shares its memory
        return Tensor(data.memptr.ptr, data.shape, uint8)
    return from_numpy(np.asarray(data))


def _foreach_copy_(dsts, srcs, non_blocking=False):
    for d, s in zip(dsts, srcs):
        d.copy_(s)


class _Stream:
    _n = 0x1000

    def __init__(self, device=None):
        _Stream._n += 1
        self.cuda_stream, self.device = _Stream._n, _parse_device(device if device is not None else 0)

    def query(self):
        return True

    def synchronize(self):
        pass

    def wait_stream(self, other):
        assert isinstance(other, _Stream)

    def wait_event(self, event):
        assert isinstance(event, _Event) and event.recorded, "waiting on an event never recorded"


class _Event:
    def __init__(self):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        return True

    def synchronize(self):
        assert self.recorded


class _Ctx:
    def __init__(self, *_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _make_torch():
    torch = types.ModuleType("torch")
    torch.Tensor, torch.Size = Tensor, Size
    for name in ("float32", "bfloat16", "float16", "uint8", "int8", "int64", "complex64", "empty", "zeros", "from_numpy",
                 "as_tensor", "_foreach_copy_"):
        setattr(torch, name, globals()[name])
    torch.float = float32
    torch.__version__ = "fake"
    cuda = types.ModuleType("torch.cuda")
    cuda.Stream, cuda.Event = _Stream, _Event
    cuda.current_stream = lambda device=None: _Stream(device)
    cuda.stream = _Ctx
    cuda.device = _Ctx
    cuda.synchronize = lambda device=None: None
    cuda.device_count = lambda: 2
    cuda.current_device = lambda: _CURRENT["device"]
    cuda.set_device = lambda d: _CURRENT.__setitem__("device", d)
    cuda.get_device_properties = lambda i: types.SimpleNamespace(uuid=types.SimpleNamespace(bytes=list(UUIDS[i])))
    torch.cuda = cuda
    return torch


# ---------------------------------------------------------------------------------- cupy --
class _CupyDevice:
    def __init__(self, index=None):
        self.id = _CURRENT["device"] if index is None else index

    def __enter__(self):
        self._prev = _CURRENT["device"]
        _CURRENT["device"] = self.id
        return self

    def __exit__(self, *exc):
        _CURRENT["device"] = self._prev
        return False

    def use(self):
        _CURRENT["device"] = self.id

    def synchronize(self):
        pass


class _Memory:
    def __init__(self, size):
        self.ptr = _alloc(size, _CURRENT["device"])


class _MemoryPointer:
    def __init__(self, mem, offset):
        self.ptr = mem.ptr + offset


class _NDArray:
    def __init__(self, shape, dtype=None, memptr=None):
        self.shape, self.memptr = tuple(shape), memptr

    def fill(self, value):
        base, _, mem = find(self.memptr.ptr)
        mem[self.memptr.ptr - base:self.memptr.ptr - base + int(np.prod(self.shape))] = value


class NcclCommunicator:
    """Rank 0 (the trainer) broadcasts to the other ranks' queues; joins never block here."""

    instances = []

    def __init__(self, ndev, commId, rank):
        assert len(commId) == 128 and all(-128 <= v < 128 for v in commId), "the id is 128 signed chars"
        self.ndev, self.rank, self.alive = ndev, rank, True
        self.device = _CURRENT["device"]
        NcclCommunicator.instances.append(self)

    def bcast(self, buff, count, datatype, root, stream):
        assert self.alive and datatype == 1 and root == 0 and isinstance(stream, int)
        assert find(buff)[1] == self.device, "broadcast from another device's memory"
        data = read(buff, count)
        for r in range(1, self.ndev):
            BROADCASTS[r].put(data)

    def check_async_error(self):
        pass

    def destroy(self):
        self.alive = False

    def abort(self):
        self.alive = False


_CURRENT_STREAM = {"stream": None}


class ExternalStream:
    def __init__(self, ptr, device_id=-1):
        assert isinstance(ptr, int) and ptr, "a raw stream handle"
        self.ptr = ptr

    def __enter__(self):
        self._prev = _CURRENT_STREAM["stream"]
        _CURRENT_STREAM["stream"] = self
        return self

    def __exit__(self, *exc):
        _CURRENT_STREAM["stream"] = self._prev
        return False


class RawKernel:
    """The trainer's gather kernel, run on the fake memory: rows of (source address, offset, bytes)."""

    def __init__(self, code, name, options=()):
        assert name in code
        self.name = name

    def compile(self):
        pass

    def __call__(self, grid, block, args, shared_mem=0):
        assert self.name == "rolloutd_gather_bytes" and len(grid) == 1 and len(block) == 1
        assert isinstance(_CURRENT_STREAM["stream"], ExternalStream), "launched on torch's stream"
        table, dst, n = args
        assert isinstance(table, np.uint64) and isinstance(dst, np.uint64) and isinstance(n, np.int32)
        rows = np.frombuffer(read(int(table), int(n) * 24), dtype=np.int64).reshape(-1, 3)
        base, dev, mem = find(int(dst))
        assert dev == _CURRENT["device"] == find(int(table))[1], "kernel, table and buffer on one device"
        for src, off, size in rows.tolist():
            assert find(src)[1] == dev, "a source on another device"
            start = int(dst) - base + off
            mem[start:start + size] = np.frombuffer(read(src, size), dtype=np.uint8)
        GATHER_LAUNCHES.append((dev, len(rows)))


def _ipc_get_mem_handle(ptr):
    base, _, _ = find(ptr)
    handle = base.to_bytes(8, "little") * 8
    HANDLES[handle] = base
    return handle


def _memcpy(dst, src, size, kind):
    assert kind == 2, "device to host"
    data = read(src, size)
    ctypes.memmove(dst, data, size)


def _make_cupy():
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "fake"
    cupy.uint8 = np.uint8
    cupy.ndarray = _NDArray
    cupy.RawKernel = RawKernel
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Memory, cuda.MemoryPointer = _CupyDevice, _Memory, _MemoryPointer
    cuda.ExternalStream = ExternalStream
    runtime = types.SimpleNamespace(ipcGetMemHandle=_ipc_get_mem_handle, memcpy=_memcpy, memcpyDeviceToHost=2,
                                    getDeviceProperties=lambda i: {"uuid": UUIDS[i]})
    cuda.runtime = runtime
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NcclCommunicator, nccl.NCCL_UINT8 = NcclCommunicator, 1
    nccl.get_version = lambda: 22809
    nccl.get_unique_id = lambda: tuple((i * 7) % 256 - 128 for i in range(128))
    cuda.nccl = nccl
    cupy.cuda = cuda
    return cupy, cuda, nccl


def install():
    """Puts fake torch and cupy into sys.modules and points rolloutd.trainer's driver call at the
    fake allocations. Returns the trainer module."""
    torch = _make_torch()
    cupy, cuda, nccl = _make_cupy()
    sys.modules.update({"torch": torch, "torch.cuda": torch.cuda, "cupy": cupy, "cupy.cuda": cuda,
                        "cupy.cuda.nccl": nccl})
    from rolloutd import trainer

    def address_range(ptr):
        base, _, mem = find(ptr)
        return base, len(mem)

    trainer._address_range = address_range
    return trainer
