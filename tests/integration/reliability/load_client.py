"""One load client: keeps OUTSTANDING generate requests in flight on one daemon for
SECONDS, then stops submitting and collects what is left (bounded by DRAIN_S).

    load_client.py ENDPOINT CLIENT_ID OUTSTANDING SECONDS DRAIN_S OUT_JSON

Checks every event against the protocol as it arrives (SPEC §1.1, §4.3, §5, §6): events
only for requests it submitted, exactly one final event per request and nothing after it,
one weight version per token, versions never decreasing within an attempt (a `retracted`
event starts a new attempt and voids the tokens before it; num_tokens_discarded counts
them), routed-expert rows contiguous from routed_experts_start_len, completion_tokens
equal to the tokens of the last attempt. Writes its counts, the violations (first 50) and
its submit latencies (send to generate.ok) to OUT_JSON."""
import json
import random
import sys
import time

import rolloutd

endpoint, cid, outstanding, seconds, drain_s, out_path = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                           float(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
rng = random.Random(cid)
c = rolloutd.Client(endpoint, timeout_s=60)
c.hello()


class Req:
    __slots__ = ("tokens", "last_version", "next_row", "final", "retractions", "routed", "versions_seen")

    def __init__(self, routed):
        self.tokens = 0
        self.last_version = None
        self.next_row = 0
        self.final = None
        self.retractions = 0
        self.routed = routed
        self.versions_seen = set()


reqs = {}
violations = []
submit_latencies = []
counts = {"submitted": 0, "finished": 0, "failed": 0, "events": 0, "tokens": 0, "retracted": 0,
          "version_switches": 0, "rejected": 0}
finish_reasons = {}
in_flight = 0
k = 0


def violation(msg):
    if len(violations) < 50:
        violations.append(msg)


def submit():
    global in_flight, k
    rid = f"load-{cid}-{k}"
    routed = k % 3 == 0
    prompt = [rng.randrange(256) for _ in range(rng.randint(1, 16))]
    t0 = time.perf_counter()
    try:
        c.submit(prompt, rid=rid, max_new_tokens=rng.randint(4, 48), temperature=1.0, seed=k,
                 return_logprob=k % 2 == 0, return_routed_experts=routed)
    except rolloutd.RolloutdError as e:
        counts["rejected"] += 1
        violation(f"{rid} rejected: {e.code} {e}")
        k += 1
        return
    submit_latencies.append(time.perf_counter() - t0)
    reqs[rid] = Req(routed)
    counts["submitted"] += 1
    in_flight += 1
    k += 1


def on_event(ev):
    global in_flight
    counts["events"] += 1
    r = reqs.get(ev.rid)
    if r is None:
        violation(f"event for a request never submitted: {ev.rid}")
        return
    if r.final is not None:
        violation(f"{ev.rid}: {type(ev).__name__} after the final event")
        return
    if isinstance(ev, rolloutd.TokensEvent):
        n = len(ev.token_ids)
        if len(ev.weight_versions) != n:
            violation(f"{ev.rid}: {n} tokens, {len(ev.weight_versions)} versions")
        for v in ev.weight_versions:
            if r.last_version is not None and v < r.last_version:
                violation(f"{ev.rid}: version {v} after {r.last_version} within one attempt")
            if r.last_version is not None and v != r.last_version:
                counts["version_switches"] += 1
            r.last_version = v
        if r.routed:
            rows = ev.routed_experts
            if rows is None:
                violation(f"{ev.rid}: tokens event without routed_experts")
            else:
                if rows.start_pos != r.next_row:
                    violation(f"{ev.rid}: rows start at {rows.start_pos}, expected {r.next_row}")
                r.next_row = rows.start_pos + rows.shape[0]
        r.tokens += n
        counts["tokens"] += n
    elif isinstance(ev, rolloutd.RetractedEvent):
        if ev.num_tokens_discarded != r.tokens:
            violation(f"{ev.rid}: retracted {ev.num_tokens_discarded} tokens, {r.tokens} were delivered")
        r.tokens, r.last_version, r.next_row = 0, None, 0
        r.retractions += 1
        counts["retracted"] += 1
    else:
        r.final = ev
        in_flight -= 1
        if isinstance(ev, rolloutd.FinishedEvent):
            counts["finished"] += 1
            finish_reasons[ev.reason] = finish_reasons.get(ev.reason, 0) + 1
            if ev.completion_tokens != r.tokens:
                violation(f"{ev.rid}: completion_tokens {ev.completion_tokens}, {r.tokens} delivered")
            if ev.reason not in ("stop", "length"):
                violation(f"{ev.rid}: finished {ev.reason}/{ev.abort_reason}")
        else:
            counts["failed"] += 1
            violation(f"{ev.rid}: failed {ev.error.code}: {ev.error.message}")


started = time.monotonic()
end = started + seconds
while time.monotonic() < end:
    while in_flight < outstanding and time.monotonic() < end:
        submit()
    ev = c.next_event(0.5)
    if ev is not None:
        on_event(ev)
submitting_s = time.monotonic() - started
drain_end = time.monotonic() + drain_s
while in_flight > 0 and time.monotonic() < drain_end:
    ev = c.next_event(0.5)
    if ev is not None:
        on_event(ev)
# Anything still arriving now would be a late (duplicate) event: look for a moment.
tail_end = time.monotonic() + 0.5
while time.monotonic() < tail_end:
    ev = c.next_event(0.1)
    if ev is not None:
        on_event(ev)
lost = [rid for rid, r in reqs.items() if r.final is None]
c.close()
with open(out_path, "w") as f:
    json.dump({"client": cid, "endpoint": endpoint, "counts": counts, "finish_reasons": finish_reasons,
               "lost": lost[:50], "num_lost": len(lost), "violations": violations,
               "submitting_s": submitting_s, "total_s": time.monotonic() - started,
               "submit_latencies_s": submit_latencies}, f)
