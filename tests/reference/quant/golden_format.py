"""The golden file format shared by make_quant_golden.py (NumPy) and make_torch_golden.py
(PyTorch), read by tests/unit/kernels/quant/quant_test_util.hpp.

    b"RDQGOLD1"  u32 record count, then per record (all little-endian):
    u16 name length, name (utf-8)         "<op>/<case>/<field>", e.g. "mxfp4/rand_bf16/blocks"
    u16 dtype length, dtype (utf-8)       "bfloat16" | "float32" | "uint8" | "int32"
    u8 rank, i64 dims[rank]
    u64 byte count, raw bytes (row-major; bfloat16/float32 as their bit patterns)

Ops and fields (the C++ golden test runs every op it finds):
    mxfp4, mxfp8        x, blocks (mxfp4) | q (mxfp8), scales, [dequant_bf16], [dequant_f32]
    fp8_1x128,
    fp8_128x128         x, q, scales (float32), scales_ue8m0 (int32), [dequant_bf16], [dequant_f32]
    mxfp4_layout_plain,
    mxfp4_layout_gate_up,
    mxfp4_layout_concat   x, blocks, scales, kernel_blocks, kernel_scales
Optional fields are in brackets. A case may also carry "note" (uint8 text) for humans.
"""
import struct

import numpy as np

MAGIC = b"RDQGOLD1"


def write_golden(path, records):
    """records: list of (name, dtype, ndarray). Arrays are written as their raw bytes."""
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<I", len(records)))
        for name, dtype, arr in records:
            arr = np.ascontiguousarray(arr)
            nb, db = name.encode(), dtype.encode()
            f.write(struct.pack("<H", len(nb)) + nb)
            f.write(struct.pack("<H", len(db)) + db)
            f.write(struct.pack("<B", arr.ndim))
            f.write(struct.pack("<%dq" % arr.ndim, *arr.shape))
            raw = arr.tobytes()
            f.write(struct.pack("<Q", len(raw)) + raw)
