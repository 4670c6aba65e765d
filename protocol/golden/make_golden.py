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
  bad_<name>.frame<i>.bin their payload frames, if any
  bad_cases.json          for each bad input: the expected error code, field path,
                          echoed id (0 when the id cannot be read) and, when it has
                          any, its payload frame files

hello_ok and status_ok are what a daemon sent before the weight-update messages
(SPEC §11) added optional fields to them: decoders must still accept them, and
re-encoding them gives hello_ok_full and status_ok_full (the added fields at their
defaults). Their dict literals below are frozen. Likewise hello_ok_full is what a
daemon sent before the GPU weight transports (SPEC §11.7) appended nccl_version and
device_uuid to hello.ok: it re-encodes, as hello_ok does, to hello_ok_cpu.

Golden files are never regenerated to follow an encoder change (SPEC §10); this
script exists so that new goldens are made the same independent way.
"""
import json
import os
import struct
import zlib

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


# ---- weight updates (SPEC §11) ----
LIMITS_FULL = dict(LIMITS, max_bucket_entries=65536)

# One inline bucket of three tensors in three dtypes, little-endian, row-major, with
# 4 bytes of padding before the second (entries need not be packed tight).
Q_PROJ = struct.pack("<6H", 0x3F80, 0xC000, 0x3F00, 0x0000, 0x8000, 0x4049)  # bf16 [2, 3]
NORM = struct.pack("<3f", 1.0, 0.5, -2.25)                                   # f32 [3]
EXPERT = bytes([0x38, 0xB8, 0x00, 0x7E])                                     # f8_e4m3fn [2, 2]
BUCKET = Q_PROJ + b"\0" * 4 + NORM + EXPERT                                  # 32 bytes
BUCKET_ENTRIES = [
    {"name": "model.layers.0.self_attn.q_proj.weight", "dtype": "bfloat16", "shape": [2, 3],
     "byte_offset": 0, "nbytes": 12},
    {"name": "model.layers.0.input_layernorm.weight", "dtype": "float32", "shape": [3],
     "byte_offset": 16, "nbytes": 12},
    {"name": "model.layers.0.mlp.experts.0.down_proj.weight", "dtype": "float8_e4m3fn",
     "shape": [2, 2], "byte_offset": 28, "nbytes": 4},
]
LM_HEAD_BYTES = 151936 * 2048 * 2


# ---- GPU weight transports (SPEC §11.7) ----
# An ncclUniqueId as the trainer sends it: CuPy's get_unique_id() gives 128 signed chars,
# the wire carries bytes((v + 256) % 256 for v in uid). Deterministic, with bytes >= 0x80
# (which a str could not hold) and zeros.
UNIQUE_ID = bytes((i * 37 + 11) % 256 for i in range(128))
# A cudaIpcMemHandle_t (64 opaque bytes) and a device UUID (16 bytes), likewise made up.
IPC_HANDLE = bytes((255 - i * 3) % 256 for i in range(64))
DEVICE_UUID = bytes.fromhex("a1b2c3d4e5f60718293a4b5c6d7e8f90")
NCCL_2_28_9 = 22809  # NCCL_VERSION_CODE: 2 * 10000 + 28 * 100 + 9
# Two bfloat16 tensors at 256-byte aligned offsets, as rolloutd.trainer packs them.
DEVICE_ENTRIES = [
    {"name": "model.layers.0.mlp.experts.gate_up_proj", "dtype": "bfloat16", "shape": [16, 64, 64],
     "byte_offset": 0, "nbytes": 131072},
    {"name": "model.layers.0.mlp.gate.weight", "dtype": "float32", "shape": [16, 64],
     "byte_offset": 131072, "nbytes": 4096},
]
DEVICE_BUCKET_BYTES = 131072 + 4096


def device_update_body(source, **override):
    body = {
        "session": 9,
        "load_format": "flattened_bucket",
        "entries": [dict(e) for e in DEVICE_ENTRIES],
        "source": source,
        "checksum": None,
    }
    body.update(override)
    return body


NCCL_SOURCE = {"kind": "nccl", "group": "weights", "root": 0, "size": DEVICE_BUCKET_BYTES}
IPC_SOURCE = {"kind": "cuda_ipc", "handle": IPC_HANDLE, "offset": 2 << 20, "size": DEVICE_BUCKET_BYTES,
              "device_uuid": DEVICE_UUID}


def init_group_body(**override):
    body = {
        "group": "weights",
        "unique_id": UNIQUE_ID,
        "world_size": 3,
        "rank": 2,
        "root": 0,
        "nccl_version": NCCL_2_28_9,
        "timeout_s": 120.0,
    }
    body.update(override)
    return body


def update_weights_body(**override):
    body = {
        "session": 7,
        "load_format": "flattened_bucket",
        "entries": [dict(e) for e in BUCKET_ENTRIES],
        "source": {"kind": "inline", "frame": 0},
        "checksum": {"algo": "crc32", "value": zlib.crc32(BUCKET)},
    }
    body.update(override)
    return body


def model_checksum(checksums):
    """SPEC §11.5: CRC-32 over name + NUL + LE32 checksum, parameters sorted by name."""
    data = b"".join(n.encode() + b"\0" + struct.pack("<I", c) for n, c in sorted(checksums.items()))
    return zlib.crc32(data)


PARAM_CHECKSUMS = {
    "model.layers.0.self_attn.q_proj.weight": zlib.crc32(Q_PROJ),
    "model.layers.0.input_layernorm.weight": zlib.crc32(NORM),
}


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
    # Top log-probs asked (SPEC §4.1): the key is written only when n > 0, last.
    "generate_top_logprobs": (envelope("generate", 40, {
        "rid": "top",
        "input_ids": [5, 6],
        "max_new_tokens": 2,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": 7,
        "stop_token_ids": [],
        "return_logprob": True,
        "return_routed_experts": False,
        "routed_experts_start_len": 0,
        "stream": True,
        "top_logprobs_num": 3,
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
    # Two tokens of a request with top_logprobs_num 3 (SPEC §4.3): three entries per token,
    # raw logit descending, id ascending on ties (ids 9 and 11 tie); -inf is a valid log-prob.
    "tokens_top_logprobs": (envelope("tokens", 40, {
        "rid": "top",
        "token_ids": [11, 4],
        "logprobs": [-0.75, -0.03125],
        "weight_versions": [2, 2],
        "routed_experts": None,
        "top_logprobs_num": 3,
        "top_token_ids": [9, 11, 0, 4, 70000, 1],
        "top_logprobs": [-0.75, -0.75, -2.0, -0.03125, -4.5, float("-inf")],
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

    # ---- weight updates and generation control (SPEC §11) ----
    "hello_ok_full": (envelope("hello.ok", 1, {
        "version": 1,
        "daemon": "rolloutd",
        "build": "0.1.0 cpu",
        "gpu": -1,
        "model": MODEL,
        "weight_version": 0,
        "limits": LIMITS_FULL,
    }), []),
    "status_ok_full": (envelope("status.ok", 2, {
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
        "paused": False,
        "update_session": 0,
    }), []),
    # A session left the daemon fail-closed while generation is paused.
    "status_ok_paused": (envelope("status.ok", 21, {
        "state": "not_ready",
        "ready": False,
        "reason": "weight update session 7 failed after 2 buckets: unknown parameter 'x'",
        "weight_version": 11,
        "num_waiting": 4,
        "num_running": 0,
        "num_requests_total": 90,
        "num_tokens_generated_total": 5000,
        "uptime_s": 120.5,
        "build": "0.1.0 cpu",
        "model": MODEL,
        "paused": True,
        "update_session": 7,
    }), []),
    "begin_weight_update": (envelope("begin_weight_update", 30, {
        "selector": ["model.layers.0.", "lm_head."],
        "timeout_s": 30.0,
    }), []),
    "begin_weight_update_all": (envelope("begin_weight_update", 31, {
        "selector": None,
        "timeout_s": 60.0,
    }), []),
    "update_weights_inline": (envelope("update_weights", 32, update_weights_body()), [BUCKET]),
    # Offsets past 4 GiB; the entries' byte_offset is relative to source.offset.
    "update_weights_shm": (envelope("update_weights", 33, {
        "session": 7,
        "load_format": "flattened_bucket",
        "entries": [
            {"name": "lm_head.weight", "dtype": "bfloat16", "shape": [151936, 2048],
             "byte_offset": 0, "nbytes": LM_HEAD_BYTES},
            {"name": "model.norm.weight", "dtype": "float32", "shape": [2048],
             "byte_offset": LM_HEAD_BYTES, "nbytes": 8192},
        ],
        "source": {"kind": "shm", "name": "/rolloutd-trainer-0", "offset": 1 << 33,
                   "size": LM_HEAD_BYTES + 8192},
        "checksum": None,
    }), []),
    "end_weight_update": (envelope("end_weight_update", 34, {"session": 7, "weight_version": 12}), []),
    "abort_weight_update": (envelope("abort_weight_update", 35, {"session": 7}), []),
    "get_weights_by_name": (envelope("get_weights_by_name", 36, {"name": "model.norm.weight",
                                                                 "truncate": 4}), []),
    "weights_checksum": (envelope("weights_checksum", 37, {
        "names": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"],
    }), []),
    "weights_checksum_all": (envelope("weights_checksum", 38, {"names": None}), []),
    "pause_generation": (envelope("pause_generation", 39, {"mode": "retract"}), []),
    "continue_generation": (envelope("continue_generation", 40, {}), []),
    "begin_weight_update_ok": (envelope("begin_weight_update.ok", 30, {
        "session": 7,
        "weight_version": 11,
        "num_parameters_restored": 48,
    }), []),
    "update_weights_ok": (envelope("update_weights.ok", 32, {
        "session": 7,
        "num_entries": 3,
        "num_bytes": 28,
        "duration_s": 0.00125,
    }), []),
    "end_weight_update_ok": (envelope("end_weight_update.ok", 34, {
        "session": 7,
        "weight_version": 12,
        "num_buckets": 2,
        "num_entries": 5,
        "num_bytes": LM_HEAD_BYTES + 8192 + 28,
        "num_parameters_updated": 5,
        "duration_s": 2.5,
        "postprocess_s": 0.75,
    }), []),
    "abort_weight_update_ok": (envelope("abort_weight_update.ok", 35, {"session": 7, "state": "not_ready"}), []),
    # bfloat16 values are exact in float64; -0.0 keeps its sign.
    "get_weights_by_name_ok": (envelope("get_weights_by_name.ok", 36, {
        "name": "model.norm.weight",
        "dtype": "bfloat16",
        "shape": [2048],
        "values": [1.0, 0.99609375, -0.0, 3.0517578125e-05],
    }), []),
    # Checksums of the inline bucket's first two tensors (zlib.crc32 of their bytes).
    "weights_checksum_ok": (envelope("weights_checksum.ok", 37, {
        "algo": "crc32",
        "weight_version": 12,
        "model_checksum": model_checksum(PARAM_CHECKSUMS),
        "parameters": [
            {"name": "model.layers.0.input_layernorm.weight", "dtype": "float32", "shape": [3],
             "checksum": PARAM_CHECKSUMS["model.layers.0.input_layernorm.weight"]},
            {"name": "model.layers.0.self_attn.q_proj.weight", "dtype": "bfloat16", "shape": [2, 3],
             "checksum": PARAM_CHECKSUMS["model.layers.0.self_attn.q_proj.weight"]},
        ],
    }), []),
    "pause_generation_ok": (envelope("pause_generation.ok", 39, {
        "num_aborted": 0,
        "num_retracted": 3,
        "num_paused": 0,
    }), []),
    "continue_generation_ok": (envelope("continue_generation.ok", 40, {"num_resumed": 3}), []),
    "retracted": (envelope("retracted", 3, {
        "rid": "rollout-0007",
        "num_tokens_discarded": 5,
        "reason": "weight_update",
    }), []),
    "finished_abort_weight_update": (envelope("finished", 3, {
        "rid": "rollout-0007",
        "reason": "abort",
        "abort_reason": "weight_update",
        "prompt_tokens": 8,
        "completion_tokens": 2,
    }), []),

    # ---- GPU weight transports (SPEC §11.7) ----
    # What a CPU daemon sends now: no NCCL, no device (the re-encoding of hello_ok and hello_ok_full).
    "hello_ok_cpu": (envelope("hello.ok", 1, {
        "version": 1,
        "daemon": "rolloutd",
        "build": "0.1.0 cpu",
        "gpu": -1,
        "model": MODEL,
        "weight_version": 0,
        "limits": LIMITS_FULL,
        "nccl_version": 0,
        "device_uuid": b"",
    }), []),
    "hello_ok_gpu": (envelope("hello.ok", 1, {
        "version": 1,
        "daemon": "rolloutd",
        "build": "0.1.0 cuda sm_90a",
        "gpu": 1,
        "model": MODEL,
        "weight_version": 5,
        "limits": LIMITS_FULL,
        "nccl_version": NCCL_2_28_9,
        "device_uuid": DEVICE_UUID,
    }), []),
    "init_weight_group": (envelope("init_weight_group", 50, init_group_body()), []),
    "init_weight_group_ok": (envelope("init_weight_group.ok", 50, {
        "group": "weights",
        "nccl_version": NCCL_2_28_9,
        "rank": 2,
        "world_size": 3,
        "duration_s": 0.75,
    }), []),
    "destroy_weight_group": (envelope("destroy_weight_group", 51, {"group": "weights"}), []),
    "destroy_weight_group_ok": (envelope("destroy_weight_group.ok", 51, {"group": "weights"}), []),
    "update_weights_nccl": (envelope("update_weights", 52, device_update_body(
        NCCL_SOURCE, checksum={"algo": "crc32", "value": 0xDEADBEEF})), []),
    # Offset 2 MiB into the exported allocation (a caching allocator's segment).
    "update_weights_cuda_ipc": (envelope("update_weights", 53, device_update_body(IPC_SOURCE)), []),
    # Memory release and resume (SPEC §12).
    "release_memory": (envelope("release_memory", 54, {"tags": ["weights", "kv_cache"]}), []),
    "release_memory_all": (envelope("release_memory", 55, {"tags": None}), []),
    "release_memory_ok": (envelope("release_memory.ok", 54, {
        "tags": ["weights", "kv_cache"],
        "num_bytes": 17179869184 + 2147483648,
        "duration_s": 0.125,
    }), []),
    "resume_memory": (envelope("resume_memory", 56, {"tags": ["weights"]}), []),
    "resume_memory_ok": (envelope("resume_memory.ok", 56, {
        "tags": [],
        "num_bytes": 0,
        "duration_s": 0.5,
    }), []),
}


def generate_body(**override):
    body = dict(GOLDEN["generate"][0]["body"])
    body.update(override)
    return {k: v for k, v in body.items() if v is not ...}


def raw(*parts):
    """Concatenates packed objects and raw header bytes, for inputs packb cannot express."""
    return b"".join(p if isinstance(p, bytes) else pack(p) for p in parts)


def bad_update(id_, **override):
    return pack(envelope("update_weights", id_, update_weights_body(**override)))


def with_entry(i, **override):
    entries = [dict(e) for e in BUCKET_ENTRIES]
    entries[i].update(override)
    return entries


# name -> (envelope bytes, expected code, expected field, expected echoed id[, payload frames])
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
    "top_logprobs_num_over_limit": (
        pack(envelope("generate", 41, generate_body(top_logprobs_num=21))),
        "out_of_range", "body.top_logprobs_num", 41),
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
    # ---- update_weights (SPEC §11.2): the decoder's checks, before anything is applied ----
    # entries[1] starts inside entries[0]: the second of the pair is named.
    "update_weights_overlap": (
        bad_update(41, entries=with_entry(1, byte_offset=8)), "invalid_argument", "body.entries[1]", 41,
        [BUCKET]),
    # The third entry's bytes [28, 32) do not fit a 30-byte frame.
    "update_weights_entry_beyond_frame": (
        bad_update(42), "out_of_range", "body.entries[2].byte_offset", 42, [BUCKET[:30]]),
    "update_weights_nbytes_mismatch": (
        bad_update(43, entries=with_entry(0, nbytes=10)), "invalid_argument", "body.entries[0].nbytes", 43,
        [BUCKET]),
    "update_weights_unknown_load_format": (
        bad_update(44, load_format="safetensors"), "invalid_argument", "body.load_format", 44, [BUCKET]),
    "update_weights_bad_shm_name": (
        bad_update(45, source={"kind": "shm", "name": "/../dev/mem", "offset": 0, "size": 32}),
        "invalid_argument", "body.source.name", 45),
    "update_weights_unknown_dtype": (
        bad_update(46, entries=with_entry(1, dtype="complex64")), "invalid_argument",
        "body.entries[1].dtype", 46, [BUCKET]),
    "update_weights_no_payload_frame": (
        bad_update(47), "out_of_range", "body.source.frame", 47),
    "update_weights_checksum_algo": (
        bad_update(48, checksum={"algo": "sha256", "value": 1}), "invalid_argument", "body.checksum.algo", 48,
        [BUCKET]),
    "pause_generation_unknown_mode": (
        pack(envelope("pause_generation", 49, {"mode": "drain"})), "invalid_argument", "body.mode", 49),
    # ---- GPU weight transports (SPEC §11.7) ----
    "init_weight_group_short_unique_id": (
        pack(envelope("init_weight_group", 60, init_group_body(unique_id=UNIQUE_ID[:127]))),
        "invalid_argument", "body.unique_id", 60),
    # The id as a str: ids are raw bytes (msgpack bin).
    "init_weight_group_unique_id_str": (
        pack(envelope("init_weight_group", 61, init_group_body(unique_id="x" * 128))),
        "wrong_type", "body.unique_id", 61),
    "init_weight_group_rank_is_root": (
        pack(envelope("init_weight_group", 62, init_group_body(rank=0))), "invalid_argument", "body.rank", 62),
    "init_weight_group_rank_beyond_world": (
        pack(envelope("init_weight_group", 63, init_group_body(rank=3))), "out_of_range", "body.rank", 63),
    "init_weight_group_world_of_one": (
        pack(envelope("init_weight_group", 64, init_group_body(world_size=1, rank=0))),
        "out_of_range", "body.world_size", 64),
    "init_weight_group_bad_name": (
        pack(envelope("init_weight_group", 65, init_group_body(group="../weights"))),
        "invalid_argument", "body.group", 65),
    "init_weight_group_timeout_zero": (
        pack(envelope("init_weight_group", 66, init_group_body(timeout_s=0.0))),
        "out_of_range", "body.timeout_s", 66),
    "destroy_weight_group_missing_group": (
        pack(envelope("destroy_weight_group", 67, {})), "missing_field", "body.group", 67),
    "update_weights_nccl_size_over_2p40": (
        pack(envelope("update_weights", 68, device_update_body(dict(NCCL_SOURCE, size=(1 << 40) + 1)))),
        "out_of_range", "body.source.size", 68),
    "update_weights_nccl_entry_beyond_size": (
        pack(envelope("update_weights", 69, device_update_body(dict(NCCL_SOURCE, size=DEVICE_BUCKET_BYTES - 1)))),
        "out_of_range", "body.entries[1].byte_offset", 69),
    "update_weights_nccl_bad_group": (
        pack(envelope("update_weights", 70, device_update_body(dict(NCCL_SOURCE, group="")))),
        "invalid_argument", "body.source.group", 70),
    "update_weights_cuda_ipc_short_handle": (
        pack(envelope("update_weights", 71, device_update_body(dict(IPC_SOURCE, handle=IPC_HANDLE[:63])))),
        "invalid_argument", "body.source.handle", 71),
    "update_weights_cuda_ipc_uuid_length": (
        pack(envelope("update_weights", 72, device_update_body(dict(IPC_SOURCE, device_uuid=DEVICE_UUID + b"\0")))),
        "invalid_argument", "body.source.device_uuid", 72),
    "update_weights_cuda_ipc_end_overflows": (
        pack(envelope("update_weights", 73, device_update_body(dict(IPC_SOURCE, offset=2**64 - 4096)))),
        "out_of_range", "body.source.size", 73),
    "release_memory_unknown_tag": (
        pack(envelope("release_memory", 74, {"tags": ["weights", "activations"]})),
        "invalid_argument", "body.tags[1]", 74),
    "release_memory_empty_tags": (
        pack(envelope("release_memory", 75, {"tags": []})), "invalid_argument", "body.tags", 75),
    "resume_memory_tag_twice": (
        pack(envelope("resume_memory", 76, {"tags": ["kv_cache", "kv_cache"]})),
        "invalid_argument", "body.tags[1]", 76),
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
    for name, (data, code, field, id_, *frames) in BAD.items():
        file = f"bad_{name}.msgpack"
        with open(os.path.join(HERE, file), "wb") as f:
            f.write(data)
        case = {"file": file, "code": code, "field": field, "id": id_}
        if frames:
            case["frames"] = []
            for i, frame in enumerate(frames[0]):
                case["frames"].append(f"bad_{name}.frame{i}.bin")
                with open(os.path.join(HERE, case["frames"][-1]), "wb") as f:
                    f.write(frame)
        cases.append(case)
    with open(os.path.join(HERE, "bad_cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
