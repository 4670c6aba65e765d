#!/usr/bin/env python3
"""Reads `nsys stats -r cuda_gpu_trace -f csv` of moe_bench (one case) and prints, for the last
graph replays (the kernels after the last host-side gap longer than 20 us are one replay; the
bench replays back to back), each kernel's median duration and the median gap from the end of the
kernel before it to its start (negative: overlap, as with programmatic dependent launch), and
the replay's median span. Plain python3 (no packages)."""
import csv
import statistics
import sys


def main(path: str) -> None:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        print("no rows in", path)
        return
    start_k = next(k for k in rows[0] if k.startswith("Start"))
    dur_k = next(k for k in rows[0] if k.startswith("Duration"))
    name_k = "Name"
    kern = [(int(r[start_k]), int(r[dur_k]), r[name_k]) for r in rows
            if r.get(name_k) and "memcpy" not in r[name_k].lower() and "memset" not in r[name_k].lower()]
    kern.sort()
    # Split into groups at host gaps > 20 us between one kernel's end and the next's start.
    groups, cur = [], []
    for s, d, n in kern:
        if cur and s - (cur[-1][0] + cur[-1][1]) > 20_000:
            groups.append(cur)
            cur = []
        cur.append((s, d, n))
    if cur:
        groups.append(cur)
    # The replays: the most common launch count among the last groups.
    tail = groups[-40:]
    size = statistics.mode(len(g) for g in tail)
    reps = [g for g in tail if len(g) == size][-20:]
    print(f"{len(reps)} replays of {size} kernels (ns; gap = start - end of the previous kernel)")
    spans = [g[-1][0] + g[-1][1] - g[0][0] for g in reps]
    for i in range(size):
        name = reps[0][i][2][:90]
        d = statistics.median(g[i][1] for g in reps)
        gap = statistics.median(g[i][0] - (g[i - 1][0] + g[i - 1][1]) for g in reps) if i else 0
        print(f"{i:3d} {d:9.0f} {gap:9.0f}  {name}")
    print("the last 24 kernels as traced (start offset, duration, name):")
    t0 = kern[max(0, len(kern) - 24)][0]
    for s, d, n in kern[-24:]:
        print(f"  {s - t0:9d} {d:8d}  {n[:80]}")
    print(f"span median {statistics.median(spans):.0f} ns, sum of durations "
          f"{statistics.median(sum(k[1] for k in g) for g in reps):.0f} ns")


if __name__ == "__main__":
    main(sys.argv[1])
