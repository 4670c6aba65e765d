"""A scripted fake daemon for the Python client tests, without pyzmq.

It speaks just enough ZMTP 3.0 (rfc.zeromq.org/spec/23, NULL mechanism) to be a
ROUTER with one DEALER peer on a loopback TCP port: the greeting, READY commands,
and multipart messages. A test passes a script that runs on the peer's thread and
uses recv() / send() with rolloutd.wire messages.
"""
import socket
import struct
import threading
import traceback

from rolloutd import wire

_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f"  # signature
             + b"\x03\x00"  # ZMTP 3.0
             + b"NULL".ljust(20, b"\x00")  # mechanism
             + b"\x00"  # as-server
             + b"\x00" * 31)  # filler
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _frame(flags: int, body: bytes) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _ready(socket_type: bytes) -> bytes:
    prop = bytes([len(b"Socket-Type")]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return _frame(_COMMAND, bytes([5]) + b"READY" + prop)


class ZmtpPeer:
    """Listens on 127.0.0.1:<free port>; `endpoint` is what a Client connects to."""

    def __init__(self, script, timeout_s: float = 5.0, port: int = 0):
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a peer before used
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(1)
        self._listener.settimeout(timeout_s)
        self.endpoint = "tcp://127.0.0.1:%d" % self._listener.getsockname()[1]
        self._timeout_s = timeout_s
        self._conn = None
        self._script = script
        self.error = None  # a failure inside the script, re-raised by join()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # ---- used by scripts ----
    def recv_frames(self):
        frames = []
        while True:
            flags, body = self._read_frame()
            if flags & _COMMAND:
                continue  # PING and the like
            frames.append(body)
            if not flags & _MORE:
                return frames

    def recv(self) -> wire.Decoded:
        return wire.decode(self.recv_frames())

    def send_frames(self, frames) -> None:
        data = b"".join(_frame(_MORE if i + 1 < len(frames) else 0, f) for i, f in enumerate(frames))
        self._conn.sendall(data)

    def send(self, msg_id: int, message) -> None:
        self.send_frames(wire.encode(msg_id, message))

    def expect_closed_or_silent(self, timeout_s: float) -> bool:
        """True if nothing (but maybe EOF) arrives within timeout_s."""
        self._conn.settimeout(timeout_s)
        try:
            return self._conn.recv(1, socket.MSG_PEEK) == b""
        except socket.timeout:
            return True
        finally:
            self._conn.settimeout(self._timeout_s)

    # ---- lifetime ----
    def join(self, timeout_s: float = 10.0) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "fake daemon script did not finish"
        if self.error is not None:
            raise AssertionError("fake daemon script failed:\n" + self.error)

    def close(self) -> None:
        for s in (self._conn, self._listener):
            if s is not None:
                s.close()

    def _run(self) -> None:
        try:
            self._conn, _ = self._listener.accept()
            self._conn.settimeout(self._timeout_s)
            self._conn.sendall(_GREETING)
            greeting = self._read_exact(64)
            assert greeting[0] == 0xFF and greeting[9] == 0x7F and greeting[10] == 3, greeting
            self._conn.sendall(_ready(b"ROUTER"))
            flags, body = self._read_frame()
            assert flags & _COMMAND and body[1:6] == b"READY", body
            self._script(self)
        except Exception:
            self.error = traceback.format_exc()

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray(n)  # filled in place: a weight bucket may be megabytes
        view, got = memoryview(buf), 0
        while got < n:
            k = self._conn.recv_into(view[got:])
            if k == 0:
                raise EOFError("peer closed the connection")
            got += k
        return bytes(buf)

    def _read_frame(self):
        flags = self._read_exact(1)[0]
        if flags & _LONG:
            (size,) = struct.unpack(">Q", self._read_exact(8))
        else:
            size = self._read_exact(1)[0]
        return flags, self._read_exact(size)
