"""rolloutctl (daemon/rolloutctl) against a scripted fake daemon: JSON out, typed errors, exit codes."""
import json
import os
import pathlib
import subprocess

import pytest

from rolloutd.messages import (AbortRequest, ContinueGenerationReply, ContinueGenerationRequest, ErrorInfo,
                               FinishedEvent, GenerateReply, GetWeightsByNameReply, GetWeightsByNameRequest,
                               HelloReply, ModelInfo, ParameterChecksum, PauseGenerationReply, PauseGenerationRequest,
                               RetractedEvent, RoutedExperts, StatusReply, StatusRequest, TokensEvent,
                               WeightsChecksumReply, WeightsChecksumRequest)

ROLLOUTCTL = os.environ.get("ROLLOUTCTL_BIN") or str(
    pathlib.Path(os.environ.get("ROLLOUTD_BUILD_DIR", "build")) / "daemon" / "rolloutctl" / "rolloutctl")
pytestmark = pytest.mark.skipif(not os.path.exists(ROLLOUTCTL), reason=f"no rolloutctl at {ROLLOUTCTL}")


def rolloutctl(*args, env=None):
    return subprocess.run([ROLLOUTCTL, *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def test_hello_prints_json(daemon):
    def script(d):
        m = d.recv()
        assert m.body.client == "rolloutctl"
        d.send(m.id, HelloReply(build="b", model=ModelInfo(name="tiny-moe", top_k=2)))

    peer = daemon(script)
    # The endpoint from the environment, as launch scripts set it.
    out = rolloutctl("hello", env={"ROLLOUTD_ENDPOINT": peer.endpoint})
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert list(reply) == ["version", "daemon", "build", "gpu", "model", "weight_version", "limits"]
    assert reply["model"]["name"] == "tiny-moe" and reply["limits"]["max_frames"] == 16


def test_generate_prints_collected_result(daemon):
    def script(d):
        m = d.recv()
        req = m.body
        assert (req.rid, req.input_ids, req.max_new_tokens, req.seed, req.stop_token_ids) == ("r1", [1, 2, 3], 2, 5,
                                                                                            [9, 8])
        assert (req.temperature, req.return_logprob, req.return_routed_experts, req.stream) == (0.0, True, True, False)
        d.send(m.id, GenerateReply("r1"))
        d.send(m.id, TokensEvent("r1", [10, 11], [-0.25, -1.5], [4, 4],
                                 RoutedExperts("uint16", (2, 1, 2), 2, bytes([1, 0, 0, 1, 3, 0, 255, 255]))))
        d.send(m.id, FinishedEvent("r1", "length", "", 3, 2))

    peer = daemon(script)
    out = rolloutctl("--endpoint", peer.endpoint, "generate", "--input-ids", "1,2,3", "--max-new-tokens", "2",
                     "--temperature", "0", "--seed", "5", "--stop-ids", "9,8", "--logprobs", "--routed-experts",
                     "--no-stream", "--rid", "r1")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["rid"], r["token_ids"], r["logprobs"], r["weight_versions"]) == ("r1", [10, 11], [-0.25, -1.5], [4, 4])
    assert (r["finish_reason"], r["prompt_tokens"], r["completion_tokens"]) == ("length", 3, 2)
    assert r["routed_experts"] == {"dtype": "uint16", "shape": [2, 1, 2], "start_pos": 2,
                                   "ids": [[[1, 256]], [[3, 65535]]]}


def test_generate_prints_top_logprobs_per_token(daemon):
    def script(d):
        m = d.recv()
        assert m.body.top_logprobs_num == 2
        d.send(m.id, GenerateReply("r3"))
        d.send(m.id, TokensEvent("r3", [10, 11], [], [4, 4], None, 2, [10, 3, 11, 10], [-0.5, -1.0, -0.25, -2.0]))
        d.send(m.id, FinishedEvent("r3", "length", "", 1, 2))

    peer = daemon(script)
    out = rolloutctl("--endpoint", peer.endpoint, "generate", "--input-ids", "1", "--rid", "r3", "--top-logprobs", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["top_logprobs"] == [[[10, -0.5], [3, -1.0]], [[11, -0.25], [10, -2.0]]]
    assert rolloutctl("generate", "--input-ids", "1", "--top-logprobs", "21").returncode == 64


def test_generate_passes_a_deadline_and_prints_its_abort(daemon):
    def script(d):
        m = d.recv()
        assert m.body.deadline_s == 2.5
        d.send(m.id, GenerateReply("r4"))
        d.send(m.id, TokensEvent("r4", [10], [], [0]))
        d.send(m.id, FinishedEvent("r4", "abort", "deadline", 1, 1))

    peer = daemon(script)
    out = rolloutctl("--endpoint", peer.endpoint, "generate", "--input-ids", "1", "--rid", "r4", "--deadline-s", "2.5")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["finish_reason"], r["abort_reason"], r["token_ids"]) == ("abort", "deadline", [10])
    assert rolloutctl("generate", "--input-ids", "1", "--deadline-s", "-1").returncode == 64


def test_generate_reports_only_the_attempt_after_a_retraction(daemon):
    def script(d):
        m = d.recv()
        d.send(m.id, GenerateReply("r2"))
        d.send(m.id, TokensEvent("r2", [10], [], [4]))
        d.send(m.id, RetractedEvent("r2", 1, "weight_update"))
        d.send(m.id, TokensEvent("r2", [12, 13], [], [5, 5]))
        d.send(m.id, FinishedEvent("r2", "length", "", 1, 2))

    peer = daemon(script)
    out = rolloutctl("--endpoint", peer.endpoint, "generate", "--input-ids", "1", "--rid", "r2")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["token_ids"], r["weight_versions"], r["num_retractions"]) == ([12, 13], [5, 5], 1)


def serve_one(daemon, request, reply):
    """A fake daemon for one rolloutctl run (one connection): expects `request`, answers `reply`."""
    def script(d):
        m = d.recv()
        assert m.body == request
        d.send(m.id, reply)

    return daemon(script).endpoint


def test_weights_checksum(daemon):
    params = [ParameterChecksum("a", "float32", [2], 1), ParameterChecksum("b.weight", "bfloat16", [], 2)]
    endpoint = serve_one(daemon, WeightsChecksumRequest(["a", "b.weight"]),
                         WeightsChecksumReply("crc32", 7, 0xFFFFFFFF, params))
    out = rolloutctl("--endpoint", endpoint, "weights-checksum", "--names", "a,b.weight")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert list(r) == ["algo", "weight_version", "model_checksum", "parameters"]
    assert r["model_checksum"] == 0xFFFFFFFF
    assert r["parameters"][1] == {"name": "b.weight", "dtype": "bfloat16", "shape": [], "checksum": 2}
    endpoint = serve_one(daemon, WeightsChecksumRequest(None), WeightsChecksumReply("crc32", 7, 3, []))
    out = rolloutctl("--endpoint", endpoint, "weights-checksum")
    assert out.returncode == 0 and json.loads(out.stdout)["parameters"] == []


def test_get_weights(daemon):
    endpoint = serve_one(daemon, GetWeightsByNameRequest("model.norm.weight", 2),
                         GetWeightsByNameReply("model.norm.weight", "bfloat16", [4], [1.5, float("nan")]))
    out = rolloutctl("--endpoint", endpoint, "get-weights", "--name", "model.norm.weight", "--truncate", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [4],
                                      "values": [1.5, None]}  # NaN has no JSON number


def test_pause_continue_and_status(daemon):
    endpoint = serve_one(daemon, PauseGenerationRequest("in_place"), PauseGenerationReply(0, 0, 2))
    out = rolloutctl("--endpoint", endpoint, "pause", "--mode", "in_place")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"num_aborted": 0, "num_retracted": 0, "num_paused": 2}
    endpoint = serve_one(daemon, StatusRequest(), StatusReply(state="ready", ready=True, paused=True,
                                                              update_session=3))
    st = json.loads(rolloutctl("--endpoint", endpoint, "status").stdout)
    assert (st["paused"], st["update_session"]) == (True, 3)
    endpoint = serve_one(daemon, ContinueGenerationRequest(), ContinueGenerationReply(2))
    out = rolloutctl("--endpoint", endpoint, "continue")
    assert out.returncode == 0 and json.loads(out.stdout) == {"num_resumed": 2}


def test_error_reply_goes_to_stderr_with_exit_2(daemon):
    def script(d):
        m = d.recv()
        assert m.body == AbortRequest(rid="gone")
        d.send(m.id, ErrorInfo("draining", "shutting down", ""))

    peer = daemon(script)
    out = rolloutctl("--endpoint", peer.endpoint, "abort", "--rid", "gone")
    assert out.returncode == 2 and out.stdout == ""
    assert json.loads(out.stderr) == {"error": {"code": "draining", "message": "shutting down", "field": ""}}


def test_usage_errors_exit_64():
    assert rolloutctl().returncode == 64
    assert rolloutctl("generate").returncode == 64  # --input-ids is required
    assert rolloutctl("abort", "--rid", "x", "--all").returncode == 64
    assert rolloutctl("generate", "--input-ids", "1,x").returncode == 64
    assert rolloutctl("pause").returncode == 64  # --mode is required
    assert rolloutctl("pause", "--mode", "drain").returncode == 64
    assert rolloutctl("get-weights").returncode == 64  # --name is required
    assert rolloutctl("get-weights", "--name", "w", "--truncate", "1000001").returncode == 64
    assert rolloutctl("--help").returncode == 0


def test_unreachable_daemon_exits_2():
    out = rolloutctl("--endpoint", "tcp://127.0.0.1:1", "--timeout-s", "0.2", "status")
    assert out.returncode == 2
    assert json.loads(out.stderr)["error"]["code"] == "unavailable"
