#!/usr/bin/env python3
"""Per-opcode summary of an Nsight Compute SASS listing (ncu --page source --print-source sass --csv).

For each kernel in the CSV: instructions executed, shared-memory wavefronts (measured, ideal,
excessive) and warp-stall samples, summed per opcode (the SASS mnemonic without its modifiers,
except where --full-opcodes keeps them). The question it answers is where a kernel's shared-memory
excess and its stalls sit, e.g. the decode GEMM's 4x cp.async wavefronts (tests/bench/NOTES.md,
2026-12-07). Standard library only; any python3.

  ncu --section SourceCounters --section WarpStateStats -o rep ...   (on the GPU host)
  ncu --import rep.ncu-rep --page source --print-source sass --csv > sass.csv
  ncu_sass_summary.py sass.csv [--full-opcodes] [--top N]
"""
import argparse
import collections
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def read_listing(path):
    """{kernel name: [row dict]} with each address once (ncu may repeat a listing)."""
    kernels = collections.OrderedDict()
    kernel, header, seen = None, None, set()
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                kernel, header = rec[1], None
                kernels.setdefault(kernel, [])
                continue
            if rec[0] == "Address":
                header = rec
                continue
            if header is None or kernel is None:
                continue
            row = dict(zip(header, rec))
            if (kernel, row.get("Address")) in seen:
                continue
            seen.add((kernel, row.get("Address")))
            kernels[kernel].append(row)
    return kernels


def opcode(source, full):
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op if full else op.split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--full-opcodes", action="store_true", help="keep modifiers (LDGSTS.E.BYPASS.128)")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    kernels = read_listing(args.csv)
    if not kernels:
        sys.exit(f"{args.csv}: no SASS listing found")
    for name, rows in kernels.items():
        instr = collections.Counter()
        wf = collections.defaultdict(lambda: [0.0, 0.0, 0.0])  # measured, ideal, excessive
        stalls = collections.Counter()
        stall_by_op = collections.defaultdict(collections.Counter)
        for r in rows:
            op = opcode(r.get("Source", ""), args.full_opcodes)
            instr[op] += number(r.get("Instructions Executed"))
            w = wf[op]
            w[0] += number(r.get("L1 Wavefronts Shared"))
            w[1] += number(r.get("L1 Wavefronts Shared Ideal"))
            w[2] += number(r.get("L1 Wavefronts Shared Excessive"))
            for key, value in r.items():
                if key.startswith("stall_") and "Not Issued" not in key:
                    stalls[key[6:]] += number(value)
                    stall_by_op[key[6:]][op] += number(value)
        total_instr = sum(instr.values())
        total_samples = sum(stalls.values()) or 1.0
        print(f"## {name}")
        print(f"instructions executed (warp level): {total_instr:,.0f}")
        print("by opcode, % of instructions: " +
              ", ".join(f"{op} {100 * n / total_instr:.1f}" for op, n in instr.most_common(args.top)))
        shared = sorted(((op, w) for op, w in wf.items() if w[0] > 0), key=lambda x: -x[1][0])
        if shared:
            tw = sum(w[0] for _, w in shared)
            te = sum(w[2] for _, w in shared)
            print(f"shared wavefronts: {tw:,.0f}, excessive {te:,.0f} ({100 * te / tw:.0f} %)")
            for op, (m, ideal, ex) in shared[:args.top]:
                per = m / instr[op] if instr[op] else 0.0
                print(f"  {op:24s} measured {m:>14,.0f}  ideal {ideal:>14,.0f}  excessive {ex:>14,.0f}"
                      f"  ({per:.1f} a warp instruction, {m / ideal if ideal else 0:.1f} x ideal)")
        print(f"stall samples: {total_samples:,.0f}: " +
              ", ".join(f"{k} {100 * v / total_samples:.1f} %" for k, v in stalls.most_common(args.top)))
        for reason, _ in stalls.most_common(4):
            top = stall_by_op[reason].most_common(5)
            print(f"  {reason}: " + ", ".join(f"{op} {100 * v / total_samples:.1f} %" for op, v in top))
        print()


if __name__ == "__main__":
    main()
