"""GPU integration tests skip themselves without a CUDA build or a visible GPU. The daemon
fixtures come from tests/integration/conftest.py (loaded explicitly below)."""
import os
import shutil
import subprocess

import importlib.util

import pytest

# The daemon fixtures of tests/integration/conftest.py. pytest loads a parent conftest only
# when its directory lies under the rootdir, which depends on where ctest runs from (the
# build directory may be outside the checkout): load it explicitly.
_spec = importlib.util.spec_from_file_location(
    "rolloutd_integration_fixtures", os.path.join(os.path.dirname(__file__), "..", "conftest.py"))
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
daemon_factory = _fixtures.daemon_factory
daemon = _fixtures.daemon
# Helpers of that conftest, for `from conftest import ...` in this folder's tests.
final_events = _fixtures.final_events
wait_queue = _fixtures.wait_queue


def _gpu_visible():
    if os.environ.get("ROLLOUTD_CUDA_ENABLED", "").upper() not in ("ON", "1", "TRUE"):
        return False, "built without CUDA"
    if not shutil.which("nvidia-smi"):
        return False, "no nvidia-smi"
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30)
    if r.returncode != 0 or b"GPU" not in r.stdout:
        return False, "no GPU visible"
    return True, ""


_ok, _why = _gpu_visible()


def pytest_collection_modifyitems(config, items):
    if _ok:
        return
    for item in items:
        item.add_marker(pytest.mark.skip(reason=_why))
