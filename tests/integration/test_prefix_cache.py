"""--prefix-cache on real daemons: the n samples of one prompt reuse its KV (and the routed-expert
records of its reused positions) and get what a daemon without the cache gives them; the cache is
reported in /v1/status and /metrics and dropped when the weights may change."""
import json

import rolloutd


def _generate(c, prompt, seed):
    r = c.generate(prompt, max_new_tokens=10, temperature=0.8 if seed else 0.0, seed=seed,
                   return_logprob=True, return_routed_experts=True)
    assert r.ok
    return r.token_ids, r.routed_experts.to_numpy().tolist(), r.logprobs


def test_a_prompts_samples_reuse_its_kv_and_match_an_uncached_daemon(daemon_factory):
    cached = daemon_factory()  # on by default
    plain = daemon_factory(["--no-prefix-cache"])
    prompt = [(7 * i + 3) % 250 for i in range(40)]  # 2 whole blocks of 16 reusable, then 8 tokens
    with cached.client() as cc, plain.client() as cp:
        for seed in range(4):  # a GRPO group, one sample after the other
            a, b = _generate(cc, prompt, seed), _generate(cp, prompt, seed)
            assert a[0] == b[0], seed
            assert a[1] == b[1], seed  # records of every position, the reused ones from the cache
            assert all(abs(x - y) < 1e-4 for x, y in zip(a[2], b[2])), seed
        st = json.loads(cached.get("/v1/status")[1])
        assert st["prefix_cache"]["hit_tokens_total"] == 3 * 32
        assert st["prefix_cache"]["queried_tokens_total"] == 4 * 39
        assert st["kv_blocks"]["cached"] >= 2
        assert cached.metric("rolloutd_prefix_cache_hit_tokens_total") == 3 * 32
        assert json.loads(plain.get("/v1/status")[1])["prefix_cache"]["hit_tokens_total"] == 0
        # A weight-update session (even an empty one) drops the cache: the next sample computes
        # the whole prompt again, and the same tokens come out (the weights did not change).
        s = cc.begin_weight_update().session
        cc.end_weight_update(s, 1)
        assert _generate(cc, prompt, 0)[:2] == _generate(cp, prompt, 0)[:2]
        assert json.loads(cached.get("/v1/status")[1])["prefix_cache"]["hit_tokens_total"] == 3 * 32
    assert cached.terminate() == 0
    config = cached.log_lines()[0]
    assert config.get("prefix_cache") is True, config
