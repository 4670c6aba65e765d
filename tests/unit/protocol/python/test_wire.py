"""rolloutd.wire against the golden files of protocol/golden/ (SPEC.md §3: canonical encoding)."""
import json
import os
import pathlib
import struct

import msgpack
import pytest

import zlib

from rolloutd import model_checksum, wire
from rolloutd.messages import (AbortRequest, BucketEntry, GenerateRequest, InlineSource, Limits, RolloutdError,
                               RoutedExperts, ShmSource, StatusReply, TokensEvent, UpdateWeightsRequest,
                               WeightsChecksumRequest)

SOURCE_ROOT = pathlib.Path(os.environ.get("ROLLOUTD_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])
GOLDEN_DIR = SOURCE_ROOT / "protocol" / "golden"
GOLDEN = sorted(p.name[:-len(".msgpack")] for p in GOLDEN_DIR.glob("*.msgpack") if not p.name.startswith("bad_"))
BAD_CASES = json.loads((GOLDEN_DIR / "bad_cases.json").read_text()) if (GOLDEN_DIR / "bad_cases.json").exists() else []
# What a daemon sent before SPEC §11 (or §11.7) added optional fields to these messages: they must
# still decode, and re-encoding writes the added fields at their defaults, giving the other golden.
UPGRADES = {"hello_ok": "hello_ok_cpu", "hello_ok_full": "hello_ok_cpu", "status_ok": "status_ok_full"}


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
    expected = read_golden(UPGRADES[name]) if name in UPGRADES else frames
    assert wire.encode(decoded.id, decoded.body) == expected


def test_upgraded_goldens_differ_only_by_the_added_fields():
    old = msgpack.unpackb(read_golden("hello_ok")[0])
    old["body"]["limits"]["max_bucket_entries"] = Limits().max_bucket_entries
    assert msgpack.packb(old) == read_golden("hello_ok_full")[0]
    old["body"].update(nccl_version=0, device_uuid=b"")  # SPEC §11.7
    assert msgpack.packb(old, use_bin_type=True) == read_golden("hello_ok_cpu")[0]
    old = msgpack.unpackb(read_golden("status_ok")[0])
    old["body"].update(paused=False, update_session=0)
    assert msgpack.packb(old) == read_golden("status_ok_full")[0]
    assert wire.decode(read_golden("status_ok")).body == wire.decode(read_golden("status_ok_full")).body


@pytest.mark.parametrize("case", BAD_CASES, ids=[c["file"] for c in BAD_CASES])
def test_bad_input_is_a_typed_error(case):
    frames = [(GOLDEN_DIR / f).read_bytes() for f in [case["file"], *case.get("frames", [])]]
    with pytest.raises(RolloutdError) as e:
        wire.decode(frames)
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


# ---- weight updates (SPEC §11) ----
def test_inline_bucket_rides_as_payload_frame():
    frames = read_golden("update_weights_inline")
    req = wire.decode(frames).body
    assert isinstance(req, UpdateWeightsRequest) and isinstance(req.source, InlineSource)
    assert req.source.frame == 0 and req.source.data == frames[1]
    assert [e.dtype for e in req.entries] == ["bfloat16", "float32", "float8_e4m3fn"]
    assert req.checksum.algo == "crc32" and req.checksum.value == zlib.crc32(frames[1])
    norm = req.entries[1]
    assert struct.unpack("<3f", frames[1][norm.byte_offset:norm.byte_offset + norm.nbytes]) == (1.0, 0.5, -2.25)


def test_shm_source_and_offsets_past_4_gib():
    req = wire.decode(read_golden("update_weights_shm")).body
    assert req.source == ShmSource("/rolloutd-trainer-0", 1 << 33, 151936 * 2048 * 2 + 8192)
    assert req.checksum is None and req.entries[1].byte_offset == 151936 * 2048 * 2


def test_weights_checksum_golden_matches_zlib_and_formula():
    bucket = wire.decode(read_golden("update_weights_inline")).body
    reply = wire.decode(read_golden("weights_checksum_ok")).body
    data = bucket.source.data
    by_name = {e.name: e for e in bucket.entries}
    sums = {}
    for p in reply.parameters:
        e = by_name[p.name]
        assert p.checksum == zlib.crc32(data[e.byte_offset:e.byte_offset + e.nbytes])
        assert (p.dtype, p.shape) == (e.dtype, e.shape)
        sums[p.name] = p.checksum
    assert [p.name for p in reply.parameters] == sorted(sums)
    assert reply.model_checksum == model_checksum(sums)


def test_dtype_spellings_are_written_as_pytorch_names():
    def entry(dtype):
        return BucketEntry("w", dtype, [2], 0, 4)

    canonical = wire.encode(1, UpdateWeightsRequest(7, entries=[entry("bfloat16")], source=InlineSource(data=b"abcd")))
    for alias in ("torch.bfloat16", "BF16"):
        assert wire.encode(1, UpdateWeightsRequest(7, entries=[entry(alias)],
                                                   source=InlineSource(data=b"abcd"))) == canonical
    assert wire.decode(canonical).body.entries[0].dtype == "bfloat16"


def test_update_weights_checks_name_the_entry():
    def check(entries, frame, code, field, source=None):
        req = UpdateWeightsRequest(7, entries=entries, source=source or InlineSource(data=frame))
        with pytest.raises(RolloutdError) as e:
            wire.decode(wire.encode(1, req))
        assert (e.value.code, e.value.field) == (code, field)

    ok = [BucketEntry("a", "float32", [2], 0, 8), BucketEntry("b", "int8", [4], 8, 4)]
    assert len(wire.decode(wire.encode(1, UpdateWeightsRequest(7, entries=ok, source=InlineSource(data=bytes(12))))
                           ).body.entries) == 2
    check([], bytes(12), "invalid_argument", "body.entries")
    check([ok[0], BucketEntry("a", "int8", [4], 8, 4)], bytes(12), "invalid_argument", "body.entries[1].name")
    # The entry that starts later in the buffer is the one named, whatever the list order.
    check([ok[1], BucketEntry("c", "int8", [4], 6, 4)], bytes(12), "invalid_argument", "body.entries[0]")
    check([BucketEntry("x", "float4_e2m1fn_x2", [3, 2], 0, 12)], bytes(12), "invalid_argument",
          "body.entries[0].nbytes")
    check([BucketEntry("x", "float32", [2**40] * 8, 0, 0)], bytes(12), "out_of_range", "body.entries[0].shape")
    check([BucketEntry("x", "float32", [2**40 + 1], 0, 0)], bytes(12), "out_of_range", "body.entries[0].shape[0]")
    check([BucketEntry("x", "float32", [1] * 9, 0, 4)], bytes(12), "too_large", "body.entries[0].shape")
    check([BucketEntry("x", "int8", [4], 2**64 - 2, 4)], bytes(12), "out_of_range", "body.entries[0].byte_offset")
    check(ok, None, "out_of_range", "body.entries[1].byte_offset", ShmSource("/r", 0, 11))
    check(ok, None, "out_of_range", "body.source.size", ShmSource("/r", 2**64 - 4, 12))
    check(ok, None, "invalid_argument", "body.source.name", ShmSource("/..", 0, 12))
    names = [BucketEntry(n, "int8", [1], i, 1) for i, n in enumerate("zbbz")]
    check(names, bytes(4), "invalid_argument", "body.entries[2].name")


def test_weights_checksum_names_must_be_distinct():
    with pytest.raises(RolloutdError) as e:
        wire.decode(wire.encode(1, WeightsChecksumRequest(["z", "b", "a", "b", "z"])))
    assert (e.value.code, e.value.field) == ("invalid_argument", "body.names[3]")
    with pytest.raises(RolloutdError) as e:
        wire.decode(wire.encode(1, WeightsChecksumRequest([])))
    assert (e.value.code, e.value.field) == ("invalid_argument", "body.names")


def test_status_defaults_for_fields_added_later():
    body = wire.decode(read_golden("status_ok")).body
    assert isinstance(body, StatusReply) and (body.paused, body.update_session) == (False, 0)


def test_deadline_travels_only_when_set_and_is_range_checked():
    plain = wire.encode(1, GenerateRequest(rid="r", input_ids=[1]))
    assert "deadline_s" not in msgpack.unpackb(plain[0])["body"]
    assert wire.decode(plain).body.deadline_s == 0.0
    asked = wire.encode(1, GenerateRequest(rid="r", input_ids=[1], deadline_s=2.5))
    assert msgpack.unpackb(asked[0])["body"]["deadline_s"] == 2.5
    assert wire.decode(asked).body.deadline_s == 2.5
    for bad in (-1.0, 86400.5, float("nan"), float("inf")):
        with pytest.raises(RolloutdError) as e:
            wire.decode(wire.encode(1, GenerateRequest(rid="r", input_ids=[1], deadline_s=bad)))
        assert (e.value.code, e.value.field) == ("out_of_range", "body.deadline_s"), bad


def test_top_logprobs_travel_only_when_asked_and_agree_with_the_tokens():
    plain = wire.encode(1, GenerateRequest(rid="r", input_ids=[1]))
    assert "top_logprobs_num" not in msgpack.unpackb(plain[0])["body"]
    asked = wire.encode(1, GenerateRequest(rid="r", input_ids=[1], top_logprobs_num=4))
    assert msgpack.unpackb(asked[0])["body"]["top_logprobs_num"] == 4
    with pytest.raises(RolloutdError) as e:
        wire.decode(wire.encode(1, GenerateRequest(rid="r", input_ids=[1], top_logprobs_num=21)))
    assert (e.value.code, e.value.field) == ("out_of_range", "body.top_logprobs_num")
    # An event without tokens still carries the (empty) arrays of a request that asked.
    empty = TokensEvent("r", [], [], [], None, 3, [], [])
    body = msgpack.unpackb(wire.encode(2, empty)[0])["body"]
    assert (body["top_logprobs_num"], body["top_token_ids"], body["top_logprobs"]) == (3, [], [])
    assert wire.decode(wire.encode(2, empty)).body == empty
    for bad, field in ((TokensEvent("r", [1, 2], [], [0, 0], None, 2, [1, 2, 3], [-1.0, -2.0, -3.0, -4.0]),
                        "body.top_token_ids"),
                       (TokensEvent("r", [1], [], [0], None, 2, [1, 2], [-1.0]), "body.top_logprobs")):
        with pytest.raises(RolloutdError) as e:
            wire.decode(wire.encode(3, bad))
        assert (e.value.code, e.value.field) == ("invalid_argument", field)
    # n = 0 writes no top keys, whatever the lists hold (as the C++ encoder), and numpy arrays encode.
    assert "top_logprobs" not in msgpack.unpackb(wire.encode(3, TokensEvent("r", [1], [], [0], None, 0, [], [-1.0]))[0])["body"]
    # Entries without n on the wire are refused, not dropped.
    raw = msgpack.unpackb(wire.encode(5, TokensEvent("r", [1], [], [0]))[0])
    raw["body"]["top_logprobs"] = [-1.0]
    with pytest.raises(RolloutdError) as e:
        wire.decode([msgpack.packb(raw)])
    assert (e.value.code, e.value.field) == ("invalid_argument", "body.top_logprobs")


def test_top_logprobs_encode_from_numpy_arrays():
    np = pytest.importorskip("numpy")
    arr = TokensEvent("r", [1], [], [0], None, 2, np.array([4, 5]), np.array([-1.0, -2.0]))
    assert wire.decode(wire.encode(4, arr)).body.top_token_ids == [4, 5]


# ---- update_weights.entries: the direct encoder and decoder against the generic schema walk ----
def _entries_kind():
    kind = dict(wire.REQUEST_TYPES["update_weights"].fields)["entries"]
    assert isinstance(kind, wire._BucketEntries)
    return kind


def _generic(fn, *args):
    """(result, None) or (None, (code, message, field)) of a call."""
    try:
        return fn(*args), None
    except RolloutdError as e:
        return None, (e.code, e.message, e.field)
    except Exception as e:  # noqa: BLE001  (the same non-wire failure on both paths)
        return None, (type(e).__name__, str(e))


class _EntrySubclass(BucketEntry):
    pass


class _Name(str):
    pass


def test_entries_encoder_writes_the_generic_walks_bytes():
    """Every entry the direct encoder writes is byte for byte what the generic walk writes, and
    every entry it does not take (odd types, out of range) gets the generic walk's result or error."""
    np = pytest.importorskip("numpy")
    kind = _entries_kind()
    cases = [
        [BucketEntry("model.layers.0.mlp.experts.gate_up_proj", "bfloat16", [128, 5760, 2880], 0, 128 * 5760 * 2880 * 2)],
        [BucketEntry(f"t.{i}", d, [i + 1, 3], i * 256, (i + 1) * 3 * s) for i, (d, s) in
         enumerate([("float32", 4), ("BF16", 2), ("torch.float16", 2), ("F8_E4M3", 1), ("uint8", 1), ("bool", 1)])],
        [BucketEntry("é名", "int8", [], 2**64 - 1, 2**64 - 1)],  # non-ASCII, scalars, the largest values
        [BucketEntry("w", "not_a_dtype", [2], 0, 4)],  # an unknown name is written as given
        [BucketEntry("w", "float32", (2, 3), 0, 24)],  # a tuple shape
        [BucketEntry("w", "float32", np.array([2, 3]), np.int64(8), np.uint64(24))],  # numpy values
        [BucketEntry(_Name("w"), "float32", [2], 0, 8), _EntrySubclass("v", "float32", [2], 8, 8)],
        [BucketEntry("w", "float32", [True], 0, 4)],  # a bool dimension: refused
        [BucketEntry("w", "float32", [-1], 0, 4)],
        [BucketEntry("w", "float32", [2**64], 0, 4)],
        [BucketEntry("w", "float32", [2], -1, 4)],
        [BucketEntry("w", "float32", [2], 0, 2**64)],
        [BucketEntry("w", "float32", [2.0], 0, 8)],
        [BucketEntry(5, "float32", [2], 0, 8)],
        [BucketEntry("w", ["float32"], [2], 0, 8)],  # unhashable dtype
        [BucketEntry("w", None, [2], 0, 8)],
        ["not an entry"],
        [BucketEntry("a", "float32", [2], 0, 8), BucketEntry("b", "int8", "x", 8, 4)],
    ]
    for entries in cases:
        ctx = wire._Ctx([], Limits())
        fast = _generic(kind.encode, entries, "body.entries", ctx)
        slow = _generic(wire._List.encode, kind, entries, "body.entries", wire._Ctx([], Limits()))
        assert fast == slow, entries
        if fast[0] is not None:
            assert msgpack.packb(fast[0], use_bin_type=True) == msgpack.packb(slow[0], use_bin_type=True)


def test_entries_decoder_accepts_and_refuses_as_the_generic_walk():
    """Entry maps mutated one field at a time: the direct decoder gives the same entries, or the same
    error with the same field path, as the generic walk."""
    kind = _entries_kind()
    good = {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [4, 8], "byte_offset": 256, "nbytes": 64}
    values = [None, True, False, 0, 1, -1, 2**40, 2**40 + 1, 2**64 - 1, 2**64 - 64, 1.5, "", "x", "BF16",
              "torch.float32", "float4_e2m1fn_x2", "é" * 1100, "a" * 4097, b"bin", [], [1] * 8, [1] * 9, [2**40] * 2,
              [-1], [True], [2**40 + 1], [4, 8], [2, 16], {"k": 1}]
    maps = [good, {**good, "extra": 1}, {k: v for k, v in good.items() if k != "shape"}, "not a map", 7]
    for key in good:
        for v in values:
            maps.append({**good, key: v})
    for limits in (Limits(), Limits(max_string_bytes=8), Limits(max_bucket_entries=2)):
        for m in maps:
            for entries in ([m], [good, m], [m, m, m]):
                fast = _generic(kind.decode, entries, "body.entries", wire._Ctx([], limits))
                slow = _generic(wire._List.decode, kind, entries, "body.entries", wire._Ctx([], limits))
                assert fast == slow, (m, limits)
    assert _generic(kind.decode, [], "body.entries", wire._Ctx([], Limits())) == \
        _generic(wire._List.decode, kind, [], "body.entries", wire._Ctx([], Limits()))
    assert _generic(kind.decode, "x", "body.entries", wire._Ctx([], Limits())) == \
        _generic(wire._List.decode, kind, "x", "body.entries", wire._Ctx([], Limits()))


def test_a_large_bucket_table_round_trips():
    entries = [BucketEntry(f"synthetic_small.{i}.weight", "bfloat16", [1024], i * 2048, 2048) for i in range(10000)]
    req = UpdateWeightsRequest(3, entries=entries, source=ShmSource("/rolloutd-x", 0, 10000 * 2048))
    frames = wire.encode(9, req)
    # The generic walk's bytes, built by hand: the envelope map in SPEC order.
    body = {"session": 3, "load_format": "flattened_bucket",
            "entries": [{"name": e.name, "dtype": e.dtype, "shape": e.shape, "byte_offset": e.byte_offset,
                         "nbytes": e.nbytes} for e in entries],
            "source": {"kind": "shm", "name": "/rolloutd-x", "offset": 0, "size": 10000 * 2048}, "checksum": None}
    assert frames == [msgpack.packb({"v": 1, "type": "update_weights", "id": 9, "body": body}, use_bin_type=True)]
    assert wire.decode(frames).body == req
