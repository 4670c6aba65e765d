#!/usr/bin/env python3
"""Goldens from the Hugging Face transformers MoE blocks (gpt_oss, qwen3_moe, deepseek_v3,
deepseek_v4 routed and hash-routed) for kernels/moe/ and core/moe/layer/.

Run on the GPU host (torch 2.11, transformers 5.17; CPU float32 is enough, no GPU needed):
    python3 tests/reference/moe/make_hf_moe_golden.py
It writes tests/reference/moe/hf_moe_golden.rdqg (format: tests/reference/quant/golden_format.py,
about 0.6 MB), read by tests/unit/core/moe_layer/moe_layer_hf_golden_test.cpp (which skips with a
message until the file exists).

Each family's MoE block is built from a tiny random config, its parameters set from
(a) MXFP4-exact expert weights (random E2M1 codes and E8M0 scales: one golden serves the bf16
and the MXFP4 weight formats, since those values are exact in both), (b) float32 router
weights and biases. The block runs fixed float32 inputs on the CPU; the router's ids and weights
are taken from the experts module's inputs (a forward pre-hook), the block output from its
return value.

Self-checks before writing (any failure aborts with a message):
- moe_numpy_ref.py (the independent NumPy implementation the CI goldens come from) must
  reproduce every block: ids equal (as sets where the reference calls torch.topk with
  sorted=False: DeepSeek-V3/V4), weights and outputs within 1e-4;
- every token's selection keeps a margin of 1e-4 (relative) between the k-th and (k+1)-th
  values (rows are redrawn until it does), so the goldens never hinge on an ulp of a backend.
DeepSeek-V3 quirk: Hugging Face fills unselected groups with 0.0 (not -inf) before the final
top-k; our router (like DeepSeek's reference and vLLM/SGLang) excludes them outright. The two
differ only when fewer than top_k allowed experts have a positive biased score; the NumPy
check would catch such a row, and the positive sigmoid scores here never produce one.

Records per case (prefix "hf/<case>/"): cfg_i int32 [family, router_kind, act_kind,
shared_act_kind, gate_up_order, H, I, E, K, n_group, topk_group, num_shared, shared_I, vocab,
renormalize, router_bias, correction_bias, expert_bias, ids_ordered, hash_score], cfg_f float32
[limit, alpha, routed_scaling_factor, shared_limit, shared_alpha], x [T,H], [token_ids [T] i32],
router [E,H], [router_bias [E]], [correction_bias [E]], [tid2eid [V,K] i32], gate_up_blocks
[E,2I,H/32,16] u8 + gate_up_scales (checkpoint layout, rows in gate_up_order), down_blocks +
down_scales, [gate_up_bias [E,2I], down_bias [E,H]], [shared_gate_up_blocks [S,2Is,H/32,16] +
shared_gate_up_scales (concatenated), shared_down_blocks + shared_down_scales], ids [T,K] i32,
weights [T,K], out [T,H]. Plus "meta/note" (uint8 text: versions).
"""
import argparse
import importlib
import os
import sys
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "quant"))
import moe_numpy_ref as ref  # noqa: E402
from golden_format import write_golden  # noqa: E402

torch = transformers = AutoConfig = None  # imported in main() unless --numpy-only

T = 16
FAMILY = {"gpt_oss": 0, "qwen3_moe": 1, "deepseek_v3": 2, "deepseek_v4": 3}
MIN_MARGIN = 1e-4


def make_config(family, **kw):
    """AutoConfig.for_model, dropping keyword arguments a strict config refuses."""
    kw = dict(kw)
    for _ in range(len(kw) + 1):
        try:
            return AutoConfig.for_model(family, **kw)
        except (TypeError, ValueError) as e:
            bad = [k for k in kw if k in str(e)]
            if not bad:
                raise
            print(f"  {family}: dropping {bad[0]} ({e})")
            kw.pop(bad[0])
    raise RuntimeError(f"cannot build a {family} config")


def eager(cfg):
    for attr in ("_experts_implementation", "experts_implementation"):
        try:
            setattr(cfg, attr, "eager")
        except Exception:  # noqa: BLE001 (a read-only property on some versions)
            pass
    return cfg


def build_block(family, cfg, layer_idx, class_names):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for name in class_names:
        cls = getattr(mod, name, None)
        if cls is None:
            continue
        for args in ((cfg, layer_idx), (cfg,)):
            try:
                return cls(*args)
            except TypeError:
                continue
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.model.layers[layer_idx].mlp


def tensor_of(module, dotted):
    obj = module
    for part in dotted.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


class Assigner:
    """Sets parameters and buffers by name, checking shapes; remembers what it set."""

    def __init__(self, module):
        self.module = module
        self.done = set()
        with torch.no_grad():
            for _, p in list(module.named_parameters()) + list(module.named_buffers()):
                p.zero_()

    def has(self, name):
        try:
            tensor_of(self.module, name)
            return True
        except (AttributeError, IndexError):
            return False

    def set(self, name, arr, transposed=None):
        """transposed: an [E, a, b] array that HF may store as [E, b, a] (x @ W layout)."""
        t = tensor_of(self.module, name)
        arr = np.asarray(arr)
        if tuple(t.shape) != arr.shape and transposed is not None:
            arr = np.ascontiguousarray(np.swapaxes(arr, -1, -2))
        if tuple(t.shape) != arr.shape:
            raise SystemExit(f"{name}: HF shape {tuple(t.shape)} vs ours {arr.shape}")
        with torch.no_grad():
            t.copy_(torch.from_numpy(np.ascontiguousarray(arr)).to(t.dtype))
        self.done.add(name)

    def check_complete(self):
        names = [n for n, _ in self.module.named_parameters()]
        missing = [n for n in names if n not in self.done]
        if missing:
            raise SystemExit(f"parameters not set (layout changed?): {missing}")


def set_experts(a, prefix, gu, dn, order_hf):
    """gu [E, 2I, H] in checkpoint `order_hf`, dn [E, H, I] (float32 values)."""
    if a.has(prefix + ".gate_up_proj"):
        t = tensor_of(a.module, prefix + ".gate_up_proj")
        e, two_i, h = gu.shape
        # [E, 2I, H] (transformers 5 default) or [E, H, 2I] (x @ W, gpt-oss); ambiguous only when
        # H == 2I, which these configs avoid.
        transposed = tuple(t.shape) == (e, h, two_i) and h != two_i
        a.set(prefix + ".gate_up_proj", np.swapaxes(gu, 1, 2) if transposed else gu)
        a.set(prefix + ".down_proj", np.swapaxes(dn, 1, 2) if transposed else dn)
        return
    inter = gu.shape[1] // 2
    gr, ur = ref.gate_up_rows(inter, order_hf)
    for e in range(gu.shape[0]):  # a ModuleList of MLPs (older transformers)
        a.set(f"{prefix}.{e}.gate_proj.weight", gu[e][gr])
        a.set(f"{prefix}.{e}.up_proj.weight", gu[e][ur])
        a.set(f"{prefix}.{e}.down_proj.weight", dn[e])


def set_mlp(a, prefix, gu, dn):
    """A dense MLP (shared experts): gu [2Is, H] concatenated, dn [H, Is]."""
    inter = gu.shape[0] // 2
    a.set(prefix + ".gate_proj.weight", gu[:inter])
    a.set(prefix + ".up_proj.weight", gu[inter:])
    a.set(prefix + ".down_proj.weight", dn)


def extract_routing(tensors, t, k, e):
    """(ids [T,K] int64, weights [T,K] float32) from whatever tensors the hook saw."""
    flat = [x for x in tensors if isinstance(x, torch.Tensor)]
    ids = next((x for x in flat if not x.is_floating_point() and tuple(x.reshape(t, -1).shape) == (t, k)), None)
    if ids is None:
        return None
    ids = ids.reshape(t, k)
    w = next((x for x in flat if x.is_floating_point() and x.numel() == t * k), None)
    if w is not None:
        return ids.long(), w.reshape(t, k).float()
    w = next((x for x in flat if x.is_floating_point() and x.numel() == t * e), None)
    if w is None:
        return None
    return ids.long(), w.reshape(t, e).gather(1, ids.long()).float()


def run_block(block, x, token_ids, k, e):
    seen = {}

    def pre_hook(_mod, args, kwargs):
        got = extract_routing(list(args) + list(kwargs.values()), x.shape[0], k, e)
        if got is not None and "routing" not in seen:
            seen["routing"] = got

    def gate_hook(_mod, _args, out):
        outs = out if isinstance(out, tuple) else (out,)
        got = extract_routing(list(outs), x.shape[0], k, e)
        if got is not None and "gate" not in seen:
            seen["gate"] = got

    hooks = []
    experts = getattr(block, "experts", None)
    if isinstance(experts, torch.nn.Module):
        hooks.append(experts.register_forward_pre_hook(pre_hook, with_kwargs=True))
    gate = getattr(block, "gate", None) or getattr(block, "router", None)
    if gate is not None:
        hooks.append(gate.register_forward_hook(gate_hook))
    with torch.no_grad():
        xt = torch.from_numpy(x)[None]
        out = block(xt, input_ids=torch.from_numpy(token_ids.astype(np.int64))[None]) \
            if token_ids is not None else block(xt)
    for h in hooks:
        h.remove()
    out = out[0] if isinstance(out, tuple) else out
    routing = seen.get("routing") or seen.get("gate")
    if routing is None:
        raise SystemExit("could not capture the router's ids and weights")
    return out.reshape(x.shape).float().numpy(), routing[0].numpy(), routing[1].numpy()


def numpy_block(c, x, token_ids, routed_act, shared_act):
    """The whole block with moe_numpy_ref.py: (out, ids, weights, min margin)."""
    logits = ref.f32(x.astype(np.float64) @ c["router"].astype(np.float64).T)
    ids = np.zeros((x.shape[0], c["K"]), np.int64)
    w = np.zeros((x.shape[0], c["K"]), np.float32)
    margins = []
    for r in range(x.shape[0]):
        i, wr, m = ref.route_token(c["kind"], logits[r], c["K"], c.get("router_bias"),
                                   c.get("correction_bias"), c["renormalize"], c["scale"],
                                   c["n_group"], c["topk_group"],
                                   None if token_ids is None else token_ids[r], c.get("tid2eid"),
                                   "sqrt_softplus")
        ids[r], w[r] = i, wr
        margins.append(m)
    l2p = np.arange(c["E"])
    out = ref.experts(x, ids, w, l2p, c["gu"], c["dn"], routed_act, c["limit"], c["alpha"], "f32",
                      c["order"], c.get("gate_up_bias"), c.get("down_bias"))
    if c["S"] > 0:
        s = c["S"]
        sh = ref.experts(x, np.tile(np.arange(s), (x.shape[0], 1)), np.ones((x.shape[0], s), np.float32),
                         np.arange(s), c["sgu"], c["sdn"], shared_act, c["limit"], c["alpha"], "f32",
                         "concat")
        out = ref.f32(out.astype(np.float64) + sh)
    return out, ids, w, np.array(margins)


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


def same_routing(ids_a, w_a, ids_b, w_b, ordered):
    for r in range(ids_a.shape[0]):
        ia, ib = ids_a[r], ids_b[r]
        wa, wb = w_a[r], w_b[r]
        if not ordered:
            oa, ob = np.argsort(ia), np.argsort(ib)
            ia, ib, wa, wb = ia[oa], ib[ob], wa[oa], wb[ob]
        if not np.array_equal(ia, ib) or not np.allclose(wa, wb, rtol=1e-4, atol=1e-6):
            return r
    return -1


def family_case(rng, name, family, *, e, k, h, inter, x_scale, kind, act, order, classes, cfg_kw,
                layer_idx=0, n_group=1, topk_group=1, renormalize=True, scale=1.0, limit=7.0,
                alpha=1.702, router_bias=False, correction=False, expert_bias=False, shared=0,
                shared_inter=0, vocab=0, shared_acts=("swiglu",), ordered=True, numpy_only=False):
    print(f"{name}: {'numpy only' if numpy_only else 'building ' + family}")
    block = None
    if not numpy_only:
        cfg = eager(make_config(family, **cfg_kw))
        block = eager_block(build_block(family, cfg, layer_idx, classes))
        block.eval()
        if shared:  # the block's own shared-expert width (moe_intermediate * n_shared or not)
            shared_inter = tensor_of(block, "shared_experts.gate_proj.weight").shape[0]
    c = {"kind": kind, "E": e, "K": k, "n_group": n_group, "topk_group": topk_group,
         "renormalize": renormalize, "scale": scale, "limit": limit, "alpha": alpha, "order": order,
         "S": 0}
    sig_w = 2.0 / (x_scale * np.sqrt(h))
    c["router"] = ref.f32(rng.normal(0, sig_w, (e, h)))
    gu_b, gu_s, c["gu"] = ref.random_mxfp4(rng, (e, 2 * inter, h), -7, -5)
    dn_b, dn_s, c["dn"] = ref.random_mxfp4(rng, (e, h, inter), -7, -5)
    if router_bias:
        c["router_bias"] = ref.f32(rng.normal(0, 0.5, e))
    if correction:
        c["correction_bias"] = ref.f32(rng.normal(0, 0.05, e))
    if kind == "hash":
        c["tid2eid"] = np.stack([rng.permutation(e)[:k] for _ in range(vocab)]).astype(np.int64)
    if expert_bias:
        c["gate_up_bias"] = ref.f32(rng.normal(0, 0.5, (e, 2 * inter)))
        c["down_bias"] = ref.f32(rng.normal(0, 0.5, (e, h)))
    if shared:
        c["S"], c["sI"] = 1, shared_inter
        sgu_b, sgu_s, c["sgu"] = ref.random_mxfp4(rng, (1, 2 * shared_inter, h), -7, -5)
        sdn_b, sdn_s, c["sdn"] = ref.random_mxfp4(rng, (1, h, shared_inter), -7, -5)

    if block is not None:
        a = Assigner(block)
        gate = "router" if a.has("router.weight") and not a.has("gate.weight") else "gate"
        a.set(gate + ".weight", c["router"])
        if router_bias:
            a.set(gate + ".bias", c["router_bias"])
        if correction:
            a.set(gate + ".e_score_correction_bias", c["correction_bias"])
        if kind == "hash":
            a.set(gate + ".tid2eid", c["tid2eid"])
        set_experts(a, "experts", c["gu"], c["dn"], order)
        if expert_bias:
            a.set("experts.gate_up_proj_bias", c["gate_up_bias"])
            a.set("experts.down_proj_bias", c["down_bias"])
        if shared:
            set_mlp(a, "shared_experts", c["sgu"][0], c["sdn"][0])
        a.check_complete()

    x = ref.f32(rng.normal(0, x_scale, (T, h)))
    token_ids = rng.integers(0, vocab, T).astype(np.int32) if kind == "hash" else None
    for attempt in range(60):
        verdicts = []
        if block is None:  # --numpy-only: the NumPy block stands in for Hugging Face
            n_out, n_ids, n_w, margins = numpy_block(c, x, token_ids, act, shared_acts[0])
            out, ids, w = n_out, n_ids, n_w
            verdicts.append((shared_acts[0], 0.0, -1, margins))
        else:
            out, ids, w = run_block(block, x, token_ids, k, e)
            for sact in shared_acts:
                n_out, n_ids, n_w, margins = numpy_block(c, x, token_ids, act, sact)
                verdicts.append((sact, rel(out, n_out), same_routing(ids, w, n_ids, n_w, ordered), margins))
        sact, err, bad_row, margins = min(verdicts, key=lambda v: v[1])
        weak = np.nonzero(margins <= MIN_MARGIN)[0]
        if len(weak) == 0 and bad_row < 0 and err < 1e-4:
            break
        redraw = set(weak.tolist()) | ({bad_row} if bad_row >= 0 else set())
        print(f"  attempt {attempt}: numpy rel err {err:.2e}, routing mismatch row {bad_row}, "
              f"{len(weak)} weak margins; redrawing rows {sorted(redraw)}")
        if not redraw:
            raise SystemExit(f"{name}: Hugging Face and moe_numpy_ref.py disagree (rel err {err:.2e})")
        for r in redraw:
            x[r] = ref.f32(rng.normal(0, x_scale, h))
    else:
        raise SystemExit(f"{name}: no clean golden after 60 attempts")
    print(f"  ok: numpy vs HF rel err {err:.2e}, shared activation {sact if shared else '-'}")

    router_kind = ref.ROUTER[kind]
    cfg_i = np.array([FAMILY[family], router_kind, ref.ACT[act], ref.ACT[sact], ref.ORDER[order], h,
                      inter, e, k, n_group, topk_group, c["S"], c.get("sI", 0), vocab,
                      int(renormalize), int(router_bias), int(correction), int(expert_bias),
                      int(ordered), ref.SCORE["sqrt_softplus"]], dtype=np.int32)
    cfg_f = np.array([limit, alpha, scale, limit, alpha], dtype=np.float32)
    p = f"hf/{name}/"
    recs = [(p + "cfg_i", "int32", cfg_i), (p + "cfg_f", "float32", cfg_f), (p + "x", "float32", x),
            (p + "router", "float32", c["router"]),
            (p + "gate_up_blocks", "uint8", gu_b), (p + "gate_up_scales", "uint8", gu_s),
            (p + "down_blocks", "uint8", dn_b), (p + "down_scales", "uint8", dn_s),
            (p + "ids", "int32", np.asarray(ids).astype(np.int32)),
            (p + "weights", "float32", ref.f32(w)), (p + "out", "float32", ref.f32(out))]
    if token_ids is not None:
        recs += [(p + "token_ids", "int32", token_ids), (p + "tid2eid", "int32", c["tid2eid"].astype(np.int32))]
    if router_bias:
        recs.append((p + "router_bias", "float32", c["router_bias"]))
    if correction:
        recs.append((p + "correction_bias", "float32", c["correction_bias"]))
    if expert_bias:
        recs += [(p + "gate_up_bias", "float32", c["gate_up_bias"]), (p + "down_bias", "float32", c["down_bias"])]
    if shared:
        recs += [(p + "shared_gate_up_blocks", "uint8", sgu_b), (p + "shared_gate_up_scales", "uint8", sgu_s),
                 (p + "shared_down_blocks", "uint8", sdn_b), (p + "shared_down_scales", "uint8", sdn_s)]
    return recs


def eager_block(block):
    """The reference (eager) expert loop, whatever implementation the config would dispatch to:
    set the config switch where it can be set, and bind the undecorated forward of any
    @use_experts_implementation class (functools.wraps keeps it as __wrapped__)."""
    for m in block.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None:
            eager(cfg)
        orig = getattr(type(m).forward, "__wrapped__", None)
        if orig is not None and type(m).__name__.endswith("Experts"):
            m.forward = types.MethodType(orig, m)
    return block


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "hf_moe_golden.rdqg"))
    ap.add_argument("--numpy-only", action="store_true",
                    help="no torch/transformers: write the NumPy block's outputs instead (a stand-in "
                         "file to exercise the C++ golden test; never commit it as the golden)")
    args = ap.parse_args()
    global torch, transformers, AutoConfig
    if not args.numpy_only:
        import torch as _torch
        import transformers as _transformers
        torch, transformers, AutoConfig = _torch, _transformers, _transformers.AutoConfig
        torch.manual_seed(0)
        torch.set_num_threads(4)
    only = dict(numpy_only=args.numpy_only)
    rng = np.random.default_rng(20260531)
    attn = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                vocab_size=64)
    recs = []
    # H != 2I everywhere, so the [E, H, 2I] (x @ W, gpt-oss) and [E, 2I, H] layouts cannot be
    # confused: gpt-oss H 192, the others H 64 with I 64.
    recs += family_case(rng, "gpt_oss", "gpt_oss", e=8, k=2, h=192, inter=64, x_scale=5.0,
                        kind="topk_softmax", act="gpt_oss_swiglu", order="interleaved",
                        classes=["GptOssMLP"], router_bias=True, expert_bias=True,
                        cfg_kw=dict(attn, hidden_size=192, intermediate_size=64,
                                    num_local_experts=8, num_experts_per_tok=2), **only)
    recs += family_case(rng, "qwen3_moe", "qwen3_moe", e=8, k=2, h=64, inter=64, x_scale=1.0,
                        kind="softmax_topk", act="swiglu", order="concat",
                        classes=["Qwen3MoeSparseMoeBlock"],
                        cfg_kw=dict(attn, hidden_size=64, intermediate_size=256,
                                    moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
                        **only)
    recs += family_case(rng, "deepseek_v3", "deepseek_v3", e=16, k=4, h=64, inter=64, x_scale=1.0,
                        kind="sigmoid_grouped_topk", act="swiglu", order="concat",
                        classes=["DeepseekV3MoE", "DeepseekV3SparseMoeBlock"], n_group=4,
                        topk_group=2, scale=2.5, correction=True, shared=1, shared_inter=64,
                        ordered=False, **only,
                        cfg_kw=dict(hidden_size=64, intermediate_size=256, moe_intermediate_size=64,
                                    n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                                    n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                    norm_topk_prob=True, first_k_dense_replace=0,
                                    num_hidden_layers=1, vocab_size=64))
    v4 = dict(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
              num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=10.0,
              scoring_func="sqrtsoftplus", num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"],
              vocab_size=64)
    # V4's shared MLP clamps with swiglu_limit in the versions read; the NumPy check picks the
    # variant that reproduces the block (clamped first) and records it.
    for name, layer, kind in (("deepseek_v4", 1, "sqrt_softplus_topk"), ("deepseek_v4_hash", 0, "hash")):
        recs += family_case(rng, name, "deepseek_v4", e=8, k=2, h=64, inter=64, x_scale=12.0,
                            kind=kind, act="clamped_swiglu", order="concat",
                            classes=["DeepseekV4SparseMoeBlock", "DeepseekV4MoE"], layer_idx=layer,
                            scale=1.5, limit=10.0, correction=kind != "hash", shared=1, shared_inter=64,
                            vocab=64 if kind == "hash" else 0, ordered=kind == "hash",
                            shared_acts=("clamped_swiglu", "swiglu"), cfg_kw=v4, **only)
    note = ("NUMPY STAND-IN, not Hugging Face" if args.numpy_only else
            f"transformers {transformers.__version__}, torch {torch.__version__}") + f", numpy {np.__version__}"
    recs.append(("meta/note", "uint8", np.frombuffer(note.encode(), dtype=np.uint8)))
    write_golden(args.out, recs)
    print(f"wrote {len(recs)} records, {os.path.getsize(args.out)} bytes to {args.out} ({note})")


if __name__ == "__main__":
    main()
