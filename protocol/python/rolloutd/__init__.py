"""Python client of rolloutd, the rollout daemon for RL on MoE language models.

    from rolloutd import Client
    with Client("tcp://127.0.0.1:7600") as c:
        print(c.hello().model)
        r = c.generate([1, 2, 3], max_new_tokens=8, return_logprob=True, return_routed_experts=True)
        print(r.token_ids, r.logprobs, r.routed_experts.shape)

The transport is the project's C++ client (rolloutd._native, pybind11): no pyzmq needed.
"""
from .client import DEFAULT_ENDPOINT, Client, GenerateResult
from .messages import (PROTOCOL_VERSION, AbortReply, ErrorInfo, FailedEvent, FinishedEvent, GenerateRequest,
                       HelloReply, Limits, ModelInfo, RolloutdError, RoutedExperts, ShutdownReply, StatusReply,
                       TokensEvent)

__all__ = ["Client", "GenerateResult", "DEFAULT_ENDPOINT", "PROTOCOL_VERSION", "RolloutdError", "ErrorInfo",
           "TokensEvent", "FinishedEvent", "FailedEvent", "RoutedExperts", "GenerateRequest", "HelloReply",
           "StatusReply", "AbortReply", "ShutdownReply", "ModelInfo", "Limits"]
