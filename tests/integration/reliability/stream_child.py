"""A coordinator that dies while its events stream.

    stream_child.py ENDPOINT NUM_REQUESTS MAX_NEW_TOKENS

Submits NUM_REQUESTS streaming requests, reads events until every request has produced
tokens, reports {"streaming": [rids]} and waits to be SIGKILLed without reading more."""
import sys
import time

import rolloutd
from rel_common import say

endpoint, n, max_new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = rolloutd.Client(endpoint, timeout_s=30)
c.hello()
rids = [c.submit([1 + i % 200, 2, 3], max_new_tokens=max_new, temperature=1.0, seed=i, rid=f"gone-{i}")
        for i in range(n)]
seen = set()
deadline = time.monotonic() + 60
while len(seen) < n and time.monotonic() < deadline:
    ev = c.next_event(1.0)
    if isinstance(ev, rolloutd.TokensEvent) and ev.token_ids:
        seen.add(ev.rid)
say(streaming=rids, with_tokens=len(seen))
# Bounded even if the test that should kill it is gone: exit 3 after 10 minutes.
time.sleep(600)
sys.exit(3)
