#!/usr/bin/env python3
"""Summarise tests/gpu/ab-kernels.sh's log: per case, every variant's times over the rounds.

MoE rows: graph-replay ms of moe_bench (shape, activations, tokens). Engine rows: median step ms
of engine_bench h2880 and, with --model-dir, ckpt (batch, records off/on), and each batch's greedy-token digest (from the
floor lines): the variants must agree there unless the change is meant to alter results.
Standard library only (any python3).
"""
import collections
import re
import sys


def main(path):
    moe = collections.defaultdict(lambda: collections.defaultdict(list))
    eng = collections.defaultdict(lambda: collections.defaultdict(list))
    digests = collections.defaultdict(lambda: collections.defaultdict(set))
    names = []
    kind = name = None
    with open(path) as f:
        for line in f:
            m = re.match(r"== (moe|engine) (\S+)(?: round \d+)?$", line)
            if m:
                kind, name = m.group(1), m.group(2)
                if name not in names:
                    names.append(name)
                continue
            d = re.match(r"(h2880|ckpt)\s+(\d+)\s+\S+\s+floor .*, tokens ([0-9a-f]+)", line)
            if kind == "engine" and d:
                digests[d.group(1) + " batch " + d.group(2)][name].add(d.group(3))
                continue
            fields = line.split()
            if kind == "moe" and len(fields) > 4 and fields[1] in ("bf16", "mxfp8"):
                moe[(fields[0], fields[1], int(fields[2]))][name].append(float(fields[4]))
            elif kind == "engine" and len(fields) > 5 and fields[5].endswith("ms"):
                eng[(fields[0] + " batch " + fields[1], "records " + fields[3])][name].append(float(fields[5][:-2]))
    print("case | " + " | ".join(names) + "   (ms; one figure per round)")
    for table in (moe, eng):
        for case in sorted(table):
            row = table[case]
            cells = ["/".join("%.4f" % x for x in row.get(n, [])) or "-" for n in names]
            print(" ".join(str(c) for c in case) + " | " + " | ".join(cells))
    for case in sorted(digests):
        seen = set().union(*digests[case].values())
        verdict = "the same tokens in every variant and round" if len(seen) == 1 else "TOKENS DIFFER"
        print("%s greedy tokens: %s (%s)" % (case, verdict, ", ".join(
            "%s %s" % (n, "/".join(sorted(digests[case].get(n, [])))) for n in names)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: ab_summary.py AB_LOG")
    main(sys.argv[1])
