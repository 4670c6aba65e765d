"""A trainer that dies in the middle of a weight session.

    trainer_child.py ENDPOINT VIA TIMEOUT_S SHM_NAME

Opens a session with idle deadline TIMEOUT_S, writes one bucket (the first layer and the
final norm of the seed-4242 weights) inline or through POSIX shm object SHM_NAME, reports
{"wrote": session} and then waits to be SIGKILLed (it never ends the session)."""
import sys
import time
import zlib

import rolloutd
from rel_common import numpy_weights, say

endpoint, via, timeout_s, shm_name = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
weights = numpy_weights(4242)
part = [(n, w) for n, w in weights.items() if n.startswith("model.layers.0.") or n == "model.norm.weight"]
c = rolloutd.Client(endpoint, timeout_s=30)
c.hello()
session = c.begin_weight_update(timeout_s=timeout_s).session
entries, data = rolloutd.weights.pack_bucket(part)
if via == "inline":
    c.update_weights_inline(session, entries, data, checksum=zlib.crc32(data))
else:
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(name=shm_name, create=True, size=len(data))
    shm.buf[:len(data)] = data
    c.update_weights_shm(session, entries, "/" + shm_name, 0, len(data), checksum=zlib.crc32(data))
    # Killed before close/unlink: the object outlives the trainer, as it would in production.
say(wrote=session, entries=len(entries), bytes=len(data))
# Bounded even if the test that should kill it is gone: exit 3 after 10 minutes.
time.sleep(600)
sys.exit(3)
