#!/usr/bin/env python3
"""Seed inputs and dictionaries for the fuzz targets (tests/fuzz/*_fuzzer.cpp).

    make_seeds.py OUT_DIR [--dicts]

writes OUT_DIR/<target>/seed-* for the targets request, incoming, bucket, config and
safetensors, and
with --dicts OUT_DIR/<target>.dict (libFuzzer dictionaries: msgpack keys and enum values
of the goldens, the flags and variables of daemon/config.cpp). tests/fuzz/run.sh calls it before every
run, so the seeds follow the golden files; the committed tests/fuzz/corpus/<target>/ holds
the same seeds (regenerate with `make_seeds.py tests/fuzz/corpus`) plus the regression
inputs, which the ctest tests fuzz_corpus_<target> replay.

Protocol seeds are protocol/golden/<name>.msgpack with its payload frames
<name>.frame<i>.bin appended after the separator of tests/fuzz/fuzz_util.hpp; requests and
the bad cases go to `request`, replies and events to `incoming`.
"""
import glob
import json
import os
import re
import struct
import sys

import msgpack

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEP = b"\n#FRAME#"
# What a daemon sends; every other type (and what does not decode) is a request seed.
INCOMING_TYPES = {"error", "tokens", "finished", "failed", "retracted"}


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def strings_of(obj, out):
    if isinstance(obj, dict):
        for k, v in obj.items():
            strings_of(k, out)
            strings_of(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            strings_of(v, out)
    elif isinstance(obj, str) and 0 < len(obj) <= 64:
        out.add(obj)


def dict_line(b):
    return '"' + "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else "\\x%02X" % c for c in b) + '"'


DICTS = {}


def protocol_seeds(out):
    strings = set()
    for path in sorted(glob.glob(os.path.join(ROOT, "protocol", "golden", "*.msgpack"))):
        name = os.path.basename(path)[:-len(".msgpack")]
        data = open(path, "rb").read()
        for frame in sorted(glob.glob(os.path.join(os.path.dirname(path), name + ".frame*.bin"))):
            data += SEP + open(frame, "rb").read()
        try:
            msg = msgpack.unpackb(open(path, "rb").read(), strict_map_key=False, raw=False)
            kind = msg.get("type") if isinstance(msg, dict) else None
            strings_of(msg, strings)
        except Exception:
            kind = None
        incoming = isinstance(kind, str) and (kind.endswith(".ok") or kind in INCOMING_TYPES)
        target = "incoming" if incoming else "request"
        write(os.path.join(out, target, "seed-" + name), data)
    # msgpack str tokens for every key and enum value the goldens use.
    lines = [dict_line(msgpack.packb(s)) for s in sorted(strings)]
    lines += [dict_line(SEP), dict_line(b"\xdd\x00\x02\x00\x00"), dict_line(b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00")]
    DICTS["request"] = DICTS["incoming"] = lines


# ---- bucket: programs in the format bucket_fuzzer.cpp reads ----
# Parameter indices follow registration order (moe_decoder.cpp): 0 embed_tokens, then per
# layer input_layernorm, q, k, v, o, post_attention_layernorm, gate (router),
# experts.gate_up_proj, experts.down_proj; then model.norm, lm_head.
def u8(v):
    return struct.pack("<B", v & 0xFF)


def u16(v):
    return struct.pack("<H", v & 0xFFFF)


def u64(v):
    return struct.pack("<Q", v & (2**64 - 1))


def op_begin(timeout_index=0, selector=()):
    b = u8(0) + u16(1) + u8(len(selector))
    for name_index, prefix_len in selector:
        b += u16(name_index) + u8(0) + u8(prefix_len)
    return b + u8(timeout_index)


def entry(name_index, dtype_mode=1, shape_mode=1, size_mode=1, off_mode=3):
    # how: low nibble != 0xf (a known name by index), high nibble picks F32 (1..5) or BF16 (6, 7)
    return u8((dtype_mode << 4) | 1) + u16(name_index) + u8(shape_mode) + u8(size_mode) + u8(off_mode)


def op_bucket(entries, crc_mode=1, buf_mode=1, slack=0):
    b = u8(1) + u16(1) + u8(len(entries)) + b"".join(entries)
    b += u8(buf_mode) + (u8(slack) if buf_mode % 4 == 1 else b"") + u16(0)
    return b + u8(crc_mode)


def op_end(version):
    return u8(2) + u16(1) + u64(version)


def op_abort():
    return u8(3) + u16(1)


def op_expire(seconds):
    return u8(4) + u16(1) + u16(seconds)


def bucket_seeds(out):
    d = os.path.join(out, "bucket")
    write(os.path.join(d, "seed-full-session"),
          op_begin() + op_bucket([entry(1), entry(2), entry(3)]) + op_end(7))
    write(os.path.join(d, "seed-bf16-session"),
          op_begin() + op_bucket([entry(1, dtype_mode=6), entry(7, dtype_mode=6)], crc_mode=0) + op_end(3))
    write(os.path.join(d, "seed-selector"),
          op_begin(selector=[(8, 20)]) + op_bucket([entry(8)]) + op_bucket([entry(2)]) + op_end(1))
    write(os.path.join(d, "seed-abort-after-write"), op_begin() + op_bucket([entry(5)]) + op_abort())
    write(os.path.join(d, "seed-expire"), op_begin(1) + op_bucket([entry(6)]) + op_expire(5) + op_end(2))
    write(os.path.join(d, "seed-overlap"), op_begin() + op_bucket([entry(1), entry(1, off_mode=1)]) + op_end(1))
    write(os.path.join(d, "seed-bad-nbytes"), op_begin() + op_bucket([entry(4, size_mode=0)]) + op_end(1))
    write(os.path.join(d, "seed-short-buffer"), op_begin() + op_bucket([entry(4)], buf_mode=2) + op_end(1))
    write(os.path.join(d, "seed-wrong-crc"), op_begin() + op_bucket([entry(4)], crc_mode=2) + u64(0) + op_end(1))


# ---- config: NUL-separated argv tokens, "$NAME=VALUE" for the environment ----
def config_seeds(out):
    d = os.path.join(out, "config")
    cases = {
        "defaults": [],
        "ephemeral": ["--control-port", "0", "--http-port", "0", "--endpoints-file", "/tmp/x.json"],
        "env": ["$ROLLOUTD_CONTROL_PORT=7601", "$ROLLOUTD_OUTBOX_LIMIT=16", "--log-level", "debug"],
        "cuda": ["--device", "cuda", "--gpu", "1", "--max-running", "8"],
        "auto": ["--device", "auto", "$CUDA_VISIBLE_DEVICES=0,1", "$SLURM_LOCALID=1"],
        "local-rank": ["$LOCAL_RANK=3", "--control-port", "7600"],
        "bad-range": ["--kv-blocks", "0", "--outbox-limit", "1"],
        "bad-number": ["--control-port", "12x", "--drain-timeout-s", "nan"],
        "help": ["--help"],
        "equals": ["--bind=0.0.0.0", "--http-bind=::1", "--shm-prefix=/r"],
        "unknown": ["--no-such-flag", "positional"],
    }
    for name, toks in cases.items():
        write(os.path.join(d, "seed-" + name), b"\0".join(t.encode() for t in toks))
    src = open(os.path.join(ROOT, "daemon", "config.cpp")).read()
    words = sorted(set(re.findall(r'"(--[a-z0-9-]+)"', src)) | set(re.findall(r'"((?:ROLLOUTD|SLURM|LOCAL|CUDA)_[A-Z_]+)"', src)))
    lines = [dict_line(w.encode()) for w in words if w.startswith("--")]
    lines += [dict_line(b"$" + w.encode() + b"=") for w in words if not w.startswith("--")]
    lines += [dict_line(b) for b in (b"\0", b"cpu", b"cuda", b"auto", b"debug", b"65535", b"-1", b"1e308")]
    DICTS["config"] = lines


# ---- safetensors: whole files (8-byte length, JSON header, data section) ----
def st_file(header, data=b"", declared=None, pad=True):
    h = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h) if declared is None else declared) + h + data


def st_entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def safetensors_seeds(out):
    d = os.path.join(out, "safetensors")
    # A tiny Qwen3-MoE-shaped checkpoint: what make-test-model writes, smaller.
    model, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in [("model.embed_tokens.weight", [8, 4]), ("model.layers.0.self_attn.q_norm.weight", [4]),
                        ("model.layers.0.mlp.gate.weight", [2, 4]),
                        ("model.layers.0.mlp.experts.0.gate_proj.weight", [2, 4]),
                        ("model.layers.0.mlp.experts.1.down_proj.weight", [4, 2]), ("lm_head.weight", [8, 4])]:
        n = 2
        for x in shape:
            n *= x
        model[name] = st_entry("BF16", shape, off, off + n)
        off += n
    cases = {
        "model": st_file(model, bytes(range(256)) * (off // 256 + 1)),
        "dtypes": st_file({"a": st_entry("F32", [2], 0, 8), "b": st_entry("U8", [3], 8, 11),
                           "c": st_entry("I64", [], 11, 19), "d": st_entry("F8_E4M3", [1, 1], 19, 20),
                           "e": st_entry("BOOL", [0, 7], 20, 20), "f": st_entry("F8_E8M0", [2], 20, 22)},
                          bytes(22)),
        "empty": st_file({}),
        "metadata-only": st_file({"__metadata__": {"format": "pt", "k": "v"}}),
        "bad-overlap": st_file({"a": st_entry("F32", [2], 0, 8), "b": st_entry("F32", [2], 4, 12)}, bytes(12)),
        "bad-size": st_file({"a": st_entry("BF16", [3], 0, 4)}, bytes(4)),
        "bad-past-end": st_file({"a": st_entry("F32", [4], 0, 16)}, bytes(15)),
        "bad-dtype": st_file({"a": st_entry("F64", [1], 0, 8)}, bytes(8)),
        "bad-length": st_file({"a": st_entry("U8", [1], 0, 1)}, b"x", declared=1 << 40),
        "bad-json": st_file(b'{"a":{"dtype":"U8","shape":[1],', b"x"),
        "bad-duplicate": st_file(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                 b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
        "bad-overflow": st_file({"a": st_entry("F32", [1 << 40, 1 << 40, 1 << 40], 0, 0)}),
    }
    for name, data in cases.items():
        write(os.path.join(d, "seed-" + name), data)
    words = ["dtype", "shape", "data_offsets", "__metadata__", "format", "pt"] + \
        ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64", "F64", "U64",
         "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"]
    lines = [dict_line(('"%s"' % w).encode()) for w in words]
    lines += [dict_line(b) for b in (b"[0,", b"]}", b'":{', b"18446744073709551615", b"1099511627776", b" ")]
    DICTS["safetensors"] = lines


def main():
    args = [a for a in sys.argv[1:] if a != "--dicts"]
    if len(args) != 1:
        sys.exit(__doc__)
    out = args[0]
    protocol_seeds(out)
    bucket_seeds(out)
    config_seeds(out)
    safetensors_seeds(out)
    if "--dicts" in sys.argv[1:]:
        for target, lines in DICTS.items():
            write(os.path.join(out, target + ".dict"), ("\n".join(lines) + "\n").encode())


if __name__ == "__main__":
    main()
