"""A trainer-side coordinator over many rolloutd daemons.

    import rolloutd
    with rolloutd.Coordinator.from_file("/run/rolloutd/endpoints.json") as fleet:
        fleet.wait_ready(timeout_s=300)
        fleet.push_weights(state_dict.items(), weight_version=step, pause_mode="retract")
        rids = fleet.submit_many([[1, 2, 3]] * 64, max_new_tokens=256, return_routed_experts=True)
        results = fleet.collect(rids, timeout_s=600)

One thread per daemon owns that daemon's Client (a Client is not thread-safe) and does
everything that touches it: commands from the caller (submit, abort, weight buckets), the
heartbeat (a `status` call plus HTTP /readyz and /v1/status), and pumping its events into
the one queue that next_event()/events() read. Every wait has a deadline.

Nothing is lost silently: every request submitted here ends with exactly one final event
(FinishedEvent or FailedEvent). When a daemon dies or restarts, the requests it held end
with FailedEvent(code "unavailable"), or, with resubmit=True, are sent again to another
ready daemon under the same rid after a RetractedEvent(reason "daemon_lost") that voids what
they had produced (the same rule as a retraction by a weight update).
"""
from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
import zlib
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import weights as _weights
from .client import Client, GenerateResult, _Collector, _is_final, _make_request
from .security import CurveKeys
from .security import resolve as resolve_curve
from .messages import (EndWeightUpdateReply, ErrorInfo, Event, FailedEvent, GenerateReply, GenerateRequest, Limits,
                       RetractedEvent, RolloutdError, TokensEvent, UpdateWeightsReply)

__all__ = ["Coordinator", "DaemonEndpoint", "DaemonHealth", "FleetWeightSession", "FleetWeightUpdate",
           "load_endpoints"]

# Errors of a submit that say "not this daemon, now": another daemon may take the request.
_RETRY_ELSEWHERE = {"draining", "not_ready", "overloaded", "unavailable", "deadline_exceeded",
                    "resource_exhausted", "failed_precondition", "unauthenticated"}


# ------------------------------------------------------------------ endpoints --
@dataclass(frozen=True)
class DaemonEndpoint:
    """Where one daemon listens. `name` identifies it across endpoint-file reloads
    ("host/index" for launch-node.sh files, else the control endpoint)."""

    control: str
    http: Optional[str] = None
    name: str = ""
    pid: Optional[int] = None  # as the launcher last started it; a change means a restart

    @property
    def key(self) -> str:
        return self.name or self.control


def _entries_of(doc: Any, origin: str) -> List[DaemonEndpoint]:
    if isinstance(doc, list):
        return [e for item in doc for e in _entries_of(item, origin)]
    if not isinstance(doc, dict):
        raise ValueError(f"{origin}: expected a JSON object or list, got {type(doc).__name__}")
    if "nodes" in doc:  # several launch-node.sh files gathered into one
        return _entries_of(doc["nodes"], origin)
    if "daemons" in doc:  # launch-node.sh
        host = str(doc.get("host", ""))
        out = []
        for d in doc["daemons"]:
            if not d.get("control") or d.get("state") in ("failed", "exited", "stopped"):
                continue  # not started yet, or gone for good
            out.append(DaemonEndpoint(d["control"], d.get("http"), f"{host}/{d.get('index', len(out))}",
                                      d.get("pid")))
        return out
    if "control" in doc:  # one daemon's --endpoints-file
        return [DaemonEndpoint(doc["control"], doc.get("http"), str(doc.get("name", "")), doc.get("pid"))]
    raise ValueError(f"{origin}: no 'daemons', 'nodes' or 'control' key")


def load_endpoints(path: str) -> List[DaemonEndpoint]:
    """Endpoints from a launch-node.sh file, a daemon's --endpoints-file, a JSON list of
    either, or a directory of such files (*.json, sorted by name)."""
    if os.path.isdir(path):
        out: List[DaemonEndpoint] = []
        for name in sorted(os.listdir(path)):
            if name.endswith(".json"):
                out.extend(load_endpoints(os.path.join(path, name)))
        return out
    with open(path) as f:
        return _entries_of(json.load(f), path)


def _as_endpoint(e: Union[str, DaemonEndpoint, Dict[str, Any]]) -> DaemonEndpoint:
    if isinstance(e, DaemonEndpoint):
        return e
    if isinstance(e, str):
        return DaemonEndpoint(e)
    return _entries_of(e, "endpoint")[0]


# ------------------------------------------------------------------- health --
@dataclass
class DaemonHealth:
    """One daemon as the coordinator last saw it (a copy: it does not change under you)."""

    index: int
    name: str
    control: str
    http: Optional[str]
    # connecting | ready | updating | not_ready | draining | starting | unreachable | lost
    state: str = "connecting"
    ready: bool = False           # the status reply said ready (and /readyz, when known, said 200)
    routable: bool = False        # ready, not stale: submit() may pick it
    reason: str = ""
    weight_version: int = 0
    stale: bool = False           # serves a version below the fleet's (Coordinator.weight_version)
    num_waiting: int = 0
    num_running: int = 0
    outstanding_requests: int = 0  # submitted here, no final event yet
    outstanding_tokens: int = 0    # their prompt + max_new_tokens not yet produced
    pid: Optional[int] = None
    incarnation: int = 0           # bumps on every detected restart or loss
    last_ok_age_s: Optional[float] = None  # since the last answered heartbeat
    num_lost: int = 0              # times its requests were lost (death, restart)


@dataclass
class _Pending:
    request: GenerateRequest
    worker: "_Worker"
    incarnation: int
    cost: int              # tokens it still stands for in the worker's outstanding count
    submitted: float
    last_event: float
    tokens: int = 0        # produced so far (since the last retraction)
    resubmits: int = 0


class _Worker(threading.Thread):
    """Owns one daemon's Client; runs commands, heartbeats and the event pump."""

    def __init__(self, coord: "Coordinator", index: int, endpoint: DaemonEndpoint):
        super().__init__(name=f"rolloutd-coord-{index}", daemon=True)
        self.coord = coord
        self.index = index
        self.endpoint = endpoint
        self.commands: "queue.SimpleQueue[Tuple[Callable[[Client], Any], Future]]" = queue.SimpleQueue()
        self.stop = threading.Event()
        self.client: Optional[Client] = None
        self.limits: Optional[Limits] = None
        # Guarded by coord._lock:
        self.health = DaemonHealth(index=index, name=endpoint.key, control=endpoint.control, http=endpoint.http)
        self.outstanding_tokens = 0
        self.outstanding_requests = 0
        self.incarnation = 0
        # Worker-thread only:
        self._last_ok: Optional[float] = None
        self._first_fail: Optional[float] = None
        self._start_estimate: Optional[float] = None  # monotonic time the daemon started (now - uptime)
        self._next_heartbeat = 0.0
        self._need_hello = True
        self._last_generated: Optional[int] = None  # the daemon's tokens generated, last heartbeat
        self._lost_since_ok = False
        self._launcher_pid = endpoint.pid

    # ---- called from other threads ----
    def call(self, fn: Callable[[Client], Any]) -> Future:
        fut: Future = Future()
        if self.stop.is_set():
            fut.set_exception(RolloutdError("unavailable", f"coordinator closed ({self.endpoint.key})", ""))
        else:
            self.commands.put((fn, fut))
        return fut

    @property
    def key(self) -> str:
        """The daemon's name in reports (threading.Thread.name is the thread's)."""
        return self.endpoint.key

    # ---- the thread ----
    def run(self) -> None:
        try:
            self._connect()
            while not self.stop.is_set():
                try:
                    self._run_commands()
                    if time.monotonic() >= self._next_heartbeat:
                        self._heartbeat()
                        self._expire_requests()
                        self._next_heartbeat = time.monotonic() + self.coord.heartbeat_interval_s
                    self._pump(self.coord.poll_interval_s if self.commands.empty() else 0.0)
                except Exception as e:  # noqa: BLE001 - a bug here must not silence this daemon's requests
                    self.coord._log(f"worker for {self.key}: {type(e).__name__}: {e}")
                    time.sleep(self.coord.poll_interval_s)
        finally:
            # Commands that will never run get an answer, so no caller waits past its deadline.
            while True:
                try:
                    _, fut = self.commands.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RolloutdError("unavailable", f"coordinator closed ({self.key})", ""))
            if self.client is not None:
                self.client.close()

    def _connect(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client = Client(self.endpoint.control, timeout_s=self.coord.timeout_s,
                             client_name=self.coord.client_name, curve=self.coord.curve or False)
        self._need_hello = True
        self._start_estimate = None

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self.commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.client))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _pump(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        n = 0
        while n < 1000:  # then let commands and heartbeats in
            try:
                event = self.client.next_event(max(0.0, deadline - time.monotonic()))
            except RolloutdError:
                return  # a malformed event: the request it belonged to is caught by its deadline
            if event is None:
                return
            self.coord._deliver(self, self.incarnation, event)
            n += 1
            deadline = time.monotonic()  # drain what is there, do not wait again

    # ---- health ----
    def _heartbeat(self) -> None:
        c = self.coord
        status = status_error = http_ready = http_status = None
        refused = False
        # HTTP first: a refused connection means no process listens there, which settles it at
        # once, without waiting out the control call's deadline.
        if self.endpoint.http:
            try:
                http_ready = _http_get(self.endpoint.http + "/readyz", c.heartbeat_timeout_s)[0] == 200
                code, body = _http_get(self.endpoint.http + "/v1/status", c.heartbeat_timeout_s)
                if code == 200:
                    http_status = json.loads(body)
            except OSError as e:
                refused = _is_refused(e)
            except ValueError:
                pass
        if refused:
            status_error = RolloutdError("unavailable", f"{self.endpoint.http} refused the connection", "")
        else:
            old_timeout = self.client.timeout_s
            self.client.timeout_s = c.heartbeat_timeout_s
            try:
                if self._need_hello:
                    self.limits = self.client.hello().limits
                    self._need_hello = False
                status = self.client.status()
            except RolloutdError as e:
                status_error = e
            finally:
                self.client.timeout_s = old_timeout
        now = time.monotonic()

        if status is None:
            if self._first_fail is None:
                self._first_fail = now
            down_for = now - (self._last_ok if self._last_ok is not None else self._first_fail)
            # Connection refused on the HTTP port means no process listens there: the daemon,
            # and every request it held, is gone. A timeout may be a slow network: wait.
            dead = refused or down_for >= c.dead_after_s
            with c._lock:
                h = self.health
                h.state = "unreachable" if not self._lost_since_ok else "lost"
                h.ready = h.routable = False
                h.reason = f"no heartbeat reply for {down_for:.1f} s: {status_error}"
                h.last_ok_age_s = None if self._last_ok is None else now - self._last_ok
            # Never answered yet (still starting): nothing was routed there, nothing to lose.
            if dead and self._last_ok is not None and not self._lost_since_ok:
                self._lose("died" if refused else f"unreachable for {down_for:.1f} s")
            return

        # Restarted? Its start time moved (uptime is steady-clock based, so the estimate only
        # jitters by a round trip), or the HTTP server reports another pid.
        start = now - status.uptime_s
        pid = http_status.get("pid") if isinstance(http_status, dict) else None
        restarted = (self._start_estimate is not None and start > self._start_estimate + c.restart_slack_s) or \
                    (pid is not None and self.health.pid is not None and pid != self.health.pid)
        if restarted and not self._lost_since_ok:
            self._lose("restarted")
        self._start_estimate = start if self._start_estimate is None or restarted else \
            min(self._start_estimate, start)
        self._last_ok, self._first_fail, self._lost_since_ok = now, None, False
        generated = status.num_tokens_generated_total
        # != rather than >: a restarted daemon counts from 0 again.
        progressing = self._last_generated is not None and generated != self._last_generated
        self._last_generated = generated
        with c._lock:
            if progressing:
                # The daemon generates: its requests that sent nothing meanwhile are queued or
                # stream=false, not stuck. request_timeout_s counts time without progress.
                for p in c._pending.values():
                    if p.worker is self:
                        p.last_event = now
            h = self.health
            h.pid = pid if pid is not None else h.pid
            h.state = status.state
            h.ready = bool(status.ready) and http_ready is not False
            h.reason = status.reason or ("" if h.ready else "/readyz is not 200")
            h.weight_version = status.weight_version
            h.num_waiting, h.num_running = status.num_waiting, status.num_running
            h.last_ok_age_s = 0.0
            self._refresh_routable()

    def _refresh_routable(self) -> None:
        """With coord._lock held."""
        h = self.health
        floor = self.coord.weight_version
        h.stale = floor is not None and h.weight_version < floor and self.coord.exclude_stale
        h.routable = h.ready and not h.stale and not self.stop.is_set()

    def note_launcher_pid(self, pid: Optional[int]) -> None:
        """The launcher's file names another pid for this daemon: it was restarted."""
        def check(_client):
            with self.coord._lock:
                seen = self.health.pid  # the process our heartbeats talk to (HTTP /v1/status)
            # Not when already lost (the heartbeat saw it die), nor when the heartbeats already
            # talk to the new process: its requests are the new incarnation's.
            if pid is not None and self._launcher_pid is not None and pid != self._launcher_pid \
                    and not self._lost_since_ok and pid != seen:
                self._lose("restarted by its launcher")
            self._launcher_pid = pid
        self.call(check)

    def retarget(self, endpoint: DaemonEndpoint) -> None:
        """The daemon moved (a restart on ephemeral ports): what it held is lost; reconnect."""
        def move(_client):
            self._lose("moved to " + endpoint.control)
            self.endpoint = endpoint
            with self.coord._lock:
                self.health.control, self.health.http = endpoint.control, endpoint.http
            self._connect()
        self.call(move)

    def _lose(self, why: str) -> None:
        """The daemon died or restarted: every request it held ends here (failed, or resubmitted
        elsewhere), and later events of the old connection are ignored. Worker thread only."""
        c = self.coord
        with c._lock:
            self.incarnation += 1
            self.health.incarnation = self.incarnation
            self.health.num_lost += 1
            self.health.ready = self.health.routable = False
            self.health.state = "lost"
            self.health.reason = why
            mine = [(rid, p) for rid, p in c._pending.items() if p.worker is self]
        self._lost_since_ok = True
        c._log(f"daemon {self.key} {why}; {len(mine)} request(s) in flight there")
        for rid, p in mine:
            c._reroute(rid, p, f"daemon {self.key} {why}")
        # A fresh connection: the old one's queues and routing id belong to a dead peer.
        self._connect()

    def _expire_requests(self) -> None:
        limit = self.coord.request_timeout_s
        if limit is None:
            return
        now = time.monotonic()
        with self.coord._lock:
            late = [(rid, p) for rid, p in self.coord._pending.items()
                    if p.worker is self and now - p.last_event > limit]
        for rid, p in late:
            with contextlib.suppress(RolloutdError):
                self.client._abandon(rid)
            self.coord._finish_synthetic(rid, p, "deadline_exceeded",
                                         f"no event for {limit} s from daemon {self.key}; aborted it")


def _is_refused(e: BaseException) -> bool:
    reason = getattr(e, "reason", e)
    return isinstance(reason, ConnectionRefusedError) or getattr(reason, "errno", None) == errno.ECONNREFUSED


def _http_get(url: str, timeout_s: float) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ------------------------------------------------------------ weight updates --
@dataclass
class FleetWeightUpdate:
    """What one fan-out weight update did, per daemon (by name)."""

    weight_version: int
    completed: Dict[str, EndWeightUpdateReply] = field(default_factory=dict)
    failed: Dict[str, RolloutdError] = field(default_factory=dict)     # began (or tried to), did not end
    skipped: Dict[str, str] = field(default_factory=dict)              # not reachable: never asked
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.skipped and bool(self.completed)

    def raise_for_error(self) -> "FleetWeightUpdate":
        if not self.ok:
            parts = [f"{n}: {e}" for n, e in self.failed.items()] + [f"{n}: {r}" for n, r in self.skipped.items()]
            raise RolloutdError("unavailable", f"weight update {self.weight_version} completed on "
                                f"{len(self.completed)} daemon(s), not on: " + "; ".join(parts), "")
        return self


class FleetWeightSession:
    """begin_weight_update on every daemon at once; buckets go to all of them; end on all.

    A daemon that fails a step is reported in .failed and its session aborted (best effort:
    it may be gone); the others carry on. Made by Coordinator.begin_weight_update()."""

    def __init__(self, coord: "Coordinator", workers: List[_Worker], selector, session_timeout_s: float,
                 step_timeout_s: float, skipped: Dict[str, str]):
        self._coord = coord
        self._step_timeout_s = step_timeout_s
        self.sessions: Dict[str, int] = {}
        self.serving_versions: Dict[str, int] = {}  # each daemon's weight_version when it began
        self.failed: Dict[str, RolloutdError] = {}
        self.skipped = dict(skipped)
        self._workers: Dict[str, _Worker] = {}
        self._closed = False
        sel = None if selector is None else list(selector)
        results = coord._fan_out(workers, lambda c: c.begin_weight_update(sel, session_timeout_s),
                                 step_timeout_s, on_late=lambda c, reply: c.abort_weight_update(reply.session))
        for w, (ok, value) in results.items():
            if ok:
                self.sessions[w.key] = value.session
                self.serving_versions[w.key] = value.weight_version
                self._workers[w.key] = w
            else:
                self.failed[w.key] = value

    @property
    def active(self) -> List[str]:
        return list(self._workers)

    @property
    def limits(self) -> Limits:
        """The tightest of the active daemons' limits (buckets must fit every one)."""
        return self._coord._tightest_limits(list(self._workers.values()))

    def _step(self, fn: Callable[[Client, int], Any]) -> Dict[str, Any]:
        if self._closed:
            raise RolloutdError("failed_precondition", "the fleet weight session is closed", "")
        workers = list(self._workers.values())
        out: Dict[str, Any] = {}
        calls = {w: w.call(lambda c, s=self.sessions[w.key]: fn(c, s)) for w in workers}
        deadline = time.monotonic() + self._step_timeout_s
        for w, fut in calls.items():
            try:
                out[w.key] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except (RolloutdError, FutureTimeout) as e:
                self._drop(w, e if isinstance(e, RolloutdError) else
                           RolloutdError("deadline_exceeded", f"no reply within {self._step_timeout_s} s", ""))
        return out

    def refuse_below(self, weight_version: int) -> None:
        """Drops (session aborted, nothing written) every daemon already serving a version above
        `weight_version`: its end_weight_update would refuse it after every bucket, and the
        abort would then leave it not_ready."""
        for name, w in list(self._workers.items()):
            if weight_version < self.serving_versions.get(name, 0):
                self._drop(w, RolloutdError("invalid_argument", f"weight_version {weight_version} is below "
                                            f"{name}'s serving version {self.serving_versions[name]}",
                                            "weight_version"))

    def _drop(self, w: _Worker, error: RolloutdError) -> None:
        name = w.key
        self.failed[name] = error
        session = self.sessions.get(name)
        del self._workers[name]
        # Give the session up so the daemon does not wait for its idle deadline (it is fail-closed
        # anyway if buckets had been written). Not waited for: the daemon may be gone.
        w.call(lambda c: c.abort_weight_update(session))

    def update_weights_inline(self, entries, payload, checksum: Union[None, bool, int] = None
                              ) -> Dict[str, UpdateWeightsReply]:
        """One bucket to every active daemon (the same bytes; sent in parallel)."""
        if checksum is True:
            checksum = zlib.crc32(payload)
        return self._step(lambda c, s: c.update_weights_inline(s, entries, payload, checksum=checksum))

    def update_weights_shm(self, entries, shm_name: str, offset: int, size: int,
                           checksum: Optional[int] = None) -> Dict[str, UpdateWeightsReply]:
        """One bucket in shared memory that every active daemon (all on this host) reads."""
        return self._step(lambda c, s: c.update_weights_shm(s, entries, shm_name, offset, size, checksum=checksum))

    def end(self, weight_version: int) -> FleetWeightUpdate:
        replies = self._step(lambda c, s: c.end_weight_update(s, weight_version))
        self._closed = True
        result = FleetWeightUpdate(weight_version, completed=replies, failed=dict(self.failed),
                                   skipped=dict(self.skipped))
        self._coord._weights_completed(result)
        return result

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._workers.values()):
            session = self.sessions[w.key]
            w.call(lambda c, s=session: c.abort_weight_update(s))


# --------------------------------------------------------------- coordinator --
class Coordinator:
    """Drives many daemons as one fleet. Thread-safe; every method is bounded in time.

    endpoints: control endpoints ("tcp://host:7600"), DaemonEndpoint, or dicts as the
    launcher's file holds them. Options:
      timeout_s             deadline of each reply (submit, weight buckets, ...)
      heartbeat_interval_s  how often each daemon is asked for its status
      heartbeat_timeout_s   deadline of one heartbeat (status reply, HTTP /readyz)
      dead_after_s          a daemon silent this long has lost its requests
      request_timeout_s     a request with no event for this long, while its daemon generates nothing
                            (its heartbeats show no new tokens), is aborted and failed (None: never)
      resubmit              send the requests of a lost daemon to another one (max_resubmits times)
      exclude_stale         do not route to daemons whose weights are older than the fleet's
      curve                 rolloutd.CurveKeys for daemons that require CURVE (one fleet key pair);
                            None: from ROLLOUTD_CURVE_SERVER_KEY / ROLLOUTD_CURVE_CLIENT_KEY_FILE
                            when set; False: plain. HTTP health checks need no key.
    """

    def __init__(self, endpoints: Iterable[Union[str, DaemonEndpoint, Dict[str, Any]]], *,
                 timeout_s: float = 30.0, heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 2.0,
                 dead_after_s: float = 5.0, request_timeout_s: Optional[float] = 600.0, resubmit: bool = False,
                 max_resubmits: int = 2, exclude_stale: bool = True, poll_interval_s: float = 0.02,
                 restart_slack_s: float = 0.5, client_name: str = "rolloutd-coordinator",
                 endpoints_file: Optional[str] = None, log: Optional[Callable[[str], None]] = None,
                 curve: Union[CurveKeys, None, bool] = None):
        # Resolved once: every worker's Client uses the same keys (and a bad key file fails here).
        self.curve: Optional[CurveKeys] = resolve_curve(curve)
        eps = [_as_endpoint(e) for e in endpoints]
        if not eps and endpoints_file is None:
            raise ValueError("a coordinator needs at least one daemon endpoint")
        for v, n in ((timeout_s, "timeout_s"), (heartbeat_interval_s, "heartbeat_interval_s"),
                     (heartbeat_timeout_s, "heartbeat_timeout_s"), (dead_after_s, "dead_after_s")):
            if v <= 0:
                raise ValueError(f"{n} must be positive")
        self.timeout_s = float(timeout_s)
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.dead_after_s = float(dead_after_s)
        self.request_timeout_s = request_timeout_s
        self.resubmit = resubmit
        self.max_resubmits = max_resubmits
        self.exclude_stale = exclude_stale
        self.poll_interval_s = poll_interval_s
        self.restart_slack_s = restart_slack_s
        self.client_name = client_name
        self._log_fn = log
        # The version the last push_weights completed; daemons below it are stale.
        self.weight_version: Optional[int] = None

        self._lock = threading.RLock()
        self._pending: Dict[str, _Pending] = {}
        self._events: "queue.Queue[Event]" = queue.Queue()
        self._stash: Deque[Event] = collections.deque()  # taken off the queue by collect(), not theirs
        self._stash_lock = threading.Lock()
        self._workers: List[_Worker] = []
        self._by_key: Dict[str, _Worker] = {}
        self._rr = 0
        self._closed = False
        self.num_dropped_events = 0  # late events of requests already ended here (counted, not delivered)
        for ep in eps:
            self._add(ep)
        self._endpoints_file = endpoints_file
        self._file_stamp: Optional[Tuple[float, int]] = None
        self._watcher: Optional[threading.Thread] = None
        if endpoints_file is not None:
            self._reload_endpoints()
            self._watcher = threading.Thread(target=self._watch_file, name="rolloutd-coord-file", daemon=True)
            self._watcher.start()

    @classmethod
    def from_file(cls, path: str, watch: bool = True, **options: Any) -> "Coordinator":
        """Endpoints from launch-node.sh's file (or any load_endpoints input). watch=True re-reads it
        when it changes: new daemons join, a moved or relaunched one is noticed at once."""
        if watch:
            return cls([], endpoints_file=path, **options)
        return cls(load_endpoints(path), **options)

    # ---- lifetime ----
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        for w in workers:
            w.stop.set()
        for w in workers:
            w.join(timeout=self.timeout_s + 5)

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- fleet membership and health ----
    def _add(self, ep: DaemonEndpoint) -> _Worker:
        with self._lock:
            w = _Worker(self, len(self._workers), ep)
            self._workers.append(w)
            self._by_key[ep.key] = w
        w.start()
        return w

    def _reload_endpoints(self) -> None:
        path = self._endpoints_file
        try:
            st = os.stat(path)
            stamp = (st.st_mtime, st.st_size, st.st_ino)
            if stamp == self._file_stamp:
                return
            eps = load_endpoints(path)
        except (OSError, ValueError) as e:
            self._log(f"cannot read {path}: {e}")
            return
        self._file_stamp = stamp
        for ep in eps:
            w = self._by_key.get(ep.key)
            if w is None:
                self._add(ep)
            elif ep.control != w.endpoint.control:
                w.retarget(ep)
            elif ep.pid is not None:
                w.note_launcher_pid(ep.pid)

    def _watch_file(self) -> None:
        while not self._closed:
            time.sleep(min(self.heartbeat_interval_s, 0.5))
            if not self._closed:
                self._reload_endpoints()

    def daemons(self) -> List[DaemonHealth]:
        """Health of every daemon, by index."""
        with self._lock:
            out = []
            for w in self._workers:
                w._refresh_routable()
                h = replace(w.health)
                h.outstanding_tokens, h.outstanding_requests = w.outstanding_tokens, w.outstanding_requests
                out.append(h)
            return out

    def wait_ready(self, n: Optional[int] = None, timeout_s: float = 60.0) -> List[DaemonHealth]:
        """Waits until `n` daemons (default: all) are routable; raises deadline_exceeded otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.daemons()
            want = len(health) if n is None else n
            ready = [h for h in health if h.routable]
            if health and len(ready) >= want:
                return ready
            if time.monotonic() >= deadline:
                raise RolloutdError("deadline_exceeded", f"{len(ready)} of {want} daemon(s) ready after "
                                    f"{timeout_s} s: " + ", ".join(f"{h.name}={h.state}"
                                                                  + (f" ({h.reason})" if h.reason else "")
                                                                  for h in health), "")
            time.sleep(0.05)

    def daemon_of(self, rid: str) -> Optional[str]:
        """The daemon (name) a request in flight runs on."""
        with self._lock:
            p = self._pending.get(rid)
            return None if p is None else p.worker.key

    @property
    def num_outstanding(self) -> int:
        with self._lock:
            return len(self._pending)

    # ---- rollouts ----
    def _pick(self, cost: int, exclude: Sequence[_Worker] = ()) -> Optional[_Worker]:
        """The routable daemon with the fewest outstanding tokens (then requests, then round robin);
        reserves `cost` on it. With self._lock held."""
        best = None
        n = len(self._workers)
        for k in range(n):
            w = self._workers[(self._rr + k) % n]
            w._refresh_routable()
            if not w.health.routable or w in exclude:
                continue
            if best is None or (w.outstanding_tokens, w.outstanding_requests) < \
                    (best.outstanding_tokens, best.outstanding_requests):
                best = w
        if best is not None:
            self._rr = (best.index + 1) % n
            best.outstanding_tokens += cost
            best.outstanding_requests += 1
        return best

    def _unreserve(self, w: _Worker, cost: int) -> None:
        with self._lock:
            w.outstanding_tokens -= cost
            w.outstanding_requests -= 1

    def _submit_command(self, w: _Worker, req: GenerateRequest, cost: int, resubmits: int = 0):
        """The command that submits `req` on w's thread. The request is registered before it is
        sent, in the thread that pumps w's events, so no event can arrive unmatched."""
        def run(client: Client):
            with self._lock:
                if req.rid in self._pending:
                    raise RolloutdError("duplicate_rid", f"request '{req.rid}' is already in flight here", "rid")
                now = time.monotonic()
                self._pending[req.rid] = _Pending(req, w, w.incarnation, cost, now, now, resubmits=resubmits)
            try:
                client._call(req, GenerateReply)
            except BaseException as e:
                with self._lock:
                    self._pending.pop(req.rid, None)
                if isinstance(e, RolloutdError) and e.code == "deadline_exceeded":
                    client._abandon(req.rid)  # it may have been accepted: abort it
                raise
            return req.rid
        return run

    def _submit_batch_command(self, w: _Worker, items: List[Tuple[GenerateRequest, int]]):
        """The command that submits several requests on w's thread: every request is registered,
        then all are sent, then their replies collected (one round trip for the batch instead of
        one per request), within one deadline of timeout_s for the whole batch. Returns, per item,
        its rid or the error that refused it; whatever is not accepted is unregistered, and a
        request sent but not settled (an unexpected error) is abandoned, on every path."""
        def run(client: Client):
            out: List[Any] = [None] * len(items)
            deadline = time.monotonic() + self.timeout_s
            registered = []
            sent: List[Tuple[int, Any]] = []
            try:
                with self._lock:
                    now = time.monotonic()
                    for k, (req, cost) in enumerate(items):
                        if req.rid in self._pending:
                            out[k] = RolloutdError("duplicate_rid", f"request '{req.rid}' is already in flight here",
                                                   "rid")
                        else:
                            self._pending[req.rid] = _Pending(req, w, w.incarnation, cost, now, now)
                            registered.append(k)
                down: Optional[RolloutdError] = None  # the daemon cannot be reached: send no more
                for k in registered:
                    left = deadline - time.monotonic()
                    if down is None and left <= 0:
                        down = RolloutdError("deadline_exceeded", "the batch's deadline passed before this request "
                                             "was sent", "")
                    if down is not None:
                        out[k] = down
                        continue
                    try:
                        sent.append((k, client.send_request(items[k][0], GenerateReply, timeout_s=left)))
                    except RolloutdError as e:
                        out[k] = e
                        if e.code in ("unavailable", "unauthenticated", "deadline_exceeded"):
                            down = e
                for k, pending in sent:
                    try:
                        pending.result()
                        out[k] = items[k][0].rid
                    except RolloutdError as e:
                        if e.code == "deadline_exceeded":
                            client._abandon(items[k][0].rid)  # it may have been accepted: abort it
                        out[k] = e
            finally:
                settled = {k for k, _ in sent if isinstance(out[k], (str, RolloutdError))}
                for k, _ in sent:
                    if k not in settled:  # an unexpected error while collecting: may run unseen
                        client._abandon(items[k][0].rid)
                with self._lock:
                    for k in registered:
                        if not isinstance(out[k], str):
                            self._pending.pop(items[k][0].rid, None)
            return out
        return run

    def submit(self, input_ids: Sequence[int], *, rid: Optional[str] = None, daemon: Optional[str] = None,
               **sampling: Any) -> str:
        """Submits one generate request (fields as GenerateRequest) to the routable daemon with the
        fewest outstanding tokens (or to `daemon`, by name); returns its rid. Its events come
        from next_event()/events()/collect(). A daemon that refuses for a passing reason
        (draining, not ready, overloaded, unreachable) is skipped for another one."""
        req = _make_request(input_ids, rid, dict(sampling))
        return self._submit_one(req, daemon)

    def _submit_one(self, req: GenerateRequest, daemon: Optional[str] = None) -> str:
        cost = len(req.input_ids) + req.max_new_tokens
        tried: List[_Worker] = []
        last: Optional[RolloutdError] = None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._closed:
                    raise RolloutdError("failed_precondition", "the coordinator is closed", "")
                if daemon is not None:
                    w = self._by_key.get(daemon)
                    if w is None:
                        raise RolloutdError("not_found", f"no daemon named '{daemon}'", "daemon")
                    w.outstanding_tokens += cost
                    w.outstanding_requests += 1
                else:
                    w = self._pick(cost, tried)
            if w is None:
                break
            fut = w.call(self._submit_command(w, req, cost))
            try:
                return fut.result(timeout=self.timeout_s + 1)
            except FutureTimeout:
                # Never started (its worker is busy): cancelled, nothing was registered or sent. Already
                # running: its own deadline bounds it, and what it did stands; giving up on it here
                # sent a request the caller was told had failed (a second final event for a retried rid).
                if fut.cancel():
                    last = RolloutdError("deadline_exceeded", f"daemon {w.key} did not take the request in time", "")
                else:
                    try:
                        return fut.result()
                    except RolloutdError as e:
                        last = e
            except RolloutdError as e:
                last = e
            self._unreserve(w, cost)
            if daemon is not None or last.code not in _RETRY_ELSEWHERE:
                raise last
            with self._lock:
                w.health.routable = w.health.ready = False  # until its next heartbeat says otherwise
            tried.append(w)
        if last is not None:
            raise last
        raise RolloutdError("unavailable", "no ready daemon: " + ", ".join(
            f"{h.name}={h.state}" + (" (stale weights)" if h.stale else "") for h in self.daemons()), "")

    def submit_many(self, prompts: Sequence[Sequence[int]], **sampling: Any) -> List[str]:
        """Submits one request per prompt, spread by outstanding tokens, the daemons taking them in
        parallel; returns the rids in prompt order. A `seed` given here is offset by the
        prompt's index (distinct samples)."""
        reqs = []
        seed = sampling.pop("seed", None)
        for i, p in enumerate(prompts):
            s = dict(sampling)
            if seed is not None:
                s["seed"] = seed + i
            reqs.append(_make_request(p, None, s))
        # Each daemon gets its share as one batch (sent back to back, replies collected after),
        # so a submission costs one round trip per daemon, not one per request.
        batches: Dict[int, Tuple[_Worker, List[Tuple[GenerateRequest, int]], List[int]]] = {}
        unplaced: List[int] = []
        with self._lock:
            for k, req in enumerate(reqs):
                cost = len(req.input_ids) + req.max_new_tokens
                w = self._pick(cost)
                if w is None:
                    unplaced.append(k)
                    continue
                batch = batches.setdefault(id(w), (w, [], []))
                batch[1].append((req, cost))
                batch[2].append(k)
        futures = [(w, items, idx, w.call(self._submit_batch_command(w, items))) for w, items, idx in batches.values()]
        rids: List[Optional[str]] = [None] * len(reqs)
        fatal: Optional[BaseException] = None
        # Settle every batch (each is bounded by its own deadline once it runs) before acting on
        # any failure, so no reservation is left behind and no accepted request is lost.
        for w, items, idx, fut in futures:
            try:
                results = fut.result(timeout=self.timeout_s + 5)
            except FutureTimeout:
                if fut.cancel():  # never started (the worker is busy): nothing was registered
                    results = [RolloutdError("deadline_exceeded", f"{w.key} did not take the batch in time", "")] \
                        * len(items)
                else:  # running: its own deadline bounds it
                    try:
                        results = fut.result()
                    except BaseException as e:  # noqa: BLE001 - settled below like any refusal
                        results = [e] * len(items)
            except BaseException as e:  # noqa: BLE001 - the batch cleaned its registrations up
                results = [e] * len(items)
            for (req, cost), k, r in zip(items, idx, results):
                if isinstance(r, str):
                    rids[k] = r
                    continue
                self._unreserve(w, cost)
                if isinstance(r, RolloutdError) and r.code in _RETRY_ELSEWHERE:
                    unplaced.append(k)
                    with self._lock:  # as _submit_one does: until its next heartbeat says otherwise
                        w.health.routable = w.health.ready = False
                elif fatal is None:
                    fatal = r
        if fatal is not None:
            for rid in rids:  # accepted by some daemon, but the caller gets no rid list: abort them
                if rid is not None:
                    try:
                        self.abort(rid)
                    except (RolloutdError, FutureTimeout):
                        pass  # its daemon is gone, and the request with it
            raise fatal
        for k in sorted(unplaced):
            rids[k] = self._submit_one(reqs[k])  # one by one, skipping daemons that refuse
        return rids

    def _abort_nowait(self, rid: str) -> None:
        """Asks the request's daemon to abort it and returns at once (its worker sends it)."""
        with self._lock:
            p = self._pending.get(rid)
        if p is not None:
            p.worker.call(lambda c: c.abort(rid))  # failures are moot: the request ends either way

    def abort(self, rid: str) -> int:
        """Aborts one request; its final event (finished{abort}) follows. 0 if it was not in flight."""
        with self._lock:
            p = self._pending.get(rid)
        if p is None:
            return 0
        return p.worker.call(lambda c: c.abort(rid).num_aborted).result(timeout=self.timeout_s + 1)

    def abort_all(self) -> Dict[str, Union[int, RolloutdError]]:
        """abort{all} on every daemon: num_aborted per daemon, or the error."""
        results = self._fan_out(self._reachable(), lambda c: c.abort_all().num_aborted, self.timeout_s)
        return {w.key: value for w, (ok, value) in results.items()}

    # ---- events ----
    def next_event(self, timeout_s: float) -> Optional[Event]:
        """The next event of any request submitted here, from any daemon; None after timeout_s."""
        with self._stash_lock:
            if self._stash:
                return self._stash.popleft()
        try:
            return self._events.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None

    def events(self, timeout_s: float = 1.0) -> Iterator[Event]:
        """Yields events of every daemon as they arrive; stops when none arrives within timeout_s."""
        while True:
            ev = self.next_event(timeout_s)
            if ev is None:
                return
            yield ev

    def collect(self, rids: Iterable[str], timeout_s: float = 600.0) -> Dict[str, GenerateResult]:
        """Collects the given requests until each has its final event; other requests' events stay
        queued for next_event(). At the deadline the rest are aborted (without waiting for the
        daemons' replies: their final events follow on next_event()) and deadline_exceeded is
        raised at once, carrying the requests that did finish as its `.results`."""
        want = {rid: _Collector(rid) for rid in rids}
        done: Dict[str, GenerateResult] = {}
        with self._stash_lock:
            keep = collections.deque()
            for ev in self._stash:
                c = want.get(ev.rid)
                if c is None or ev.rid in done:
                    keep.append(ev)
                elif c.add(ev):
                    done[ev.rid] = c.result
            self._stash = keep
        deadline = time.monotonic() + timeout_s
        while len(done) < len(want):
            left = deadline - time.monotonic()
            ev = None
            if left > 0:
                try:
                    ev = self._events.get(timeout=left)
                except queue.Empty:
                    ev = None
            if ev is None:
                missing = [rid for rid in want if rid not in done]
                for rid in missing:
                    self._abort_nowait(rid)
                err = RolloutdError("deadline_exceeded", f"{len(missing)} request(s) did not finish within "
                                    f"{timeout_s} s (aborted): {missing[:5]}", "rid")
                err.results = done  # type: ignore[attr-defined]  # one straggler must not cost the batch
                raise err
            c = want.get(ev.rid)
            if c is None or ev.rid in done:
                with self._stash_lock:
                    self._stash.append(ev)
            elif c.add(ev):
                done[ev.rid] = c.result
        return {rid: done[rid] for rid in want}

    def generate_many(self, prompts: Sequence[Sequence[int]], timeout_s: float = 600.0,
                      **sampling: Any) -> List[GenerateResult]:
        """submit_many + collect: one GenerateResult per prompt, in order."""
        rids = self.submit_many(prompts, **sampling)
        results = self.collect(rids, timeout_s)
        return [results[r] for r in rids]

    # ---- bookkeeping of events (worker threads) ----
    def _deliver(self, w: _Worker, incarnation: int, ev: Event) -> None:
        with self._lock:
            p = self._pending.get(ev.rid)
            if p is None or p.worker is not w or p.incarnation != incarnation:
                # The request already ended here (lost, timed out, resubmitted elsewhere): its
                # final event was delivered; this straggler must not make a second one.
                self.num_dropped_events += 1
                return
            p.last_event = time.monotonic()
            if isinstance(ev, TokensEvent):
                n = min(len(ev.token_ids), p.cost)
                p.tokens += len(ev.token_ids)
                p.cost -= n
                w.outstanding_tokens -= n
            elif isinstance(ev, RetractedEvent):
                # It starts again from its prompt: what it had produced is owed again.
                back = len(p.request.input_ids) + p.request.max_new_tokens - p.cost
                p.cost += back
                w.outstanding_tokens += back
                p.tokens = 0
            elif _is_final(ev):
                del self._pending[ev.rid]
                w.outstanding_tokens -= p.cost
                w.outstanding_requests -= 1
            self._events.put(ev)

    def _finish_synthetic(self, rid: str, p: _Pending, code: str, message: str) -> None:
        """Ends a request the daemon can no longer end itself. Worker thread of p.worker."""
        with self._lock:
            if self._pending.get(rid) is not p:
                return
            del self._pending[rid]
            p.worker.outstanding_tokens -= p.cost
            p.worker.outstanding_requests -= 1
            self._events.put(FailedEvent(rid, ErrorInfo(code, message, "rid")))

    def _reroute(self, rid: str, p: _Pending, why: str) -> None:
        """A lost daemon's request: resubmitted elsewhere when allowed, else failed."""
        if not self.resubmit or p.resubmits >= self.max_resubmits:
            self._finish_synthetic(rid, p, "unavailable", why + "; the request was lost with it")
            return
        full = len(p.request.input_ids) + p.request.max_new_tokens
        with self._lock:
            if self._pending.get(rid) is not p:
                return
            w = self._pick(full, exclude=[p.worker])
            if w is None:
                del self._pending[rid]
                p.worker.outstanding_tokens -= p.cost
                p.worker.outstanding_requests -= 1
                self._events.put(FailedEvent(rid, ErrorInfo("unavailable", why + "; no other daemon could take "
                                                            "it", "rid")))
                return
            del self._pending[rid]
            p.worker.outstanding_tokens -= p.cost
            p.worker.outstanding_requests -= 1
            # Void what it produced, as a retraction does, then run it again elsewhere.
            self._events.put(RetractedEvent(rid, p.tokens, "daemon_lost"))
        req, resubmits = p.request, p.resubmits + 1
        self._log(f"resubmitting {rid} to {w.key} ({why})")

        def run(client: Client):
            try:
                return self._submit_command(w, req, full, resubmits)(client)
            except BaseException as e:  # noqa: BLE001 - reported as the request's final event
                with self._lock:
                    w.outstanding_tokens -= full
                    w.outstanding_requests -= 1
                    self._events.put(FailedEvent(rid, ErrorInfo(
                        getattr(e, "code", "unavailable"), f"{why}; resubmitting to {w.key} failed: {e}", "rid")))
        w.call(run)

    # ---- weights and fleet-wide calls ----
    def _reachable(self) -> List[_Worker]:
        with self._lock:
            return [w for w in self._workers if w.health.state not in ("lost", "unreachable", "connecting")]

    def _fan_out(self, workers: Sequence[_Worker], fn: Callable[[Client], Any], timeout_s: float,
                 on_late: Optional[Callable[[Client, Any], Any]] = None) -> Dict[_Worker, Tuple[bool, Any]]:
        """Runs fn on each worker's thread in parallel: {worker: (True, value) | (False, error)}.
        A worker that does not answer by the deadline fails with deadline_exceeded; if its call
        completes later, on_late(client, value) undoes it (an opened session is aborted)."""
        gave_up: Dict[_Worker, bool] = {}
        done: Dict[_Worker, bool] = {}  # fn returned: the caller must take its value, not give up
        lock = threading.Lock()

        def wrap(w):
            def run(client):
                value = fn(client)
                with lock:
                    done[w] = True
                    late = gave_up.get(w, False)
                if late and on_late is not None:
                    with contextlib.suppress(RolloutdError):
                        on_late(client, value)
                return value
            return run

        calls = {w: w.call(wrap(w)) for w in workers}
        deadline = time.monotonic() + timeout_s
        out: Dict[_Worker, Tuple[bool, Any]] = {}
        for w, fut in calls.items():
            try:
                out[w] = (True, fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                with lock:
                    finished = done.get(w, False)
                    if not finished:
                        gave_up[w] = True
                if finished:  # fn returned just as the wait ran out: its outcome stands (no undo runs)
                    try:
                        out[w] = (True, fut.result())
                    except RolloutdError as e:
                        out[w] = (False, e)
                    continue
                out[w] = (False, RolloutdError("deadline_exceeded", f"daemon {w.key} did not answer within "
                                               f"{timeout_s} s", ""))
            except RolloutdError as e:
                out[w] = (False, e)
        return out

    def _tightest_limits(self, workers: Sequence[_Worker]) -> Limits:
        known = [w.limits for w in workers if w.limits is not None]
        if not known:
            return Limits()
        return Limits(**{f: min(getattr(l, f) for l in known) for f in Limits.__dataclass_fields__})

    def _weights_completed(self, result: FleetWeightUpdate) -> None:
        if not result.completed:
            return
        with self._lock:
            if self.weight_version is None or result.weight_version > self.weight_version:
                self.weight_version = result.weight_version
            for w in self._workers:
                if w.key in result.completed:
                    w.health.weight_version = max(w.health.weight_version, result.weight_version)
                w._refresh_routable()

    def begin_weight_update(self, selector: Optional[Sequence[str]] = None, session_timeout_s: float = 60.0,
                            daemons: Optional[Sequence[str]] = None,
                            step_timeout_s: Optional[float] = None) -> FleetWeightSession:
        """Opens a weight-update session on every reachable daemon (or the named ones)."""
        with self._lock:
            pool = [w for w in self._workers if daemons is None or w.key in daemons]
        reachable = set(self._reachable())
        skipped = {w.key: f"not reachable ({w.health.state}: {w.health.reason})"
                   for w in pool if w not in reachable}
        return FleetWeightSession(self, [w for w in pool if w in reachable], selector, session_timeout_s,
                                  self.timeout_s if step_timeout_s is None else step_timeout_s, skipped)

    def push_weights(self, tensors, weight_version: int, *, bucket_bytes: int = 256 << 20, via: str = "inline",
                     checksum: bool = False, selector: Optional[Sequence[str]] = None,
                     session_timeout_s: float = 60.0, pause_mode: Optional[str] = None,
                     daemons: Optional[Sequence[str]] = None, align: int = 64) -> FleetWeightUpdate:
        """One weight update on every reachable daemon: (pause_generation(pause_mode),) begin on all,
        each bucket to all, end(weight_version) on all (, continue_generation). Buckets are packed
        once and fit the tightest daemon limits. via="shm" writes each bucket once into one POSIX
        shared-memory region that every daemon reads (they must all run on this host).

        A daemon that fails a step is dropped from the rest (its session aborted) and reported in
        the result's .failed; unreachable ones in .skipped. Call .raise_for_error() to insist."""
        if via not in ("inline", "shm"):
            raise ValueError(f"via must be 'inline' or 'shm', got {via!r}")
        started = time.monotonic()
        items = [_weights._as_tensor(i, t) for i, t in enumerate(tensors)]
        paused: List[_Worker] = []
        if pause_mode is not None:
            pool = [w for w in self._reachable() if daemons is None or w.key in daemons]
            # A pause that completes after the deadline is undone at once: that daemon is not in
            # `paused`, so the continue below would never reach it, and it would stay paused
            # while its heartbeat said ready (requests routed there would wait for ever).
            for w, (ok, _) in self._fan_out(pool, lambda c: c.pause_generation(pause_mode), self.timeout_s,
                                            on_late=lambda c, _: c.continue_generation()).items():
                if ok:
                    paused.append(w)
        shm = None
        session = self.begin_weight_update(selector, session_timeout_s, daemons)
        session.refuse_below(weight_version)
        try:
            limits = session.limits
            max_bytes = min(bucket_bytes, limits.max_frame_bytes) if via == "inline" else bucket_bytes
            if via == "inline":
                for t in items:
                    if t.nbytes > limits.max_frame_bytes:
                        raise ValueError(f"'{t.name}' is {t.nbytes} bytes, more than the daemons' max_frame_bytes "
                                         f"({limits.max_frame_bytes}); send it with via='shm'")
            max_envelope = max(limits.max_envelope_bytes - _weights._ENVELOPE_SLACK, 1)
            buckets = _weights._buckets(items, max_bytes, max(limits.max_bucket_entries, 1), max_envelope, align)
            if via == "shm" and buckets:
                from multiprocessing import shared_memory
                import uuid

                region = max(_weights._layout(b, align)[1] for b in buckets)
                shm = shared_memory.SharedMemory(name=f"rolloutd-fleet-{uuid.uuid4().hex}", create=True,
                                                 size=max(region, 1))
            for bucket in buckets:
                if not session.active:
                    break
                if via == "inline":
                    entries, data = _weights._pack(bucket, align)
                    session.update_weights_inline(entries, data, checksum=True if checksum else None)
                else:
                    entries, size = _weights._layout(bucket, align)
                    buf, end = shm.buf, 0
                    for t, e in zip(bucket, entries):
                        buf[end:e.byte_offset] = bytes(e.byte_offset - end)
                        buf[e.byte_offset:e.byte_offset + e.nbytes] = t.data
                        end = e.byte_offset + e.nbytes
                    # Every daemon has copied the region once its reply is in (SPEC §11.3); the
                    # step waits for all of them before the next bucket overwrites it.
                    session.update_weights_shm(entries, "/" + shm.name, 0, size,
                                               checksum=zlib.crc32(buf[:size]) if checksum else None)
            result = session.end(weight_version)
        except BaseException:
            session.abort()
            raise
        finally:
            if shm is not None:
                shm.close()
                shm.unlink()
            if paused:
                self._fan_out(paused, lambda c: c.continue_generation(), self.timeout_s)
        # Heartbeats taken during the session saw "updating": look again now, so routing sees
        # the daemons ready at their new version as soon as this returns.
        self.refresh_health()
        result.duration_s = time.monotonic() - started
        return result

    def refresh_health(self, timeout_s: Optional[float] = None) -> List[DaemonHealth]:
        """Takes a heartbeat of every daemon now (instead of at its next interval); returns daemons()."""
        with self._lock:
            workers = list(self._workers)
        futures = [w.call(lambda c, w=w: w._heartbeat()) for w in workers]
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 2 * self.heartbeat_timeout_s + 1)
        for f in futures:
            with contextlib.suppress(FutureTimeout, RolloutdError):
                f.result(timeout=max(0.0, deadline - time.monotonic()))
        return self.daemons()

    def pause_generation(self, mode: str) -> Dict[str, Any]:
        return {w.key: v for w, (_, v) in self._fan_out(self._reachable(), lambda c: c.pause_generation(mode),
                                                            self.timeout_s).items()}

    def continue_generation(self) -> Dict[str, Any]:
        return {w.key: v for w, (_, v) in self._fan_out(self._reachable(), lambda c: c.continue_generation(),
                                                            self.timeout_s).items()}

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """Per daemon: its ReleaseMemoryReply (or the error: failed_precondition while busy)."""
        return {w.key: v for w, (_, v) in self._fan_out(self._reachable(), lambda c: c.release_memory(tags),
                                                            self.timeout_s).items()}

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """Per daemon: its ResumeMemoryReply (or the error: resource_exhausted while the GPU is full).
        Weights must be pushed again afterwards (FleetWeightUpdate) before the daemons are ready."""
        return {w.key: v for w, (_, v) in self._fan_out(self._reachable(), lambda c: c.resume_memory(tags),
                                                            self.timeout_s).items()}

    def weights_checksum(self, names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
        """Per daemon: its WeightsChecksums (or the error)."""
        return {w.key: v for w, (_, v) in self._fan_out(self._reachable(), lambda c: c.weights_checksum(names),
                                                            self.timeout_s).items()}

    def status(self) -> Dict[str, Any]:
        """Per daemon: a fresh status reply (or the error)."""
        return {w.key: v for w, (_, v) in self._fan_out(self._reachable(), lambda c: c.status(),
                                                            self.timeout_s).items()}

    def _log(self, msg: str) -> None:
        if self._log_fn is not None:
            self._log_fn(msg)

