"""Client of one rolloutd daemon's control socket.

The socket is the C++ client's ZeroMQ DEALER (rolloutd._native, no pyzmq needed);
messages are encoded here with rolloutd.wire. Replies are matched to requests by
envelope id; events that arrive while a call waits are queued for events(). Every
wait has a deadline. Not thread-safe: use one Client per thread.
"""
from __future__ import annotations

import collections
import contextlib
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Set, Union

from . import wire
from .messages import (PROTOCOL_VERSION, AbortReply, AbortRequest, AbortWeightUpdateReply,
                       AbortWeightUpdateRequest, BeginWeightUpdateReply, BeginWeightUpdateRequest, BucketChecksum,
                       BucketEntry, ContinueGenerationReply, ContinueGenerationRequest, CudaIpcSource,
                       DestroyWeightGroupReply, DestroyWeightGroupRequest, EndWeightUpdateReply,
                       EndWeightUpdateRequest, ErrorInfo, Event, FailedEvent, FinishedEvent, GenerateReply,
                       GenerateRequest, GetWeightsByNameReply, GetWeightsByNameRequest, HelloReply, HelloRequest,
                       InitWeightGroupReply, InitWeightGroupRequest, InlineSource, Limits, NcclSource,
                       ParameterChecksum, PauseGenerationReply, PauseGenerationRequest,
                       ReleaseMemoryReply, ReleaseMemoryRequest, ResumeMemoryReply, ResumeMemoryRequest,
                       RetractedEvent, RolloutdError, RoutedExperts, ShmSource, ShutdownReply, ShutdownRequest,
                       StatusReply, StatusRequest, TokensEvent, UpdateWeightsReply, UpdateWeightsRequest,
                       WeightsChecksumReply, WeightsChecksumRequest)
from . import security as _security
from . import weights as _weights

try:
    from . import _native
except ImportError as _e:  # the codec (rolloutd.wire) stays usable without the extension
    _native = None
    _native_import_error = _e

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7600"
_EVENT_TYPES = (TokensEvent, FinishedEvent, FailedEvent, RetractedEvent)


@dataclass
class GenerateResult:
    """Everything one generate request produced. Exactly one of finish_reason / error is set."""

    rid: str
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    weight_versions: List[int] = field(default_factory=list)
    # With top_logprobs_num > 0: per token, its most likely tokens and their log-probs
    # (raw logit descending, id ascending on ties: SPEC §4.1), aligned with token_ids.
    top_token_ids: List[List[int]] = field(default_factory=list)
    top_logprobs: List[List[float]] = field(default_factory=list)
    routed_experts: Optional[RoutedExperts] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    abort_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[ErrorInfo] = None  # from a failed event
    # Times the daemon retracted the request (pause_generation(mode="retract")); each one
    # voided what had been collected, so the fields above hold the last attempt only.
    num_retractions: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> "GenerateResult":
        if self.error is not None:
            raise self.error.to_exception()
        return self


class _Collector:
    """Folds one request's events into a GenerateResult."""

    def __init__(self, rid: str, top_logprobs_num: Optional[int] = None):
        self.result = GenerateResult(rid=rid)
        # The request's n when known (generate()); else the first event with tokens sets it.
        self._top_n = top_logprobs_num
        self._rows: Optional[RoutedExperts] = None
        self._chunks: List[bytes] = []

    def add(self, event: Event) -> bool:
        """Applies one event; True once the request has ended."""
        r = self.result
        if isinstance(event, TokensEvent):
            r.token_ids.extend(event.token_ids)
            r.logprobs.extend(event.logprobs)
            r.weight_versions.extend(event.weight_versions)
            n = event.top_logprobs_num
            if event.token_ids:
                if self._top_n is None:
                    self._top_n = n
                if n != self._top_n:
                    hint = " (does this daemon support top_logprobs_num?)" if n == 0 else ""
                    raise RolloutdError("bad_message", f"tokens event with top_logprobs_num {n}, expected "
                                        f"{self._top_n}{hint}", "body.top_logprobs_num")
            for j in range(len(event.token_ids) if n else 0):
                r.top_token_ids.append(event.top_token_ids[j * n:(j + 1) * n])
                r.top_logprobs.append(event.top_logprobs[j * n:(j + 1) * n])
            if event.routed_experts is not None:
                self._add_rows(event.routed_experts)
            return False
        if isinstance(event, RetractedEvent):
            # The request restarts from its prompt under new weights: nothing received so far
            # stands, and its routed rows start again at routed_experts_start_len.
            r.token_ids, r.logprobs, r.weight_versions = [], [], []
            r.top_token_ids, r.top_logprobs = [], []
            self._rows, self._chunks = None, []
            r.num_retractions += 1
            return False
        if isinstance(event, FinishedEvent):
            r.finish_reason, r.abort_reason = event.reason, event.abort_reason
            r.prompt_tokens, r.completion_tokens = event.prompt_tokens, event.completion_tokens
        else:
            r.error = event.error
        if self._rows is not None:
            rows = self._rows
            r.routed_experts = RoutedExperts(rows.dtype, rows.shape, rows.start_pos, b"".join(self._chunks))
        return True

    def _add_rows(self, rows: RoutedExperts) -> None:
        # Rows must keep one layout and follow on, or tokens and experts would misalign.
        path = "body.routed_experts"
        if self._rows is None:
            self._rows = rows
            self._chunks = [rows.data]
            return
        acc = self._rows
        if (rows.dtype, rows.shape[1:]) != (acc.dtype, acc.shape[1:]):
            raise RolloutdError("bad_message", f"routed-experts rows changed layout within one request: "
                                f"{rows.dtype} {rows.shape[1:]} after {acc.dtype} {acc.shape[1:]}", path)
        expected = acc.start_pos + acc.shape[0]
        if rows.start_pos != expected:
            raise RolloutdError("bad_message", f"routed-experts rows start at position {rows.start_pos}, "
                                f"expected {expected}", f"{path}.start_pos")
        self._rows = RoutedExperts(acc.dtype, (acc.shape[0] + rows.shape[0],) + acc.shape[1:], acc.start_pos, b"")
        self._chunks.append(rows.data)


class PendingReply:
    """A request sent without waiting for its reply (Client.send_request, or the calls that take
    wait=False). result() waits for the reply, bounded by the deadline set when it was sent (or
    timeout_s), and returns its body or raises RolloutdError. Replies to several pending requests
    of one Client may be collected in any order. Use it from the Client's own thread."""

    def __init__(self, client: "Client", msg_id: int, request: Any, reply_type: type, deadline: float,
                 lost_since: Optional[int] = None):
        self.client, self.id, self.request, self.reply_type = client, msg_id, request, reply_type
        self.deadline, self._lost_since = deadline, lost_since
        self._done, self._value, self._error = False, None, None

    def done(self) -> bool:
        """True once the reply was collected (result() then returns at once)."""
        return self._done

    def result(self, timeout_s: Optional[float] = None) -> Any:
        if not self._done:
            deadline = self.deadline if timeout_s is None else time.monotonic() + timeout_s
            try:
                msg = self.client._await_reply(self.id, self.request, deadline, self._lost_since)
                self._value = self.client._reply_body(msg, self.request, self.reply_type)
            except RolloutdError as e:
                if e.code == "deadline_exceeded" and timeout_s is not None and time.monotonic() < self.deadline:
                    raise  # a shorter wait of the caller's: the reply may still come
                self._error = e
            finally:
                if self._error is not None or self._value is not None:
                    self._done = True
                    self.client._outstanding.pop(self.id, None)
        if self._error is not None:
            raise self._error
        return self._value


def _is_final(event: Event) -> bool:
    return isinstance(event, (FinishedEvent, FailedEvent))


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


class Client:
    """Connects to one daemon, e.g. ``Client("tcp://127.0.0.1:7600")``.

    ``timeout_s`` bounds every reply; generate calls take their own overall timeout.
    ``curve``: a rolloutd.CurveKeys for a daemon that requires CURVE (rolloutd.security); None
    (default) takes them from ROLLOUTD_CURVE_SERVER_KEY / ROLLOUTD_CURVE_CLIENT_KEY_FILE when
    set; False forces a plain connection.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 30.0, *,
                 client_name: str = "rolloutd-py", send_hwm: int = 1000, recv_hwm: int = 100000,
                 curve: Union["_security.CurveKeys", None, bool] = None):
        if _native is None:
            raise ImportError(f"rolloutd._native is not built: {_native_import_error}")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.client_name = client_name
        keys = _security.resolve(curve)
        self.curve = keys
        self._transport = self._native_call(
            lambda: _native.Transport(endpoint, send_hwm, recv_hwm,
                                      curve_server_key=keys.server_key if keys else "",
                                      curve_public_key=keys.public_key if keys else "",
                                      curve_secret_key=keys.secret_key if keys else ""))
        self._next_id = 1
        # The daemon's limits from its last hello reply (defaults until then); push_weights
        # sizes buckets by them.
        self.limits = Limits()
        self._events: Deque[Event] = collections.deque()
        # Requests whose caller gave up: their later events are dropped until the final one.
        self._abandoned: Set[str] = set()
        # rid -> _disconnects() before submit() sent it, for collect(); dropped at its final event.
        self._submitted_since: Dict[str, int] = {}
        # Replies that arrived for PendingReply ids other than the one being waited for (None:
        # not yet arrived); collected by that PendingReply's result().
        self._outstanding: Dict[int, Optional[wire.Decoded]] = {}

    # ---- lifetime ----
    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- typed calls ----
    def hello(self) -> HelloReply:
        reply = self._call(HelloRequest(client=self.client_name, versions=[PROTOCOL_VERSION]), HelloReply)
        if reply.version != PROTOCOL_VERSION:
            raise RolloutdError("unsupported_version", f"daemon chose protocol version {reply.version}, this "
                                f"client speaks {PROTOCOL_VERSION}", "body.version")
        self.limits = reply.limits
        return reply

    def status(self) -> StatusReply:
        return self._call(StatusRequest(), StatusReply)

    def submit(self, input_ids: Sequence[int], *, rid: Optional[str] = None, **sampling: Any) -> str:
        """Submits a generate request (fields as GenerateRequest); returns its rid. Events follow."""
        req = _make_request(input_ids, rid, sampling)
        since = self._disconnects()
        self._call(req, GenerateReply)
        self._submitted_since[req.rid] = since
        return req.rid

    def abort(self, rid: str) -> AbortReply:
        return self._call(AbortRequest(rid=rid), AbortReply)

    def abort_all(self) -> AbortReply:
        return self._call(AbortRequest(all=True), AbortReply)

    def shutdown(self, drain: bool = True, deadline_s: float = 30.0) -> ShutdownReply:
        return self._call(ShutdownRequest(drain=drain, deadline_s=deadline_s), ShutdownReply)

    # ---- weight updates (SPEC §11) ----
    def begin_weight_update(self, selector: Optional[Sequence[str]] = None,
                            timeout_s: float = 60.0) -> BeginWeightUpdateReply:
        """Opens a session; `selector` lists the parameter-name prefixes it may touch (None: all)."""
        return self._call(BeginWeightUpdateRequest(None if selector is None else list(selector), timeout_s),
                          BeginWeightUpdateReply)

    def update_weights_inline(self, session: int, entries: Sequence[BucketEntry], payload: Any,
                              checksum: Union[None, bool, int] = None) -> UpdateWeightsReply:
        """Sends one bucket whose bytes (`payload`, bytes-like) travel as a payload frame.
        checksum: a CRC-32 of the payload, or True to compute it here."""
        if checksum is True:
            checksum = zlib.crc32(payload)
        return self._call(UpdateWeightsRequest(session=session, entries=list(entries),
                                               source=InlineSource(data=payload),
                                               checksum=_checksum(checksum)), UpdateWeightsReply)

    def update_weights_shm(self, session: int, entries: Sequence[BucketEntry], shm_name: str, offset: int,
                           size: int, checksum: Optional[int] = None) -> UpdateWeightsReply:
        """Sends one bucket in [offset, offset + size) of POSIX shared memory `shm_name` ("/...").
        Once this returns the daemon has copied the bytes and unmapped the region."""
        return self._call(UpdateWeightsRequest(session=session, entries=list(entries),
                                               source=ShmSource(shm_name, offset, size),
                                               checksum=_checksum(checksum)), UpdateWeightsReply)

    def end_weight_update(self, session: int, weight_version: int) -> EndWeightUpdateReply:
        return self._call(EndWeightUpdateRequest(session, weight_version), EndWeightUpdateReply)

    def abort_weight_update(self, session: int) -> AbortWeightUpdateReply:
        return self._call(AbortWeightUpdateRequest(session), AbortWeightUpdateReply)

    def get_weights_by_name(self, name: str, truncate: int = 100) -> GetWeightsByNameReply:
        return self._call(GetWeightsByNameRequest(name, truncate), GetWeightsByNameReply)

    def weights_checksum(self, names: Optional[Sequence[str]] = None) -> "WeightsChecksums":
        """Per-parameter CRC-32s of the daemon's checkpoint-layout weights, as a dict name -> crc32
        that also carries .model_checksum, .weight_version and .parameters (the full reply)."""
        reply = self._call(WeightsChecksumRequest(None if names is None else list(names)), WeightsChecksumReply)
        return WeightsChecksums(reply)

    def pause_generation(self, mode: str) -> PauseGenerationReply:
        """mode: "abort" (end every request, waiting ones too), "retract" (restart the in-flight ones from their prompt
        later) or "in_place" (hold them, KV cache included, until continue_generation)."""
        return self._call(PauseGenerationRequest(mode), PauseGenerationReply)

    def continue_generation(self) -> ContinueGenerationReply:
        return self._call(ContinueGenerationRequest(), ContinueGenerationReply)

    # ---- memory release and resume (SPEC §12) ----
    def release_memory(self, tags: Optional[Sequence[str]] = None) -> ReleaseMemoryReply:
        """Gives the GPU memory of `tags` ("weights", "kv_cache", "cuda_graph"; None = all) back to
        the device, for a colocated trainer. The daemon must be idle (no request in flight, no weight
        session open): failed_precondition otherwise. After releasing weights: resume_memory, then
        push weights (a full weight-update session) before generating."""
        return self._call(ReleaseMemoryRequest(None if tags is None else list(tags)), ReleaseMemoryReply)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> ResumeMemoryReply:
        """Maps memory again under `tags` (None = all), at the same addresses; static state comes
        back bit for bit. resource_exhausted while the device is still full (retry later)."""
        return self._call(ResumeMemoryRequest(None if tags is None else list(tags)), ResumeMemoryReply)

    # ---- GPU weight transports (SPEC §11.7) ----
    def init_weight_group(self, group: str, unique_id: bytes, world_size: int, rank: int, root: int = 0,
                          nccl_version: int = 0, timeout_s: float = 120.0, *,
                          wait: bool = True) -> Union[InitWeightGroupReply, PendingReply]:
        """Joins the daemon to the NCCL group `group` as `rank` of `world_size`; the trainer (rank
        `root`) created `unique_id` (128 bytes) and must join at the same time, so pass wait=False
        and call .result() after starting the trainer's own join (rolloutd.trainer.NcclWeightGroup
        does all of this). The reply comes once the daemon joined, within timeout_s."""
        req = InitWeightGroupRequest(group, bytes(unique_id), world_size, rank, root, nccl_version, timeout_s)
        # The daemon answers when joined or after timeout_s: wait past that, with slack for the reply.
        return self._maybe_wait(self.send_request(req, InitWeightGroupReply, max(self.timeout_s, timeout_s + 5.0)),
                                wait)

    def destroy_weight_group(self, group: str, *, wait: bool = True) -> Union[DestroyWeightGroupReply, PendingReply]:
        """Tears the group down on the daemon; the trainer destroys its communicator at the same time."""
        return self._maybe_wait(self.send_request(DestroyWeightGroupRequest(group), DestroyWeightGroupReply), wait)

    def update_weights_nccl(self, session: int, entries: Sequence[BucketEntry], group: str, root: int, size: int,
                            checksum: Optional[int] = None, *, wait: bool = True,
                            timeout_s: Optional[float] = None) -> Union[UpdateWeightsReply, PendingReply]:
        """One bucket of `size` bytes that rank `root` broadcasts over `group`. The daemon replies
        after it received and applied the bytes: send with wait=False, post the broadcast, then
        .result() (or post the broadcast on a CUDA stream first, then call with wait=True)."""
        req = UpdateWeightsRequest(session=session, entries=list(entries), source=NcclSource(group, root, size),
                                   checksum=_checksum(checksum))
        return self._maybe_wait(self.send_request(req, UpdateWeightsReply, timeout_s), wait)

    def update_weights_cuda_ipc(self, session: int, entries: Sequence[BucketEntry], handle: bytes, offset: int,
                                size: int, device_uuid: bytes, checksum: Optional[int] = None, *,
                                wait: bool = True,
                                timeout_s: Optional[float] = None) -> Union[UpdateWeightsReply, PendingReply]:
        """One bucket in [offset, offset + size) of the CUDA allocation exported as `handle` (64-byte
        cudaIpcMemHandle_t) on GPU `device_uuid` (16 bytes: the daemon's, hello().device_uuid). The
        daemon's copies out of it have completed on the device when the reply arrives: the buffer may
        be reused then. Several buckets may be in flight (wait=False); each is answered when its own
        copies are done, in order."""
        req = UpdateWeightsRequest(session=session, entries=list(entries),
                                   source=CudaIpcSource(bytes(handle), offset, size, bytes(device_uuid)),
                                   checksum=_checksum(checksum))
        return self._maybe_wait(self.send_request(req, UpdateWeightsReply, timeout_s), wait)

    def send_request(self, request: Any, reply_type: type, timeout_s: Optional[float] = None) -> PendingReply:
        """Sends any request without waiting; PendingReply.result() collects its reply (bounded by
        timeout_s, default the client's). Lets one thread keep requests to many daemons in flight."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        since = self._disconnects()
        msg_id = self._send_request(request, deadline)
        self._outstanding[msg_id] = None
        return PendingReply(self, msg_id, request, reply_type, deadline, since)

    @staticmethod
    def _maybe_wait(pending: PendingReply, wait: bool):
        return pending.result() if wait else pending

    def push_weights(self, tensors, weight_version: int, bucket_bytes: int = 256 << 20, via: str = "inline",
                     shm_name: Optional[str] = None, checksum: bool = False,
                     selector: Optional[Sequence[str]] = None, timeout_s: float = 60.0) -> EndWeightUpdateReply:
        """One whole weight update: begin, buckets of at most `bucket_bytes`, end(weight_version).

        tensors: (name, numpy array) or (name, dtype, shape, bytes-like) items, as pack_bucket takes.
        via="inline" sends each bucket as a payload frame; via="shm" writes it into one POSIX
        shared-memory region (`shm_name`, default "/rolloutd-<random>"), reused for every bucket
        and unlinked at the end. Buckets also respect the daemon's limits from the last hello()
        (frame size, entries per bucket, envelope size). On any failure the session is aborted
        and the error re-raised. Returns the end_weight_update reply."""
        return _weights.push_weights(self, tensors, weight_version, bucket_bytes=bucket_bytes, via=via,
                                     shm_name=shm_name, checksum=checksum, selector=selector, timeout_s=timeout_s)

    # ---- events ----
    def next_event(self, timeout_s: float) -> Optional[Event]:
        """The next event of any submitted request, or None if none arrives within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self._events:
            msg = self._receive(deadline)
            if msg is None:
                return None
            if isinstance(msg.body, _EVENT_TYPES):
                self._enqueue(msg.body)
            # Anything else is a reply to a call that gave up waiting.
        return self._events.popleft()

    def events(self, timeout_s: float = 1.0) -> Iterator[Event]:
        """Yields events as they arrive; stops when none arrives within timeout_s."""
        while True:
            event = self.next_event(timeout_s)
            if event is None:
                return
            yield event

    # ---- generation ----
    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 16, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: Optional[int] = None,
                 stop_token_ids: Sequence[int] = (), return_logprob: bool = False,
                 return_routed_experts: bool = False, routed_experts_start_len: int = 0,
                 rid: Optional[str] = None, timeout_s: float = 120.0, stream: bool = True,
                 top_logprobs_num: int = 0, deadline_s: float = 0.0) -> GenerateResult:
        """Submits one request and collects its events until the final one.

        Raises RolloutdError if the daemon rejects the request or it does not end
        within timeout_s (it is then aborted); a failed event sets ``result.error``.
        deadline_s > 0 has the daemon itself end the request (finished, abort_reason
        "deadline", with the tokens so far) that many seconds after it received it.
        """
        rid = uuid.uuid4().hex if rid is None else rid
        collector = _Collector(rid, top_logprobs_num)
        stream_it = self.generate_stream(
            input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, stop_token_ids=stop_token_ids, return_logprob=return_logprob,
            return_routed_experts=return_routed_experts, routed_experts_start_len=routed_experts_start_len,
            rid=rid, timeout_s=timeout_s, stream=stream, top_logprobs_num=top_logprobs_num, deadline_s=deadline_s)
        with contextlib.closing(stream_it):  # an error here aborts the request at once
            for event in stream_it:
                if collector.add(event):
                    return collector.result
        raise AssertionError("generate_stream ended without a final event")  # pragma: no cover

    def collect(self, rid: str, timeout_s: float = 120.0) -> GenerateResult:
        """Collects the events of a request sent with submit() until its final one (events that
        arrived earlier are taken from the queue). A coordinator submits many requests, to one
        or many daemons, then collects each; the timeout aborts the request like generate()."""
        collector = _Collector(rid)
        deadline = time.monotonic() + timeout_s
        # A request submit() sent here fails 'unavailable' once its daemon's connection is lost.
        with contextlib.closing(self._stream(rid, deadline, timeout_s, self._submitted_since.get(rid))) as events:
            for event in events:
                if collector.add(event):
                    return collector.result
        raise AssertionError("the event stream ended without a final event")  # pragma: no cover

    def generate_stream(self, input_ids: Sequence[int], *, rid: Optional[str] = None, timeout_s: float = 120.0,
                        **sampling: Any) -> Iterator[Event]:
        """Submits one request and yields its TokensEvent / RetractedEvent / FinishedEvent /
        FailedEvent, the final one last (a RetractedEvent voids what came before it). Events of
        other requests stay queued. Closing the iterator early, or the timeout expiring
        (RolloutdError deadline_exceeded), aborts the request."""
        deadline = time.monotonic() + timeout_s
        req = _make_request(input_ids, rid, sampling)
        reply_deadline = min(deadline, time.monotonic() + self.timeout_s)
        since = self._disconnects()
        msg_id = self._send_request(req, reply_deadline)
        try:
            reply = self._await_reply(msg_id, req, reply_deadline, since)
        except BaseException:  # timeout, bad reply, Ctrl-C: the request may be running
            self._abandon(req.rid)
            raise
        # A rejection is not aborted: its rid may belong to another request in flight.
        self._reply_body(reply, req, GenerateReply)
        return self._stream(req.rid, deadline, timeout_s, since)

    def _stream(self, rid: str, deadline: float, timeout_s: float,
                lost_since: Optional[int] = None) -> Iterator[Event]:
        done = False
        try:
            # Events that arrived while waiting for the reply come first, in order.
            mine = [e for e in self._events if e.rid == rid]
            if mine:
                self._events = collections.deque(e for e in self._events if e.rid != rid)
            for event in mine:
                done = _is_final(event)
                yield event
                if done:
                    return
            while True:
                msg = self._receive(deadline, lost_since)
                if msg is None:
                    raise RolloutdError("deadline_exceeded",
                                        f"request '{rid}' did not finish within {timeout_s} s; aborted it", "rid")
                if not isinstance(msg.body, _EVENT_TYPES):
                    continue  # a late reply to a call that gave up
                if msg.body.rid != rid:
                    self._enqueue(msg.body)
                    continue
                done = _is_final(msg.body)
                yield msg.body
                if done:
                    return
        finally:
            self._submitted_since.pop(rid, None)  # ended, or abandoned just below
            if not done and self._transport is not None:
                self._abandon(rid)

    # ---- raw transport (bad-input tests) ----
    def send_raw(self, frames: Sequence[bytes], timeout_s: Optional[float] = None) -> None:
        self._native_call(self._live().send, list(frames), _ms(self.timeout_s if timeout_s is None else timeout_s))

    def recv_raw(self, timeout_s: float) -> Optional[List[bytes]]:
        return self._native_call(self._live().recv, _ms(timeout_s))

    # ---- internals ----
    def _live(self):
        if self._transport is None:
            raise RolloutdError("failed_precondition", "client is closed", "")
        return self._transport

    @staticmethod
    def _native_call(fn, *args):
        try:
            return fn(*args)
        except _native.TransportError as e:
            raise RolloutdError(e.code, e.message, e.field) from None

    def _receive(self, deadline: float, lost_since: Optional[int] = None) -> Optional[wire.Decoded]:
        """The next message before `deadline`. With lost_since (a _disconnects() value read before
        sending what is awaited) the wait raises RolloutdError 'unavailable' once the connection
        drops and does not come back within 300 ms: whatever was awaited would have come over it."""
        frames = self._native_call(self._live().recv, _ms(max(0.0, deadline - time.monotonic())), lost_since)
        return None if frames is None else wire.decode(frames)

    def _disconnects(self) -> int:
        return self._native_call(lambda: self._live().disconnects)

    def _call(self, request: Any, reply_type: type, deadline: Optional[float] = None) -> Any:
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        return self._reply_body(self._exchange(request, deadline), request, reply_type)

    def _exchange(self, request: Any, deadline: float) -> wire.Decoded:
        since = self._disconnects()
        return self._await_reply(self._send_request(request, deadline), request, deadline, since)

    def _send_request(self, request: Any, deadline: float) -> int:
        msg_id = self._next_id
        self._next_id += 1
        self.send_raw(wire.encode(msg_id, request), max(0.0, deadline - time.monotonic()))
        return msg_id

    def _await_reply(self, msg_id: int, request: Any, deadline: float,
                     lost_since: Optional[int] = None) -> wire.Decoded:
        """The reply to message `msg_id`; events that come first are queued, and replies to other
        pending requests (send_request) are kept for them."""
        stashed = self._outstanding.get(msg_id)
        if stashed is not None:
            return stashed
        while True:
            msg = self._receive(deadline, lost_since)
            if msg is None:
                raise RolloutdError("deadline_exceeded", f"no reply to '{wire.type_name(request)}' (id {msg_id}) "
                                    f"from {self.endpoint} in time", "")
            if isinstance(msg.body, _EVENT_TYPES):
                self._enqueue(msg.body)
            elif msg.id == msg_id:
                return msg
            elif msg.id in self._outstanding:
                self._outstanding[msg.id] = msg
            # Otherwise it answers a call that already gave up waiting.

    @staticmethod
    def _reply_body(msg: wire.Decoded, request: Any, reply_type: type) -> Any:
        if isinstance(msg.body, ErrorInfo):
            raise msg.body.to_exception()
        if not isinstance(msg.body, reply_type):
            raise RolloutdError("bad_message", f"reply of type '{msg.type}' does not answer "
                                f"'{wire.type_name(request)}'", "type")
        return msg.body

    def _enqueue(self, event: Event) -> None:
        if _is_final(event):
            self._submitted_since.pop(event.rid, None)
        if event.rid in self._abandoned:
            if _is_final(event):
                self._abandoned.discard(event.rid)
            return
        self._events.append(event)

    def _abandon(self, rid: str) -> None:
        """Drops the request's events and aborts it without waiting (its reply is dropped as stale)."""
        self._events = collections.deque(e for e in self._events if e.rid != rid)
        self._abandoned.add(rid)
        try:
            self._send_request(AbortRequest(rid=rid), time.monotonic() + 0.1)
        except RolloutdError:
            pass  # the daemon is unreachable, and the request with it


class WeightsChecksums(dict):
    """name -> CRC-32 of a parameter's checkpoint-layout bytes, from weights_checksum(); compare
    with rolloutd.crc32_of(array) per tensor, or model_checksum(dict) as a whole."""

    def __init__(self, reply: WeightsChecksumReply):
        super().__init__((p.name, p.checksum) for p in reply.parameters)
        self.algo = reply.algo
        self.weight_version = reply.weight_version
        self.model_checksum = reply.model_checksum
        self.parameters: List[ParameterChecksum] = reply.parameters


def _checksum(value: Optional[int]) -> Optional[BucketChecksum]:
    return None if value is None else BucketChecksum(value=int(value))


def _make_request(input_ids: Sequence[int], rid: Optional[str], sampling: dict) -> GenerateRequest:
    if hasattr(input_ids, "tolist"):  # numpy arrays, torch tensors
        input_ids = input_ids.tolist()
    if "stop_token_ids" in sampling:
        sampling["stop_token_ids"] = list(sampling["stop_token_ids"])
    return GenerateRequest(rid=uuid.uuid4().hex if rid is None else rid, input_ids=list(input_ids), **sampling)
