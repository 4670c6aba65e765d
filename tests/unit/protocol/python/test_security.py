"""rolloutd.security: CURVE key files, the environment fallback, and what Client(curve=...) means."""
import os
import stat

import pytest

import rolloutd
from rolloutd import security


def test_keygen_and_load(tmp_path):
    assert rolloutd.curve_available()
    pub, pub_path, sec_path = rolloutd.keygen(str(tmp_path / "t"))
    assert (pub_path, sec_path) == (str(tmp_path / "t.key"), str(tmp_path / "t.key_secret"))
    assert stat.S_IMODE(os.stat(sec_path).st_mode) == 0o600
    keys = rolloutd.CurveKeys.load(server_key=pub, client_key_file=sec_path)  # Z85 text works as well as a path
    assert keys.server_key == keys.public_key == pub and len(keys.secret_key) == 40
    assert keys.secret_key not in repr(keys)
    with pytest.raises(rolloutd.RolloutdError) as e:
        rolloutd.keygen(str(tmp_path / "t"))
    assert e.value.code == "failed_precondition"
    with pytest.raises(rolloutd.RolloutdError) as e:
        rolloutd.CurveKeys.load(server_key=pub, client_key_file=pub_path)  # a public certificate is no pair
    assert e.value.code == "invalid_argument"


def test_environment_fallback_and_resolve(tmp_path, monkeypatch):
    pub, pub_path, sec_path = rolloutd.keygen(str(tmp_path / "t"))
    monkeypatch.delenv(security.SERVER_KEY_ENV, raising=False)
    monkeypatch.delenv(security.CLIENT_KEY_FILE_ENV, raising=False)
    assert security.resolve(None) is None
    monkeypatch.setenv(security.SERVER_KEY_ENV, pub_path)
    with pytest.raises(rolloutd.RolloutdError) as e:
        security.resolve(None)
    assert (e.value.code, e.value.field) == ("invalid_argument", security.CLIENT_KEY_FILE_ENV)
    monkeypatch.setenv(security.CLIENT_KEY_FILE_ENV, sec_path)
    keys = security.resolve(None)
    assert keys is not None and keys.server_key == pub
    assert security.resolve(False) is None
    assert security.resolve(keys) is keys
    with pytest.raises(TypeError):
        security.resolve("a key")
