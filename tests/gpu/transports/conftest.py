"""GPU weight transports (SPEC §11.7) end to end: a PyTorch/CuPy trainer (this process) and real
daemons on the GPU host. Everything here skips itself without torch, CuPy with NCCL, or a CUDA
build of the daemon; with one GPU only the tests marked `one_gpu` (CUDA IPC: trainer and daemon
colocated) run. See rdgpu.py for the environment it reads."""
import os
import shutil

import pytest

import rdgpu


def _why_skip():
    try:
        import torch  # noqa: F401  (first: CuPy's NCCL then binds to PyTorch's, see rolloutd.trainer._cupy)
        import cupy  # noqa: F401
        import cupy.cuda.nccl  # noqa: F401
    except ImportError as e:
        return f"needs torch and CuPy with NCCL: {e}"
    if rdgpu.gpu_count() < 1:
        return "needs a GPU"
    if os.environ.get("ROLLOUTD_CUDA_ENABLED", "ON").upper() not in ("ON", "1", "TRUE"):
        return "the daemon was built without CUDA"
    path = rdgpu.BIN if os.path.sep in rdgpu.BIN else shutil.which(rdgpu.BIN)
    if not path or not os.path.exists(path):
        return f"no daemon binary at {rdgpu.BIN} (set ROLLOUTD_BIN or ROLLOUTD_BUILD_DIR)"
    return None


_WHY = _why_skip()


def pytest_configure(config):
    config.addinivalue_line("markers", "one_gpu: runs with a single GPU (the other tests need two)")


def pytest_collection_modifyitems(config, items):
    one_gpu = _WHY is None and rdgpu.gpu_count() < 2
    for item in items:
        if _WHY is not None:
            item.add_marker(pytest.mark.skip(reason=_WHY))
        elif one_gpu and item.get_closest_marker("one_gpu") is None:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))


@pytest.fixture
def daemon_factory():
    """daemon_factory(gpu, *args, env=None) starts a daemon; all are stopped at the end, and the
    logs of any that failed a test are printed."""
    started = []

    def start(gpu=None, *args, env=None):
        d = rdgpu.Daemon(gpu, args, env=env)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(timeout=30)
        d.log.close()


@pytest.fixture(scope="session")
def weights():
    """Two sets of the embedded model's weights (float32 numpy): A from seed 4242, B from 777."""
    return {"A": (4242, rdgpu.reference_weights(4242)), "B": (777, rdgpu.reference_weights(777))}
