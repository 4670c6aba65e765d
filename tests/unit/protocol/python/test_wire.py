"""rolloutd.wire against the golden files of protocol/golden/ (SPEC.md §3: canonical encoding)."""
import json
import os
import pathlib
import struct

import msgpack
import pytest

from rolloutd import wire
from rolloutd.messages import (AbortRequest, GenerateRequest, RolloutdError, RoutedExperts, TokensEvent)

SOURCE_ROOT = pathlib.Path(os.environ.get("ROLLOUTD_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])
GOLDEN_DIR = SOURCE_ROOT / "protocol" / "golden"
GOLDEN = sorted(p.name[:-len(".msgpack")] for p in GOLDEN_DIR.glob("*.msgpack") if not p.name.startswith("bad_"))
BAD_CASES = json.loads((GOLDEN_DIR / "bad_cases.json").read_text()) if (GOLDEN_DIR / "bad_cases.json").exists() else []


def read_golden(name):
    frames = [(GOLDEN_DIR / f"{name}.msgpack").read_bytes()]
    i = 0
    while (GOLDEN_DIR / f"{name}.frame{i}.bin").exists():
        frames.append((GOLDEN_DIR / f"{name}.frame{i}.bin").read_bytes())
        i += 1
    return frames


def test_golden_files_exist():
    assert GOLDEN, f"no golden files in {GOLDEN_DIR}"
    assert BAD_CASES, f"no bad_cases.json in {GOLDEN_DIR}"


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_decodes_and_reencodes_identically(name):
    frames = read_golden(name)
    plain = msgpack.unpackb(frames[0], raw=False)
    decoded = wire.decode(frames)
    assert (decoded.type, decoded.id) == (plain["type"], plain["id"])
    assert wire.type_name(decoded.body) == plain["type"]
    assert wire.encode(decoded.id, decoded.body) == frames


@pytest.mark.parametrize("case", BAD_CASES, ids=[c["file"] for c in BAD_CASES])
def test_bad_input_is_a_typed_error(case):
    with pytest.raises(RolloutdError) as e:
        wire.decode([(GOLDEN_DIR / case["file"]).read_bytes()])
    assert (e.value.code, e.value.field) == (case["code"], case["field"])


def test_routed_rows_as_numpy_and_lists():
    frames = read_golden("tokens_uint16")
    rows = wire.decode(frames).body.routed_experts
    assert rows.dtype == "uint16" and rows.shape == (3, 3, 2) and rows.start_pos == 0
    flat = list(struct.unpack("<18H", frames[1]))
    assert [e for t in rows.to_list() for l in t for e in l] == flat
    np = pytest.importorskip("numpy")
    arr = rows.to_numpy()
    assert arr.shape == (3, 3, 2) and arr.dtype == np.dtype("<u2")
    assert arr.ravel().tolist() == flat


def test_rows_without_bytes_have_no_frame():
    frames = read_golden("tokens_no_rows")
    rows = wire.decode(frames).body.routed_experts
    assert rows.shape == (0, 3, 2) and rows.data == b"" and len(frames) == 1


def test_encoders_coerce_to_wire_types():
    np = pytest.importorskip("numpy")
    plain = GenerateRequest(rid="r", input_ids=[1, 2, 3], temperature=1.0, seed=5, stop_token_ids=[2])
    coerced = GenerateRequest(rid="r", input_ids=np.array([1, 2, 3], dtype=np.int64), temperature=1,
                              seed=np.uint64(5), stop_token_ids=(np.int32(2),))
    assert wire.encode(9, coerced) == wire.encode(9, plain)
    body = msgpack.unpackb(wire.encode(9, coerced)[0])["body"]
    assert isinstance(body["temperature"], float)


def test_encoders_reject_what_the_wire_cannot_carry():
    with pytest.raises(RolloutdError) as e:
        wire.encode(1, GenerateRequest(rid="r", input_ids=[1, 2**31]))
    assert (e.value.code, e.value.field) == ("out_of_range", "body.input_ids[1]")
    with pytest.raises(RolloutdError) as e:
        wire.encode(1, GenerateRequest(rid="r", input_ids=[1], temperature="hot"))
    assert (e.value.code, e.value.field) == ("wrong_type", "body.temperature")
    with pytest.raises(RolloutdError) as e:
        wire.encode(1, TokensEvent(rid="r", token_ids=[1], weight_versions=[0],
                                   routed_experts=RoutedExperts("uint8", (1, 1, 2), 0, b"\x01")))
    assert e.value.code == "invalid_argument"


def test_abort_encodings():
    assert msgpack.unpackb(wire.encode(1, AbortRequest(rid="x"))[0])["body"] == {"rid": "x", "all": False}
    assert msgpack.unpackb(wire.encode(1, AbortRequest(all=True))[0])["body"] == {"all": True}


def test_duplicate_keys_are_refused():
    # {"v": 1, "v": 1, ...}: readers keeping the first or the last key would disagree.
    env = b"\x85" + b"".join(msgpack.packb(x) for x in ("v", 1, "v", 1, "type", "status", "id", 1, "body", {}))
    with pytest.raises(RolloutdError) as e:
        wire.decode([env])
    assert e.value.code == "bad_message"


def test_missing_body_means_empty():
    frames = [msgpack.packb({"v": 1, "type": "status", "id": 4})]
    assert wire.decode(frames).type == "status"
