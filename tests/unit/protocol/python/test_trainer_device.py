"""rolloutd.trainer's torch/CuPy code paths (NcclWeightGroup, the torch backend of push_weights,
pack_device_bucket, ipc_export) against fake torch and CuPy (fake_gpu.py) and scripted fake
daemons (zmtp_peer), each scenario in its own interpreter so the fakes never meet real modules.
The GPU host runs the real thing: tests/gpu/transports."""
import os
import subprocess
import sys
import zlib

import pytest

pytest.importorskip("numpy")

SCENARIOS = ["nccl_group_and_push", "ipc_push", "version_mismatch_refused_locally", "refused_join_is_torn_down",
             "colocated_daemon_needs_ipc", "device_primitives", "pack_paths"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario(scenario):
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here] + sys.path)}
    r = subprocess.run([sys.executable, os.path.abspath(__file__), scenario], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-5000:]


# --------------------------------------------------------------------- run in a subprocess --
def _daemon(script):
    from zmtp_peer import ZmtpPeer

    return ZmtpPeer(script, timeout_s=10.0)


def _serve_group(d, rank, world, fake, uuid, state):
    """A daemon of a group: hello, init_weight_group, then every push (buckets read from the fake
    broadcasts), then destroy_weight_group."""
    from rolloutd.messages import (BeginWeightUpdateReply, BeginWeightUpdateRequest, DestroyWeightGroupReply,
                                   DestroyWeightGroupRequest, EndWeightUpdateReply, EndWeightUpdateRequest,
                                   HelloReply, HelloRequest, InitWeightGroupReply, InitWeightGroupRequest,
                                   NcclSource, UpdateWeightsReply, UpdateWeightsRequest)

    state["applied"] = {}
    while True:
        m = d.recv()
        body = m.body
        if isinstance(body, HelloRequest):
            d.send(m.id, HelloReply(gpu=1, nccl_version=22809, device_uuid=uuid))
        elif isinstance(body, InitWeightGroupRequest):
            assert (body.group, body.world_size, body.rank, body.root, body.nccl_version) == \
                ("weights", world, rank, 0, 22809), body
            assert len(body.unique_id) == 128
            state["uid"] = body.unique_id
            d.send(m.id, InitWeightGroupReply(body.group, 22809, rank, world, 0.01))
        elif isinstance(body, BeginWeightUpdateRequest):
            d.send(m.id, BeginWeightUpdateReply(40 + rank, 0, 0))
        elif isinstance(body, UpdateWeightsRequest):
            assert isinstance(body.source, NcclSource) and body.source.group == "weights"
            data = fake.BROADCASTS[rank].get(timeout=5)
            assert len(data) == body.source.size
            if body.checksum is not None:
                assert body.checksum.value == zlib.crc32(data)
            for e in body.entries:
                state["applied"][e.name] = (e.dtype, e.shape, data[e.byte_offset:e.byte_offset + e.nbytes])
            d.send(m.id, UpdateWeightsReply(body.session, len(body.entries), 0, 0.0))
        elif isinstance(body, EndWeightUpdateRequest):
            d.send(m.id, EndWeightUpdateReply(body.session, body.weight_version))
        elif isinstance(body, DestroyWeightGroupRequest):
            d.send(m.id, DestroyWeightGroupReply(body.group))
            return
        else:
            raise AssertionError(f"unexpected {m.type}")


def _tensors(torch, device):
    """A float32 tensor, a bfloat16 one, a host tensor, and three views of one flat buffer."""
    import numpy as np

    a = torch.from_numpy(np.arange(600, dtype=np.float32).reshape(2, 300)).to(device)
    b = a.to(torch.bfloat16)
    host = torch.from_numpy(np.full(5, 3, dtype=np.int8))
    flat = torch.from_numpy(np.arange(1024, dtype=np.float32)).to(device)
    views = [("flat.0", flat[0:256]), ("flat.1", flat[256:768].view((16, 32))), ("flat.2", flat[768:1024])]
    return [("a", a), ("b", b), ("host", host)] + views


def _check(state, tensors):
    assert set(state["applied"]) == {n for n, _ in tensors}, sorted(state["applied"])
    for name, t in tensors:
        dtype, shape, data = state["applied"][name]
        assert dtype == str(t.dtype).replace("torch.", "") and shape == list(t.shape), name
        assert data == t._bytes().tobytes(), name


def nccl_group_and_push(fake, trainer, torch):
    from rolloutd import Client

    states = [{}, {}]
    peers = [_daemon(lambda d, r=r, s=s: _serve_group(d, r, 3, fake, fake.UUIDS[1], s))
             for r, s in zip((1, 2), states)]
    clients = [Client(p.endpoint, timeout_s=5) for p in peers]
    tensors = _tensors(torch, "cuda:0")
    with trainer.NcclWeightGroup(clients, device=0, timeout_s=5) as group:
        assert group.world_size == 3 and group.version == 22809 and group.usable
        assert states[0]["uid"] == states[1]["uid"] == trainer.unique_id_bytes(fake._make_cupy()[2].get_unique_id())
        stats = {}
        ends = trainer.push_weights(clients, tensors, 5, via="nccl", group=group, bucket_bytes=2048, checksum=True,
                                    stats=stats)
        assert [e.weight_version for e in ends] == [5, 5]
        assert stats["num_direct"] >= 1 and stats["num_direct"] < stats["num_buckets"], stats
        trainer.push_weights(clients, tensors[:2], 6, group=group)  # staging again, one bucket
    assert not group.usable and all(not c.alive for c in fake.NcclCommunicator.instances)
    for p in peers:
        p.join()
    for s in states:
        _check(s, tensors)
    assert all(q.empty() for q in fake.BROADCASTS.values())


def ipc_push(fake, trainer, torch):
    from rolloutd import Client
    from rolloutd.messages import (BeginWeightUpdateReply, CudaIpcSource, EndWeightUpdateReply,
                                   EndWeightUpdateRequest, HelloReply, UpdateWeightsReply, UpdateWeightsRequest)

    state = {"applied": {}, "handles": set()}

    def script(d):
        m = d.recv()
        d.send(m.id, HelloReply(gpu=1, nccl_version=22809, device_uuid=fake.UUIDS[1]))
        m = d.recv()
        d.send(m.id, BeginWeightUpdateReply(3, 0, 0))
        while True:
            m = d.recv()
            if isinstance(m.body, EndWeightUpdateRequest):
                d.send(m.id, EndWeightUpdateReply(3, m.body.weight_version))
                return
            req = m.body
            assert isinstance(req, UpdateWeightsRequest) and isinstance(req.source, CudaIpcSource)
            assert req.source.device_uuid == fake.UUIDS[1]
            base = fake.HANDLES[req.source.handle]
            assert fake.find(base)[1] == 1, "the bucket lies on the daemon's GPU"
            state["handles"].add(req.source.handle)
            data = fake.read(base + req.source.offset, req.source.size)
            assert req.checksum.value == zlib.crc32(data)
            for e in req.entries:
                state["applied"][e.name] = (e.dtype, e.shape, data[e.byte_offset:e.byte_offset + e.nbytes])
            d.send(m.id, UpdateWeightsReply(3, len(req.entries), 0, 0.0))

    peer = _daemon(script)
    client = Client(peer.endpoint, timeout_s=5)
    tensors = _tensors(torch, "cuda:0")  # not on the daemon's GPU: packed into staging on cuda:1
    local = [(n, t.to("cuda:1")) for n, t in tensors if t.is_cuda and n.startswith("flat")]
    flat = torch.from_numpy(__import__("numpy").arange(64, dtype="float32")).to("cuda:1")
    local += [("flat1.a", flat[0:32]), ("flat1.b", flat[32:64])]
    stats = {}
    trainer.push_weights([client], tensors + local, 9, via="cuda_ipc", bucket_bytes=2048, checksum=True,
                         stats=stats)
    peer.join()
    _check(state, tensors + local)
    assert stats["num_direct"] >= 1 and len(state["handles"]) >= 2, (stats, len(state["handles"]))


def version_mismatch_refused_locally(fake, trainer, torch):
    from rolloutd import Client, RolloutdError
    from rolloutd.messages import HelloReply

    def script(d):
        m = d.recv()
        d.send(m.id, HelloReply(gpu=1, nccl_version=22803, device_uuid=fake.UUIDS[1]))
        assert d.expect_closed_or_silent(0.5), "nothing after hello: no init_weight_group"

    peer = _daemon(script)
    client = Client(peer.endpoint, timeout_s=5)
    try:
        trainer.NcclWeightGroup([client], device=0)
    except RolloutdError as e:
        assert e.code == "failed_precondition" and e.field == "nccl_version", e
        assert "2.28.3" in e.message and "2.28.9" in e.message and "LD_LIBRARY_PATH=" in e.message, e.message
    else:
        raise AssertionError("a daemon with another NCCL was accepted")
    peer.join()


def refused_join_is_torn_down(fake, trainer, torch):
    from rolloutd import Client, RolloutdError
    from rolloutd.messages import DestroyWeightGroupReply, DestroyWeightGroupRequest, ErrorInfo, HelloReply

    def script(d):
        m = d.recv()
        d.send(m.id, HelloReply(gpu=1, nccl_version=22809, device_uuid=fake.UUIDS[1]))
        m = d.recv()
        d.send(m.id, ErrorInfo("resource_exhausted", "too many groups", "body.group"))
        m = d.recv()
        assert isinstance(m.body, DestroyWeightGroupRequest)
        d.send(m.id, DestroyWeightGroupReply("weights"))

    peer = _daemon(script)
    client = Client(peer.endpoint, timeout_s=5)
    try:
        trainer.NcclWeightGroup([client], device=0, timeout_s=5)
    except RolloutdError as e:
        assert (e.code, e.field) == ("resource_exhausted", "body.group") and peer.endpoint in e.message
    else:
        raise AssertionError("a refused join succeeded")
    peer.join()
    assert all(not c.alive for c in fake.NcclCommunicator.instances), "the trainer's half of the group aborted"


def colocated_daemon_needs_ipc(fake, trainer, torch):
    from rolloutd import Client
    from rolloutd.messages import HelloReply

    def script(d):
        m = d.recv()
        d.send(m.id, HelloReply(gpu=0, nccl_version=22809, device_uuid=fake.UUIDS[0]))

    peer = _daemon(script)
    client = Client(peer.endpoint, timeout_s=5)
    try:
        trainer.NcclWeightGroup([client], device=0)
    except ValueError as e:
        assert "cuda_ipc" in str(e)
    else:
        raise AssertionError("NCCL to a daemon on the trainer's own GPU was attempted")
    peer.join()


def device_primitives(fake, trainer, torch):
    import numpy as np

    staging = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:1")
    tensors = _tensors(torch, "cuda:1")
    entries, size = trainer.pack_device_bucket(staging, tensors)
    assert [e.byte_offset % 256 for e in entries] == [0] * len(entries)
    for (name, t), e in zip(tensors, entries):
        assert staging[e.byte_offset:e.byte_offset + e.nbytes]._bytes().tobytes() == t._bytes().tobytes(), name
    handle, offset = trainer.ipc_export(staging[512:1024])
    assert fake.HANDLES[handle] == staging.data_ptr() and offset == 512
    assert trainer.device_uuid(1) == fake.UUIDS[1] and trainer.find_device(fake.UUIDS[1]) == 1
    f32 = np.array([1.0, 2.5, -3.0], dtype=np.float32)
    t = torch.from_numpy(f32)
    assert trainer.crc32_of_tensor(t) == zlib.crc32(f32.tobytes())
    sums = trainer.expected_checksums([("w", t.to(torch.bfloat16))], "float32")
    assert sums["w"] == zlib.crc32(f32.tobytes())  # exact in bfloat16: widened back unchanged


def pack_paths(fake, trainer, torch):
    """Packing takes the gather kernel for small contiguous tensors on the staging buffer's device
    (one launch for all of them) and torch for the others; without the kernel (disabled, or a
    launch refused) every tensor takes torch, and the bytes are the same on every path."""
    import numpy as np

    def pack(tensors):
        staging = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:1")
        entries, size = trainer.pack_device_bucket(staging, tensors)
        for (name, t), e in zip(tensors, entries):
            assert staging[e.byte_offset:e.byte_offset + e.nbytes]._bytes().tobytes() == t._bytes().tobytes(), name
        return staging[:size]._bytes().tobytes()

    # Small tensors on cuda:1 (gathered), one above the gather limit, one on cuda:0, one on the host.
    small = [(f"s.{i}", torch.from_numpy(np.arange(i, i + 7 + i, dtype=np.float32)).to("cuda:1")) for i in range(5)]
    big = [("big", torch.from_numpy(np.arange(3000, dtype=np.float32)).to("cuda:1"))]
    other = [("other", torch.from_numpy(np.ones(9, dtype=np.float32)).to("cuda:0")),
             ("host", torch.from_numpy(np.full(5, 3, dtype=np.int8)))]
    tensors = small[:2] + big + other + small[2:]
    trainer._GATHER_MAX_BYTES = 4096  # "big" (12,000 bytes) takes torch
    fake.GATHER_LAUNCHES.clear()
    gathered = pack(tensors)
    assert fake.GATHER_LAUNCHES == [(1, 5)], fake.GATHER_LAUNCHES

    os.environ["ROLLOUTD_PACK_GATHER"] = "0"
    trainer._GATHER_KERNELS.clear()
    assert pack(tensors) == gathered and fake.GATHER_LAUNCHES == [(1, 5)]
    del os.environ["ROLLOUTD_PACK_GATHER"]
    trainer._GATHER_KERNELS.clear()

    def refuse(*args, **kwargs):
        raise RuntimeError("launch refused")

    fake.RawKernel.__call__ = refuse
    assert pack(tensors) == gathered
    assert trainer._GATHER_KERNELS[1] is None, "a refused launch turns the kernel off"


if __name__ == "__main__":
    import fake_gpu

    trainer_module = fake_gpu.install()
    import torch as fake_torch  # the fake

    globals()[sys.argv[1]](fake_gpu, trainer_module, fake_torch)
    print("ok")
