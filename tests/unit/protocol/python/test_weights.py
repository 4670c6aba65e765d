"""Weight-update helpers of the rolloutd package (SPEC §11): pack_bucket, crc32_of, model_checksum,
and the Client's session calls and push_weights against a scripted fake daemon (zmtp_peer)."""
import os
import struct
import zlib

import pytest

np = pytest.importorskip("numpy")

from rolloutd import Client, RolloutdError, crc32_of, model_checksum, pack_bucket  # noqa: E402
from rolloutd.messages import (AbortWeightUpdateReply, AbortWeightUpdateRequest, BeginWeightUpdateReply,  # noqa: E402
                               BeginWeightUpdateRequest, ContinueGenerationReply, ContinueGenerationRequest,
                               EndWeightUpdateReply, ErrorInfo, GetWeightsByNameReply, GetWeightsByNameRequest,
                               HelloReply, InlineSource, Limits, ParameterChecksum, PauseGenerationReply,
                               PauseGenerationRequest, ShmSource, UpdateWeightsReply, UpdateWeightsRequest,
                               WeightsChecksumReply, WeightsChecksumRequest)


def bf16_bytes(values):
    """bfloat16 bytes of float32 values (truncation: exact for the values used here)."""
    return np.asarray(values, dtype="<f4").view("<u4").__rshift__(16).astype("<u2").tobytes()


TENSORS = [
    ("model.embed_tokens.weight", np.arange(12, dtype=np.float32).reshape(3, 4)),
    ("model.layers.0.mlp.gate.weight", "bfloat16", [2, 2], bf16_bytes([1.0, -2.0, 0.5, 0.25])),
    ("model.layers.0.mlp.experts.e_score_correction_bias", np.array([1, -2, 3], dtype=">i4")),  # big-endian in
    ("model.norm.weight", np.ones(5, dtype=np.float16)),
    ("lm_head.weight", np.full((2, 3), 7, dtype=np.int8)),
]


def expected_bytes(item):
    if len(item) == 4:
        return item[3]
    return np.ascontiguousarray(item[1].astype(item[1].dtype.newbyteorder("<"))).tobytes()


# ---------------------------------------------------------------------------------- helpers --
def test_pack_bucket_aligns_each_tensor_and_keeps_little_endian_bytes():
    entries, data = pack_bucket(TENSORS)
    assert [e.name for e in entries] == [t[0] for t in TENSORS]
    assert [e.dtype for e in entries] == ["float32", "bfloat16", "int32", "float16", "int8"]
    assert [e.shape for e in entries] == [[3, 4], [2, 2], [3], [5], [2, 3]]
    assert [e.byte_offset for e in entries] == [0, 64, 128, 192, 256]
    assert len(data) == 256 + 6 and isinstance(data, bytes)
    for e, t in zip(entries, TENSORS):
        assert e.nbytes == len(expected_bytes(t))
        assert data[e.byte_offset:e.byte_offset + e.nbytes] == expected_bytes(t)
    assert data[48:64] == bytes(16)  # padding is zeros
    assert struct.unpack("<3i", data[128:140]) == (1, -2, 3)


def test_pack_bucket_tight_and_dtype_spellings():
    entries, data = pack_bucket([("a", "torch.bfloat16", (1,), b"\x80\x3f"), ("b", "F32", [1], struct.pack("<f", 2)),
                                 ("c", np.array(True))], align=1)
    assert [(e.dtype, e.byte_offset, e.nbytes) for e in entries] == [("bfloat16", 0, 2), ("float32", 2, 4),
                                                                    ("bool", 6, 1)]
    assert entries[2].shape == [] and data == b"\x80\x3f" + struct.pack("<f", 2) + b"\x01"


def test_pack_bucket_refuses_what_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="float64"):
        pack_bucket([("x", np.zeros(2))])
    with pytest.raises(ValueError, match="6 bytes"):
        pack_bucket([("x", "bfloat16", [2], bytes(6))])
    with pytest.raises(ValueError, match="unknown dtype"):
        pack_bucket([("x", "complex64", [1], bytes(8))])
    with pytest.raises(TypeError):
        pack_bucket([np.zeros(2, dtype=np.float32)])


def test_crc32_of_is_zlib_over_little_endian_bytes():
    assert crc32_of(b"123456789") == 0xCBF43926  # the CRC-32 check value
    big = np.arange(7, dtype=">f4").reshape(7, 1)
    assert crc32_of(big) == zlib.crc32(big.astype("<f4").tobytes())
    sliced = np.arange(20, dtype=np.int16)[::2]  # not contiguous
    assert crc32_of(sliced) == zlib.crc32(sliced.copy().tobytes())


def test_model_checksum_is_the_spec_formula():
    sums = {"b.weight": 0xDEADBEEF, "a.bias": 1, "é.weight": 0xFFFFFFFF}
    data = b"".join(n.encode() + b"\0" + struct.pack("<I", sums[n]) for n in sorted(sums))
    assert model_checksum(sums) == zlib.crc32(data)
    assert model_checksum(dict(reversed(list(sums.items())))) == model_checksum(sums)
    assert model_checksum({}) == 0


# -------------------------------------------------------------------------- session calls --
def test_session_calls_round_trip(daemon):
    def script(d):
        m = d.recv()
        assert m.body == BeginWeightUpdateRequest(selector=["model.layers.0."], timeout_s=5.0)
        d.send(m.id, BeginWeightUpdateReply(9, 3, 12))
        m = d.recv()
        assert m.body.session == 9 and m.body.checksum.value == zlib.crc32(b"abcd")
        assert m.body.source == InlineSource(0, b"abcd")
        d.send(m.id, UpdateWeightsReply(9, 1, 4, 0.001))
        m = d.recv()
        assert m.body == AbortWeightUpdateRequest(9)
        d.send(m.id, AbortWeightUpdateReply(9, "not_ready"))
        m = d.recv()
        assert m.body == GetWeightsByNameRequest("model.norm.weight", 3)
        d.send(m.id, GetWeightsByNameReply("model.norm.weight", "bfloat16", [5], [1.0, float("nan"), -0.0]))
        m = d.recv()
        assert m.body == PauseGenerationRequest("in_place")
        d.send(m.id, PauseGenerationReply(0, 0, 4))
        m = d.recv()
        assert m.body == ContinueGenerationRequest()
        d.send(m.id, ContinueGenerationReply(4))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        assert c.begin_weight_update(["model.layers.0."], timeout_s=5.0).session == 9
        entries, _ = pack_bucket([("w", np.zeros(1, dtype=np.float32))])
        assert c.update_weights_inline(9, entries, b"abcd", checksum=True).num_bytes == 4
        assert c.abort_weight_update(9).state == "not_ready"
        w = c.get_weights_by_name("model.norm.weight", truncate=3)
        assert w.shape == [5] and w.values[0] == 1.0 and w.values[1] != w.values[1]
        assert c.pause_generation("in_place").num_paused == 4
        assert c.continue_generation().num_resumed == 4


def test_weights_checksum_is_a_dict_with_the_model_checksum(daemon):
    params = [ParameterChecksum("a", "float32", [2], 5), ParameterChecksum("b", "bfloat16", [1, 2], 6)]

    def script(d):
        m = d.recv()
        assert m.body == WeightsChecksumRequest(None)
        d.send(m.id, WeightsChecksumReply("crc32", 4, model_checksum({"a": 5, "b": 6}), params))
        m = d.recv()
        assert m.body == WeightsChecksumRequest(["b"])
        d.send(m.id, ErrorInfo("not_found", "no parameter 'b'", "body.names[0]"))

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        sums = c.weights_checksum()
        assert sums == {"a": 5, "b": 6}
        assert (sums.weight_version, sums.algo, sums.parameters) == (4, "crc32", params)
        assert sums.model_checksum == model_checksum(sums)
        with pytest.raises(RolloutdError) as e:
            c.weights_checksum(["b"])
        assert (e.value.code, e.value.field) == ("not_found", "body.names[0]")


# ---------------------------------------------------------------------------- push_weights --
def serve_session(d, session, weight_version, read_bucket, max_updates=100):
    """Answers begin, every update_weights (checking it with read_bucket(request) -> bytes), and end;
    returns {name: bytes} as the daemon would have applied them."""
    m = d.recv()
    assert isinstance(m.body, BeginWeightUpdateRequest)
    d.send(m.id, BeginWeightUpdateReply(session, 0, 0))
    applied, buckets = {}, []
    for _ in range(max_updates):
        m = d.recv()
        if not isinstance(m.body, UpdateWeightsRequest):
            break
        req = m.body
        assert req.session == session
        data = read_bucket(req)
        if req.checksum is not None:
            assert req.checksum.value == zlib.crc32(data)
        for e in req.entries:
            applied[e.name] = (e.dtype, e.shape, bytes(data[e.byte_offset:e.byte_offset + e.nbytes]))
        buckets.append([e.name for e in req.entries])
        d.send(m.id, UpdateWeightsReply(session, len(req.entries), sum(e.nbytes for e in req.entries), 0.0))
    assert m.type == "end_weight_update" and m.body.session == session
    assert m.body.weight_version == weight_version
    d.send(m.id, EndWeightUpdateReply(session, weight_version, len(buckets), len(applied)))
    return applied, buckets


def check_applied(applied):
    assert set(applied) == {t[0] for t in TENSORS}
    for t in TENSORS:
        assert applied[t[0]][2] == expected_bytes(t), t[0]


def test_push_weights_inline_splits_buckets(daemon):
    result = {}

    def script(d):
        result["applied"], result["buckets"] = serve_session(d, 3, 17, lambda req: req.source.data)

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        end = c.push_weights(TENSORS, weight_version=17, bucket_bytes=100, checksum=True)
    peer.join()
    assert (end.session, end.weight_version, end.num_buckets) == (3, 17, 3)
    check_applied(result["applied"])
    # 48 + 8 (aligned to 64) fits 100; the int32 tensor starts a new bucket, and so on.
    assert result["buckets"] == [[t[0] for t in TENSORS[:2]], [t[0] for t in TENSORS[2:4]], [TENSORS[4][0]]]


def test_push_weights_shm_reuses_one_region_and_unlinks_it(daemon):
    result = {"names": set()}

    def read_shm(req):
        assert isinstance(req.source, ShmSource) and req.source.offset == 0
        result["names"].add(req.source.name)
        with open("/dev/shm" + req.source.name, "rb") as f:  # what the daemon maps
            data = f.read()
        return data[:req.source.size]

    def script(d):
        result["applied"], _ = serve_session(d, 4, 18, read_shm)

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        c.push_weights(TENSORS, weight_version=18, bucket_bytes=100, via="shm", shm_name="/rolloutd-test-push",
                       checksum=True)
    peer.join()
    check_applied(result["applied"])
    assert result["names"] == {"/rolloutd-test-push"}
    assert not os.path.exists("/dev/shm/rolloutd-test-push")


def test_push_weights_respects_the_daemons_limits(daemon):
    result = {}

    def script(d):
        m = d.recv()
        d.send(m.id, HelloReply(limits=Limits(max_bucket_entries=2, max_frame_bytes=1 << 20)))
        result["applied"], result["buckets"] = serve_session(d, 5, 1, lambda req: req.source.data)

    peer = daemon(script)
    with Client(peer.endpoint) as c:
        c.hello()
        c.push_weights(TENSORS, weight_version=1)
    peer.join()
    check_applied(result["applied"])
    assert [len(b) for b in result["buckets"]] == [2, 2, 1]


def test_push_weights_aborts_the_session_when_a_bucket_fails(daemon):
    def script(d):
        m = d.recv()
        d.send(m.id, BeginWeightUpdateReply(6, 0, 0))
        m = d.recv()
        assert isinstance(m.body, UpdateWeightsRequest)
        d.send(m.id, ErrorInfo("not_found", "unknown parameter", "body.entries[0].name"))
        m = d.recv()
        assert m.body == AbortWeightUpdateRequest(6)
        d.send(m.id, AbortWeightUpdateReply(6, "ready"))

    peer = daemon(script)
    with Client(peer.endpoint) as c, pytest.raises(RolloutdError) as e:
        c.push_weights(TENSORS, weight_version=2, via="shm", shm_name="rolloutd-test-abort")
    assert (e.value.code, e.value.field) == ("not_found", "body.entries[0].name")
    assert not os.path.exists("/dev/shm/rolloutd-test-abort")


def test_push_weights_refuses_an_inline_tensor_over_the_frame_limit():
    c = Client("tcp://127.0.0.1:1", timeout_s=0.1)
    c.limits = Limits(max_frame_bytes=16)
    with pytest.raises(ValueError, match="via='shm'"):
        c.push_weights([("big", np.zeros(8, dtype=np.float32))], weight_version=1)
    c.close()
