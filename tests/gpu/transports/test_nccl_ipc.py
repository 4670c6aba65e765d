"""GPU weight transports end to end (SPEC §11.7, issue 7): this process is a PyTorch/CuPy trainer
on GPU 0, the daemons are real rolloutd processes on GPU 1 (NCCL) or GPU 0 (CUDA IPC).

New weights come from the independent NumPy re-implementation of the embedded model with other
seeds (tests/reference/tiny_moe_reference.py), so a daemon that took them must report the
trainer's checksums and generate exactly like a daemon started with --model-seed of that seed.

Run on the GPU host (see tests/gpu/bench-transports.sh for the environment):
    ROLLOUTD_BUILD_DIR=build/gpu python3 -m pytest -q tests/gpu/transports
"""
import gc
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest

import rdgpu
from rolloutd import RolloutdError, nccl_version_string
from rolloutd import trainer
from rolloutd.trainer import (NcclWeightGroup, crc32_of_tensor, device_uuid, expected_checksums, ipc_export,
                              pack_device_bucket, push_weights)

HERE = os.path.dirname(os.path.abspath(__file__))
# With one GPU only the CUDA IPC tests run (conftest.py), and a second daemon shares GPU 0.
TRAINER_GPU, DAEMON_GPU = 0, (1 if rdgpu.gpu_count() >= 2 else 0)
GROUP_TIMEOUT_S = 30.0
# A gauge of CUDA IPC handles the daemon holds open, if it exports one: 0 between sessions.
IPC_HANDLES_METRIC = "rolloutd_weight_ipc_handles_open"


def crcs(w):
    """{name: CRC-32} of float32 numpy weights: what the daemon reports after taking them."""
    return {n: zlib.crc32(a.tobytes()) for n, a in w.items()}


def flat_views(tensors):
    """The same tensors as views of one flat buffer, back to back: buckets go out without staging."""
    import torch

    flat = torch.cat([t.reshape(-1) for _, t in tensors])
    out, offset = [], 0
    for name, t in tensors:
        out.append((name, flat[offset:offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return out


def test_nccl_push_equals_a_daemon_started_with_those_weights(daemon_factory, weights):
    import cupy
    import torch

    seed, w = weights["A"]
    pushed = daemon_factory(DAEMON_GPU)
    fresh = daemon_factory(DAEMON_GPU, "--model-seed", str(seed))
    with pushed.client() as c, fresh.client() as f:
        hello = c.hello()
        assert hello.gpu == DAEMON_GPU and hello.device_uuid == device_uuid(DAEMON_GPU)
        assert hello.nccl_version == cupy.cuda.nccl.get_version(), (
            f"the daemon loaded NCCL {hello.nccl_version}: is LD_LIBRARY_PATH={trainer.nccl_lib_dir()} reaching it?")
        tensors = rdgpu.to_torch(w, f"cuda:{TRAINER_GPU}")
        with NcclWeightGroup([c], device=TRAINER_GPU, timeout_s=GROUP_TIMEOUT_S) as group:
            assert (group.world_size, group.replies[0].rank, group.replies[0].nccl_version) == (2, 1, group.version)
            stats = {}
            (end,) = push_weights([c], tensors, 7, via="nccl", group=group, bucket_bytes=256 << 10, checksum=True,
                                  stats=stats)
            assert end.weight_version == 7 and end.num_parameters_updated == len(w) and stats["num_buckets"] > 1
            sums = c.weights_checksum()
            want = expected_checksums(tensors, sums)
            assert dict(sums) == dict(want) == crcs(w)
            assert sums.model_checksum == want.model_checksum == f.weights_checksum().model_checksum
            assert rdgpu.greedy(c) == rdgpu.greedy(f)

            # bfloat16 into the daemon's float32 parameters: widened exactly, as expected_checksums says.
            bf16 = [(n, t.to(torch.bfloat16)) for n, t in tensors]
            push_weights([c], bf16, 8, via="nccl", group=group, bucket_bytes=64 << 10)
            sums = c.weights_checksum()
            assert dict(sums) == dict(expected_checksums(bf16, sums)) != crcs(w)

            # Views of one flat buffer: every bucket broadcast straight from it (where the allocator's
            # segments are plain cudaMallocs; packed through staging otherwise, which works as well).
            stats = {}
            push_weights([c], flat_views(tensors), 9, via="nccl", group=group, bucket_bytes=1 << 20, stats=stats)
            if rdgpu.torch_memory_exportable(TRAINER_GPU):
                assert stats["num_direct"] == stats["num_buckets"] > 0, stats
            assert c.weights_checksum().model_checksum == f.weights_checksum().model_checksum
            assert rdgpu.greedy(c) == rdgpu.greedy(f)
        assert c.status().ready


@pytest.mark.one_gpu
def test_ipc_push_equals_a_daemon_started_with_those_weights(daemon_factory, weights):
    import torch

    seed, w = weights["A"]
    pushed = daemon_factory(TRAINER_GPU)  # on this trainer's GPU: colocated
    fresh = daemon_factory(DAEMON_GPU, "--model-seed", str(seed))
    with pushed.client() as c, fresh.client() as f:
        assert c.hello().device_uuid == device_uuid(TRAINER_GPU)
        assert trainer.find_device(c.hello().device_uuid) == TRAINER_GPU
        tensors = rdgpu.to_torch(w, f"cuda:{TRAINER_GPU}")
        stats = {}
        (end,) = push_weights([c], tensors, 3, via="cuda_ipc", bucket_bytes=256 << 10, checksum=True, stats=stats)
        assert end.weight_version == 3 and stats["num_buckets"] > 1
        assert dict(c.weights_checksum()) == crcs(w)
        assert c.weights_checksum().model_checksum == f.weights_checksum().model_checksum
        assert rdgpu.greedy(c) == rdgpu.greedy(f)

        # Zero-copy from one flat buffer, then host tensors packed through staging, then bfloat16.
        stats = {}
        push_weights([c], flat_views(tensors), 4, via="cuda_ipc", bucket_bytes=1 << 20, stats=stats)
        if rdgpu.torch_memory_exportable(TRAINER_GPU):
            assert stats["num_direct"] == stats["num_buckets"] > 0, stats
        assert dict(c.weights_checksum()) == crcs(w)
        host = [(n, torch.from_numpy(a)) for n, a in w.items()]
        stats = {}
        push_weights([c], host, 5, via="cuda_ipc", bucket_bytes=128 << 10, stats=stats)
        assert stats["num_direct"] == 0
        assert dict(c.weights_checksum()) == crcs(w)
        bf16 = [(n, t.to(torch.bfloat16)) for n, t in tensors]
        push_weights([c], bf16, 6, via="cuda_ipc")
        sums = c.weights_checksum()
        assert dict(sums) == dict(expected_checksums(bf16, sums))
        assert c.status().ready


def test_fifty_alternating_sessions_keep_checksums_and_memory(daemon_factory, weights):
    """NCCL from GPU 0 and CUDA IPC on GPU 1 into one daemon on GPU 1, alternating, a third of the
    sessions partial, two bucket sizes: checksums right after every session, the daemon's device
    memory flat after warm-up, no IPC handle left open, ready at the end."""
    import torch

    d = daemon_factory(DAEMON_GPU)
    sources = {key: {"nccl": dict(rdgpu.to_torch(w, f"cuda:{TRAINER_GPU}")),
                     "cuda_ipc": dict(rdgpu.to_torch(w, f"cuda:{DAEMON_GPU}"))} for key, (_, w) in weights.items()}
    sums = {key: crcs(w) for key, (_, w) in weights.items()}
    names = list(weights["A"][1])
    partial = [n for n in names if n.startswith(("model.layers.0.", "model.layers.1."))]
    assert 0 < len(partial) < len(names)

    def memory():
        torch.cuda.synchronize(DAEMON_GPU)
        gc.collect()
        per_process = rdgpu.process_gpu_memory_mib(d.proc.pid, DAEMON_GPU)
        return per_process if per_process is not None else rdgpu.device_used_mib(DAEMON_GPU)

    with d.client() as c, NcclWeightGroup([c], device=TRAINER_GPU, timeout_s=GROUP_TIMEOUT_S) as group:
        expected = dict(c.weights_checksum())
        samples = []
        for k in range(50):
            via = "nccl" if k % 2 == 0 else "cuda_ipc"
            key = "A" if (k // 2) % 2 == 0 else "B"
            subset = partial if k % 3 == 2 else names
            bucket = (1 << 20) if (k // 2) % 2 else (64 << 10)
            tensors = [(n, sources[key][via][n]) for n in subset]
            extra = {"group": group} if via == "nccl" else {}
            (end,) = push_weights([c], tensors, k + 1, via=via, bucket_bytes=bucket, **extra)
            assert end.num_parameters_updated == len(subset)
            expected.update((n, sums[key][n]) for n in subset)
            got = c.weights_checksum()
            assert dict(got) == expected, f"session {k}: {via}, set {key}, {len(subset)} tensors"
            assert got.weight_version == k + 1
            if k >= 8:  # after warm-up: both transports and both bucket sizes seen
                samples.append(memory())
        growth = max(samples) - samples[0]
        assert growth <= 64, f"daemon device memory grew {growth:.0f} MiB over {len(samples)} sessions: {samples}"
        handles = d.metric(IPC_HANDLES_METRIC)
        assert handles in (None, 0.0), f"{handles:.0f} CUDA IPC handles still open between sessions"
        status = d.status_json()
        assert status.get("state") == "ready" and d.get("/readyz")[0] == 200, status
        assert c.status().ready


def kill_trainer_child_after_sent(d, args, what):
    """Starts trainer_child.py ARGS against daemon d and waits (bounded) for it to print "SENT";
    returns (child, its stderr file) for kill(). `what` names the step in errors."""
    err = open(os.path.join(d.dir, f"child-{args[-1]}.stderr"), "w")
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_child.py"), d.control, *map(str, args)],
                             stdout=subprocess.PIPE, stderr=err, text=True, cwd=HERE)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in child.stdout], daemon=True).start()
    try:
        said = lines.get(timeout=180)
    except queue.Empty:
        said = None
    if said != "SENT":
        child.kill()
        err.close()
        raise AssertionError(f"the trainer child did not get to {what} ({said!r}):\n" + open(err.name).read()[-5000:])
    return child, err


def wait_failed_closed(d, c, killed, within_s):
    """After a trainer died mid-session: the daemon reaches not_ready (bounded), with a reason,
    no session open, /readyz failing and generation refused."""
    status = c.status()
    while status.state != "not_ready":
        assert time.monotonic() - killed < within_s, (
            f"still {status.state!r} {time.monotonic() - killed:.0f} s after the trainer died:\n{d.read_log(5000)}")
        time.sleep(0.25)
        status = c.status()
    assert not status.ready and status.reason and status.update_session == 0, status
    assert d.get("/readyz")[0] != 200
    with pytest.raises(RolloutdError) as e:
        c.generate([1, 2, 3], max_new_tokens=2, temperature=0.0)
    assert e.value.code == "not_ready"


def kill(child, err):
    """SIGKILLs the trainer child; returns the monotonic time of the kill."""
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    err.close()
    return time.monotonic()


def test_trainer_killed_mid_broadcast_fails_the_session_closed(daemon_factory, weights):
    """A trainer SIGKILLed after it sent a bucket's update_weights but before it broadcast: the daemon's
    broadcast never completes, so within the group's timeout it aborts the communicator and the
    session fails closed (a bucket had been applied); a new group and a full session then work."""
    child_timeout_s = 10.0
    d = daemon_factory(DAEMON_GPU)
    child, err = kill_trainer_child_after_sent(d, [TRAINER_GPU, child_timeout_s], "its second bucket")
    killed = kill(child, err)

    with d.client() as c:
        wait_failed_closed(d, c, killed, child_timeout_s + 30)

        # The same group name again, a whole session: serving again, with exactly those weights.
        _, w = weights["B"]
        with NcclWeightGroup([c], device=TRAINER_GPU, timeout_s=GROUP_TIMEOUT_S) as group:
            push_weights([c], rdgpu.to_torch(w, f"cuda:{TRAINER_GPU}"), 21, via="nccl", group=group)
        status = c.status()
        assert status.ready and status.state == "ready" and status.weight_version == 21
        assert dict(c.weights_checksum()) == crcs(w)


@pytest.mark.one_gpu
def test_trainer_killed_mid_ipc_session_expires_closes_its_handle_and_fails_closed(daemon_factory, weights):
    """A colocated trainer SIGKILLed after one CUDA IPC bucket was applied: the session expires at
    its deadline, the daemon closes the dead process's handle (the open-handle gauge returns to
    0), fails closed (not ready, generation refused), and the next IPC session makes it whole."""
    session_timeout_s = 3.0
    d = daemon_factory(TRAINER_GPU)  # colocated
    child, err = kill_trainer_child_after_sent(d, [TRAINER_GPU, session_timeout_s, "ipc"], "its bucket")
    assert d.metric(IPC_HANDLES_METRIC) == 1, "the daemon holds the handle while the session is open"
    killed = kill(child, err)

    with d.client() as c:
        wait_failed_closed(d, c, killed, session_timeout_s + 30)
        assert d.metric(IPC_HANDLES_METRIC) == 0, "the dead trainer's handle was closed with its session"

        _, w = weights["B"]
        push_weights([c], rdgpu.to_torch(w, f"cuda:{TRAINER_GPU}"), 22, via="cuda_ipc")
        status = c.status()
        assert status.ready and status.weight_version == 22
        assert dict(c.weights_checksum()) == crcs(w)
        assert d.metric(IPC_HANDLES_METRIC) == 0


@pytest.mark.one_gpu
def test_ipc_buckets_in_flight_are_answered_in_order_and_free_their_memory(daemon_factory, weights):
    """Several CUDA IPC buckets sent without waiting (the daemon queues their copies and answers
    each when its copies are done): the producer overwrites each bucket's buffer the moment its
    reply arrives, a refused bucket among them changes nothing and keeps the session open, and
    after the end every tensor holds what was sent and no handle is left open."""
    import torch

    _, w = weights["A"]
    names = list(w)
    d = daemon_factory(TRAINER_GPU)
    with d.client() as c:
        session = c.begin_weight_update().session
        groups = [names[k::4] for k in range(4)]
        pendings, buffers = [], []
        for k, group in enumerate(groups):
            buf, owner = rdgpu.ipc_buffer(sum(w[n].nbytes for n in group) + 256 * len(group) + 4096, TRAINER_GPU)
            entries, size = pack_device_bucket(buf, rdgpu.to_torch({n: w[n] for n in group}, f"cuda:{TRAINER_GPU}"))
            if k == 2:  # refused: an unknown name (nothing of it is written)
                entries = [type(entries[0])("no.such.weight", entries[0].dtype, entries[0].shape,
                                            entries[0].byte_offset, entries[0].nbytes)] + entries[1:]
            handle, offset = ipc_export(buf)
            pendings.append(c.update_weights_cuda_ipc(session, entries, handle, offset, size,
                                                      device_uuid(TRAINER_GPU), wait=False))
            buffers.append((buf, owner, group, entries, size, handle, offset))
        for k, p in enumerate(pendings):
            if k == 2:
                with pytest.raises(RolloutdError) as e:
                    p.result()
                assert (e.value.code, e.value.field) == ("not_found", "body.entries[0].name")
                continue
            assert p.result().num_entries == len(groups[k])
            buffers[k][0].fill_(0xFF)  # the reply is the licence to reuse it
        torch.cuda.synchronize(TRAINER_GPU)
        # The refused bucket again, right this time (its buffer was never answered as read: refill it).
        buf, owner, group, _, _, handle, offset = buffers[2]
        entries, size = pack_device_bucket(buf, rdgpu.to_torch({n: w[n] for n in group}, f"cuda:{TRAINER_GPU}"))
        c.update_weights_cuda_ipc(session, entries, handle, offset, size, device_uuid(TRAINER_GPU))
        assert d.metric(IPC_HANDLES_METRIC) == 4
        c.end_weight_update(session, 7)
        assert dict(c.weights_checksum()) == crcs(w)
        assert d.metric(IPC_HANDLES_METRIC) == 0
        assert c.status().ready


def test_corrupted_checksums_are_rejected_and_nothing_breaks(daemon_factory, weights):
    import torch

    _, w = weights["A"]
    _, wb = weights["B"]
    names = list(w)
    d = daemon_factory(DAEMON_GPU)
    with d.client() as c, NcclWeightGroup([c], device=TRAINER_GPU, timeout_s=GROUP_TIMEOUT_S) as group:
        before = dict(c.weights_checksum())

        # NCCL: the refused bucket's bytes are still received, so the group stays in step.
        staging = torch.zeros(1 << 22, dtype=torch.uint8, device=f"cuda:{TRAINER_GPU}")
        entries, size = pack_device_bucket(staging, rdgpu.to_torch({n: w[n] for n in names[:3]},
                                                                   f"cuda:{TRAINER_GPU}"))
        good = crc32_of_tensor(staging[:size])
        session = c.begin_weight_update().session
        pending = c.update_weights_nccl(session, entries, group.name, group.root, size, checksum=good ^ 1,
                                        wait=False)
        group.broadcast(staging[:size])
        with pytest.raises(RolloutdError) as e:
            pending.result()
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.checksum")
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(TRAINER_GPU))
        group.wait(done, 30)  # our side of the refused bucket's broadcast completed
        assert dict(c.weights_checksum()) == before, "a refused bucket writes nothing"
        pending = c.update_weights_nccl(session, entries, group.name, group.root, size, checksum=good, wait=False)
        group.broadcast(staging[:size])
        assert pending.result().num_entries == 3

        # CUDA IPC, from GPU 1 (the daemon's): a wrong checksum, a handle of another GPU, then right.
        staging1, owner = rdgpu.ipc_buffer(1 << 22, DAEMON_GPU)
        entries1, size1 = pack_device_bucket(staging1[4096:], rdgpu.to_torch({n: wb[n] for n in names[3:6]},
                                                                             f"cuda:{DAEMON_GPU}"))
        staging1 = staging1[4096:]  # a range inside the allocation: the offset travels too
        handle, offset = ipc_export(staging1)
        assert offset == 4096
        good1 = crc32_of_tensor(staging1[:size1])
        with pytest.raises(RolloutdError) as e:
            c.update_weights_cuda_ipc(session, entries1, handle, offset, size1, device_uuid(DAEMON_GPU),
                                      checksum=good1 ^ 1)
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.checksum")
        with pytest.raises(RolloutdError) as e:
            c.update_weights_cuda_ipc(session, entries1, handle, offset, size1, device_uuid(TRAINER_GPU))
        assert (e.value.code, e.value.field) == ("invalid_argument", "body.source.device_uuid")
        c.update_weights_cuda_ipc(session, entries1, handle, offset, size1, device_uuid(DAEMON_GPU), checksum=good1)
        staging1.fill_(0xFF)  # the producer may reuse its buffer as soon as the reply is in
        torch.cuda.synchronize(DAEMON_GPU)
        c.end_weight_update(session, 5)

        expected = dict(before)
        expected.update((n, zlib.crc32(w[n].tobytes())) for n in names[:3])
        expected.update((n, zlib.crc32(wb[n].tobytes())) for n in names[3:6])
        assert dict(c.weights_checksum()) == expected
        # The group is still usable for a whole push.
        push_weights([c], rdgpu.to_torch(w, f"cuda:{TRAINER_GPU}"), 6, via="nccl", group=group, checksum=True)
        assert dict(c.weights_checksum()) == crcs(w)
        assert c.status().ready


def test_mismatched_nccl_version_is_refused_clearly(daemon_factory):
    import cupy

    mine = cupy.cuda.nccl.get_version()
    d = daemon_factory(DAEMON_GPU)
    with d.client() as c:
        with pytest.raises(RolloutdError) as e:
            c.init_weight_group("mismatch", os.urandom(128), 2, 1, 0, mine + 1, timeout_s=5.0)
        assert (e.value.code, e.value.field) == ("failed_precondition", "body.nccl_version")
        assert "LD_LIBRARY_PATH" in e.value.message, e.value.message
        assert c.status().ready


def test_daemon_on_the_system_nccl_is_refused_before_joining(daemon_factory):
    """The real-world mistake: a daemon started without PyTorch's NCCL on LD_LIBRARY_PATH."""
    import cupy

    mine = cupy.cuda.nccl.get_version()
    d = daemon_factory(DAEMON_GPU, env=rdgpu.nccl_env(with_trainer_nccl=False))
    with d.client() as c:
        theirs = c.hello().nccl_version
        if theirs in (0, mine):
            pytest.skip(f"the system NCCL is {nccl_version_string(theirs)}, the same as PyTorch's or none")
        with pytest.raises(RolloutdError) as e:
            NcclWeightGroup([c], device=TRAINER_GPU, timeout_s=10.0)
        assert e.value.code == "failed_precondition" and "LD_LIBRARY_PATH=" in e.value.message
        assert nccl_version_string(theirs) in e.value.message and nccl_version_string(mine) in e.value.message
        with pytest.raises(RolloutdError) as e:
            c.init_weight_group("weights", os.urandom(128), 2, 1, 0, mine, timeout_s=5.0)
        assert (e.value.code, e.value.field) == ("failed_precondition", "body.nccl_version")
        assert c.status().ready
