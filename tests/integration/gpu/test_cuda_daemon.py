"""The daemon on the CUDA backend (label gpu): same greedy tokens and expert records as the
NumPy reference and as the CPU daemon, logits within FP32 tolerance -- with its decode steps
replayed from CUDA graphs (the default on CUDA), and again with graphs off."""
import json
import os

import numpy as np
import pytest


def graphs_status(d):
    code, body = d.get("/v1/status")
    assert code == 200
    return json.loads(body)["cuda_graphs"]


@pytest.mark.parametrize("graphs", ["default", "off"])
def test_cuda_daemon_matches_reference_and_cpu(daemon_factory, graphs):
    golden = json.load(open(os.path.join(os.environ["ROLLOUTD_SOURCE_ROOT"],
                                         "tests/reference/tiny_moe_golden.json")))
    extra = ["--cuda-graph-max-batch", "0"] if graphs == "off" else []
    gpu = daemon_factory(args=["--device", "cuda", "--gpu", "0", *extra])
    cpu = daemon_factory()
    with gpu.client() as g, cpu.client() as c:
        assert g.hello().gpu == 0
        for case in golden["cases"]:
            n = len(case["greedy_tokens"])
            rg = g.generate(case["prompt"], max_new_tokens=n, temperature=0.0, return_routed_experts=True,
                            return_logprob=True)
            rc = c.generate(case["prompt"], max_new_tokens=n, temperature=0.0, return_routed_experts=True,
                            return_logprob=True)
            assert rg.token_ids == case["greedy_tokens"]
            assert rg.routed_experts.to_numpy().tolist() == case["routed_experts"]
            assert rg.token_ids == rc.token_ids
            assert np.allclose(rg.logprobs, rc.logprobs, atol=1e-4)
        # Seeded sampling on one backend is reproducible.
        a = g.generate([1, 2, 3], max_new_tokens=32, temperature=1.0, seed=5)
        b = g.generate([1, 2, 3], max_new_tokens=32, temperature=1.0, seed=5)
        assert a.token_ids == b.token_ids
    st = graphs_status(gpu)
    if graphs == "off":
        assert st["max_batch"] == 0 and st["graphs"] == 0 and st["graph_steps_total"] == 0
    else:
        # Every decode step above was a graph replay (one request: bucket 1); prefills eager.
        assert st["max_batch"] > 0 and st["graphs"] == 2 * st["buckets"] > 0
        assert st["graph_steps_total"] > 0 and st["eager_steps_total"] > 0
    assert graphs_status(cpu)["max_batch"] == 0  # no graphs (nor padding) on the CPU by default
    assert gpu.terminate() == 0
