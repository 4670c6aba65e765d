"""Fixtures shared by the rolloutd package tests (run with PYTHONPATH=<build>/python)."""
import pytest

from zmtp_peer import ZmtpPeer


@pytest.fixture
def daemon():
    """daemon(script) starts a fake daemon running `script`; the script's failures fail the test."""
    peers = []

    def start(script):
        peers.append(ZmtpPeer(script))
        return peers[-1]

    yield start
    try:
        for p in peers:
            p.join()  # the script's own checks, once it has seen everything it waits for
    finally:
        for p in peers:
            p.close()
