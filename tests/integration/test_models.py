"""`--model DIR`: daemons serving Hugging Face checkpoints written by `rolloutctl make-test-model`.

The contract from issue 6: the names a checkpoint holds are the names update_weights takes, and
an update with the checkpoint's own tensors leaves bit-identical parameters (equal CRC-32s, equal
greedy tokens and routed experts). Bad checkpoints stop the daemon at start-up (exit 2) with a
log line naming the tensor; a --model that is not a directory is a usage error (exit 64).
"""
import json
import os
import struct
import subprocess
import tempfile

import pytest

from conftest import BIN

ROLLOUTCTL = os.environ.get("ROLLOUTCTL_BIN", "rolloutctl")
SMALL = ["--layers", "2", "--hidden", "64", "--experts", "8", "--top-k", "2", "--heads", "4",
         "--kv-heads", "2", "--head-dim", "16", "--intermediate", "32", "--vocab", "128"]
DTYPES = {"BF16": "bfloat16", "F32": "float32"}


def make_model(out, seed, family="qwen3_moe", extra=(), small=SMALL):
    r = subprocess.run([ROLLOUTCTL, "make-test-model", "--family", family, *small, *extra, "--seed", str(seed),
                        "--out", out], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["out"] == out
    return out


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} -- a reader independent of the daemon's."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {name: (DTYPES[e["dtype"]], e["shape"], data[base + e["data_offsets"][0]:base + e["data_offsets"][1]])
            for name, e in header.items()}


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, b) in tensors.items():
        st = {v: k for k, v in DTYPES.items()}[dtype]
        header[name] = {"dtype": st, "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.fixture(scope="module")
def models():
    d = tempfile.mkdtemp(prefix="rolloutd-models-")
    return {"a": make_model(os.path.join(d, "a"), 1), "b": make_model(os.path.join(d, "b"), 2), "root": d,
            # gpt_oss with a window of 4 on its sliding layers: every generation below outgrows it.
            "oss-a": make_model(os.path.join(d, "oss-a"), 1, "gpt_oss", ("--sliding-window", "4")),
            "oss-b": make_model(os.path.join(d, "oss-b"), 2, "gpt_oss", ("--sliding-window", "4"))}


def greedy(c, prompt=(3, 1, 4, 1, 5, 9, 2, 6), n=12):
    r = c.generate(list(prompt), max_new_tokens=n, temperature=0.0, return_logprob=True,
                   return_routed_experts=True)
    return r.token_ids, r.routed_experts.data


@pytest.mark.parametrize("family,a_key,b_key", [("qwen3_moe", "a", "b"), ("gpt_oss", "oss-a", "oss-b")])
def test_serves_a_checkpoint_and_an_update_with_its_tensors_is_bit_identical(daemon_factory, models, family,
                                                                               a_key, b_key):
    a = daemon_factory(["--model", models[a_key]])
    b = daemon_factory(["--model", models[b_key]])
    with a.client() as ca, b.client() as cb:
        hello = ca.hello()
        assert hello.model.family == family
        assert hello.model.num_experts == 8 and hello.model.top_k == 2 and hello.model.num_layers == 2
        tokens_a, experts_a = greedy(ca)
        assert len(tokens_a) == 12
        sums_a = ca.weights_checksum()
        assert greedy(cb) != (tokens_a, experts_a)  # another seed: other weights
        tensors = read_safetensors(os.path.join(models[a_key], "model.safetensors"))
        reply = cb.push_weights([(name, dtype, shape, data) for name, (dtype, shape, data) in tensors.items()],
                                weight_version=3, bucket_bytes=64 << 10)
        assert reply.num_entries == len(tensors)
        sums_b = cb.weights_checksum()
        assert sums_b.model_checksum == sums_a.model_checksum
        assert dict((p.name, p.checksum) for p in sums_b.parameters) == \
            dict((p.name, p.checksum) for p in sums_a.parameters)
        assert greedy(cb) == (tokens_a, experts_a)
    assert a.terminate() == 0
    assert b.terminate() == 0
    ready = [l for l in a.log_lines() if l.get("msg") == "model ready"]
    assert ready and ready[0]["family"] == family and ready[0]["checkpoint_size_bytes"] > 0


def test_qwen3_moe_with_mxfp4_experts_serves_and_an_update_with_its_tensors_changes_nothing(daemon_factory,
                                                                                             models):
    """--quantize-experts mxfp4: the checkpoint's BF16 per-expert tensors are quantized on load into
    `<name>_blocks` / `<name>_scales`; pushing the same tensors again (quantized on arrival) leaves
    every checksum as it was, and brings a daemon of other weights to the same parameters."""
    a = daemon_factory(["--model", models["a"], "--quantize-experts", "mxfp4"])
    b = daemon_factory(["--model", models["b"], "--quantize-experts", "mxfp4"])
    plain = daemon_factory(["--model", models["a"]])
    tensors = read_safetensors(os.path.join(models["a"], "model.safetensors"))
    entries = [(name, dtype, shape, data) for name, (dtype, shape, data) in tensors.items()]
    with a.client() as ca, b.client() as cb, plain.client() as cp:
        tokens_a, experts_a = greedy(ca)
        assert len(tokens_a) == 12
        sums_a = ca.weights_checksum()
        names = {p.name for p in sums_a.parameters}
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
        assert "model.layers.1.mlp.experts.down_proj_scales" in names
        assert "model.layers.0.mlp.experts.gate_up_proj" not in names  # no FP32 copy of the experts
        ca.push_weights(entries, weight_version=2, bucket_bytes=64 << 10)
        again = ca.weights_checksum()
        assert again.model_checksum == sums_a.model_checksum
        assert greedy(ca) == (tokens_a, experts_a)
        assert greedy(cb) != (tokens_a, experts_a)  # another seed: other weights
        cb.push_weights(entries, weight_version=3, bucket_bytes=64 << 10)
        assert cb.weights_checksum().model_checksum == sums_a.model_checksum
        assert greedy(cb) == (tokens_a, experts_a)
        # Quantization changes the model: the unquantized daemon's tokens are reported, not compared.
        tokens_p, _ = greedy(cp)
        print(f"MXFP4 vs unquantized experts: {sum(x == y for x, y in zip(tokens_a, tokens_p))} of "
              f"{len(tokens_a)} greedy tokens agree")
    assert a.terminate() == 0
    config = a.log_lines()[0]
    assert config.get("quantize_experts") == "mxfp4", config
    ready = [l for l in a.log_lines() if l.get("msg") == "model ready"]
    assert ready and ready[0]["experts"] == "mxfp4"


def test_gpt_oss_bf16_experts_quantize_on_load_and_on_arrival_to_the_published_blocks(daemon_factory, models):
    """transformers keeps gpt-oss's BF16 experts input-major ([E, hidden, 2 * intermediate]). With
    --quantize-experts mxfp4 they are transposed back and quantized on load, and a daemon serving an
    MXFP4 checkpoint takes them in update_weights the same way: both equal a daemon on the MXFP4
    checkpoint that make-test-model writes from the same BF16 values (blocks and scales as OpenAI
    publishes them), in checksums, greedy tokens and routed experts."""
    root, window = models["root"], ("--sliding-window", "4")
    mx_a = make_model(os.path.join(root, "oss-a-mx"), 1, "gpt_oss", (*window, "--experts-mxfp4"))
    mx_b = make_model(os.path.join(root, "oss-b-mx"), 2, "gpt_oss", (*window, "--experts-mxfp4"))
    published = daemon_factory(["--model", mx_a])
    quantized = daemon_factory(["--model", models["oss-a"], "--quantize-experts", "mxfp4"])
    other = daemon_factory(["--model", mx_b])
    tensors = read_safetensors(os.path.join(models["oss-a"], "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"][:2] == ("bfloat16", [8, 64, 64])
    entries = [(name, dtype, shape, data) for name, (dtype, shape, data) in tensors.items()]
    with published.client() as cp, quantized.client() as cq, other.client() as co:
        want = cp.weights_checksum()
        names = {p.name for p in want.parameters}
        assert "model.layers.1.mlp.experts.down_proj_blocks" in names
        assert "model.layers.1.mlp.experts.down_proj" not in names  # no BF16 copy of the experts
        ref = greedy(cp)
        assert cq.weights_checksum().model_checksum == want.model_checksum
        assert greedy(cq) == ref
        assert greedy(co) != ref  # another seed: other weights
        co.push_weights(entries, weight_version=3, bucket_bytes=64 << 10)
        got = co.weights_checksum()
        assert dict((p.name, p.checksum) for p in got.parameters) == \
            dict((p.name, p.checksum) for p in want.parameters)
        assert greedy(co) == ref
    assert quantized.terminate() == 0
    ready = [l for l in quantized.log_lines() if l.get("msg") == "model ready"]
    assert ready and ready[0]["experts"] == "mxfp4"


@pytest.mark.parametrize("model,intermediate,field,words", [
    # The MXFP4 block is 32 values along the expert's input.
    ("qwen-i16", "16", "moe_intermediate_size", "multiple of 32"),
])
def test_quantize_experts_refusals_exit_2_naming_the_field(models, model, intermediate, field, words):
    small = [intermediate if i > 0 and SMALL[i - 1] == "--intermediate" else a for i, a in enumerate(SMALL)]
    d = models.get(model) or make_model(os.path.join(models["root"], model), 1, small=small)
    rc, out = start_fails(["--model", d, "--quantize-experts", "mxfp4"])
    assert rc == 2, out
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    failed = [l for l in lines if l.get("msg") == "model load failed"]
    assert failed and failed[0]["tensor"] == field, out
    assert words in failed[0]["error"], out
    # The embedded model is not a checkpoint: a usage error.
    rc, out = start_fails(["--quantize-experts", "mxfp4"])
    assert rc == 64 and "checkpoint directory" in out, out


def test_gpt_oss_request_alone_equals_it_inside_a_busy_chunked_batch(daemon_factory, models):
    """Sliding windows, sinks and the rest under continuous batching: a greedy request alone on an
    idle daemon returns the same tokens, routed experts and log-probs as inside a batch of other
    lengths whose prompts are split into chunks (--max-step-tokens 8) and mixed with decodes."""
    import threading
    import numpy as np
    alone = daemon_factory(["--model", models["oss-a"]])
    busy = daemon_factory(["--model", models["oss-a"], "--max-step-tokens", "8"])
    prompt = [5, 9, 2, 77, 31, 64, 8, 100, 3, 12, 41]  # longer than a step and than the window
    kw = dict(max_new_tokens=20, temperature=0.0, return_logprob=True, return_routed_experts=True)
    with alone.client() as c:
        ref = c.generate(prompt, **kw)
    results, others = {}, [[1 + i, 7, 3 * i + 2] * (i + 1) for i in range(5)]

    def one(key, p, n):
        with busy.client() as c:
            results[key] = c.generate(p, **{**kw, "max_new_tokens": n})

    threads = [threading.Thread(target=one, args=(i, p, 20 + 3 * i)) for i, p in enumerate(others)]
    threads.append(threading.Thread(target=one, args=("target", prompt, 20)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    got = results["target"]
    assert got.token_ids == ref.token_ids
    assert got.routed_experts.data == ref.routed_experts.data
    assert np.allclose(got.logprobs, ref.logprobs, atol=1e-4)
    assert all(len(results[i].token_ids) == 20 + 3 * i for i in range(len(others)))


def test_sharded_checkpoint_serves_the_same_model(daemon_factory, models):
    tensors = read_safetensors(os.path.join(models["a"], "model.safetensors"))
    d = os.path.join(models["root"], "sharded")
    os.makedirs(d)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, part in shards.items():
        write_safetensors(os.path.join(d, shard), {n: tensors[n] for n in part})
        weight_map.update({n: shard for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(len(t[2]) for t in tensors.values())}, "weight_map": weight_map}, f)
    with open(os.path.join(models["a"], "config.json")) as src, open(os.path.join(d, "config.json"), "w") as dst:
        dst.write(src.read())
    a = daemon_factory(["--model", models["a"]])
    s = daemon_factory(["--model", d])
    with a.client() as ca, s.client() as cs:
        assert cs.weights_checksum().model_checksum == ca.weights_checksum().model_checksum
        assert greedy(cs) == greedy(ca)


def start_fails(args):
    r = subprocess.run([BIN, "--control-port", "0", "--http-port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("edit,tensor", [
    ("drop", "model.layers.1.mlp.experts.5.up_proj.weight"),
    ("extra", "model.layers.0.mlp.shared_expert.down_proj.weight"),
    ("reshape", "model.layers.0.self_attn.k_norm.weight"),
])
def test_bad_checkpoint_exits_2_naming_the_tensor(models, edit, tensor):
    tensors = read_safetensors(os.path.join(models["a"], "model.safetensors"))
    if edit == "drop":
        del tensors[tensor]
    elif edit == "extra":
        tensors[tensor] = ("bfloat16", [64, 32], bytes(64 * 32 * 2))
    else:
        dtype, shape, data = tensors[tensor]
        tensors[tensor] = (dtype, [shape[0] // 2, 2], data)
    d = os.path.join(models["root"], "bad-" + edit)
    os.makedirs(d)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    with open(os.path.join(models["a"], "config.json")) as src, open(os.path.join(d, "config.json"), "w") as dst:
        dst.write(src.read())
    rc, out = start_fails(["--model", d])
    assert rc == 2, out
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    failed = [l for l in lines if l.get("msg") == "model load failed"]
    assert failed and failed[0]["tensor"] == tensor, out
    assert tensor in failed[0]["error"]


def test_truncated_file_and_unsupported_family_exit_2(models):
    d = os.path.join(models["root"], "truncated")
    os.makedirs(d)
    with open(os.path.join(models["a"], "model.safetensors"), "rb") as f:
        data = f.read()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(data[:-10])
    with open(os.path.join(models["a"], "config.json")) as src, open(os.path.join(d, "config.json"), "w") as dst:
        dst.write(src.read())
    rc, out = start_fails(["--model", d])
    assert rc == 2 and "past the data section" in out, out

    d = os.path.join(models["root"], "llama")
    os.makedirs(d)
    with open(os.path.join(models["a"], "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"] = "llama"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(models["a"], "model.safetensors"), "rb") as src, \
            open(os.path.join(d, "model.safetensors"), "wb") as dst:
        dst.write(src.read())
    rc, out = start_fails(["--model", d])
    assert rc == 2 and "model_type 'llama' is not supported" in out, out


def test_model_that_is_not_a_directory_is_a_usage_error(models):
    rc, out = start_fails(["--model", os.path.join(models["root"], "nope")])
    assert rc == 64, out
    assert "checkpoint directory" in out


def test_sliding_kv_pool_gives_the_same_rollouts_and_frees_the_window_layers_blocks(daemon_factory, models):
    """--sliding-kv-pool (gpt_oss, window 4, blocks of 4): the window layers' KV in a pool of its
    own. The same greedy tokens, records and log-probs as one pool, in a chunked busy batch; the
    pool reported in /v1/status and /metrics and empty again when the requests end; a KV budget
    pays for it, then holds more full-attention blocks than it held blocks of every layer."""
    import threading
    budget = ["--kv-cache-bytes", str(1 << 20), "--kv-block-size", "4", "--max-blocks-per-seq", "64"]
    pool = daemon_factory(["--model", models["oss-a"], "--max-step-tokens", "8", "--sliding-kv-pool", *budget])
    # One pool, and no prefix cache either (the pool turns the default cache off): one difference.
    plain = daemon_factory(["--model", models["oss-a"], "--max-step-tokens", "8", "--no-prefix-cache", *budget])
    kw = dict(temperature=0.0, return_logprob=True, return_routed_experts=True)
    prompts = [[(5 * i + 3 * j + 1) % 120 for j in range(3 + 7 * i)] for i in range(5)]
    results = {}

    def one(d, i):
        with d.client() as c:
            results[(d.control_port, i)] = c.generate(prompts[i], max_new_tokens=30 + i, **kw)

    for d in (pool, plain):
        threads = [threading.Thread(target=one, args=(d, i)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    for i in range(len(prompts)):
        a, b = results[(pool.control_port, i)], results[(plain.control_port, i)]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30 + i, i
        assert a.routed_experts.data == b.routed_experts.data, i
        assert all(abs(x - y) < 1e-4 for x, y in zip(a.logprobs, b.logprobs)), i
    st, st_plain = (json.loads(d.get("/v1/status")[1])["kv_blocks"] for d in (pool, plain))
    assert st["sliding"]["total"] > 0 and st["sliding"]["free"] == st["sliding"]["total"], st
    assert st_plain["sliding"]["total"] == 0, st_plain
    assert st["total"] > st_plain["total"], (st, st_plain)  # one of two layers' blocks from the rest of the budget
    assert pool.metric("rolloutd_kv_blocks", pool="sliding", state="free") == st["sliding"]["total"]
    assert pool.metric("rolloutd_kv_blocks", pool="full", state="free") == st["total"]
    assert json.loads(pool.get("/v1/status")[1])["prefix_cache"]["enabled"] is False
    assert pool.terminate() == 0
    assert pool.log_lines()[0].get("sliding_kv_pool") is True


def test_sliding_kv_pool_refusals_and_models_without_windows(daemon_factory, models):
    # An invalid configuration: a usage error, before any model is read.
    rc, out = start_fails(["--model", models["oss-a"], "--sliding-kv-pool", "--prefix-cache"])
    assert rc == 64 and "field=sliding_kv_pool" in out and "--prefix-cache" in out, out
    # Too small a budget for the pool (it grows with --max-running and --max-step-tokens).
    rc, out = start_fails(["--model", models["oss-a"], "--sliding-kv-pool", "--kv-cache-bytes", "4096"])
    assert rc == 2 and "sliding-window pool" in out, out
    # qwen3_moe has no sliding layers: the flag changes nothing (the default prefix cache stays
    # on), and says so.
    d = daemon_factory(["--model", models["a"], "--sliding-kv-pool"])
    st = json.loads(d.get("/v1/status")[1])
    assert st["kv_blocks"]["sliding"]["total"] == 0 and st["prefix_cache"]["enabled"] is True, st
    assert d.terminate() == 0
    assert any("no sliding-window layers" in l.get("msg", "") and l.get("prefix_cache") is True
               for l in d.log_lines())
