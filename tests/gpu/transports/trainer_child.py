"""A trainer process for test_nccl_ipc.py's fault tests, to be SIGKILLed mid-update.

    python trainer_child.py ENDPOINT DEVICE GROUP_TIMEOUT_S
    python trainer_child.py ENDPOINT DEVICE SESSION_TIMEOUT_S ipc

Joins an NCCL group with the daemon at ENDPOINT from cuda:DEVICE, opens a session, pushes one
bucket completely (so the session has written a parameter), then sends the update_weights of a
second bucket and never posts its broadcast: it prints "SENT" and sleeps until it is killed. The
daemon has posted its side of that broadcast by then, or will when it reads the message."""
import sys
import time

import rdgpu  # noqa: F401  (paths and NCCL environment)
import torch

from rolloutd import Client
from rolloutd.trainer import NcclWeightGroup, device_uuid, ipc_export, pack_device_bucket


def main_ipc(endpoint, device, session_timeout_s):
    """CUDA IPC: opens a session with a short deadline, pushes one bucket from its own memory
    (the daemon maps the handle and copies), prints "SENT" and sleeps until it is killed. The
    daemon still holds the dead process's handle open until the session ends."""
    torch.cuda.set_device(device)
    client = Client(endpoint, timeout_s=120)
    params = [p for p in client.weights_checksum().parameters if not p.name.startswith("synthetic.")]
    staging = torch.zeros(1 << 22, dtype=torch.uint8, device=f"cuda:{device}")
    session = client.begin_weight_update(timeout_s=session_timeout_s).session
    tensor = torch.randn(params[0].shape, device=f"cuda:{device}").to(getattr(torch, params[0].dtype))
    entries, size = pack_device_bucket(staging, [(params[0].name, tensor)])
    torch.cuda.synchronize(device)
    handle, offset = ipc_export(staging)
    client.update_weights_cuda_ipc(session, entries, handle, offset, size, device_uuid(device))
    print("SENT", flush=True)
    time.sleep(3600)


def main(endpoint, device, group_timeout_s):
    torch.cuda.set_device(device)
    client = Client(endpoint, timeout_s=120)
    group = NcclWeightGroup([client], group="weights", device=device, timeout_s=group_timeout_s)
    params = [p for p in client.weights_checksum().parameters if not p.name.startswith("synthetic.")]
    first, second = params[0], params[1]
    staging = torch.zeros(1 << 22, dtype=torch.uint8, device=f"cuda:{device}")
    session = client.begin_weight_update(timeout_s=3600).session

    tensor = torch.randn(first.shape, device=f"cuda:{device}").to(getattr(torch, first.dtype))
    entries, size = pack_device_bucket(staging, [(first.name, tensor)])
    pending = client.update_weights_nccl(session, entries, group.name, group.root, size, wait=False)
    group.broadcast(staging[:size])
    pending.result()

    tensor = torch.randn(second.shape, device=f"cuda:{device}").to(getattr(torch, second.dtype))
    entries, size = pack_device_bucket(staging, [(second.name, tensor)])
    client.update_weights_nccl(session, entries, group.name, group.root, size, wait=False)
    # ZeroMQ writes to the socket from its own thread: give it time to, before saying so (a
    # SIGKILL right after the send could otherwise take the message with it).
    time.sleep(2.0)
    print("SENT", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[4:] == ["ipc"]:
        main_ipc(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
    else:
        main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
