"""Python client of rolloutd, the rollout daemon for RL on MoE language models.

    from rolloutd import Client
    with Client("tcp://127.0.0.1:7600") as c:
        print(c.hello().model)
        r = c.generate([1, 2, 3], max_new_tokens=8, return_logprob=True, return_routed_experts=True)
        print(r.token_ids, r.logprobs, r.routed_experts.shape)
        c.pause_generation("retract")
        c.push_weights(state_dict.items(), weight_version=1)  # begin, buckets, end
        c.continue_generation()

Many daemons at once: rolloutd.Coordinator (coordinator.py) spreads rollouts, fans their events
into one stream, fans weight updates out, and accounts for the requests of a daemon that dies.

The transport is the project's C++ client (rolloutd._native, pybind11): no pyzmq needed.
"""
from .client import DEFAULT_ENDPOINT, Client, GenerateResult, WeightsChecksums
from .coordinator import (Coordinator, DaemonEndpoint, DaemonHealth, FleetWeightSession, FleetWeightUpdate,
                          load_endpoints)
from .messages import (PROTOCOL_VERSION, AbortReply, AbortWeightUpdateReply, BeginWeightUpdateReply, BucketChecksum,
                       BucketEntry, ContinueGenerationReply, EndWeightUpdateReply, ErrorInfo, FailedEvent,
                       FinishedEvent, GenerateRequest, GetWeightsByNameReply, HelloReply, InlineSource, Limits,
                       ModelInfo, ParameterChecksum, PauseGenerationReply, RetractedEvent, RolloutdError,
                       RoutedExperts, ShmSource, ShutdownReply, StatusReply, TokensEvent, UpdateWeightsReply,
                       WeightsChecksumReply)
from .weights import crc32_of, model_checksum, pack_bucket

__all__ = ["Client", "GenerateResult", "DEFAULT_ENDPOINT", "PROTOCOL_VERSION", "RolloutdError", "ErrorInfo",
           "TokensEvent", "FinishedEvent", "FailedEvent", "RetractedEvent", "RoutedExperts", "GenerateRequest",
           "HelloReply", "StatusReply", "AbortReply", "ShutdownReply", "ModelInfo", "Limits",
           "BucketEntry", "BucketChecksum", "InlineSource", "ShmSource", "BeginWeightUpdateReply",
           "UpdateWeightsReply", "EndWeightUpdateReply", "AbortWeightUpdateReply", "GetWeightsByNameReply",
           "WeightsChecksumReply", "ParameterChecksum", "PauseGenerationReply", "ContinueGenerationReply",
           "WeightsChecksums", "pack_bucket", "crc32_of", "model_checksum",
           "Coordinator", "DaemonEndpoint", "DaemonHealth", "FleetWeightSession", "FleetWeightUpdate",
           "load_endpoints"]

# GPU weight transports (SPEC §11.7). The PyTorch side, rolloutd.trainer (NcclWeightGroup,
# push_weights), imports torch and CuPy when used, so it is not imported here.
from .client import PendingReply  # noqa: E402
from .messages import (CudaIpcSource, DestroyWeightGroupReply, InitWeightGroupReply, NcclSource,  # noqa: E402
                       nccl_version_string)

__all__ += ["PendingReply", "NcclSource", "CudaIpcSource", "InitWeightGroupReply", "DestroyWeightGroupReply",
            "nccl_version_string"]

# Control-plane security (SPEC §1.2): keys for daemons started with --curve-key-file.
from .security import CurveKeys, curve_available, keygen  # noqa: E402

__all__ += ["CurveKeys", "curve_available", "keygen"]

# Memory release and resume (SPEC §12).
from .messages import MEMORY_TAGS, ReleaseMemoryReply, ResumeMemoryReply  # noqa: E402

__all__ += ["MEMORY_TAGS", "ReleaseMemoryReply", "ResumeMemoryReply"]
