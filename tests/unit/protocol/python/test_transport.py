"""rolloutd._native.Transport: the C++ client's raw ZeroMQ transport, without pyzmq."""
import socket
import time

import pytest

from rolloutd import _native
from zmtp_peer import ZmtpPeer


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def nobody():
    """An endpoint on which nobody listens."""
    return f"tcp://127.0.0.1:{free_port()}"


def test_recv_returns_none_on_timeout(nobody):
    with _native.Transport(nobody) as t:
        start = time.monotonic()
        assert t.recv(150) is None
        assert 0.14 <= time.monotonic() - start < 2.0
        assert t.recv(0) is None


def test_send_without_a_daemon_is_unavailable(nobody):
    with _native.Transport(nobody) as t:
        start = time.monotonic()
        with pytest.raises(_native.TransportError) as e:
            t.send([b"envelope"], timeout_ms=150)
        assert 0.14 <= time.monotonic() - start < 2.0
        assert e.value.code == "unavailable"
        assert nobody in e.value.message


def test_bad_endpoint_is_invalid_argument():
    with pytest.raises(_native.TransportError) as e:
        _native.Transport("not-an-endpoint")
    assert (e.value.code, e.value.field) == ("invalid_argument", "endpoint")
    assert isinstance(e.value, RuntimeError)


def test_closed_transport_refuses_calls(nobody):
    t = _native.Transport(nobody)
    assert not t.closed and t.endpoint == nobody
    t.close()
    t.close()  # idempotent
    assert t.closed
    with pytest.raises(_native.TransportError) as e:
        t.recv(0)
    assert e.value.code == "failed_precondition"


def test_argument_errors(nobody):
    with _native.Transport(nobody) as t:
        with pytest.raises(TypeError):
            t.send(["text is not bytes"], timeout_ms=0)
        with pytest.raises(ValueError):
            t.send([], timeout_ms=0)
        with pytest.raises(ValueError):
            t.recv(-1)


def test_frames_round_trip_through_a_peer():
    def echo(peer):
        frames = peer.recv_frames()
        peer.send_frames(list(reversed(frames)))

    peer = ZmtpPeer(echo)
    try:
        with _native.Transport(peer.endpoint) as t:
            big = bytes(range(256)) * 1000  # a long ZMTP frame
            t.send([b"envelope", bytearray(b"payload"), memoryview(big)], timeout_ms=5000)
            assert t.recv(5000) == [big, b"payload", b"envelope"]
        peer.join()
    finally:
        peer.close()
