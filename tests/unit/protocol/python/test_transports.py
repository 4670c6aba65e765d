"""GPU weight transports (SPEC §11.7) without a GPU: the wire messages, the Client calls and
PendingReply, and rolloutd.trainer's planning, checksums and push orchestration, the latter
driven through a fake device backend (numpy memory) against scripted fake daemons (zmtp_peer)."""
import contextlib
import gc
import os
import queue
import struct
import sys
import zlib

import msgpack
import pytest

np = pytest.importorskip("numpy")

from rolloutd import Client, RolloutdError, model_checksum, nccl_version_string, wire  # noqa: E402
from rolloutd import trainer  # noqa: E402
from rolloutd.messages import (AbortWeightUpdateReply, AbortWeightUpdateRequest, BeginWeightUpdateReply,  # noqa: E402
                               BeginWeightUpdateRequest, BucketEntry, CudaIpcSource, DestroyWeightGroupReply,
                               DestroyWeightGroupRequest, EndWeightUpdateReply, EndWeightUpdateRequest, ErrorInfo,
                               HelloReply, HelloRequest, InitWeightGroupReply, InitWeightGroupRequest, Limits,
                               NcclSource, StatusReply, StatusRequest, UpdateWeightsReply, UpdateWeightsRequest)
from rolloutd.trainer import TensorInfo, plan_buckets  # noqa: E402

UID = bytes(range(128, 256))
HANDLE = bytes(range(64))
UUID = bytes.fromhex("00112233445566778899aabbccddeeff")


# ------------------------------------------------------------------------------------ wire --
def test_weight_group_messages_round_trip():
    req = InitWeightGroupRequest("weights", UID, 3, 2, 0, 22809, 30.0)
    frames = wire.encode(4, req)
    body = msgpack.unpackb(frames[0], raw=False)["body"]
    assert list(body) == ["group", "unique_id", "world_size", "rank", "root", "nccl_version", "timeout_s"]
    assert isinstance(body["unique_id"], bytes) and frames[0].count(b"\xc4\x80") == 1  # bin8 of 128 bytes
    assert wire.decode(frames).body == req
    assert wire.decode(wire.encode(5, DestroyWeightGroupRequest("weights"))).body == DestroyWeightGroupRequest("weights")
    reply = InitWeightGroupReply("weights", 22809, 2, 3, 0.5)
    assert wire.decode(wire.encode(4, reply)).body == reply
    assert wire.decode(wire.encode(5, DestroyWeightGroupReply("w"))).body == DestroyWeightGroupReply("w")


def test_device_sources_round_trip():
    entries = [BucketEntry("a", "bfloat16", [4], 0, 8), BucketEntry("b", "float32", [], 256, 4)]
    nccl = UpdateWeightsRequest(9, entries=entries, source=NcclSource("weights", 0, 260))
    assert wire.decode(wire.encode(1, nccl)).body == nccl
    ipc = UpdateWeightsRequest(9, entries=entries, source=CudaIpcSource(HANDLE, 1 << 21, 260, UUID))
    body = msgpack.unpackb(wire.encode(1, ipc)[0], raw=False)["body"]["source"]
    assert body == {"kind": "cuda_ipc", "handle": HANDLE, "offset": 1 << 21, "size": 260, "device_uuid": UUID}
    assert wire.decode(wire.encode(1, ipc)).body == ipc


def test_hello_reports_nccl_and_device():
    h = HelloReply(gpu=1, nccl_version=22809, device_uuid=UUID)
    body = msgpack.unpackb(wire.encode(1, h)[0], raw=False)["body"]
    assert list(body)[-2:] == ["nccl_version", "device_uuid"]
    assert wire.decode(wire.encode(1, h)).body == h
    assert nccl_version_string(22809) == "2.28.9" and nccl_version_string(2708) == "2.7.8"


@pytest.mark.parametrize("override,code,field", [
    (dict(unique_id=UID[:-1]), "invalid_argument", "body.unique_id"),
    (dict(unique_id="u" * 128), "wrong_type", "body.unique_id"),
    (dict(group="a/b"), "invalid_argument", "body.group"),
    (dict(group="g" * 65), "invalid_argument", "body.group"),
    (dict(world_size=65537), "out_of_range", "body.world_size"),
    (dict(rank=3), "out_of_range", "body.rank"),
    (dict(root=3), "out_of_range", "body.root"),
    (dict(rank=0), "invalid_argument", "body.rank"),
    (dict(timeout_s=3600.5), "out_of_range", "body.timeout_s"),
])
def test_init_weight_group_refusals(override, code, field):
    body = dict(group="weights", unique_id=UID, world_size=3, rank=1, root=0, nccl_version=22809, timeout_s=1.0)
    body.update(override)
    env = msgpack.packb({"v": 1, "type": "init_weight_group", "id": 1, "body": body}, use_bin_type=True)
    with pytest.raises(RolloutdError) as e:
        wire.decode([env])
    assert (e.value.code, e.value.field) == (code, field)


@pytest.mark.parametrize("source,code,field", [
    ({"kind": "nccl", "group": "w", "root": 0, "size": (1 << 40) + 1}, "out_of_range", "body.source.size"),
    ({"kind": "nccl", "group": "w", "root": 0, "size": 11}, "out_of_range", "body.entries[1].byte_offset"),
    ({"kind": "nccl", "group": "", "root": 0, "size": 12}, "invalid_argument", "body.source.group"),
    ({"kind": "cuda_ipc", "handle": b"\0\0" + HANDLE, "offset": 0, "size": 12, "device_uuid": UUID},
     "invalid_argument", "body.source.handle"),
    ({"kind": "cuda_ipc", "handle": HANDLE, "offset": 2**64 - 8, "size": 12, "device_uuid": UUID},
     "out_of_range", "body.source.size"),
    ({"kind": "cuda_ipc", "handle": HANDLE, "offset": 0, "size": 12, "device_uuid": UUID.hex()},
     "wrong_type", "body.source.device_uuid"),
    ({"kind": "rdma"}, "invalid_argument", "body.source.kind"),
])
def test_device_source_refusals(source, code, field):
    body = {"session": 1, "load_format": "flattened_bucket",
            "entries": [{"name": "a", "dtype": "int8", "shape": [4], "byte_offset": 0, "nbytes": 4},
                        {"name": "b", "dtype": "int8", "shape": [8], "byte_offset": 4, "nbytes": 8}],
            "source": source, "checksum": None}
    env = msgpack.packb({"v": 1, "type": "update_weights", "id": 1, "body": body}, use_bin_type=True)
    with pytest.raises(RolloutdError) as e:
        wire.decode([env])
    assert (e.value.code, e.value.field) == (code, field)


# ---------------------------------------------------------------------------------- client --
def test_client_group_and_device_bucket_calls(daemon):
    def script(d):
        m = d.recv()
        assert m.body == InitWeightGroupRequest("weights", UID, 2, 1, 0, 22809, 0.3)
        init_id = m.id
        m = d.recv()  # the client sent the bucket before the join reply came
        assert isinstance(m.body.source, NcclSource) and m.body.checksum.value == 5
        d.send(m.id, UpdateWeightsReply(3, 1, 8, 0.1))
        d.send(init_id, InitWeightGroupReply("weights", 22809, 1, 2, 0.2))
        m = d.recv()
        assert m.body.source == CudaIpcSource(HANDLE, 512, 8, UUID)
        d.send(m.id, ErrorInfo("invalid_argument", "another GPU's handle", "body.source.device_uuid"))
        m = d.recv()
        assert m.body == DestroyWeightGroupRequest("weights")
        d.send(m.id, DestroyWeightGroupReply("weights"))

    peer = daemon(script)
    entries = [BucketEntry("w", "bfloat16", [4], 0, 8)]
    with Client(peer.endpoint, timeout_s=0.1) as c:
        init = c.init_weight_group("weights", UID, 2, 1, 0, 22809, 0.3, wait=False)
        bucket = c.update_weights_nccl(3, entries, "weights", 0, 8, checksum=5, wait=False, timeout_s=5.0)
        # Collected in either order; init waits past the client's own timeout (timeout_s + slack).
        assert bucket.result().num_bytes == 8
        assert init.result().duration_s == 0.2 and init.done()
        with pytest.raises(RolloutdError) as e:
            c.update_weights_cuda_ipc(3, entries, HANDLE, 512, 8, UUID, timeout_s=5.0)
        assert e.value.field == "body.source.device_uuid"
        c.timeout_s = 5.0
        assert c.destroy_weight_group("weights").group == "weights"


def test_pending_replies_arrive_in_any_order(daemon):
    def script(d):
        a, b = d.recv(), d.recv()
        d.send(b.id, HelloReply(build="second"))
        d.send(a.id, StatusReply(state="ready"))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        status = c.send_request(StatusRequest(), StatusReply)
        hello = c.send_request(HelloRequest(), HelloReply)
        assert status.result().state == "ready"
        assert hello.result().build == "second"
        assert status.result().state == "ready"  # a collected result stays


def test_pending_reply_short_wait_keeps_it_pending(daemon):
    def script(d):
        m = d.recv()
        assert d.expect_closed_or_silent(0.3)
        d.send(m.id, StatusReply(state="late"))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        p = c.send_request(StatusRequest(), StatusReply, timeout_s=5.0)
        with pytest.raises(RolloutdError) as e:
            p.result(0.05)
        assert e.value.code == "deadline_exceeded" and not p.done()
        assert p.result().state == "late"


# --------------------------------------------------------------------------------- planning --
def info(name, nbytes, ptr=None, device=None, dtype="int8"):
    return TensorInfo(name, dtype, [nbytes], nbytes, ptr, device)


def test_plan_packs_in_order_at_256_byte_offsets():
    items = [info("a", 10), info("b", 300), info("c", 1), info("d", 0), info("e", 600)]
    buckets = plan_buckets(items, bucket_bytes=1024)
    assert [[e.name for e in b.entries] for b in buckets] == [["a", "b", "c", "d"], ["e"]]
    assert [e.byte_offset for e in buckets[0].entries] == [0, 256, 768, 1024]
    assert buckets[0].size == 1024 and not buckets[0].direct
    assert [e.nbytes for e in buckets[0].entries] == [10, 300, 1, 0]


def test_plan_big_tensor_travels_alone_and_limits_close_buckets():
    items = [info("a", 10), info("big", 5000), info("c", 10)]
    assert [b.size for b in plan_buckets(items, bucket_bytes=1024)] == [10, 5000, 10]
    many = [info(f"t{i}", 1) for i in range(10)]
    assert [len(b.entries) for b in plan_buckets(many, 1 << 20, max_entries=4)] == [4, 4, 2]
    long_names = [info("n" * 2000, 1) for _ in range(6)]
    per_entry = 2000 + len("int8") + 9 + 72  # name, dtype, one dimension, keys and headers
    envelope = 4096 + 3 * per_entry + 1  # 4096 bytes stay free for the rest of the envelope
    assert [len(b.entries) for b in plan_buckets(long_names, 1 << 20, max_envelope_bytes=envelope)] == [3, 3]


def test_plan_direct_buckets_from_back_to_back_device_tensors():
    base = 1 << 32
    items = [info("a", 1000, base, 0), info("b", 24, base + 1024, 0), info("z", 0, None, 0),
             info("c", 100, base + 1048, 0)]
    (b,) = plan_buckets(items, bucket_bytes=1 << 20, direct_device=0)
    assert b.direct and b.direct_ptr == base and b.size == 1148
    assert [e.byte_offset for e in b.entries] == [0, 1024, 0, 1048]
    # Another device, a gap over 4 KiB, overlap, reversed order, a host tensor or a veto: packed.
    assert not plan_buckets(items, 1 << 20, direct_device=1)[0].direct
    assert not plan_buckets(items, 1 << 20)[0].direct
    for bad in ([info("a", 8, base, 0), info("b", 8, base + 8 + 4097, 0)],
                [info("a", 8, base, 0), info("b", 8, base + 4, 0)],
                [info("a", 8, base + 64, 0), info("b", 8, base, 0)],
                [info("a", 8, base, 0), info("b", 8, None, None)]):
        assert not plan_buckets(bad, 1 << 20, direct_device=0)[0].direct
    assert not plan_buckets(items, 1 << 20, direct_device=0, can_direct=lambda g: False)[0].direct


def test_plan_split_sends_big_separate_tensors_directly_and_packs_the_rest():
    # Three allocations far apart: not one direct bucket. With split_direct_bytes the two big ones
    # go from where they lie (one bucket each), the small ones are packed together, in order.
    items = [info("big0", 4096, 1 << 32, 0), info("s0", 10, None, None), info("big1", 8192, 2 << 32, 0),
             info("s1", 10, 3 << 32, 0)]
    plain = plan_buckets(items, bucket_bytes=1 << 20, direct_device=0)
    assert len(plain) == 1 and not plain[0].direct
    split = plan_buckets(items, 1 << 20, direct_device=0, split_direct_bytes=4096)
    assert [[e.name for e in b.entries] for b in split] == [["big0"], ["big1"], ["s0", "s1"]]
    assert [b.direct for b in split] == [True, True, False]
    assert split[0].direct_ptr == 1 << 32 and split[1].direct_ptr == 2 << 32
    assert [e.byte_offset for e in split[2].entries] == [0, 256]
    # A veto keeps them packed; a bucket already direct is left as it is.
    assert len(plan_buckets(items, 1 << 20, direct_device=0, can_direct=lambda g: False, split_direct_bytes=1)) == 1
    flat = [info("a", 4096, 1 << 32, 0), info("b", 4096, (1 << 32) + 4096, 0)]
    (b,) = plan_buckets(flat, 1 << 20, direct_device=0, split_direct_bytes=1)
    assert b.direct and len(b.entries) == 2


# -------------------------------------------------------------------------------- checksums --
def bf16_reference(u):
    """float32 bits -> bfloat16 bits, round to nearest even, NaN quieted (kernels/bf16.hpp)."""
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x7FFFFF):
        return (u >> 16) | 0x40
    upper, lower = u >> 16, u & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper & 0xFFFF


def test_expected_checksums_convert_as_the_daemon_stores():
    bits = [0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0xBF7FFFFF, 0x7F7FFFFF, 0x7F800000,
            0x7F800001, 0xFFC12345, 0x00000001, 0x80000000]
    f32 = np.array(bits, dtype="<u4").view("<f4")
    got = trainer.expected_checksums([("w", f32)], stored_dtypes="bfloat16")
    want = struct.pack(f"<{len(bits)}H", *[bf16_reference(u) for u in bits])
    assert got["w"] == zlib.crc32(want)
    assert got.model_checksum == model_checksum({"w": zlib.crc32(want)})
    # Widening is exact; no stored dtype given means the tensor's own.
    assert trainer.expected_checksums({"w": f32})["w"] == zlib.crc32(f32.tobytes())
    bf16 = np.frombuffer(want, dtype="<u2")
    widened = (bf16.astype("<u4") << 16).tobytes()
    assert trainer._convert_like_daemon(want, "bfloat16", "float32") == widened
    with pytest.raises(ValueError):
        trainer.expected_checksums([("w", f32)], stored_dtypes="float16")
    # Per-name dtypes, or the daemon's own reply.
    class Reply:
        parameters = [type("P", (), {"name": "w", "dtype": "bfloat16"})()]
    assert trainer.expected_checksums([("w", f32)], Reply())["w"] == got["w"]
    assert trainer.crc32_of_tensor(f32) == zlib.crc32(f32.tobytes())


def test_unique_id_bytes_from_signed_chars():
    uid = tuple(range(-128, 0))
    assert trainer.unique_id_bytes(uid) == bytes(range(128, 256))
    with pytest.raises(ValueError):
        trainer.unique_id_bytes(uid[:127])


def test_nccl_lib_dir_and_daemon_env(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert trainer.nccl_lib_dir() == str(lib)
    env = trainer.daemon_env({"LD_LIBRARY_PATH": f"/opt/x:{lib}"})
    assert env["LD_LIBRARY_PATH"] == f"{lib}:/opt/x"
    assert trainer.daemon_env({})["LD_LIBRARY_PATH"] == str(lib)
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        del sys.modules[name]  # the fake package must not outlive the test


# -------------------------------------------------------------- push orchestration, faked --
class FakeTensor:
    """A tensor in fake device memory: `ptr` into FakeBackend.memory."""

    def __init__(self, backend, ptr, array):
        self.backend, self.ptr, self.array = backend, ptr, array


class FakeBackend:
    """trainer._TorchBackend's interface over host memory: addresses index `regions`."""

    def __init__(self, device=0):
        self.device = device
        self.regions = {}  # base -> bytearray
        self._next = 1 << 32
        self.slots, self._slot = [], 0
        self.prepared, self.settle = [], True

    def alloc(self, nbytes):
        base = self._next
        self._next += (nbytes + (1 << 20)) & ~0xFFFF
        self.regions[base] = bytearray(max(nbytes, 1))
        return base

    def device_tensor(self, array, ptr=None):
        """`array` copied into fake device memory (at ptr, else a new region)."""
        data = np.ascontiguousarray(array)
        if ptr is None:
            ptr = self.alloc(data.nbytes)
        self.write(ptr, data.tobytes())
        return FakeTensor(self, ptr, data)

    def find(self, ptr):
        for base, mem in self.regions.items():
            if base <= ptr < base + len(mem):
                return base, mem
        raise KeyError(hex(ptr))

    def read(self, ptr, n):
        base, mem = self.find(ptr)
        return bytes(mem[ptr - base:ptr - base + n])

    def write(self, ptr, data):
        base, mem = self.find(ptr)
        mem[ptr - base:ptr - base + len(data)] = data

    # ---- the interface push_weights uses ----
    def describe(self, index, name, t):
        if isinstance(t, FakeTensor):
            a = t.array
            return TensorInfo(name, trainer.weight_dtype(a.dtype.name), list(a.shape), a.nbytes, t.ptr, self.device, t)
        a = np.asarray(t)
        return TensorInfo(name, trainer.weight_dtype(a.dtype.name), list(a.shape), a.nbytes, None, None, a)

    def start(self, items):
        pass

    def can_direct(self, items):
        return len({self.find(t.ptr)[0] for t in items if t.nbytes}) <= 1

    def allocate(self, nbytes, count):
        self.slots = [trainer._Slot(self.alloc(nbytes)) for _ in range(count)]

    def next_slot(self):
        slot = self.slots[self._slot % len(self.slots)]
        self._slot += 1
        return slot

    def prepare(self, bucket, slot):
        self.prepared.append(bucket)
        if bucket.direct:
            return trainer._Prepared(bucket.direct_ptr, bucket.size)
        for item, e in zip(bucket.items, bucket.entries):
            data = item.tensor.array if isinstance(item.tensor, FakeTensor) else item.tensor
            self.write(slot.tensor + e.byte_offset, np.ascontiguousarray(data).tobytes())
        return trainer._Prepared(slot.tensor, bucket.size, None, slot)

    def host_bytes(self, prep):
        return self.read(prep.ptr, prep.size)

    def export(self, prep):
        base, _ = self.find(prep.ptr)
        return base.to_bytes(8, "little") * 8, prep.ptr - base

    def broadcast(self, group, prep):
        group.broadcast_ptr(prep.ptr, prep.size)

    def finish(self, group, timeout_s):
        pass

    def settled(self, timeout_s):
        return self.settle

    def close(self):
        pass


class FakeGroup:
    """NcclWeightGroup's interface for push_weights: a broadcast hands the bytes to every daemon."""

    def __init__(self, clients, backend):
        self.clients, self.backend = clients, backend
        self.name, self.root, self.device, self.timeout_s = "weights", 0, backend.device, 5.0
        self.queues = {c.endpoint: queue.Queue() for c in clients}
        self.aborted = None

    @property
    def usable(self):
        return self.aborted is None

    def _check_usable(self):
        if self.aborted:
            raise RolloutdError("failed_precondition", self.aborted, "")

    def broadcast_ptr(self, ptr, nbytes, stream=None):
        data = self.backend.read(ptr, nbytes)
        for q in self.queues.values():
            q.put(data)

    def abort(self, reason):
        self.aborted = reason


TENSORS = [
    ("model.layers.0.mlp.experts.gate_up_proj", np.arange(600, dtype=np.float32).reshape(2, 300)),
    ("model.layers.0.mlp.gate.weight", np.full((4, 4), 7, dtype=np.int8)),
    ("model.norm.weight", np.linspace(-1, 1, 33).astype(np.float16)),
    ("model.layers.0.input_layernorm.weight", np.ones(3, dtype=np.float32)),
]


def serve(d, session, get_bytes, state, fail_at=None, broadcast_on_failure=True, max_in_flight=2):
    """A fake daemon's whole push: hello, begin, buckets (bytes from get_bytes(req)), end or abort."""
    m = d.recv()
    assert isinstance(m.body, HelloRequest)
    d.send(m.id, HelloReply(gpu=0, nccl_version=22809, device_uuid=UUID, limits=Limits()))
    m = d.recv()
    assert isinstance(m.body, BeginWeightUpdateRequest)
    d.send(m.id, BeginWeightUpdateReply(session, 0, 0))
    state.setdefault("applied", {})
    state["buckets"] = 0
    unanswered = []
    while True:
        m = d.recv()
        if isinstance(m.body, (EndWeightUpdateRequest, AbortWeightUpdateRequest)):
            assert not unanswered, "end/abort before every bucket was answered"
            state["final"] = m.body
            reply = (EndWeightUpdateReply(session, m.body.weight_version, state["buckets"])
                     if isinstance(m.body, EndWeightUpdateRequest) else AbortWeightUpdateReply(session, "ready"))
            d.send(m.id, reply)
            return
        req = m.body
        assert isinstance(req, UpdateWeightsRequest) and req.session == session
        index = state["buckets"]
        state["buckets"] += 1
        # A refusal with a broadcast is one bucket's; one without (no such group) is every later one's too.
        failing = fail_at is not None and (index == fail_at[0] or (not broadcast_on_failure and index > fail_at[0]))
        data = get_bytes(req) if (not failing or broadcast_on_failure) else None
        if failing:
            reply = ErrorInfo(*fail_at[1:])
        else:
            assert len(data) == req.source.size
            if req.checksum is not None:
                assert req.checksum.value == zlib.crc32(data)
            for e in req.entries:
                state["applied"][e.name] = (e.dtype, e.shape, data[e.byte_offset:e.byte_offset + e.nbytes])
            reply = UpdateWeightsReply(session, len(req.entries), sum(e.nbytes for e in req.entries), 0.0)
        # Replies are held while the client keeps sending, and go out (oldest first) once it waits
        # or max_in_flight are pending: a client that sent more without a reply fails here.
        unanswered.append((m.id, reply))
        state["max_in_flight"] = max(state.get("max_in_flight", 0), len(unanswered))
        assert len(unanswered) <= max_in_flight, "more buckets in flight than the daemon stages"
        while unanswered and (len(unanswered) >= max_in_flight or d.expect_closed_or_silent(0.05)):
            mid, r = unanswered.pop(0)
            d.send(mid, r)


def check_applied(state, tensors):
    assert set(state["applied"]) == {n for n, _ in tensors}
    for name, a in tensors:
        dtype, shape, data = state["applied"][name]
        arr = a.array if isinstance(a, FakeTensor) else a
        assert (dtype, shape, data) == (trainer.weight_dtype(arr.dtype.name), list(arr.shape), arr.tobytes()), name


def two_daemons(daemon, script):
    states = [{}, {}]
    peers = [daemon(lambda d, s=s, i=i: script(d, s, i)) for i, s in enumerate(states)]
    return peers, states


def two_daemons_in_a_group(daemon, script, backend, box):
    """two_daemons, a client of each and a FakeGroup over them in box["g"] (where the scripts
    find the group's queues): (peers, states, clients). The caller joins the peers and closes
    the clients."""
    peers, states = two_daemons(daemon, script)
    clients = [Client(p.endpoint) for p in peers]
    box["g"] = FakeGroup(clients, backend)
    return peers, states, clients


def test_push_nccl_to_two_daemons_packs_every_bucket_once(daemon):
    backend = FakeBackend()
    group_box = {}

    def script(d, state, i):
        serve(d, 11 + i, lambda req: group_box["g"].queues[d.endpoint].get(timeout=5), state)

    peers, states, clients = two_daemons_in_a_group(daemon, script, backend, group_box)
    stats = {}
    ends = trainer.push_weights(clients, TENSORS, 7, via="nccl", group=group_box["g"], bucket_bytes=2600,
                                checksum=True, stats=stats, _backend=backend)
    for p in peers:
        p.join()
    assert [e.weight_version for e in ends] == [7, 7] and [e.session for e in ends] == [11, 12]
    for s in states:
        check_applied(s, TENSORS)
        assert s["buckets"] == 2 and isinstance(s["final"], EndWeightUpdateRequest)
    assert stats["num_buckets"] == 2 and stats["num_direct"] == 0 and stats["num_bytes"] == 2400 + 16 + 66 + 12
    assert states[0]["max_in_flight"] == 2, "two buckets are kept in flight"
    assert all(q.empty() for q in group_box["g"].queues.values())
    assert group_box["g"].usable
    for c in clients:
        c.close()


def test_push_nccl_sends_back_to_back_device_tensors_directly(daemon):
    backend = FakeBackend()
    flat = backend.alloc(4096)
    a = backend.device_tensor(np.arange(256, dtype=np.float32), flat)          # [0, 1024)
    b = backend.device_tensor(np.arange(10, dtype=np.int8), flat + 1024)       # [1024, 1034)
    c = backend.device_tensor(np.ones(5, dtype=np.float16), flat + 1040)       # a 6-byte gap
    tensors = [("a", a), ("b", b), ("c", c), ("host", np.zeros(2, np.float32))]
    box = {}

    def script(d, state, i):
        serve(d, 1, lambda req: box["g"].queues[d.endpoint].get(timeout=5), state)

    peer = daemon(lambda d: script(d, box.setdefault("state", {}), 0))
    client = Client(peer.endpoint)
    box["g"] = FakeGroup([client], backend)
    stats = {}
    trainer.push_weights([client], tensors, 1, group=box["g"], bucket_bytes=1300, stats=stats, _backend=backend)
    peer.join()
    assert stats["num_buckets"] == 2 and stats["num_direct"] == 1
    direct = backend.prepared[0]
    assert direct.direct_ptr == flat and direct.size == 1050
    assert [e.byte_offset for e in direct.entries] == [0, 1024, 1040]
    check_applied(box["state"], tensors)
    client.close()


@contextlib.contextmanager
def gc_set(enabled):
    """The collector on or off for the block, then back as it was."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled_before", [True, False])
def test_push_pauses_gc_while_planning_and_restores_it(daemon, enabled_before):
    """The collector is off while push_weights describes and sends the tensors, back as it was after."""
    seen = []

    class Recording(FakeBackend):
        def describe(self, index, name, t):
            seen.append(gc.isenabled())
            return super().describe(index, name, t)

        def prepare(self, *args, **kwargs):
            seen.append(gc.isenabled())
            return super().prepare(*args, **kwargs)

    backend = Recording()
    tensors = [("a", np.arange(8, dtype=np.float32)), ("b", np.ones(4, dtype=np.float16))]
    box = {}

    def script(d):
        serve(d, 1, lambda req: box["g"].queues[d.endpoint].get(timeout=5), box.setdefault("state", {}))

    peer = daemon(script)
    client = Client(peer.endpoint)
    box["g"] = FakeGroup([client], backend)
    with gc_set(enabled_before):
        trainer.push_weights([client], tensors, 1, group=box["g"], _backend=backend)
        assert gc.isenabled() == enabled_before
    peer.join()
    assert seen and not any(seen)  # describe twice, then every bucket's preparation
    check_applied(box["state"], tensors)
    client.close()


@pytest.mark.parametrize("enabled_before", [True, False])
def test_push_refused_restores_gc(daemon, enabled_before):
    """A push that fails (a refused bucket) leaves the collector as it found it."""
    backend = FakeBackend()
    box = {}

    def script(d):
        fail = (1, "invalid_argument", "checksum mismatch", "body.checksum")
        serve(d, 5, lambda req: box["g"].queues[d.endpoint].get(timeout=5), box.setdefault("state", {}), fail_at=fail)

    peer = daemon(script)
    client = Client(peer.endpoint)
    box["g"] = FakeGroup([client], backend)
    with gc_set(enabled_before):
        with pytest.raises(RolloutdError):
            trainer.push_weights([client], TENSORS, 3, group=box["g"], bucket_bytes=64, _backend=backend)
        assert gc.isenabled() == enabled_before
    peer.join()
    client.close()


def test_gc_pauses_overlapping_on_threads_end_with_the_last():
    """Two pushes' pauses overlapping (two threads): the collector stays off until both end."""
    with gc_set(True):
        outer = trainer._gc_paused(True)
        inner = trainer._gc_paused(True)
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)  # the first push ends while the other still runs
        assert not gc.isenabled()
        inner.__exit__(None, None, None)
        assert gc.isenabled()
        with trainer._gc_paused(False):
            assert gc.isenabled()  # PAUSE_GC_DURING_PUSH off: untouched


def test_push_nccl_refusal_keeps_the_group_and_aborts_the_sessions(daemon):
    backend = FakeBackend()
    box = {}

    def script(d, state, i):
        fail = (1, "invalid_argument", "checksum mismatch", "body.checksum") if i == 0 else None
        serve(d, 5, lambda req: box["g"].queues[d.endpoint].get(timeout=5), state, fail_at=fail)

    peers, states, clients = two_daemons_in_a_group(daemon, script, backend, box)
    with pytest.raises(RolloutdError) as e:
        trainer.push_weights(clients, TENSORS, 3, group=box["g"], bucket_bytes=64, _backend=backend)
    for p in peers:
        p.join()
    assert (e.value.code, e.value.field) == ("invalid_argument", "body.checksum")
    assert e.value.message.startswith(peers[0].endpoint)
    assert all(isinstance(s["final"], AbortWeightUpdateRequest) for s in states)
    assert box["g"].usable, "the daemon received the bytes of the refused bucket: the group is in step"
    for c in clients:
        c.close()


def test_push_refused_at_begin_by_one_daemon_aborts_the_sessions_opened_on_the_others(daemon):
    # An open session stops a daemon's forward steps until its idle deadline: a begin refused by
    # one daemon must not leave the others' sessions open (they were left open until 2026-12-02).
    backend = FakeBackend()
    box = {}

    def script(d, state, i):
        m = d.recv()
        assert isinstance(m.body, HelloRequest)
        d.send(m.id, HelloReply(gpu=0, nccl_version=22809, device_uuid=UUID, limits=Limits()))
        m = d.recv()
        assert isinstance(m.body, BeginWeightUpdateRequest)
        if i == 0:
            d.send(m.id, BeginWeightUpdateReply(21, 0, 0))
            m = d.recv()
            state["final"] = m.body
            d.send(m.id, AbortWeightUpdateReply(21, "ready"))
        else:
            d.send(m.id, ErrorInfo("failed_precondition", "session 4 is already open", "session"))

    peers, states, clients = two_daemons_in_a_group(daemon, script, backend, box)
    with pytest.raises(RolloutdError) as e:
        trainer.push_weights(clients, TENSORS, 3, group=box["g"], bucket_bytes=64, _backend=backend)
    for p in peers:
        p.join()
    assert e.value.code == "failed_precondition" and e.value.message.startswith(peers[1].endpoint)
    assert isinstance(states[0].get("final"), AbortWeightUpdateRequest) and states[0]["final"].session == 21
    for c in clients:
        c.close()


def test_push_nccl_aborts_a_group_left_out_of_step(daemon):
    backend = FakeBackend()
    backend.settle = False  # our broadcast of the refused bucket never completes
    box = {}

    def script(d, state, i):
        serve(d, 5, lambda req: box["g"].queues[d.endpoint].get(timeout=5), state,
              fail_at=(0, "not_found", "no group 'weights'", "body.source.group"), broadcast_on_failure=False)

    peer = daemon(lambda d: script(d, box.setdefault("state", {}), 0))
    client = Client(peer.endpoint)
    box["g"] = FakeGroup([client], backend)
    with pytest.raises(RolloutdError) as e:
        trainer.push_weights([client], TENSORS, 3, group=box["g"], _backend=backend)
    peer.join()
    assert e.value.code == "not_found"
    assert not box["g"].usable and "push_weights failed" in box["g"].aborted
    assert isinstance(box["state"]["final"], AbortWeightUpdateRequest)
    client.close()


def test_push_nccl_needs_exactly_the_groups_daemons():
    backend = FakeBackend()
    a, b = Client("tcp://127.0.0.1:1", timeout_s=0.1), Client("tcp://127.0.0.1:2", timeout_s=0.1)
    with pytest.raises(ValueError, match="group="):
        trainer.push_weights([a], TENSORS, 1, via="nccl", _backend=backend)
    a.close(), b.close()


def test_push_ipc_waits_for_the_reply_before_reusing_a_buffer(daemon):
    backend = FakeBackend()
    flat = backend.alloc(1 << 16)
    big = backend.device_tensor(np.arange(4096, dtype=np.float32), flat)  # direct, in its own allocation
    tensors = TENSORS + [("big", big)]
    seen = []

    def read(req):
        assert isinstance(req.source, CudaIpcSource) and req.source.device_uuid == UUID
        base = int.from_bytes(req.source.handle[:8], "little")
        assert req.source.handle == req.source.handle[:8] * 8
        seen.append((base, req.source.offset, req.source.size))
        return backend.read(base + req.source.offset, req.source.size)

    state = {}
    peer = daemon(lambda d: serve(d, 8, read, state))
    client = Client(peer.endpoint)
    stats = {}
    trainer.push_weights([client], tensors, 2, via="cuda_ipc", bucket_bytes=2600, checksum=True, stats=stats,
                         _backend=backend)
    peer.join()
    check_applied(state, tensors)
    assert stats["num_buckets"] == 3 and stats["num_direct"] == 1
    assert seen[-1] == (flat, 0, 4096 * 4)  # the big tensor straight from where it lies
    assert len({base for base, _, _ in seen[:2]}) == 2, "two staging buffers alternate"
    client.close()


def test_push_ipc_needs_the_daemons_on_one_gpu(daemon):
    def script(d):
        m = d.recv()
        d.send(m.id, HelloReply(gpu=-1, nccl_version=0, device_uuid=b""))

    peer = daemon(script)
    with Client(peer.endpoint) as c, pytest.raises(ValueError, match="one GPU"):
        trainer.push_weights([c], TENSORS, 1, via="cuda_ipc", _backend=FakeBackend())


def test_importing_trainer_needs_neither_torch_nor_cupy():
    import subprocess

    code = ("import sys; sys.modules['torch'] = None; sys.modules['cupy'] = None\n"
            "import rolloutd.trainer as t\n"
            "assert t.plan_buckets([t.TensorInfo('a', 'int8', [1], 1)])[0].size == 1\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr


def test_push_ipc_refusal_among_buckets_in_flight_drains_then_aborts(daemon):
    """One bucket refused while others are in flight: push_weights raises that refusal, collects
    the later buckets' replies before its abort (the daemon answers in order), and leaves no reply
    pending in the client."""
    backend = FakeBackend()
    tensors = [(f"t{i}", np.full(600, i, dtype=np.float32)) for i in range(8)]  # 2400 B each: one per bucket

    def read(req):
        base = int.from_bytes(req.source.handle[:8], "little")
        return backend.read(base + req.source.offset, req.source.size)

    state = {}
    peer = daemon(lambda d: serve(d, 4, read, state, fail_at=(1, "invalid_argument", "refused", "body.entries"),
                                  max_in_flight=4))
    client = Client(peer.endpoint)
    with pytest.raises(RolloutdError, match="refused"):
        trainer.push_weights([client], tensors, 2, via="cuda_ipc", bucket_bytes=2600, _backend=backend)
    peer.join()
    assert isinstance(state["final"], AbortWeightUpdateRequest)
    assert state["buckets"] >= 2
    assert not client._outstanding, "replies of buckets in flight were left behind"
    client.close()
