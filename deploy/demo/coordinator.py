#!/usr/bin/python3
"""A small coordinator: sends a few rollout requests to every daemon, prints the
generated token ids, their log-probs and the routed-expert records.

Runs under Debian's /usr/bin/python3 (python3-msgpack, python3-numpy) with the
built package on PYTHONPATH (deploy/run-demo.sh sets it).

    coordinator.py ENDPOINT [ENDPOINT ...]
"""
import sys

import rolloutd


def main(endpoints):
    clients = [rolloutd.Client(ep, timeout_s=60.0) for ep in endpoints]
    for ep, c in zip(endpoints, clients):
        info = c.hello()
        m = info.model
        print(f"{ep}: {info.daemon} {info.build}; model {m.name} "
              f"({m.num_moe_layers} MoE layers, {m.num_experts} experts, top-{m.top_k}), "
              f"weight version {info.weight_version}")

    prompts = [[1, 2, 3, 4, 5], [17, 42, 99], [200, 13, 7, 7, 7, 7, 250]]
    # Submit everything first (all daemons work concurrently), then collect.
    pending = []
    for i, prompt in enumerate(prompts):
        for d, c in enumerate(clients):
            rid = c.submit(prompt, max_new_tokens=8, temperature=0.8, top_p=0.95, seed=1000 + i,
                           return_logprob=True, return_routed_experts=True)
            pending.append((d, i, c, rid))
    for d, i, c, rid in pending:
        r = c.collect(rid, timeout_s=60.0)
        print(f"\n[daemon {d}] request {rid} prompt={prompts[i]} -> {r.finish_reason}")
        print(f"  token_ids: {r.token_ids}")
        print("  logprobs:  [" + ", ".join(f"{x:.3f}" for x in r.logprobs) + "]")
        print(f"  weight_versions: {r.weight_versions}")
        re = r.routed_experts
        if re is not None:
            print(f"  routed_experts: dtype={re.dtype} shape={tuple(re.shape)} start_pos={re.start_pos}")
            arr = re.to_numpy()
            for t in range(min(3, arr.shape[0])):
                print(f"    position {re.start_pos + t}: " +
                      " | ".join(" ".join(str(int(e)) for e in arr[t, l]) for l in range(arr.shape[1])))
    for c in clients:
        c.close()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
