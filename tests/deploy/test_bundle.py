"""deploy/bundle.sh: the tarball runs on a node without the build's packages. Unpacked into an
empty directory, the daemon starts from it (--device cpu) and answers /livez; rolloutctl and
the Python package from the bundle talk to it; every library outside glibc resolves inside."""
import os
import shutil
import subprocess
import tarfile
import tempfile

import pytest

from conftest import SOURCE_ROOT, http_get, read_json, wait_for

BUILD = os.environ.get("ROLLOUTD_BUILD_DIR", os.path.join(SOURCE_ROOT, "build", "ci"))
GLIBC = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libmvec.so", "libpthread.so", "libdl.so", "librt.so",
         "libresolv.so", "libutil.so")
# A node without the build's packages: nothing but the base system on the paths.
BARE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C"}


@pytest.fixture(scope="module")
def bundle():
    # Removed at the end (the CUDA build's bundle is most of a gigabyte).
    work = tempfile.mkdtemp(prefix="rolloutd-bundle-test-")
    try:
        yield _make_and_unpack(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _make_and_unpack(work):
    out_dir = os.path.join(work, "out")
    # Uncompressed: this test checks contents, not gzip, and the CUDA build's cuBLAS is large.
    r = subprocess.run([os.path.join(SOURCE_ROOT, "deploy", "bundle.sh"), "--build-dir", BUILD,
                        "--rolloutd", os.environ.get("ROLLOUTD_BIN", os.path.join(BUILD, "daemon", "rolloutd")),
                        "--out", os.path.join(out_dir, "rolloutd.tar"), "--compress", "none"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    tarball = r.stdout.strip().splitlines()[-1]
    unpack = os.path.join(work, "node")  # an empty directory
    os.mkdir(unpack)
    with tarfile.open(tarball) as t:  # one top-level directory, nothing outside it
        tops = {n.split("/", 1)[0] for n in t.getnames()}
    assert len(tops) == 1 and not any(n.startswith(("/", "..")) for n in tops), tops
    subprocess.run(["tar", "-C", unpack, "-xf", tarball], check=True, timeout=300)  # as an operator would
    os.unlink(tarball)
    return os.path.join(unpack, tops.pop())


def test_bundle_has_the_daemon_rolloutctl_python_package_and_manifest(bundle):
    for rel in ("bin/rolloutd", "bin/rolloutctl", "bin/launch-node.sh", "libexec/rolloutd", "libexec/rolloutctl",
                "python/rolloutd/__init__.py", "python/rolloutd/coordinator.py", "env.sh", "MANIFEST.txt",
                "deploy/systemd/rolloutd@.service", "deploy/k8s/rolloutd.yaml", "deploy/slurm/rolloutd.sbatch"):
        assert os.path.exists(os.path.join(bundle, rel)), rel
    assert any(n.startswith("_native") for n in os.listdir(os.path.join(bundle, "python", "rolloutd")))
    manifest = open(os.path.join(bundle, "MANIFEST.txt")).read()
    assert "glibc >= 2." in manifest and "libzmq.so" in manifest


def test_every_library_outside_glibc_resolves_inside_the_bundle(bundle):
    lib = os.path.join(bundle, "lib")
    libs = set(os.listdir(lib))
    assert any(n.startswith("libzmq.so") for n in libs) and any(n.startswith("libstdc++.so") for n in libs)
    assert not any(n.startswith(("libc.so", "libcuda.so", "libnccl")) for n in libs)
    native = [os.path.join(bundle, "python", "rolloutd", n) for n in os.listdir(os.path.join(bundle, "python", "rolloutd"))
              if n.endswith(".so")]
    for f in [os.path.join(bundle, "libexec", "rolloutd"), os.path.join(bundle, "libexec", "rolloutctl"), *native]:
        out = subprocess.run(["ldd", f], env={**BARE_ENV, "LD_LIBRARY_PATH": lib}, capture_output=True, text=True,
                             timeout=60).stdout
        for line in out.splitlines():
            name = line.split()[0]
            if name.startswith(GLIBC) or name.startswith("/"):
                continue
            assert "not found" not in line, (f, line)
            assert "=> " + lib + "/" in line, (f, line)


def test_daemon_runs_from_the_unpacked_bundle_and_answers_livez(bundle, tmp_path):
    ep_file = str(tmp_path / "ep.json")
    proc = subprocess.Popen([os.path.join(bundle, "bin", "rolloutd"), "--device", "cpu", "--control-port", "0",
                             "--http-port", "0", "--endpoints-file", ep_file], cwd=str(tmp_path), env=BARE_ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ep = wait_for(lambda: read_json(ep_file) or proc.poll() is not None, 60, "the bundled daemon to listen")
        assert proc.poll() is None, f"the bundled daemon exited {proc.returncode}"
        assert http_get(ep["http"] + "/livez")[0] == 200
        wait_for(lambda: http_get(ep["http"] + "/readyz")[0] == 200, 30, "/readyz")
        # rolloutctl from the bundle.
        ctl = subprocess.run([os.path.join(bundle, "bin", "rolloutctl"), "--endpoint", ep["control"], "status"],
                             env=BARE_ENV, capture_output=True, text=True, timeout=60)
        assert ctl.returncode == 0 and "ready" in ctl.stdout, ctl.stdout + ctl.stderr
        # The Python package from the bundle, in an environment that knows nothing of the build.
        script = ("import rolloutd, sys; assert rolloutd.__file__.startswith(sys.argv[2]), rolloutd.__file__;"
                  "c = rolloutd.Client(sys.argv[1], timeout_s=10); print(c.generate([1, 2, 3], max_new_tokens=4).finish_reason)")
        py = subprocess.run(["bash", "-c", 'source "$1/env.sh" && /usr/bin/python3 -c "$2" "$3" "$1"', "_",
                             bundle, script, ep["control"]], env=BARE_ENV, capture_output=True, text=True, timeout=60)
        assert py.returncode == 0 and py.stdout.strip() == "length", py.stdout + py.stderr
    finally:
        proc.send_signal(15)
        assert proc.wait(timeout=30) == 0
