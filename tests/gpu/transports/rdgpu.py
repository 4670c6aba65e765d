"""Helpers of the GPU transport tests and benchmarks (tests/gpu/transports, tests/bench/transports):
daemon processes on given GPUs with the trainer's NCCL, GPU facts, the reference weights.

Runs only on the GPU host (torch, CuPy, two GPUs). Paths come from the environment, as ctest sets
them for the other Python tests: ROLLOUTD_BIN (the daemon; default $ROLLOUTD_BUILD_DIR/daemon/
rolloutd), ROLLOUTD_SOURCE_ROOT (the checkout; default: found from this file), and the built
rolloutd package on PYTHONPATH (default: $ROLLOUTD_BUILD_DIR/python is added here).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SOURCE_ROOT = os.environ.get("ROLLOUTD_SOURCE_ROOT") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD_DIR = os.environ.get("ROLLOUTD_BUILD_DIR", "")
BIN = os.environ.get("ROLLOUTD_BIN") or (os.path.join(BUILD_DIR, "daemon", "rolloutd") if BUILD_DIR else "rolloutd")
if BUILD_DIR and os.path.isdir(os.path.join(BUILD_DIR, "python")):
    sys.path.insert(0, os.path.join(BUILD_DIR, "python"))
sys.path.insert(0, os.path.join(SOURCE_ROOT, "tests", "reference"))

# NVLink multicast stays off on the shared GPU host (device README); set before NCCL starts here
# and inherited by every daemon started below.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import rolloutd  # noqa: E402
from rolloutd import trainer  # noqa: E402


def nccl_env(with_trainer_nccl=True):
    """Environment for a daemon: LD_LIBRARY_PATH led by PyTorch's NCCL folder (the trainer's NCCL),
    or, with_trainer_nccl=False, with that folder removed (the daemon then loads the system NCCL)."""
    if with_trainer_nccl:
        return trainer.daemon_env()
    env = dict(os.environ)
    d = trainer.nccl_lib_dir()
    env["LD_LIBRARY_PATH"] = ":".join(p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != d)
    return env


class Daemon:
    """One rolloutd process on ephemeral loopback ports (tests/integration/conftest.py's pattern),
    on the CUDA backend of GPU `gpu` unless gpu is None. Every wait is bounded."""

    def __init__(self, gpu=None, args=(), env=None, start_timeout_s=120):
        self.gpu = gpu
        self.dir = tempfile.mkdtemp(prefix="rolloutd-gpu-")
        self.endpoints_file = os.path.join(self.dir, "endpoints.json")
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.log = open(self.log_path, "wb")
        device = ["--device", "cuda", "--gpu", str(gpu)] if gpu is not None else ["--device", "cpu"]
        cmd = [BIN, "--control-port", "0", "--http-port", "0", "--endpoints-file", self.endpoints_file,
               *device, *args]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=nccl_env() if env is None else env)
        deadline = time.monotonic() + start_timeout_s
        while not os.path.exists(self.endpoints_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"rolloutd exited with {self.proc.returncode}:\n{self.read_log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"rolloutd did not start within {start_timeout_s} s:\n{self.read_log()}")
            time.sleep(0.05)
        with open(self.endpoints_file) as f:
            ep = json.load(f)
        self.control, self.http = ep["control"], ep["http"]

    def client(self, timeout_s=60.0):
        return rolloutd.Client(self.control, timeout_s=timeout_s)

    def get(self, path):
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def status_json(self):
        code, body = self.get("/v1/status")
        assert code in (200, 503), (code, body)
        return json.loads(body)

    def metric(self, name):
        """The value of an unlabelled Prometheus sample, or None if the daemon does not export it."""
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return None

    def stop(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()

    def read_log(self, tail=20000):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-tail:]


def gpu_count():
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def process_gpu_memory_mib(pid, gpu):
    """Device memory of process `pid` on GPU `gpu` as nvidia-smi reports it (MiB), or None when
    nvidia-smi does not list it (PID namespaces in containers hide processes)."""
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def device_used_mib(gpu):
    """Memory in use on the whole device (MiB), from this process (cudaMemGetInfo)."""
    import torch

    free, total = torch.cuda.mem_get_info(gpu)
    return (total - free) / (1 << 20)


def reference_weights(seed):
    """{name: float32 numpy array} of the embedded model initialised with `seed`, from the
    independent NumPy re-implementation (as tests/integration/test_weights.py builds them)."""
    import tiny_moe_reference as ref

    old = ref.SEED
    ref.SEED = seed
    try:
        return ref.build_weights(ref.CONFIG)
    finally:
        ref.SEED = old


def to_torch(weights, device, dtype=None):
    """[(name, tensor)] on `device`, cast to `dtype` (torch) if given, in the dict's order."""
    import torch

    out = []
    for name, a in weights.items():
        t = torch.from_numpy(a).to(device)
        out.append((name, t if dtype is None else t.to(dtype)))
    return out


def torch_memory_exportable(device):
    """Whether PyTorch's allocator gives cudaMalloc'd segments here, which CUDA IPC can export (not
    the case with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): push_weights sends tensors
    from where they lie only then, and packs them into its own staging otherwise."""
    import torch

    probe = torch.empty(1 << 20, dtype=torch.uint8, device=f"cuda:{device}")
    try:
        trainer.ipc_export(probe)
        return True
    except Exception:  # noqa: BLE001
        return False


def ipc_buffer(nbytes, device):
    """A uint8 CUDA tensor in its own cudaMalloc (CuPy), exportable whatever PyTorch's allocator
    does; keep the returned owner alive as long as the tensor."""
    import cupy
    import torch

    with cupy.cuda.Device(device):
        mem = cupy.cuda.Memory(nbytes)
        arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        arr.fill(0)
        cupy.cuda.Device(device).synchronize()
    return torch.as_tensor(arr, device=f"cuda:{device}"), (mem, arr)


def greedy(client, prompts=((3, 1, 4, 1, 5), (17, 42, 99), (200, 13, 7, 7)), n=12):
    """Greedy tokens and routed-expert records of a few prompts: equal iff the weights behave alike."""
    out = []
    for p in prompts:
        r = client.generate(list(p), max_new_tokens=n, temperature=0.0, return_routed_experts=True)
        r.raise_for_error()
        out.append((r.token_ids, r.routed_experts.data if r.routed_experts else b""))
    return out
