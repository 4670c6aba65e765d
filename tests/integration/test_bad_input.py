"""Bad input: each answered with a typed error (code, message, field) while the daemon keeps
serving. Messages are built here with the plain msgpack library, not the client's encoder."""
import msgpack
import pytest

import rolloutd


def envelope(type_, body, id_=7, v=1):
    return msgpack.packb({"v": v, "type": type_, "id": id_, "body": body})


def exchange(c, frames, timeout_s=10.0):
    c.send_raw(frames)
    reply = c.recv_raw(timeout_s)
    assert reply is not None, "no reply to a bad message"
    return msgpack.unpackb(reply[0], raw=False)


def gen_body(**over):
    body = {"rid": "r1", "input_ids": [1, 2, 3], "max_new_tokens": 4}
    body.update(over)
    return body


CASES = [
    # (name, frames, expected code, expected field or None)
    ("unknown type", [envelope("frobnicate", {})], "unknown_type", "type"),
    ("wrong type: input_ids not a list", [envelope("generate", gen_body(input_ids="abc"))], "wrong_type",
     "body.input_ids"),
    ("wrong type: token id is a string", [envelope("generate", gen_body(input_ids=[1, "x"]))], "wrong_type",
     "body.input_ids[1]"),
    ("wrong type: temperature is a string", [envelope("generate", gen_body(temperature="hot"))], "wrong_type",
     "body.temperature"),
    ("wrong type: max_new_tokens is a float", [envelope("generate", gen_body(max_new_tokens=4.5))], "wrong_type",
     "body.max_new_tokens"),
    ("missing field: input_ids", [envelope("generate", {"rid": "r", "max_new_tokens": 3})], "missing_field",
     "body.input_ids"),
    ("missing field: rid", [envelope("generate", {"input_ids": [1], "max_new_tokens": 3})], "missing_field",
     "body.rid"),
    ("truncated msgpack", [envelope("generate", gen_body())[:-5]], "bad_message", None),
    ("garbage", [b"\xc1\xff\x00garbage"], "bad_message", None),
    ("not a map", [msgpack.packb([1, "generate", 3])], "bad_message", None),
    ("unsupported protocol version", [envelope("status", {}, v=2)], "unsupported_version", None),
    ("hello without a common version", [envelope("hello", {"client": "t", "versions": [7, 9]})],
     "unsupported_version", "body.versions"),
    ("out-of-vocabulary token", [envelope("generate", gen_body(input_ids=[1, 256]))], "out_of_range",
     "body.input_ids[1]"),
    ("negative token", [envelope("generate", gen_body(input_ids=[-3]))], "out_of_range", "body.input_ids[0]"),
    ("max_new_tokens zero", [envelope("generate", gen_body(max_new_tokens=0))], "out_of_range",
     "body.max_new_tokens"),
    ("max_new_tokens beyond the limit", [envelope("generate", gen_body(max_new_tokens=10**7))], "out_of_range",
     "body.max_new_tokens"),
    ("context overflow", [envelope("generate", gen_body(max_new_tokens=4095))], "out_of_range",
     "body.max_new_tokens"),
    ("top_p zero", [envelope("generate", gen_body(top_p=0.0))], "out_of_range", "body.top_p"),
    ("abort with neither rid nor all", [envelope("abort", {})], "invalid_argument", None),
    ("empty input", [envelope("generate", gen_body(input_ids=[]))], None, "body.input_ids"),
]


@pytest.mark.parametrize("name,frames,code,field", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_typed_error_and_daemon_keeps_serving(daemon, name, frames, code, field):
    with daemon.client() as c:
        reply = exchange(c, frames)
        assert reply["type"] == "error", reply
        err = reply["body"]
        if code is not None:
            assert err["code"] == code, err
        if field is not None:
            assert err["field"] == field, err
        assert err["message"]
        # Still serving, on the same connection.
        assert c.generate([1, 2], max_new_tokens=2).ok
    assert daemon.metric("rolloutd_errors_total", code=err["code"]) >= 1


def test_error_reply_echoes_the_envelope_id(daemon):
    with daemon.client() as c:
        reply = exchange(c, [envelope("generate", gen_body(input_ids=[999]), id_=4242)])
        assert reply["id"] == 4242


def test_oversized_envelope_is_refused_with_too_large(daemon):
    with daemon.client() as c:
        limit = c.hello().limits.max_envelope_bytes
        big = envelope("generate", gen_body(input_ids=[1] * 10, pad=b"x" * (limit + 1)))
        reply = exchange(c, [big])
        assert reply["type"] == "error" and reply["body"]["code"] == "too_large"
        assert c.generate([1], max_new_tokens=1).ok


def test_too_many_frames(daemon):
    with daemon.client() as c:
        limit = c.hello().limits.max_frames
        reply = exchange(c, [envelope("status", {})] + [b"x"] * (limit + 1))
        assert reply["body"]["code"] == "too_large"


def test_unknown_keys_are_ignored(daemon):
    with daemon.client() as c:
        reply = exchange(c, [envelope("status", {"future_field": [1, 2, 3]})])
        assert reply["type"] == "status.ok"


def test_empty_message_frame(daemon):
    with daemon.client() as c:
        reply = exchange(c, [b""])
        assert reply["type"] == "error" and reply["body"]["code"] == "bad_message"


def test_a_flood_of_bad_messages_does_not_stop_service(daemon):
    with daemon.client() as c:
        for i in range(300):
            c.send_raw([b"\xc1" * (i % 7 + 1)])
        replies = 0
        while c.recv_raw(2.0) is not None:
            replies += 1
            if replies == 300:
                break
        assert replies == 300
        assert c.generate([3], max_new_tokens=2).ok
    assert daemon.get("/livez")[0] == 200
