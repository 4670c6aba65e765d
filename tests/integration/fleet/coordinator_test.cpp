// The C++ coordinator (protocol/coordinator.hpp) against real daemons on loopback: requests
// spread by outstanding tokens with their events fanned into one stream, weight updates fanned
// out with per-daemon results, and a daemon killed mid-rollout whose requests end failed (or
// run again elsewhere when asked) — each with exactly one final event. Its deadlines too: the
// idle timeout spares requests whose daemon makes progress, and a pause or submit that times
// out is undone or never sent (a stopped daemon, SIGSTOP, makes the calls late).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "protocol/client.hpp"
#include "protocol/codec.hpp"
#include "protocol/coordinator.hpp"

namespace rolloutd::protocol {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::string daemon_binary() {
  if (const char* b = std::getenv("ROLLOUTD_BIN")) return b;
  const char* build = std::getenv("ROLLOUTD_BUILD_DIR");
  return std::string(build ? build : ".") + "/daemon/rolloutd";
}

// One rolloutd process on ephemeral loopback ports; killed at destruction if still running.
class DaemonProcess {
 public:
  DaemonProcess(const fs::path& dir, int n, std::vector<std::string> extra_args = {}) {
    fs::create_directories(dir);
    ep_file_ = dir / ("d" + std::to_string(n) + ".json");
    const std::string log = (dir / ("d" + std::to_string(n) + ".log")).string();
    const std::string bin = daemon_binary();
    // argv is built before fork: the child of a threaded process may only call async-signal-safe functions.
    std::vector<std::string> args = {bin, "--control-port", "0", "--http-port", "0", "--endpoints-file",
                                     ep_file_.string(), "--drain-timeout-s", "5"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
      execv(bin.c_str(), argv.data());
      _exit(127);
    }
  }
  ~DaemonProcess() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // The daemon's control endpoint once it listens (empty on timeout).
  std::string wait_endpoint() {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      if (fs::exists(ep_file_)) {
        auto eps = load_endpoints_file(ep_file_.string());
        if (eps.ok() && !eps->empty()) return (*eps)[0].control;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return {};
  }
  void send(int sig) { kill(pid_, sig); }
  void kill_now() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    reaped_ = true;
  }
  pid_t pid() const { return pid_; }

 private:
  fs::path ep_file_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

class Fleet : public ::testing::Test {
 protected:
  // Loopback timings: a dead daemon is noticed in 1.5 s.
  static CoordinatorOptions test_options() {
    CoordinatorOptions o;
    o.heartbeat_interval_ms = 200;
    o.heartbeat_timeout_ms = 500;
    o.dead_after_ms = 1500;
    o.request_timeout_ms = 10000;
    return o;
  }

  void start(int n, CoordinatorOptions options = test_options(), std::vector<std::string> daemon_args = {}) {
    dir_ = fs::temp_directory_path() / ("rolloutd-coord-test-" + std::to_string(getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::vector<DaemonEndpoint> eps;
    for (int i = 0; i < n; ++i) daemons_.push_back(std::make_unique<DaemonProcess>(dir_, i, daemon_args));
    for (int i = 0; i < n; ++i) {
      const std::string ep = daemons_[i]->wait_endpoint();
      ASSERT_FALSE(ep.empty()) << "daemon " << i << " did not start";
      eps.push_back({ep, "d" + std::to_string(i)});
      endpoints_.push_back(ep);
    }
    auto c = Coordinator::create(eps, options);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    coord_ = std::move(c).value();
    ASSERT_TRUE(coord_->wait_ready(0, 30000).ok());
  }
  void TearDown() override {
    coord_.reset();
    daemons_.clear();
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Reads the fleet's events until every rid has its final one; fails on a second.
  std::map<std::string, FleetEvent> finals(const std::set<std::string>& rids, int timeout_ms,
                                           std::map<std::string, std::vector<FleetEvent>>* all = nullptr) {
    std::map<std::string, FleetEvent> out;
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (out.size() < rids.size() && Clock::now() < deadline) {
      auto ev = coord_->next_event(200);
      if (!ev) continue;
      const std::string rid = std::visit([](const auto& e) { return e.rid; }, ev->event);
      if (all) (*all)[rid].push_back(*ev);
      if (std::holds_alternative<FinishedEvent>(ev->event) || std::holds_alternative<FailedEvent>(ev->event)) {
        EXPECT_EQ(out.count(rid), 0u) << "two final events for " << rid;
        out.emplace(rid, *ev);
      }
    }
    return out;
  }

  static ClientOptions options_for(const std::string& endpoint) {
    ClientOptions o;
    o.endpoint = endpoint;
    return o;
  }

  // A bucket that writes one float32 parameter's current value (daemon 0's) back: a real write
  // that leaves every daemon's model as it was.
  void same_value_bucket(std::shared_ptr<WeightBucket>* out, uint32_t* model_checksum = nullptr) {
    auto probe = Client::connect(options_for(endpoints_[0]));
    ASSERT_TRUE(probe.ok());
    auto sums = (*probe)->weights_checksum();
    ASSERT_TRUE(sums.ok());
    const ParameterChecksum* param = nullptr;
    for (const auto& p : sums->parameters)
      if (p.dtype == "float32" && (!param || p.shape.size() < param->shape.size())) param = &p;
    ASSERT_NE(param, nullptr);
    uint64_t numel = 1;
    for (auto d : param->shape) numel *= static_cast<uint64_t>(d);
    auto values = (*probe)->get_weights_by_name(param->name, static_cast<uint32_t>(numel));
    ASSERT_TRUE(values.ok());
    auto bucket = std::make_shared<WeightBucket>();
    bucket->payload.resize(numel * 4);
    for (uint64_t i = 0; i < numel; ++i) {
      const float f = static_cast<float>(values->values[i]);
      std::memcpy(bucket->payload.data() + i * 4, &f, 4);
    }
    bucket->entries.push_back(BucketEntry{param->name, DType::kF32, param->shape, 0, numel * 4});
    bucket->checksum = crc32(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bucket->payload.data()),
                                                      bucket->payload.size()));
    *out = std::move(bucket);
    if (model_checksum) *model_checksum = sums->model_checksum;
  }

  GenerateRequest request(int32_t first, uint32_t max_new_tokens) {
    GenerateRequest r;
    r.input_ids = {first, 2, 3};
    r.max_new_tokens = max_new_tokens;
    r.temperature = 1.0;
    r.seed = static_cast<uint64_t>(first);
    return r;
  }

  fs::path dir_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::string> endpoints_;
  std::unique_ptr<Coordinator> coord_;
};

TEST_F(Fleet, SpreadsRequestsAndFansTheirEventsIntoOneStream) {
  start(3);
  // Paused while the requests are placed: tokens produced during the submissions would
  // lower their daemon's outstanding cost and tilt the spread (seen under ASan, where the
  // submissions are slower than six tokens of decode).
  std::vector<std::unique_ptr<Client>> pausers;
  for (const auto& ep : endpoints_) {
    auto c = Client::connect(options_for(ep));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ASSERT_TRUE((*c)->pause_generation(PauseMode::kInPlace).ok());
    pausers.push_back(std::move(c).value());
  }
  std::set<std::string> rids;
  for (int i = 0; i < 12; ++i) {
    auto rid = coord_->submit(request(1 + i, 6));
    ASSERT_TRUE(rid.ok()) << rid.status().to_string();
    rids.insert(*rid);
  }
  for (auto& c : pausers) ASSERT_TRUE(c->continue_generation().ok());
  std::map<std::string, std::vector<FleetEvent>> all;
  auto done = finals(rids, 60000, &all);
  ASSERT_EQ(done.size(), rids.size());
  std::map<std::string, int> per_daemon;
  for (const auto& [rid, ev] : done) {
    const auto* f = std::get_if<FinishedEvent>(&ev.event);
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(f->reason, "length");
    size_t tokens = 0;
    for (const auto& e : all[rid])
      if (auto* t = std::get_if<TokensEvent>(&e.event)) tokens += t->token_ids.size();
    EXPECT_EQ(tokens, 6u);
    ++per_daemon[ev.daemon];
  }
  ASSERT_EQ(per_daemon.size(), 3u);
  for (const auto& [d, n] : per_daemon) EXPECT_EQ(n, 4) << d;  // equal costs: an even spread
  EXPECT_EQ(coord_->num_outstanding(), 0u);
}

TEST_F(Fleet, WeightUpdateFansOutAndReportsEachDaemon) {
  start(3);
  // Today's value of one float32 parameter, pushed back as version 7: every daemon takes it,
  // and their checksums do not move.
  std::shared_ptr<WeightBucket> bucket;
  uint32_t model_checksum = 0;
  ASSERT_NO_FATAL_FAILURE(same_value_bucket(&bucket, &model_checksum));

  auto update = coord_->push_weights({bucket}, 7, PauseMode::kRetract);
  EXPECT_TRUE(update.ok());
  EXPECT_EQ(update.completed.size(), 3u);
  EXPECT_EQ(coord_->weight_version(), std::optional<uint64_t>(7));
  for (const auto& ep : endpoints_) {
    auto c = Client::connect(options_for(ep));
    ASSERT_TRUE(c.ok());
    auto s = (*c)->weights_checksum();
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->model_checksum, model_checksum);
    EXPECT_EQ(s->weight_version, 7u);
  }

  // One daemon gone: the update completes on the others and names the missing one.
  daemons_[1]->kill_now();
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline && coord_->daemons()[1].state != "lost") std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto second = coord_->push_weights({bucket}, 8);
  EXPECT_FALSE(second.ok());
  EXPECT_EQ(second.completed.size(), 2u);
  EXPECT_EQ(second.completed.count("d1"), 0u);
  EXPECT_TRUE(second.skipped.count("d1") || second.failed.count("d1"));
}

TEST_F(Fleet, APauseThatAnswersLateIsUndone) {
  // push_weights(pause) gives up on a daemon whose pause has not answered by the deadline; when
  // that pause completes later it is undone (continue_generation). Until 2026-12-04 the C++
  // coordinator left that daemon paused while its heartbeat said ready.
  CoordinatorOptions o = test_options();
  o.request_timeout_ms = 3000;  // each reply; a fan-out step waits 1 s longer
  start(2, o);
  // Fault injection: d0 stopped, a submit to it holds its worker (submit, then abort of what it
  // may have sent: 3 s each), so the pause queued behind it runs after its step's 4 s wait.
  // SIGCONT at 5 s, within the abort's wait (0.8 s either side), lets the late pause through.
  daemons_[0]->send(SIGSTOP);
  std::thread holder([&] { (void)coord_->submit(request(1, 8), "d0"); });
  std::thread resume([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5000));
    daemons_[0]->send(SIGCONT);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the submit is queued first
  (void)coord_->push_weights({}, 1, PauseMode::kInPlace);
  resume.join();
  holder.join();
  auto c = Client::connect(options_for(endpoints_[0]));
  ASSERT_TRUE(c.ok());
  // The undo ran on d0's worker before its begin, which push_weights waited for; polled all
  // the same, within a deadline, so a slow reply is not mistaken for a daemon left paused.
  Result<StatusReply> st = Status(ErrorCode::kUnavailable, "no status yet");
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  do {
    st = (*c)->status();
    if (st.ok() && !st->paused && st->ready) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (Clock::now() < deadline);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_FALSE(st->paused);
  EXPECT_TRUE(st->ready) << st->state << ": " << st->reason;
  auto g = (*c)->generate(request(2, 3), 10000);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  ASSERT_TRUE(g->finished.has_value());
  EXPECT_EQ(g->finished->reason, "length");
}

TEST_F(Fleet, WeightUpdateBelowTheServingVersionWritesNothing) {
  // push_weights with a weight_version below what a daemon serves drops that daemon right after
  // begin (session aborted, nothing written), so it stays ready; end would have refused it
  // after every bucket, and the abort then left it not_ready.
  start(2);
  std::shared_ptr<WeightBucket> bucket;
  ASSERT_NO_FATAL_FAILURE(same_value_bucket(&bucket));
  ASSERT_TRUE(coord_->push_weights({bucket}, 5).ok());
  auto low = coord_->push_weights({bucket}, 3);
  EXPECT_TRUE(low.completed.empty());
  ASSERT_EQ(low.failed.size(), 2u);
  for (const auto& [name, s] : low.failed) {
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << name << ": " << s.to_string();
    EXPECT_EQ(s.field(), "weight_version") << name << ": " << s.to_string();
  }
  EXPECT_EQ(coord_->weight_version(), std::optional<uint64_t>(5));
  for (const auto& ep : endpoints_) {
    auto c = Client::connect(options_for(ep));
    ASSERT_TRUE(c.ok());
    // The session's abort is sent, not waited for: it may land just after push_weights returns.
    Result<StatusReply> st = Status(ErrorCode::kUnavailable, "no status yet");
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    do {
      st = (*c)->status();
      if (st.ok() && st->update_session == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (Clock::now() < deadline);
    ASSERT_TRUE(st.ok()) << st.status().to_string();
    EXPECT_EQ(st->update_session, 0u) << ep;
    EXPECT_TRUE(st->ready) << ep << ": " << st->state << ": " << st->reason;
    EXPECT_EQ(st->weight_version, 5u) << ep;
  }
}

TEST_F(Fleet, ASubmitThatTimedOutIsNeverSentLaterAndATimedOutReplyIsAborted) {
  // Two submits to a stopped daemon. The first one's command runs: its reply times out and the
  // request, which the daemon may take later, is aborted. The second one's command waits behind
  // it past the submit's deadline and is cancelled: a request the caller was told had failed
  // must not generate later (a retried rid would get two final events, the outstanding counters
  // would go below zero).
  CoordinatorOptions o = test_options();
  o.request_timeout_ms = 3000;  // each reply; submit waits 1 s longer for its command
  start(1, o);
  daemons_[0]->send(SIGSTOP);
  // Its command holds d0's worker for 6 s (submit, then the abort, 3 s each) unless d0 resumes.
  GenerateRequest held = request(1, 3000);
  held.rid = "held";
  std::thread holder([&] { (void)coord_->submit(held, "d0"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its command is queued first
  GenerateRequest req = request(2, 4);
  req.rid = "r1";
  auto late = coord_->submit(req, "d0");  // gives up at ~4.2 s
  daemons_[0]->send(SIGCONT);
  holder.join();
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), ErrorCode::kDeadlineExceeded);
  EXPECT_NE(late.status().message().find("did not take the request in time"), std::string::npos)
      << late.status().to_string();  // cancelled while queued, not failed while running
  // The daemon took "held" once it resumed, and the abort that followed ended it.
  auto c = Client::connect(options_for(endpoints_[0]));
  ASSERT_TRUE(c.ok());
  Result<StatusReply> st = Status(ErrorCode::kUnavailable, "no status yet");
  const auto deadline = Clock::now() + std::chrono::seconds(1);  // 3,000 tokens take ~2 s
  do {
    st = (*c)->status();
    if (st.ok() && st->num_running == 0 && st->num_waiting == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (Clock::now() < deadline);
  ASSERT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->num_running + st->num_waiting, 0u) << "the timed-out submit was not aborted";
  // Nothing of r1 ever comes, and nothing is left outstanding.
  const auto quiet = Clock::now() + std::chrono::seconds(1);
  while (Clock::now() < quiet) {
    auto ev = coord_->next_event(100);
    if (ev) {
      EXPECT_NE(std::visit([](const auto& e) { return e.rid; }, ev->event), "r1");
    }
  }
  EXPECT_EQ(coord_->num_outstanding(), 0u);
  ASSERT_TRUE(coord_->wait_ready(1, 10000).ok());
  auto h = coord_->daemons()[0];
  EXPECT_EQ(h.outstanding_requests, 0u);
  EXPECT_EQ(h.outstanding_tokens, 0u);
  // The same rid submitted again runs once.
  auto again = coord_->submit(req, "d0");
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  std::map<std::string, std::vector<FleetEvent>> all;
  auto done = finals({"r1"}, 30000, &all);
  ASSERT_EQ(done.size(), 1u);
  const auto* f = std::get_if<FinishedEvent>(&done["r1"].event);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->reason, "length");
  size_t tokens = 0;
  for (const auto& e : all["r1"])
    if (auto* t = std::get_if<TokensEvent>(&e.event)) tokens += t->token_ids.size();
  EXPECT_EQ(tokens, 4u);
  EXPECT_FALSE(coord_->next_event(500).has_value());  // no second final event
}

TEST_F(Fleet, KilledDaemonRequestsEndFailedEachExactlyOnce) {
  start(2);
  std::set<std::string> rids;
  std::map<std::string, std::string> where;
  for (int i = 0; i < 6; ++i) {
    auto rid = coord_->submit(request(1 + i, 3000));
    ASSERT_TRUE(rid.ok()) << rid.status().to_string();
    rids.insert(*rid);
    where[*rid] = coord_->daemon_of(*rid).value_or("?");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  daemons_[0]->kill_now();
  for (const auto& rid : rids) {
    if (where[rid] != "d0") {
      EXPECT_TRUE(coord_->abort(rid).ok());
    }
  }
  auto done = finals(rids, 30000);
  ASSERT_EQ(done.size(), rids.size());
  int failed = 0;
  for (const auto& [rid, ev] : done) {
    if (where[rid] != "d0") {
      ASSERT_TRUE(std::holds_alternative<FinishedEvent>(ev.event));
      continue;
    }
    const auto* f = std::get_if<FailedEvent>(&ev.event);
    ASSERT_NE(f, nullptr) << rid;
    EXPECT_EQ(f->error.code, "unavailable");
    ++failed;
  }
  EXPECT_EQ(failed, 3);
  EXPECT_EQ(coord_->num_outstanding(), 0u);
  // Nothing more for those requests.
  auto more = coord_->next_event(1000);
  EXPECT_FALSE(more.has_value());
}

TEST_F(Fleet, KilledDaemonRequestsAreResubmittedWhenAsked) {
  CoordinatorOptions o = test_options();
  o.resubmit = true;
  start(2, o);
  // Long enough that the victim's requests are still running at the kill (200 ms in; ~3 ms a
  // token in a release build), short enough for the ASan stage on two loaded cores (2,000 tokens
  // took 90-128 s there, past the old 120 s deadline once; 1,000 took 30 s).
  constexpr uint32_t kTokens = 1000;
  std::set<std::string> rids;
  std::map<std::string, std::string> where;
  for (int i = 0; i < 4; ++i) {
    auto rid = coord_->submit(request(1 + i, kTokens));
    ASSERT_TRUE(rid.ok());
    rids.insert(*rid);
    where[*rid] = coord_->daemon_of(*rid).value_or("?");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  daemons_[0]->kill_now();
  std::map<std::string, std::vector<FleetEvent>> all;
  auto done = finals(rids, 180000, &all);
  ASSERT_EQ(done.size(), rids.size());
  int resubmitted = 0;
  for (const auto& [rid, ev] : done) {
    const auto* f = std::get_if<FinishedEvent>(&ev.event);
    ASSERT_NE(f, nullptr) << rid;
    EXPECT_EQ(f->reason, "length");
    bool retracted = false;
    size_t tokens_after = 0;  // what stands: the tokens after the last retraction
    for (const auto& e : all[rid]) {
      if (auto* r = std::get_if<RetractedEvent>(&e.event)) {
        EXPECT_EQ(r->reason, "daemon_lost");
        retracted = true;
        tokens_after = 0;
      } else if (auto* t = std::get_if<TokensEvent>(&e.event)) {
        tokens_after += t->token_ids.size();
      }
    }
    EXPECT_EQ(tokens_after, kTokens) << rid;
    if (retracted) {
      EXPECT_EQ(where[rid], "d0");
      EXPECT_EQ(ev.daemon, "d1");  // finished on the survivor
      ++resubmitted;
    } else {
      // Not on the victim, or done before the kill.
      EXPECT_TRUE(where[rid] == "d1" || ev.daemon == "d0") << rid;
    }
  }
  EXPECT_GE(resubmitted, 1);
  EXPECT_EQ(coord_->num_outstanding(), 0u);
}

TEST_F(Fleet, IdleTimeoutCountsTimeWithoutProgressNotQueuedOrStreamFalseTime) {
  // request_idle_timeout_ms catches a daemon that is alive but stuck. Queued requests and
  // stream=false ones send no event while their daemon is busy or generating; until 2026-12-04
  // the C++ coordinator failed them after the limit all the same (the Python one was fixed
  // first). One request runs at a time here: most of the others queue for longer than the 1 s
  // limit, and the stream=false one is silent while it queues and runs.
  CoordinatorOptions o = test_options();
  o.request_idle_timeout_ms = 1000;
  start(1, o, {"--max-running", "1"});
  // As many requests as take ~2.5 s, from the measured time of one: ~50 ms in a release build,
  // seconds under ASan, and the silence must outlast the limit in the one without taking
  // minutes in the other. (Equal requests: a token's cost grows with the sequence, so a short
  // request would not time a long one.)
  constexpr uint32_t kTokens = 300;
  const auto t0 = Clock::now();
  auto warm = coord_->submit(request(100, kTokens));
  ASSERT_TRUE(warm.ok()) << warm.status().to_string();
  ASSERT_EQ(finals({*warm}, 120000).size(), 1u);
  const double request_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const int n = std::clamp(static_cast<int>(2.5 / request_s) + 1, 3, 200);
  std::set<std::string> rids;
  for (int i = 0; i < n; ++i) {
    GenerateRequest r = request(1 + i, kTokens);
    r.stream = i + 1 < n;  // the last one, queued longest, also sends nothing while it runs
    auto rid = coord_->submit(r);
    ASSERT_TRUE(rid.ok()) << rid.status().to_string();
    rids.insert(*rid);
  }
  auto done = finals(rids, 120000);
  ASSERT_EQ(done.size(), rids.size());
  for (const auto& [r, ev] : done) {
    const auto* f = std::get_if<FinishedEvent>(&ev.event);
    const auto* failed = std::get_if<FailedEvent>(&ev.event);
    ASSERT_NE(f, nullptr) << r << ": " << (failed ? failed->error.code + ": " + failed->error.message : "");
    EXPECT_EQ(f->reason, "length") << r;
  }
  EXPECT_EQ(coord_->num_outstanding(), 0u);
}

TEST_F(Fleet, IdleTimeoutStillFailsARequestOfADaemonThatMakesNoProgress) {
  CoordinatorOptions o = test_options();
  o.request_idle_timeout_ms = 1000;
  start(1, o);
  // Paused in place, the daemon answers heartbeats (ready) but generates nothing, as a stuck one
  // would: the progress that spares queued requests must not spare this one.
  auto pauser = Client::connect(options_for(endpoints_[0]));
  ASSERT_TRUE(pauser.ok()) << pauser.status().to_string();
  ASSERT_TRUE((*pauser)->pause_generation(PauseMode::kInPlace).ok());
  auto rid = coord_->submit(request(1, 50));
  ASSERT_TRUE(rid.ok()) << rid.status().to_string();
  auto done = finals({*rid}, 15000);
  ASSERT_EQ(done.size(), 1u);
  const auto* f = std::get_if<FailedEvent>(&done.begin()->second.event);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->error.code, "deadline_exceeded");
  EXPECT_EQ(coord_->num_outstanding(), 0u);
  EXPECT_TRUE((*pauser)->continue_generation().ok());
}

TEST(CoordinatorEndpoints, ReadsLauncherAndDaemonFiles) {
  const auto dir = fs::temp_directory_path() / ("rolloutd-ep-test-" + std::to_string(getpid()));
  fs::create_directories(dir);
  {
    std::FILE* f = std::fopen((dir / "node.json").c_str(), "w");
    std::fputs(R"({"host":"10.0.0.2","launcher_pid":1,"device":"cpu","daemons":[)"
               R"({"index":0,"state":"running","restarts":0,"pid":5,"gpu":-1,"control":"tcp://10.0.0.2:7600","http":"http://10.0.0.2:7700"},)"
               R"({"index":1,"state":"failed","restarts":3,"pid":6,"gpu":-1,"control":"tcp://10.0.0.2:7601","http":"http://10.0.0.2:7701"},)"
               R"({"index":2,"state":"starting","restarts":0,"pid":7,"gpu":-1}]})", f);
    std::fclose(f);
    f = std::fopen((dir / "d.json").c_str(), "w");
    std::fputs(R"({"control":"tcp://127.0.0.1:7600","gpu":0,"http":"http://127.0.0.1:7700","pid":9})", f);
    std::fclose(f);
  }
  auto node = load_endpoints_file((dir / "node.json").string());
  ASSERT_TRUE(node.ok());
  ASSERT_EQ(node->size(), 1u);
  EXPECT_EQ((*node)[0].control, "tcp://10.0.0.2:7600");
  EXPECT_EQ((*node)[0].name, "10.0.0.2/0");
  auto one = load_endpoints_file((dir / "d.json").string());
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].key(), "tcp://127.0.0.1:7600");
  EXPECT_FALSE(load_endpoints_file((dir / "missing.json").string()).ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rolloutd::protocol
