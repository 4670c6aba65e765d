#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw --metrics gpu__time_duration.sum` log per kernel name and per
step (a step = one launch of the sampling kernel), largest first, with each kernel's mean time
per launch. The window rarely holds whole steps, so a per-layer kernel shows 7.2-7.6 launches
per 8-layer step and its per-step sum moves with the window: compare runs per launch.
Plain python3 (no packages)."""
import csv
import re
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own messages are not CSV rows
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        print("no kernels in", path)
        return
    name_col = next(i for i, h in enumerate(header) if h in ("Kernel Name", "Function Name"))
    time_col = header.index("gpu__time_duration.sum")
    scale = 1.0  # to ns
    for r in reader:
        if len(r) <= max(name_col, time_col):
            continue
        try:
            t = float(r[time_col].replace(",", ""))
        except ValueError:  # the units row
            scale = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6}.get(r[time_col], 1.0)
            continue
        rows.append((r[name_col], t * scale))
    total = defaultdict(float)
    count = defaultdict(int)
    for name, t in rows:
        short = re.sub(r"\(.*", "", name)[:90]
        total[short] += t
        count[short] += 1
    steps = max(1, sum(c for n, c in count.items() if "sample" in n))
    grand = sum(total.values())
    print(f"{len(rows)} kernels, {steps} steps; per step {grand / steps / 1e3:.1f} us of kernel time")
    for n in sorted(total, key=total.get, reverse=True)[:40]:
        print(f"{total[n] / steps / 1e3:9.1f} us/step {count[n] / steps:6.1f} launches/step "
              f"{total[n] / count[n] / 1e3:8.2f} us/launch  {n}")


if __name__ == "__main__":
    main(sys.argv[1])
