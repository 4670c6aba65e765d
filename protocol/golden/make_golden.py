#!/usr/bin/python3
"""Writes the protocol v1 golden files (protocol/SPEC.md) from Python dict literals.

Run with Debian's interpreter, which has python3-msgpack:

    /usr/bin/python3 protocol/golden/make_golden.py

The bytes come from the Python msgpack library, an implementation independent of
the C++ encoder, so the C++ test "decode, re-encode, compare bytes" checks the
C++ codec against something it did not write. Dict literals list keys in SPEC
order; msgpack.packb keeps dict order, writes non-negative ints in the positive
family, floats as float64 and str as str: the canonical encoding of SPEC §3.

Outputs, next to this script:
  <name>.msgpack          envelope frame (frame 0)
  <name>.frame<i>.bin     payload frame i
  bad_<name>.msgpack      inputs the daemon must reject
  bad_cases.json          for each bad input: the expected error code, field path
                          and echoed id (0 when the id cannot be read)

Golden files are never regenerated to follow an encoder change (SPEC §10); this
script exists so that new goldens are made the same independent way.
"""
import json
import os
import struct

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))


def envelope(type_, id_, body):
    return {"v": 1, "type": type_, "id": id_, "body": body}


def pack(obj):
    return msgpack.packb(obj, use_bin_type=True)


MODEL = {
    "name": "tiny-moe",
    "family": "qwen3_moe",
    "vocab_size": 512,
    "num_layers": 4,
    "num_moe_layers": 3,
    "num_experts": 8,
    "top_k": 2,
    "routed_experts_dtype": "uint8",
}

LIMITS = {
    "max_envelope_bytes": 4 << 20,
    "max_frame_bytes": 256 << 20,
    "max_frames": 16,
    "max_rid_bytes": 256,
    "max_string_bytes": 4096,
    "max_input_tokens": 131072,
    "max_new_tokens": 65536,
    "max_stop_token_ids": 256,
    "max_versions": 16,
}

# Routed-expert rows, shape [num_tokens, num_layers, top_k], row-major, little-endian.
ROWS_U8 = [[[1, 5], [0, 7], [3, 2]],
           [[6, 4], [2, 1], [7, 0]]]
ROWS_U16 = [[[1000, 3], [259, 40000], [65535, 0]],
            [[12, 513], [7, 8], [256, 1]],
            [[300, 301], [302, 303], [304, 305]]]


def flatten(rows):
    return [e for token in rows for layer in token for e in layer]


GOLDEN = {
    # ---- requests (every field present, SPEC order) ----
    "hello": (envelope("hello", 1, {"client": "trainer-0", "versions": [1]}), []),
    "status": (envelope("status", 2, {}), []),
    "generate": (envelope("generate", 3, {
        "rid": "rollout-0007",
        "input_ids": [1, 17, 300, 0, 511, 128, 255, 256],
        "max_new_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 18446744073709551615,
        "stop_token_ids": [2, 70000],
        "return_logprob": True,
        "return_routed_experts": True,
        "routed_experts_start_len": 3,
        "stream": True,
    }), []),
    # Greedy, no seed (nil), defaults elsewhere: still every field, as encoders write them.
    "generate_greedy": (envelope("generate", 4, {
        "rid": "g",
        "input_ids": [5],
        "max_new_tokens": 16,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop_token_ids": [],
        "return_logprob": False,
        "return_routed_experts": False,
        "routed_experts_start_len": 0,
        "stream": False,
    }), []),
    "abort": (envelope("abort", 5, {"rid": "rollout-0007", "all": False}), []),
    "abort_all": (envelope("abort", 6, {"all": True}), []),
    "shutdown": (envelope("shutdown", 7, {"drain": True, "deadline_s": 12.5}), []),
    # ---- replies ----
    "hello_ok": (envelope("hello.ok", 1, {
        "version": 1,
        "daemon": "rolloutd",
        "build": "0.1.0 cpu",
        "gpu": -1,
        "model": MODEL,
        "weight_version": 0,
        "limits": LIMITS,
    }), []),
    "status_ok": (envelope("status.ok", 2, {
        "state": "ready",
        "ready": True,
        "reason": "",
        "weight_version": 4294967296,
        "num_waiting": 3,
        "num_running": 200,
        "num_requests_total": 70000,
        "num_tokens_generated_total": 123456789012,
        "uptime_s": 3601.25,
        "build": "0.1.0 cpu",
        "model": MODEL,
    }), []),
    "generate_ok": (envelope("generate.ok", 3, {"rid": "rollout-0007"}), []),
    "abort_ok": (envelope("abort.ok", 5, {"num_aborted": 1}), []),
    "shutdown_ok": (envelope("shutdown.ok", 7, {"accepted": True}), []),
    "error": (envelope("error", 3, {
        "code": "out_of_range",
        "message": "must be in [0, 512), got 70000",
        "field": "body.input_ids[4]",
    }), []),
    # ---- events ----
    "tokens_uint8": (envelope("tokens", 3, {
        "rid": "rollout-0007",
        "token_ids": [42, 7],
        "logprobs": [-0.125, -2.5],
        "weight_versions": [3, 3],
        "routed_experts": {"dtype": "uint8", "num_tokens": 2, "num_layers": 3, "top_k": 2,
                           "start_pos": 8, "frame": 0},
    }), [struct.pack("<12B", *flatten(ROWS_U8))]),
    "tokens_uint16": (envelope("tokens", 9, {
        "rid": "wide",
        "token_ids": [1, 2, 3],
        "logprobs": [],
        "weight_versions": [6, 7, 7],
        "routed_experts": {"dtype": "uint16", "num_tokens": 3, "num_layers": 3, "top_k": 2,
                           "start_pos": 0, "frame": 0},
    }), [struct.pack("<18H", *flatten(ROWS_U16))]),
    # Routed experts requested but no rows in this event: the map is there, frame is nil.
    "tokens_no_rows": (envelope("tokens", 3, {
        "rid": "rollout-0007",
        "token_ids": [9],
        "logprobs": [-0.5],
        "weight_versions": [3],
        "routed_experts": {"dtype": "uint8", "num_tokens": 0, "num_layers": 3, "top_k": 2,
                           "start_pos": 10, "frame": None},
    }), []),
    "tokens_plain": (envelope("tokens", 4, {
        "rid": "g",
        "token_ids": [100, 101, 102],
        "logprobs": [],
        "weight_versions": [0, 0, 0],
        "routed_experts": None,
    }), []),
    "finished": (envelope("finished", 3, {
        "rid": "rollout-0007",
        "reason": "stop",
        "abort_reason": "",
        "prompt_tokens": 8,
        "completion_tokens": 3,
    }), []),
    "finished_abort": (envelope("finished", 9, {
        "rid": "wide",
        "reason": "abort",
        "abort_reason": "client_gone",
        "prompt_tokens": 1,
        "completion_tokens": 3,
    }), []),
    "failed": (envelope("failed", 4, {
        "rid": "g",
        "error": {"code": "internal", "message": "engine step failed", "field": ""},
    }), []),
}


def generate_body(**override):
    body = dict(GOLDEN["generate"][0]["body"])
    body.update(override)
    return {k: v for k, v in body.items() if v is not ...}


def raw(*parts):
    """Concatenates packed objects and raw header bytes, for inputs packb cannot express."""
    return b"".join(p if isinstance(p, bytes) else pack(p) for p in parts)


# name -> (envelope bytes, expected code, expected field, expected echoed id)
BAD = {
    # Cut inside the last key: the id (3) came before the cut and is echoed.
    "truncated": (pack(GOLDEN["generate"][0])[:-5], "bad_message", "", 3),
    "garbage": (b"\xc1GET / HTTP/1.1\r\n\r\n", "bad_message", "", 0),
    "not_a_map": (pack([1, "generate", 3, {}]), "bad_message", "", 0),
    "trailing_bytes": (pack(envelope("status", 11, {})) + b"\x00", "bad_message", "", 11),
    "wrong_type": (pack(envelope("generate", 12, generate_body(temperature="hot"))),
                   "wrong_type", "body.temperature", 12),
    "float_for_int": (pack(envelope("generate", 13, generate_body(max_new_tokens=16.0))),
                      "wrong_type", "body.max_new_tokens", 13),
    "missing_field": (pack(envelope("generate", 14, generate_body(input_ids=...))),
                      "missing_field", "body.input_ids", 14),
    "negative_token": (pack(envelope("generate", 15, generate_body(input_ids=[1, 2, 3, -1]))),
                       "out_of_range", "body.input_ids[3]", 15),
    "max_new_tokens_over_limit": (
        pack(envelope("generate", 16, generate_body(max_new_tokens=65537))),
        "out_of_range", "body.max_new_tokens", 16),
    "unknown_type": (pack(envelope("frobnicate", 17, {})), "unknown_type", "type", 17),
    "unsupported_version": (pack({"v": 2, "type": "status", "id": 18, "body": {}}),
                            "unsupported_version", "v", 18),
    "abort_both": (pack(envelope("abort", 19, {"rid": "x", "all": True})),
                   "invalid_argument", "body", 19),
    # An array32 header claiming 2^32-1 token ids: refused while parsing, before
    # anything is allocated for it, so no field path; the id before it is echoed.
    "oversized_array_header": (
        raw(b"\x84", "v", 1, "type", "generate", "id", 20, "body",
            b"\x82", "rid", "r", "input_ids", b"\xdd\xff\xff\xff\xff"),
        "too_large", "", 20),
}


def main():
    for name in os.listdir(HERE):
        if name.endswith((".msgpack", ".bin")) or name == "bad_cases.json":
            os.remove(os.path.join(HERE, name))
    for name, (env, frames) in GOLDEN.items():
        with open(os.path.join(HERE, name + ".msgpack"), "wb") as f:
            f.write(pack(env))
        for i, frame in enumerate(frames):
            with open(os.path.join(HERE, f"{name}.frame{i}.bin"), "wb") as f:
                f.write(frame)
    cases = []
    for name, (data, code, field, id_) in BAD.items():
        file = f"bad_{name}.msgpack"
        with open(os.path.join(HERE, file), "wb") as f:
            f.write(data)
        cases.append({"file": file, "code": code, "field": field, "id": id_})
    with open(os.path.join(HERE, "bad_cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
