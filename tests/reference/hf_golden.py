#!/usr/bin/env python3
"""Golden outputs of Hugging Face transformers for `rolloutctl make-test-model` checkpoints
(qwen3_moe, gpt_oss).

    hf_golden.py CHECKPOINT_DIR OUT.json [CHECKPOINT_DIR OUT.json ...]

Runs on the GPU host (transformers 5.17, torch 2.11; see ../shared/gpu/NOTES.md), on its CPU in
float32 with eager attention, so the numbers are the reference for rolloutd's FP32 CPU path:

  - prompt_logits: the logits of every prompt position, [T, vocab];
  - greedy: the greedy continuation of 32 tokens (generate, do_sample=False);
  - routed_experts: each prompt token's top-k expert ids per MoE layer (from the routers'
    logits, bias included for gpt_oss, ascending ids per token), [T, layers, top_k];
  - checkpoint_crc32: zlib.crc32 of model.safetensors, so the C++ test (hf_fidelity_test.cpp)
    can regenerate the checkpoint with make-test-model and know it is the same file.

Goldens here (checked by tests/unit/core/model/hf_fidelity_test.cpp; tests/gpu/hf-model-goldens.sh
holds the make-test-model recipe of each): hf_qwen3_moe_golden.json, hf_qwen3_moe_dense_golden.json,
hf_gpt_oss_golden.json, hf_gpt_oss_sw8_golden.json (window 8) and hf_gpt_oss_mxfp4_golden.json
(MXFP4 experts).

The checkpoint is loaded with from_pretrained (transformers fuses the per-expert tensors on
load). If transformers reports missing or unexpected keys, the script stops: the golden is only
meaningful when transformers read every tensor rolloutd reads.
"""
import json
import os
import sys
import zlib

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5, 200, 33]
NEW_TOKENS = 32


def golden(ckpt, out):
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(ckpt)
    model, info = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    print("loading info:", {k: (list(v)[:8] if v else v) for k, v in info.items()}, flush=True)
    if bad:
        sys.exit(f"transformers did not read the checkpoint whole: {bad}")
    # transformers dequantizes MXFP4 experts to bfloat16 whatever dtype is asked for; the values
    # are exact in FP32, so casting the model keeps them and computes everything in float32.
    model = model.float().eval()
    ids = torch.tensor([PROMPT])
    # Router logits from the routers' inputs (a hook on each `mlp.gate`), whatever the router
    # module returns in this transformers version.
    captured = []
    gates = [m for n, m in model.named_modules()
             if n.endswith("mlp.gate") or n.endswith("mlp.router") or type(m).__name__.endswith("Router")]
    assert gates, [(n, type(m).__name__) for n, m in model.named_modules() if "mlp" in n]
    print("routers:", [(n, type(m).__name__) for n, m in model.named_modules() if any(m is g for g in gates)])
    hooks = [g.register_forward_hook(lambda mod, inp, out: captured.append(
        torch.nn.functional.linear(inp[0].reshape(-1, inp[0].shape[-1]).float(), mod.weight.float(),
                                   None if getattr(mod, "bias", None) is None else mod.bias.float()))) for g in gates]
    with torch.no_grad():
        o = model(ids)
        for h in hooks:
            h.remove()
        logits = o.logits[0].float()
        routed = []
        for layer_logits in captured:  # one [T, E] per MoE layer, in layer order
            top = torch.topk(layer_logits, cfg.num_experts_per_tok, dim=-1).indices
            routed.append(torch.sort(top, dim=-1).values)
        routed = torch.stack(routed, dim=1)  # [T, layers, k]
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                             eos_token_id=None, pad_token_id=0)
    greedy = gen[0, len(PROMPT):].tolist()
    top2 = torch.topk(logits, 2, dim=-1).values
    with open(os.path.join(ckpt, "model.safetensors"), "rb") as f:
        crc = zlib.crc32(f.read())
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    golden = {
        "generator": "tests/reference/hf_golden.py",
        "model_type": config["model_type"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "make_test_model": config.get("rolloutd_test_model", {}),
        "spec": {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "num_local_experts",
                                        "num_experts_per_tok", "num_attention_heads", "num_key_value_heads",
                                        "head_dim", "moe_intermediate_size", "intermediate_size", "vocab_size",
                                        "dtype", "mlp_only_layers", "decoder_sparse_step", "sliding_window")
                 if k in config and config[k] is not None},
        "checkpoint_crc32": crc,
        # make-test-model --experts-mxfp4: the experts are MXFP4 blocks/scales (transformers
        # dequantizes them on load).
        "experts_mxfp4": config.get("quantization_config", {}).get("quant_method") == "mxfp4",
        "prompt": PROMPT,
        "prompt_logits": [[float(x) for x in row] for row in logits.tolist()],
        "min_top2_gap": float((top2[:, 0] - top2[:, 1]).min()),
        "routed_experts": routed.tolist(),
        "greedy": greedy,
    }
    with open(out, "w") as f:
        json.dump(golden, f)
    print("greedy:", greedy)
    print("wrote", out, os.path.getsize(out), "bytes")


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2:
        sys.exit(__doc__)
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    failed = 0
    for ckpt, out in zip(args[::2], args[1::2]):
        try:
            golden(ckpt, out)
        except Exception as e:  # one checkpoint's failure must not cost the others' goldens
            failed += 1
            print(f"FAILED {ckpt}: {type(e).__name__}: {e}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
