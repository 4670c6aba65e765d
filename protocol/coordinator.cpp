#include "protocol/coordinator.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <regex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "protocol/client.hpp"

namespace rolloutd::protocol {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

const std::string& rid_of(const Event& e) {
  return std::visit([](const auto& ev) -> const std::string& { return ev.rid; }, e);
}

// Errors of a submit that say "not this daemon, now": another may take the request.
bool retry_elsewhere(ErrorCode c) {
  switch (c) {
    case ErrorCode::kDraining:
    case ErrorCode::kNotReady:
    case ErrorCode::kOverloaded:
    case ErrorCode::kUnavailable:
    case ErrorCode::kDeadlineExceeded:
    case ErrorCode::kResourceExhausted:
    case ErrorCode::kFailedPrecondition:
    case ErrorCode::kUnauthenticated:  // this daemon refuses our key; another may not
      return true;
    default:
      return false;
  }
}

uint64_t cost_of(const GenerateRequest& r) { return r.input_ids.size() + uint64_t{r.max_new_tokens}; }

}  // namespace

// ------------------------------------------------------------- endpoints file --

Result<std::vector<DaemonEndpoint>> load_endpoints_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status(ErrorCode::kNotFound, "cannot read " + path, "path");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  // The files are ours (launch-node.sh, the daemon's --endpoints-file): flat objects of
  // strings and integers, so a scan is enough and protocol/ keeps off a JSON library.
  std::smatch m;
  std::string host;
  if (std::regex_search(text, m, std::regex(R"re("host"\s*:\s*"([^"]*)")re"))) host = m[1];
  std::vector<DaemonEndpoint> out;
  const std::regex object(R"re(\{[^{}]*"control"\s*:\s*"([^"]+)"[^{}]*\})re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), object); it != std::sregex_iterator(); ++it) {
    const std::string obj = (*it)[0];
    std::smatch s;
    if (std::regex_search(obj, s, std::regex(R"re("state"\s*:\s*"(\w+)")re")) &&
        (s[1] == "failed" || s[1] == "exited" || s[1] == "stopped"))
      continue;
    DaemonEndpoint ep;
    ep.control = (*it)[1];
    if (std::regex_search(obj, s, std::regex(R"re("index"\s*:\s*(\d+))re"))) ep.name = host + "/" + s[1].str();
    out.push_back(std::move(ep));
  }
  if (out.empty() && text.find("\"daemons\"") == std::string::npos)
    return Status(ErrorCode::kInvalidArgument, path + " names no daemon (no \"control\" endpoint)", "path");
  return out;
}

// ------------------------------------------------------------------ internals --

struct Worker;

struct Pending {
  GenerateRequest request;
  Worker* worker = nullptr;
  uint32_t incarnation = 0;
  uint64_t cost = 0;  // tokens it still stands for in the worker's outstanding count
  Clock::time_point last_event;
  uint32_t tokens = 0;
  uint32_t resubmits = 0;
};

struct Coordinator::Impl {
  CoordinatorOptions options;
  mutable std::mutex mu;  // guards everything below and each Worker's shared fields
  std::vector<std::unique_ptr<Worker>> workers;
  std::unordered_map<std::string, Pending> pending;
  std::deque<FleetEvent> events;
  std::condition_variable events_cv;
  std::optional<uint64_t> fleet_version;
  size_t rr = 0;
  uint64_t dropped = 0;

  ~Impl();
  // With mu held: the routable worker with the fewest outstanding tokens; reserves `cost`.
  Worker* pick(uint64_t cost, const std::vector<Worker*>& exclude);
  void refresh_routable(Worker& w);  // mu held
  void deliver(Worker& w, uint32_t incarnation, Event event);
  void finish_synthetic(const std::string& rid, Worker& w, const std::string& code, const std::string& message);
  void reroute(const std::string& rid, Worker& w, const std::string& why);
  void push_event(std::string daemon, Event e);  // mu held
  std::function<Result<std::string>(Client&)> submit_task(Worker& w, GenerateRequest req, uint64_t cost,
                                                          uint32_t resubmits);
};

struct Worker {
  using Task = std::function<void(Client*)>;  // nullptr: the coordinator is closing

  Coordinator::Impl& owner;
  size_t index;
  DaemonEndpoint endpoint;
  std::thread thread;
  std::mutex qmu;
  std::deque<Task> tasks;
  std::atomic<bool> stop{false};

  // Guarded by owner.mu:
  DaemonHealth health;
  uint64_t outstanding_tokens = 0;
  uint64_t outstanding_requests = 0;
  uint32_t incarnation = 0;

  // Worker thread only:
  std::unique_ptr<Client> client;  // commands and events
  std::unique_ptr<Client> probe;   // heartbeats, with a short deadline
  std::optional<Clock::time_point> last_ok, first_fail;
  std::optional<Clock::time_point> start_estimate;
  bool lost_since_ok = false;
  Clock::time_point next_heartbeat{};
  std::optional<uint64_t> last_generated;  // the daemon's tokens generated, last heartbeat

  Worker(Coordinator::Impl& o, size_t i, DaemonEndpoint ep) : owner(o), index(i), endpoint(std::move(ep)) {
    health.index = i;
    health.name = endpoint.key();
    health.control = endpoint.control;
  }

  template <class T>
  std::future<Result<T>> call(std::function<Result<T>(Client&)> fn) {
    auto promise = std::make_shared<std::promise<Result<T>>>();
    auto fut = promise->get_future();
    Task task = [promise, fn = std::move(fn), key = endpoint.key()](Client* c) {
      if (c == nullptr) {
        promise->set_value(Status(ErrorCode::kUnavailable, "coordinator closed (" + key + ")"));
        return;
      }
      promise->set_value(fn(*c));
    };
    {
      std::lock_guard<std::mutex> lock(qmu);
      if (!stop.load()) {
        tasks.push_back(std::move(task));
        return fut;
      }
    }
    task(nullptr);
    return fut;
  }

  void connect() {
    ClientOptions o;
    o.endpoint = endpoint.control;
    o.curve = owner.options.curve;
    o.request_timeout_ms = owner.options.request_timeout_ms;
    auto c = Client::connect(o);
    o.request_timeout_ms = owner.options.heartbeat_timeout_ms;
    auto p = Client::connect(o);
    // connect() only fails for a malformed endpoint; create() checked them.
    client = c.ok() ? std::move(c).value() : nullptr;
    probe = p.ok() ? std::move(p).value() : nullptr;
    start_estimate.reset();
  }

  void run() {
    connect();
    while (!stop.load()) {
      run_tasks();
      if (Clock::now() >= next_heartbeat) {
        heartbeat();
        expire_requests();
        next_heartbeat = Clock::now() + milliseconds(owner.options.heartbeat_interval_ms);
      }
      bool idle;
      {
        std::lock_guard<std::mutex> lock(qmu);
        idle = tasks.empty();
      }
      pump(idle ? owner.options.poll_interval_ms : 0);
    }
    // Tasks that will never run get an answer, so no caller waits past its deadline.
    std::deque<Task> left;
    {
      std::lock_guard<std::mutex> lock(qmu);
      left.swap(tasks);
    }
    for (auto& t : left) t(nullptr);
  }

  void run_tasks() {
    for (;;) {
      Task t;
      {
        std::lock_guard<std::mutex> lock(qmu);
        if (tasks.empty()) return;
        t = std::move(tasks.front());
        tasks.pop_front();
      }
      t(client.get());
    }
  }

  void pump(int wait_ms) {
    for (int n = 0; n < 1000; ++n) {  // then let tasks and heartbeats in
      auto ev = client->next_event(n == 0 ? wait_ms : 0);
      if (!ev.ok() || !*ev) return;  // a malformed event's request is caught by its idle deadline
      owner.deliver(*this, incarnation_now(), std::move(**ev));
    }
  }

  uint32_t incarnation_now() {
    std::lock_guard<std::mutex> lock(owner.mu);
    return incarnation;
  }

  void heartbeat() {
    const auto& o = owner.options;
    auto status = probe->status();
    const auto now = Clock::now();
    if (!status.ok()) {
      if (!first_fail) first_fail = now;
      const double down_s = std::chrono::duration<double>(now - (last_ok ? *last_ok : *first_fail)).count();
      {
        std::lock_guard<std::mutex> lock(owner.mu);
        health.state = lost_since_ok ? "lost" : "unreachable";
        health.ready = health.routable = false;
        health.reason = "no heartbeat reply for " + std::to_string(down_s) + " s: " + status.status().to_string();
      }
      if (last_ok && !lost_since_ok && down_s * 1000 >= o.dead_after_ms)
        lose("unreachable for " + std::to_string(static_cast<int>(down_s)) + " s");
      return;
    }
    // Restarted? Its start time (now - uptime, steady-clock based) moved forward.
    const auto start = now - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(status->uptime_s));
    const bool restarted =
        start_estimate && std::chrono::duration<double>(start - *start_estimate).count() > o.restart_slack_s;
    if (restarted && !lost_since_ok) lose("restarted");
    if (!start_estimate || restarted || start < *start_estimate) start_estimate = start;
    last_ok = now;
    first_fail.reset();
    lost_since_ok = false;
    const uint64_t generated = status->num_tokens_generated_total;
    // != rather than >: a restarted daemon counts from 0 again.
    const bool progressing = last_generated && generated != *last_generated;
    last_generated = generated;
    std::lock_guard<std::mutex> lock(owner.mu);
    if (progressing) {
      // The daemon generates: its requests that sent nothing meanwhile are queued or
      // stream=false, not stuck. request_idle_timeout_ms counts time without progress.
      for (auto& [rid, p] : owner.pending)
        if (p.worker == this) p.last_event = now;
    }
    health.state = status->state;
    health.ready = status->ready;
    health.reason = status->reason;
    health.weight_version = status->weight_version;
    owner.refresh_routable(*this);
  }

  // The daemon died or restarted: every request it held ends (failed, or resubmitted
  // elsewhere); later events of the old connection are ignored. Worker thread only.
  void lose(const std::string& why) {
    std::vector<std::string> mine;
    {
      std::lock_guard<std::mutex> lock(owner.mu);
      ++incarnation;
      health.incarnation = incarnation;
      ++health.num_lost;
      health.ready = health.routable = false;
      health.state = "lost";
      health.reason = why;
      for (const auto& [rid, p] : owner.pending)
        if (p.worker == this) mine.push_back(rid);
    }
    lost_since_ok = true;
    for (const auto& rid : mine) owner.reroute(rid, *this, "daemon " + endpoint.key() + " " + why);
    connect();  // a fresh connection: the old one's routing id belongs to a dead peer
  }

  void expire_requests() {
    const int limit = owner.options.request_idle_timeout_ms;
    if (limit <= 0) return;
    std::vector<std::string> late;
    {
      std::lock_guard<std::mutex> lock(owner.mu);
      for (const auto& [rid, p] : owner.pending)
        if (p.worker == this && Clock::now() - p.last_event > milliseconds(limit)) late.push_back(rid);
    }
    for (const auto& rid : late) {
      (void)client->abort(rid);
      owner.finish_synthetic(rid, *this, "deadline_exceeded",
                             "no event for " + std::to_string(limit) + " ms from daemon " + endpoint.key() +
                                 "; aborted it");
    }
  }
};

Coordinator::Impl::~Impl() {
  for (auto& w : workers) w->stop.store(true);
  for (auto& w : workers)
    if (w->thread.joinable()) w->thread.join();
}

void Coordinator::Impl::refresh_routable(Worker& w) {
  w.health.stale = options.exclude_stale && fleet_version && w.health.weight_version < *fleet_version;
  w.health.routable = w.health.ready && !w.health.stale && !w.stop.load();
}

Worker* Coordinator::Impl::pick(uint64_t cost, const std::vector<Worker*>& exclude) {
  Worker* best = nullptr;
  const size_t n = workers.size();
  for (size_t k = 0; k < n; ++k) {
    Worker* w = workers[(rr + k) % n].get();
    refresh_routable(*w);
    if (!w->health.routable || std::find(exclude.begin(), exclude.end(), w) != exclude.end()) continue;
    if (!best || std::pair(w->outstanding_tokens, w->outstanding_requests) <
                     std::pair(best->outstanding_tokens, best->outstanding_requests))
      best = w;
  }
  if (best) {
    rr = (best->index + 1) % n;
    best->outstanding_tokens += cost;
    best->outstanding_requests += 1;
  }
  return best;
}

void Coordinator::Impl::push_event(std::string daemon, Event e) {
  events.push_back(FleetEvent{std::move(daemon), std::move(e)});
  events_cv.notify_one();
}

void Coordinator::Impl::deliver(Worker& w, uint32_t incarnation, Event event) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pending.find(rid_of(event));
  if (it == pending.end() || it->second.worker != &w || it->second.incarnation != incarnation) {
    // The request already ended here (lost, timed out, resubmitted): its final event was
    // delivered; a straggler must not make a second one.
    ++dropped;
    return;
  }
  Pending& p = it->second;
  p.last_event = Clock::now();
  if (auto* t = std::get_if<TokensEvent>(&event)) {
    const uint64_t n = std::min<uint64_t>(t->token_ids.size(), p.cost);
    p.tokens += static_cast<uint32_t>(t->token_ids.size());
    p.cost -= n;
    w.outstanding_tokens -= n;
  } else if (std::holds_alternative<RetractedEvent>(event)) {
    const uint64_t back = cost_of(p.request) - p.cost;  // produced so far: owed again
    p.cost += back;
    w.outstanding_tokens += back;
    p.tokens = 0;
  } else {
    w.outstanding_tokens -= p.cost;
    w.outstanding_requests -= 1;
    pending.erase(it);
  }
  push_event(w.endpoint.key(), std::move(event));
}

void Coordinator::Impl::finish_synthetic(const std::string& rid, Worker& w, const std::string& code,
                                         const std::string& message) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pending.find(rid);
  if (it == pending.end() || it->second.worker != &w) return;
  w.outstanding_tokens -= it->second.cost;
  w.outstanding_requests -= 1;
  pending.erase(it);
  push_event(w.endpoint.key(), FailedEvent{rid, ErrorInfo{code, message, "rid"}});
}

std::function<Result<std::string>(Client&)> Coordinator::Impl::submit_task(Worker& w, GenerateRequest req,
                                                                           uint64_t cost, uint32_t resubmits) {
  // Registered before it is sent, on the thread that pumps w's events: no event can arrive
  // unmatched.
  return [this, &w, req = std::move(req), cost, resubmits](Client& c) -> Result<std::string> {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (pending.count(req.rid))
        return Status(ErrorCode::kDuplicateRid, "request '" + req.rid + "' is already in flight here", "rid");
      Pending p;
      p.request = req;
      p.worker = &w;
      p.incarnation = w.incarnation;
      p.cost = cost;
      p.last_event = Clock::now();
      p.resubmits = resubmits;
      pending.emplace(req.rid, std::move(p));
    }
    auto reply = c.submit(req);
    if (!reply.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu);
        pending.erase(req.rid);
      }
      if (reply.status().code() == ErrorCode::kDeadlineExceeded) (void)c.abort(req.rid);  // it may run
      return reply.status();
    }
    return req.rid;
  };
}

void Coordinator::Impl::reroute(const std::string& rid, Worker& from, const std::string& why) {
  Worker* to = nullptr;
  GenerateRequest req;
  uint32_t resubmits = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(rid);
    if (it == pending.end() || it->second.worker != &from) return;
    Pending p = it->second;
    from.outstanding_tokens -= p.cost;
    from.outstanding_requests -= 1;
    pending.erase(it);
    if (options.resubmit && p.resubmits < options.max_resubmits) to = pick(cost_of(p.request), {&from});
    if (!to) {
      push_event(from.endpoint.key(),
                 FailedEvent{rid, ErrorInfo{"unavailable",
                                            why + (options.resubmit ? "; no other daemon could take it"
                                                                    : "; the request was lost with it"),
                                            "rid"}});
      return;
    }
    // Void what it produced, as a retraction does, then run it again elsewhere.
    push_event(from.endpoint.key(), RetractedEvent{rid, p.tokens, "daemon_lost"});
    req = p.request;
    resubmits = p.resubmits + 1;
  }
  const uint64_t cost = cost_of(req);
  auto task = submit_task(*to, req, cost, resubmits);
  (void)to->call<std::string>([this, to, task, rid, why, cost](Client& c) -> Result<std::string> {
    auto r = task(c);
    if (!r.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      to->outstanding_tokens -= cost;
      to->outstanding_requests -= 1;
      push_event(to->endpoint.key(),
                 FailedEvent{rid, ErrorInfo{std::string(error_code_name(r.status().code())),
                                            why + "; resubmitting to " + to->endpoint.key() +
                                                " failed: " + r.status().message(),
                                            "rid"}});
    }
    return r;
  });
}

// ---------------------------------------------------------------- Coordinator --

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() = default;

Result<std::unique_ptr<Coordinator>> Coordinator::create(std::vector<DaemonEndpoint> endpoints,
                                                         CoordinatorOptions options) {
  if (endpoints.empty())
    return Status(ErrorCode::kInvalidArgument, "a coordinator needs at least one daemon", "endpoints");
  if (options.request_timeout_ms <= 0 || options.heartbeat_interval_ms <= 0 || options.heartbeat_timeout_ms <= 0 ||
      options.dead_after_ms <= 0)
    return Status(ErrorCode::kInvalidArgument, "timeouts and intervals must be positive", "options");
  for (const auto& ep : endpoints) {
    ClientOptions o;
    o.endpoint = ep.control;
    o.curve = options.curve;
    RD_RETURN_IF_ERROR(Client::connect(o).status());  // a malformed endpoint or key fails here
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  for (size_t i = 0; i < endpoints.size(); ++i)
    impl->workers.push_back(std::make_unique<Worker>(*impl, i, std::move(endpoints[i])));
  for (auto& w : impl->workers) w->thread = std::thread([w = w.get()] { w->run(); });
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

std::vector<DaemonHealth> Coordinator::daemons() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<DaemonHealth> out;
  for (auto& w : impl_->workers) {
    impl_->refresh_routable(*w);
    DaemonHealth h = w->health;
    h.outstanding_tokens = w->outstanding_tokens;
    h.outstanding_requests = w->outstanding_requests;
    out.push_back(std::move(h));
  }
  return out;
}

Status Coordinator::wait_ready(size_t n, int timeout_ms) {
  const auto deadline = Clock::now() + milliseconds(timeout_ms);
  for (;;) {
    auto health = daemons();
    const size_t want = n == 0 ? health.size() : n;
    size_t ready = 0;
    std::string states;
    for (const auto& h : health) {
      ready += h.routable ? 1 : 0;
      states += (states.empty() ? "" : ", ") + h.name + "=" + h.state;
    }
    if (ready >= want) return Status::Ok();
    if (Clock::now() >= deadline)
      return Status(ErrorCode::kDeadlineExceeded,
                    std::to_string(ready) + " of " + std::to_string(want) + " daemon(s) ready: " + states);
    std::this_thread::sleep_for(milliseconds(20));
  }
}

Result<std::string> Coordinator::submit(GenerateRequest req, const std::string& daemon) {
  if (req.rid.empty()) req.rid = random_rid();
  const uint64_t cost = cost_of(req);
  std::vector<Worker*> tried;
  Status last(ErrorCode::kUnavailable, "no ready daemon");
  const auto deadline = Clock::now() + milliseconds(impl_->options.request_timeout_ms);
  while (Clock::now() < deadline) {
    Worker* w = nullptr;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      if (!daemon.empty()) {
        for (auto& c : impl_->workers)
          if (c->endpoint.key() == daemon) w = c.get();
        if (!w) return Status(ErrorCode::kNotFound, "no daemon named '" + daemon + "'", "daemon");
        w->outstanding_tokens += cost;
        w->outstanding_requests += 1;
      } else {
        w = impl_->pick(cost, tried);
      }
    }
    if (!w) break;
    // 0 queued, 1 running, 2 cancelled. A command still queued when the wait below gives up is
    // cancelled; one already running is waited for (its client calls are bounded) and its outcome
    // stands. Giving up on it without either sent a request the caller was told had failed.
    auto state = std::make_shared<std::atomic<int>>(0);
    auto fut = w->call<std::string>(
        [state, task = impl_->submit_task(*w, req, cost, 0)](Client& c) -> Result<std::string> {
          int queued = 0;
          if (!state->compare_exchange_strong(queued, 1))
            return Status(ErrorCode::kDeadlineExceeded, "the submit gave up before its command ran");
          return task(c);
        });
    if (fut.wait_for(milliseconds(impl_->options.request_timeout_ms + 1000)) == std::future_status::ready) {
      auto r = fut.get();
      if (r.ok()) return r;
      last = r.status();
    } else if (int queued = 0; state->compare_exchange_strong(queued, 2)) {
      last = Status(ErrorCode::kDeadlineExceeded, "daemon " + w->endpoint.key() + " did not take the request in time");
    } else {
      auto r = fut.get();
      if (r.ok()) return r;
      last = r.status();
    }
    std::lock_guard<std::mutex> lock(impl_->mu);
    w->outstanding_tokens -= cost;
    w->outstanding_requests -= 1;
    if (!daemon.empty() || !retry_elsewhere(last.code())) return last;
    w->health.ready = w->health.routable = false;  // until its next heartbeat says otherwise
    tried.push_back(w);
  }
  return last;
}

std::optional<FleetEvent> Coordinator::next_event(int timeout_ms) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  if (!impl_->events_cv.wait_for(lock, milliseconds(std::max(timeout_ms, 0)),
                                 [&] { return !impl_->events.empty(); }))
    return std::nullopt;
  FleetEvent e = std::move(impl_->events.front());
  impl_->events.pop_front();
  return e;
}

Status Coordinator::abort(const std::string& rid) {
  Worker* w = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->pending.find(rid);
    if (it == impl_->pending.end()) return Status::Ok();
    w = it->second.worker;
  }
  auto fut = w->call<uint32_t>([rid](Client& c) -> Result<uint32_t> {
    RD_ASSIGN_OR_RETURN(auto r, c.abort(rid));
    return r.num_aborted;
  });
  if (fut.wait_for(milliseconds(impl_->options.request_timeout_ms + 1000)) != std::future_status::ready)
    return Status(ErrorCode::kDeadlineExceeded, "abort of '" + rid + "' got no reply in time", "rid");
  return fut.get().status();
}

size_t Coordinator::num_outstanding() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->pending.size();
}

std::optional<std::string> Coordinator::daemon_of(const std::string& rid) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->pending.find(rid);
  if (it == impl_->pending.end()) return std::nullopt;
  return it->second.worker->endpoint.key();
}

uint64_t Coordinator::num_dropped_events() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->dropped;
}

std::optional<uint64_t> Coordinator::weight_version() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->fleet_version;
}

namespace {

// Runs fn on each worker's thread in parallel and waits for all until timeout_ms. A worker that
// does not answer by then fails with kDeadlineExceeded; if its call completes later, on_late
// undoes it on that worker's thread (an opened session is aborted, a pause continued).
template <class T>
std::map<Worker*, Result<T>> fan_out(const std::vector<Worker*>& workers, std::function<Result<T>(Client&, Worker&)> fn,
                                     int timeout_ms, std::function<void(Client&, const T&)> on_late = nullptr) {
  // Decides, once per call, whether the caller took its outcome or gave up on it: the two
  // threads may reach the deadline together.
  struct Call {
    std::mutex mu;
    bool done = false;     // fn returned
    bool gave_up = false;  // the caller reported it failed: its outcome must be undone
  };
  struct Waiting {
    Worker* worker;
    std::shared_ptr<Call> call;
    std::future<Result<T>> result;
  };
  std::vector<Waiting> calls;
  for (Worker* w : workers) {
    auto call = std::make_shared<Call>();
    calls.push_back(Waiting{w, call, w->call<T>([fn, on_late, w, call](Client& c) {
                              Result<T> r = fn(c, *w);
                              bool late;
                              {
                                std::lock_guard<std::mutex> lock(call->mu);
                                call->done = true;
                                late = call->gave_up;
                              }
                              if (late && r.ok() && on_late) on_late(c, *r);
                              return r;
                            })});
  }
  const auto deadline = Clock::now() + milliseconds(timeout_ms);
  std::map<Worker*, Result<T>> out;
  for (auto& [w, call, fut] : calls) {
    if (fut.wait_until(deadline) == std::future_status::ready) {
      out.emplace(w, fut.get());
      continue;
    }
    bool finished;
    {
      std::lock_guard<std::mutex> lock(call->mu);
      finished = call->done;
      if (!finished) call->gave_up = true;
    }
    if (finished)  // fn returned just as the wait ran out: its outcome stands (no undo runs)
      out.emplace(w, fut.get());
    else
      out.emplace(w, Status(ErrorCode::kDeadlineExceeded,
                            "daemon " + w->endpoint.key() + " did not answer within " + std::to_string(timeout_ms) + " ms"));
  }
  return out;
}

}  // namespace

FleetWeightUpdate Coordinator::push_weights(const std::vector<std::shared_ptr<const WeightBucket>>& buckets,
                                            uint64_t weight_version,
                                            std::optional<PauseMode> pause, double session_timeout_s) {
  Impl& im = *impl_;
  const int step_ms = im.options.request_timeout_ms + 1000;
  FleetWeightUpdate result;
  result.weight_version = weight_version;
  std::vector<Worker*> targets;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    for (auto& w : im.workers) {
      const auto& s = w->health.state;
      if (s == "lost" || s == "unreachable" || s == "connecting")
        result.skipped[w->endpoint.key()] = "not reachable (" + s + ": " + w->health.reason + ")";
      else
        targets.push_back(w.get());
    }
  }
  std::vector<Worker*> paused;
  if (pause) {
    // A pause that completes after the deadline is undone at once: that daemon is not in
    // `paused`, so the continue below would never reach it, and it would stay paused while its
    // heartbeat said ready (requests routed there would wait for ever).
    for (auto& [w, r] : fan_out<PauseGenerationReply>(
             targets, [mode = *pause](Client& c, Worker&) { return c.pause_generation(mode); }, step_ms,
             [](Client& c, const PauseGenerationReply&) { (void)c.continue_generation(); }))
      if (r.ok()) paused.push_back(w);
  }
  // begin on all. One that answers after the deadline has its session aborted at once.
  std::map<Worker*, uint64_t> sessions;
  std::map<Worker*, uint64_t> serving_versions;  // each daemon's weight_version when it began
  for (auto& [w, r] : fan_out<BeginWeightUpdateReply>(
           targets,
           [session_timeout_s](Client& c, Worker&) { return c.begin_weight_update(std::nullopt, session_timeout_s); },
           step_ms,
           [](Client& c, const BeginWeightUpdateReply& reply) { (void)c.abort_weight_update(reply.session); })) {
    if (r.ok()) {
      sessions[w] = r->session;
      serving_versions[w] = r->weight_version;
    } else {
      result.failed[w->endpoint.key()] = r.status();
    }
  }
  auto drop = [&](Worker* w, Status s) {
    result.failed[w->endpoint.key()] = std::move(s);
    const uint64_t session = sessions[w];
    sessions.erase(w);
    // Not waited for: the daemon may be gone (it is fail-closed anyway once buckets were written).
    (void)w->call<AbortWeightUpdateReply>([session](Client& c) { return c.abort_weight_update(session); });
  };
  auto active = [&] {
    std::vector<Worker*> out;
    for (auto& [w, _] : sessions) out.push_back(w);
    return out;
  };
  // A daemon already serving a version above weight_version is dropped now, before any bucket:
  // its end_weight_update would refuse it after every bucket, and the abort would then leave it
  // not_ready.
  for (const auto& [w, serving] : serving_versions)
    if (weight_version < serving)
      drop(w, Status(ErrorCode::kInvalidArgument,
                     "weight_version " + std::to_string(weight_version) + " is below " + w->endpoint.key() +
                         "'s serving version " + std::to_string(serving),
                     "weight_version"));
  // Tasks hold the bucket and the session ids by value: one that runs after its step gave up
  // on it must not read the caller's memory.
  for (const auto& bucket : buckets) {
    if (sessions.empty()) break;
    for (auto& [w, r] : fan_out<UpdateWeightsReply>(
             active(),
             [bucket, ids = sessions](Client& c, Worker& w) {
               return c.update_weights_inline(ids.at(&w), bucket->entries, bucket->payload, bucket->checksum);
             },
             step_ms))
      if (!r.ok()) drop(w, r.status());
  }
  for (auto& [w, r] : fan_out<EndWeightUpdateReply>(
           active(),
           [ids = sessions, weight_version](Client& c, Worker& w) { return c.end_weight_update(ids.at(&w), weight_version); },
           step_ms)) {
    if (r.ok())
      result.completed[w->endpoint.key()] = *r;
    else
      drop(w, r.status());
  }
  if (!paused.empty())
    (void)fan_out<ContinueGenerationReply>(paused, [](Client& c, Worker&) { return c.continue_generation(); }, step_ms);
  if (!result.completed.empty()) {
    std::lock_guard<std::mutex> lock(im.mu);
    if (!im.fleet_version || weight_version > *im.fleet_version) im.fleet_version = weight_version;
    for (auto& w : im.workers) {
      if (result.completed.count(w->endpoint.key()))
        w->health.weight_version = std::max(w->health.weight_version, weight_version);
      im.refresh_routable(*w);
    }
  }
  return result;
}

}  // namespace rolloutd::protocol
