"""The raw ZMTP client the fault tests read with (rel_zmtp.RawDealer), against a fake peer: a
message whose frames arrive on both sides of a recv timeout is returned whole by a later recv,
not cut (its first frames were once dropped, and the next recv began a message at a payload
frame). No daemon: a thread plays the ZMTP 3 peer over a loopback socket."""
import socket
import threading
import time

from rel_zmtp import FLAG_MORE, GREETING, RawDealer, _command, _property


def _fake_peer(listener, frames, pause_s, done):
    conn, _ = listener.accept()
    with conn:
        conn.sendall(GREETING)
        got = b""
        while len(got) < 64:
            got += conn.recv(64 - len(got))
        conn.sendall(_command(b"READY", _property(b"Socket-Type", b"ROUTER")))
        first, rest = frames[:-1], frames[-1]
        for f in first:
            conn.sendall(bytes([FLAG_MORE, len(f)]) + f)
        time.sleep(pause_s)  # the reader's recv times out here, between two frames of one message
        conn.sendall(bytes([0, len(rest)]) + rest)
        done.wait(10)


def test_a_message_split_by_a_recv_timeout_is_returned_whole():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    frames = [b"envelope", b"payload-1", b"payload-2"]
    done = threading.Event()
    peer = threading.Thread(target=_fake_peer, args=(listener, frames, 0.5, done), daemon=True)
    peer.start()
    try:
        dealer = RawDealer(f"tcp://127.0.0.1:{port}", timeout_s=5.0)
        try:
            assert dealer.recv(0.1) is None  # the first two frames came, the last not yet
            deadline, got = time.monotonic() + 5.0, None
            while got is None and time.monotonic() < deadline:
                got = dealer.recv(0.1)
            assert got == frames
        finally:
            dealer.close()
    finally:
        done.set()
        peer.join(5)
        listener.close()
    assert not peer.is_alive()
