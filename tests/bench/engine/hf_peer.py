#!/usr/bin/env python3
"""Same-run peer of tests/bench/engine/engine_bench.cpp: Hugging Face `generate` on the same
checkpoint (a `rolloutctl make-test-model` directory), greedy, the same prompts (16 tokens,
ids (i * 131 + t * 17 + 1) % vocab for request i), at each batch size.

    hf_peer.py --model DIR --batches 1,32,256 --new-tokens 64 --json OUT.json [--dtype float32]
               [--prefill R,L]

Runs on the GPU host (torch + transformers from ../shared/gpu/NOTES.md), on cuda:0, in the
checkpoint's float32 unless told otherwise (rolloutd's decoder computes in FP32). Decode
throughput is (batch * (new_tokens - 1)) / (t(new_tokens) - t(1)): the prefill and the first
token cost the same in both runs, so the difference is the decode steps alone. Writes
{"batches": {"B": {"decode_tokens_per_s", "step_ms", "first_tokens"}}} where first_tokens are
request 0's greedy tokens (the C++ bench reports whether its own match), and
{"prefill": {"requests", "prompt_len", "tokens_per_s", "ms"}}: one forward of R prompts of L
tokens (request i's token t is (i * 131 + t * 17 + 1) % vocab, as in engine_bench --prefill),
logits of the last position only, best of three after a warm-up (default 8,512; 0 to skip).
"""
import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def prompts(batch, vocab):
    return [[(i * 131 + t * 17 + 1) % vocab for t in range(16)] for i in range(batch)]


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", required=True)
    ap.add_argument("--prefill", default="8,512")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    # .to(dtype): transformers dequantizes MXFP4 experts to bfloat16 whatever dtype is asked for.
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dtype).to("cuda:0").eval()
    vocab = model.config.vocab_size
    result = {"model": a.model, "dtype": a.dtype, "new_tokens": a.new_tokens, "torch": torch.__version__,
              "batches": {}}
    import transformers
    result["transformers"] = transformers.__version__
    with torch.inference_mode():
        for b in [int(x) for x in a.batches.split(",") if x]:
            ids = torch.tensor(prompts(b, vocab), dtype=torch.long, device="cuda:0")
            timed_generate(model, ids, 2)  # warm-up
            t1 = min(timed_generate(model, ids, 1)[0] for _ in range(2))
            tn, out = timed_generate(model, ids, a.new_tokens)
            tn = min(tn, timed_generate(model, ids, a.new_tokens)[0])
            decode_s = max(tn - t1, 1e-9)
            result["batches"][str(b)] = {
                "decode_tokens_per_s": b * (a.new_tokens - 1) / decode_s,
                "step_ms": decode_s / (a.new_tokens - 1) * 1e3,
                "first_tokens": out[0, 16:].tolist(),
            }
            print(f"hf peer batch {b}: {result['batches'][str(b)]['decode_tokens_per_s']:.0f} decode tok/s, "
                  f"{result['batches'][str(b)]['step_ms']:.2f} ms/step", file=sys.stderr)
        pf = [int(x) for x in a.prefill.split(",") if x]
        if len(pf) == 2 and pf[0] > 0 and pf[1] > 0:
            r, n = pf
            ids = torch.tensor([[(i * 131 + t * 17 + 1) % vocab for t in range(n)] for i in range(r)],
                               dtype=torch.long, device="cuda:0")
            best = None
            for i in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if i > 0:
                    best = dt if best is None else min(best, dt)
            result["prefill"] = {"requests": r, "prompt_len": n, "tokens_per_s": r * n / best, "ms": best * 1e3}
            print(f"hf peer prefill {r} x {n}: {r * n / best:.0f} tok/s ({best * 1e3:.2f} ms)", file=sys.stderr)
    with open(a.json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
