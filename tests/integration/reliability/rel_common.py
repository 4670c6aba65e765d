"""Shared by the reliability tests and their child processes."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "reference"))
import tiny_moe_reference as ref  # noqa: E402  (tests/reference)


def numpy_weights(seed):
    """The embedded model's parameters as the NumPy reference builds them from `seed`
    (checkpoint names, FP32): a daemon that takes them serves exactly --model-seed seed."""
    old = ref.SEED
    ref.SEED = seed
    try:
        return ref.build_weights(ref.CONFIG)
    finally:
        ref.SEED = old


def say(**msg):
    """One JSON line to the parent (Child.expect reads them)."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()
