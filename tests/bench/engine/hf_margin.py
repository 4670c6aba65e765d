#!/usr/bin/env python3
"""Why do rolloutd's greedy tokens part from Hugging Face's? A diagnosis for engine_bench.

The parting position reported is the first where Hugging Face's teacher-forced argmax (its
choice given our tokens as context) differs from our token; with our tokens as context it is
where engine_bench's `first_request_parts_from_peer_at` says the two greedy runs part.

    hf_margin.py --model DIR --bench ENGINE.json --json OUT.json [--batch 1]

Reads request 0's greedy tokens that engine_bench recorded for the checkpoint (`ckpt` runs,
`first_request_tokens`), feeds the prompt plus those tokens to the Hugging Face model in one
teacher-forced forward (FP32, cuda:0) and reports, for every generated position, Hugging Face's
own argmax, the margin between its best and second-best logits, and how far below its best our
token lies. Before the first parting position both runs saw the same context, so at that
position the gap says whether the two runs disagree on a near-tie (a gap about the size of the
numeric difference between them) or on a clear choice (a bug).

It also runs the same forward with the input of every MoE experts module rounded to BF16, then
with the SwiGLU output (`_apply_gate`, the down projection's input) rounded too: that is what
rolloutd's grouped MXFP4 expert kernels do to their GEMM inputs. If the variant picks our token
at the parting position, or moves the gap by about as much, the rounding explains the difference.

Runs on the GPU host (torch + transformers from ../shared/gpu/NOTES.md).
"""
import argparse
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def prompt(vocab):
    # engine_bench's and hf_peer.py's prompt for request 0.
    return [(t * 17 + 1) % vocab for t in range(16)]


def our_tokens(bench, batch):
    for run in bench.get("runs", []):
        if run.get("model") != "ckpt":
            continue
        for b in run.get("batches", []):
            if b.get("batch") == batch and "first_request_tokens" in b:
                return b["first_request_tokens"]
    raise SystemExit(f"no ckpt run with first_request_tokens at batch {batch} in the bench JSON")


def bf16_round_hook(_module, args, kwargs):
    args = list(args)
    if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
        args[0] = args[0].to(torch.bfloat16).to(args[0].dtype)
    elif torch.is_tensor(kwargs.get("hidden_states")):
        h = kwargs["hidden_states"]
        kwargs["hidden_states"] = h.to(torch.bfloat16).to(h.dtype)
    return tuple(args), kwargs


def forward_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits[0].float()


def analyse(logits, ours, start):
    rows = []
    for i, tok in enumerate(ours):
        row = logits[start + i - 1]
        top2 = torch.topk(row, 2)
        best = int(top2.indices[0])
        rows.append({"pos": i, "ours": int(tok), "hf_argmax": best,
                     "hf_margin": float(top2.values[0] - top2.values[1]),
                     "ours_below_best": float(row[best] - row[int(tok)]),
                     "logit_std": float(row.std())})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    with open(a.bench) as f:
        ours = our_tokens(json.load(f), a.batch)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(torch.float32).to("cuda:0").eval()
    p = prompt(model.config.vocab_size)
    ids = torch.tensor([p + ours[:-1]], dtype=torch.long, device="cuda:0")
    fp32 = analyse(forward_logits(model, ids), ours, len(p))
    hooks = [m.register_forward_pre_hook(bf16_round_hook, with_kwargs=True)
             for name, m in model.named_modules() if name.endswith("mlp.experts")]
    bf16 = analyse(forward_logits(model, ids), ours, len(p))
    gated = 0
    for name, m in model.named_modules():
        if name.endswith("mlp.experts") and hasattr(m, "_apply_gate"):
            orig = m._apply_gate
            m._apply_gate = (lambda o: lambda gu: (lambda y: y.to(torch.bfloat16).to(y.dtype))(o(gu)))(orig)
            gated += 1
    bf16_h = analyse(forward_logits(model, ids), ours, len(p)) if gated else None
    for h in hooks:
        h.remove()
    for name, m in model.named_modules():
        if name.endswith("mlp.experts") and "_apply_gate" in vars(m):
            del m._apply_gate  # the instance patch; the class method is back
    part = next((r["pos"] for r in fp32 if r["hf_argmax"] != r["ours"]), -1)
    margins = sorted(r["hf_margin"] for r in fp32)
    summary = {
        "experts_hooked": len(hooks),
        "parts_at": part,
        "median_hf_margin": margins[len(margins) // 2],
        "min_hf_margin": margins[0],
        "at_parting": fp32[part] if part >= 0 else None,
        "bf16_experts_at_parting": bf16[part] if part >= 0 else None,
        "bf16_experts_parts_at": next((r["pos"] for r in bf16 if r["hf_argmax"] != r["ours"]), -1),
        "gates_hooked": gated,
        "bf16_experts_and_swiglu_at_parting": bf16_h[part] if (bf16_h and part >= 0) else None,
        "bf16_experts_and_swiglu_parts_at":
            next((r["pos"] for r in bf16_h if r["hf_argmax"] != r["ours"]), -1) if bf16_h else None,
    }
    print(json.dumps(summary, indent=1), file=sys.stderr)
    with open(a.json, "w") as f:
        json.dump({"summary": summary, "fp32": fp32, "bf16_experts": bf16, "bf16_experts_and_swiglu": bf16_h}, f)


if __name__ == "__main__":
    main()
