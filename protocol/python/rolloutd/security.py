"""CURVE keys for daemons that require them (SPEC §1.2).

A daemon started with ``--curve-key-file`` (or ``ROLLOUTD_CURVE_SECRET_KEY``) and
``--curve-allow`` accepts only clients that know its public key and prove a key pair whose public
key it allows. Make key pairs with ``rolloutctl keygen --out NAME`` or :func:`keygen`:
``NAME.key`` is the public certificate (into the daemon's allowlist, or the client's
``server_key``), ``NAME.key_secret`` the secret one (mode 0600, for its owner only)::

    keys = rolloutd.CurveKeys.load(server_key="/etc/rolloutd/daemon.key",
                                   client_key_file="~/.rolloutd/trainer.key_secret")
    with rolloutd.Client("tcp://node7:7600", curve=keys) as c: ...
    fleet = rolloutd.Coordinator.from_file("/run/rolloutd/node.json", curve=keys)

``Client`` and ``Coordinator`` with ``curve=None`` (the default) read the same two settings from
``ROLLOUTD_CURVE_SERVER_KEY`` and ``ROLLOUTD_CURVE_CLIENT_KEY_FILE`` when they are set (as
``rolloutctl`` does); ``curve=False`` forces a plain connection. A daemon that refuses the
handshake makes calls fail at once with ``RolloutdError("unauthenticated")``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

from .messages import RolloutdError

try:
    from . import _native
except ImportError:  # rolloutd.wire stays usable without the extension; keys need it
    _native = None

SERVER_KEY_ENV = "ROLLOUTD_CURVE_SERVER_KEY"
CLIENT_KEY_FILE_ENV = "ROLLOUTD_CURVE_CLIENT_KEY_FILE"


def _native_call(fn, *args):
    if _native is None:
        raise ImportError("rolloutd._native is not built: CURVE keys need it")
    try:
        return fn(*args)
    except _native.TransportError as e:
        raise RolloutdError(e.code, e.message, e.field) from None


def curve_available() -> bool:
    """Whether this build's libzmq supports CURVE."""
    return bool(_native_call(_native.curve_available))


@dataclass(frozen=True)
class CurveKeys:
    """The daemon's public key and this client's key pair, Z85 text (40 characters each)."""

    server_key: str
    public_key: str
    secret_key: str = field(repr=False)

    @classmethod
    def load(cls, server_key: str, client_key_file: str) -> "CurveKeys":
        """server_key: the daemon's public key as Z85 text or its certificate path (NAME.key);
        client_key_file: this client's secret certificate (NAME.key_secret)."""
        server = _native_call(_native.load_curve_public_key, os.path.expanduser(server_key))
        public, secret = _native_call(_native.load_curve_keypair, os.path.expanduser(client_key_file))
        return cls(server, public, secret)

    @classmethod
    def from_env(cls) -> Optional["CurveKeys"]:
        """From ROLLOUTD_CURVE_SERVER_KEY and ROLLOUTD_CURVE_CLIENT_KEY_FILE; None when neither is set."""
        server, client = os.environ.get(SERVER_KEY_ENV, ""), os.environ.get(CLIENT_KEY_FILE_ENV, "")
        if not server and not client:
            return None
        if not server or not client:
            missing = SERVER_KEY_ENV if not server else CLIENT_KEY_FILE_ENV
            raise RolloutdError("invalid_argument", f"CURVE needs both {SERVER_KEY_ENV} and {CLIENT_KEY_FILE_ENV}; "
                                f"{missing} is not set", missing)
        return cls.load(server, client)


def resolve(curve: Union["CurveKeys", None, bool]) -> Optional[CurveKeys]:
    """What Client(curve=...) means: keys as given, None -> the environment, False -> plain."""
    if curve is False:
        return None
    if curve is None:
        return CurveKeys.from_env()
    if isinstance(curve, CurveKeys):
        return curve
    raise TypeError(f"curve must be a CurveKeys, None or False, not {type(curve).__name__}")


def keygen(base: str, overwrite: bool = False) -> Tuple[str, str, str]:
    """Writes a new key pair to BASE.key (public) and BASE.key_secret (mode 0600), as
    `rolloutctl keygen --out BASE` does. Returns (public_key, public_path, secret_path)."""
    return tuple(_native_call(_native.write_curve_keypair, os.path.expanduser(base), overwrite))
