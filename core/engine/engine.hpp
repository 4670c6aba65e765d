#pragma once
// The generation engine: one scheduler owning the batch (continuous batching
// with chunked prefill), the model, the KV block pool and the sampler. It is
// driven by one thread (the daemon's engine actor): submit/abort between steps,
// step() to advance every running request by one forward pass.
//
// Nothing lost: every accepted request leaves the engine through exactly one
// final event (finished or failed), produced by step(), abort() or abort_all().
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/engine/kv_cache.hpp"
#include "core/engine/prefix_cache.hpp"
#include "core/model/moe_decoder.hpp"
#include "core/moe/routed_experts.hpp"
#include "core/sampling/sampler.hpp"
#include "core/storage/memory_manager.hpp"
#include "core/weights/session.hpp"

namespace rolloutd::core {

struct RequestSpec {
  std::string rid;
  std::vector<int32_t> input_ids;
  uint32_t max_new_tokens = 16;
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;
  bool return_logprob = false;
  bool return_routed_experts = false;
  uint32_t routed_experts_start_len = 0;
  // [0, min(kMaxTopLogprobs, vocab)]: the n most likely tokens of every sampled token.
  uint32_t top_logprobs_num = 0;
  uint64_t tag = 0;  // opaque to the engine; the daemon uses it to route events
  // When set, the request ends with finished{abort, "deadline"} at the first expire() at or
  // after it, wherever it is (queued, prefilling, decoding, paused).
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

struct EngineEvent {
  // kRetracted: the request restarts from its prompt (pause mode retract); what the client
  // received for it so far is void. Not final.
  enum class Kind : uint8_t { kTokens, kFinished, kFailed, kRetracted };
  Kind kind = Kind::kTokens;
  std::string rid;
  uint64_t tag = 0;
  // kTokens
  std::vector<int32_t> token_ids;
  std::vector<float> logprobs;              // only when return_logprob
  std::vector<uint64_t> weight_versions;    // one per token
  // The request's top_logprobs_num n; token j's n most likely tokens at [j*n, (j+1)*n).
  uint32_t top_logprobs_num = 0;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
  std::vector<int32_t> routed_rows;         // [routed_num_tokens, moe_layers, top_k] logical ids
  int64_t routed_num_tokens = 0;
  int64_t routed_start_pos = 0;
  // kFinished
  std::string finish_reason;                // "stop" | "length" | "abort"
  std::string abort_reason;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  // kFailed
  Status error;
  // kRetracted
  uint32_t num_tokens_discarded = 0;
};

struct EngineOptions {
  int64_t max_running = 64;         // sequences decoding at once
  int64_t max_waiting = 4096;       // queue bound: submit beyond it -> kOverloaded
  StepLimits step;                  // tokens per step, KV blocks, block size
  // CUDA: sample on the device (MoeDecoder::step_sample; only tokens and log-probs come back);
  // false: copy the logits back and sample on the host (core::Sampler). The CPU backend always
  // samples on the host. The kept sets agree; the draws differ (Backend::sample).
  bool device_sampling = true;
  // Keep full KV blocks after their request, keyed by their tokens and all before them, for
  // requests that start with the same tokens (PrefixCache): a prompt's n samples, the next turn
  // of a conversation. Cleared whenever the weights may change. Not with a sliding KV pool
  // (StepLimits::num_sliding_kv_blocks): those blocks are freed as requests move past them.
  bool prefix_cache = false;
};

struct EngineStats {
  uint64_t num_waiting = 0;
  uint64_t num_running = 0;
  uint64_t num_requests_total = 0;
  uint64_t num_prompt_tokens_total = 0;
  uint64_t num_generated_tokens_total = 0;
  // Preemption when the KV pool runs dry (Engine::step): requests sent back to the queue with
  // KV dropped, and the tokens whose KV was dropped (counted then: a request aborted, expired or
  // retracted before its readmission never computes them again).
  uint64_t num_preemptions_total = 0;
  uint64_t num_recomputed_tokens_total = 0;
  uint64_t num_deadline_aborts_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_blocks_total = 0;
  // The sliding-window layers' own pool (StepLimits::num_sliding_kv_blocks; 0 and 0 without).
  int64_t sliding_kv_blocks_free = 0;
  int64_t sliding_kv_blocks_total = 0;
  // Prefix cache: blocks it keeps (not free, evicted when the pool needs them); prompt tokens
  // looked up at admission and those found cached (their KV reused, not computed), counted once
  // the request computes after that admission (a lookup voided before, by a weight change, is not).
  int64_t kv_blocks_cached = 0;
  int64_t kv_blocks_evictable = 0;  // of those, the ones no request reads: free for the asking
  bool prefix_cache_enabled = false;
  uint64_t num_prefix_cache_queried_tokens_total = 0;
  uint64_t num_prefix_cache_hit_tokens_total = 0;
  // Decode graphs (StepLimits::graph_max_batch; MoeDecoder::graph_stats).
  int64_t graph_buckets = 0, graph_max_batch = 0, num_graphs = 0;
  uint64_t graph_steps = 0, eager_steps = 0;
  double graph_capture_s = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<MoeDecoder> model,
                                                const EngineOptions& options);

  // Validates against the model (vocab, context length, KV capacity) and queues. Errors are
  // typed and name the field; a rejected request leaves no trace.
  Status submit(RequestSpec spec);
  // Ends the request with finished{abort, reason}; returns false if the rid is not in flight.
  bool abort(const std::string& rid, const std::string& reason, std::vector<EngineEvent>& out);
  // Aborts every request (optionally only those with `tag_filter`); returns how many.
  size_t abort_all(const std::string& reason, std::vector<EngineEvent>& out,
                   std::optional<uint64_t> tag_filter = std::nullopt);

  // Requests in flight (waiting or running), whether or not they can advance now.
  bool has_requests() const { return !waiting_.empty() || !running_.empty(); }
  // Requests that step() would advance: none while paused, while a weight-update session is
  // open, or while the model is not whole after a failed session.
  bool has_work() const { return has_requests() && can_step(); }
  bool can_step() const { return !paused_ && updater_.whole() && memory_blocked_reason().empty(); }

  // ---- memory release/resume (colocated training) ----
  // Releases the memory of each tag (weights, kv_cache, cuda_graph; scratch stays): only while
  // idle -- no request in flight, no weight-update session open (kFailedPrecondition
  // otherwise, nothing released). Releasing weights loses every parameter's value (static
  // state is kept): the model is not whole until sessions have rewritten every parameter
  // after resume. Releasing kv_cache drops every cached block (requests hold none while idle; the
  // prefix cache, if on, is cleared).
  struct MemoryTagResult {
    MemoryTag tag = MemoryTag::kWeights;
    MemoryOpResult op;
  };
  Result<std::vector<MemoryTagResult>> release_memory(const std::vector<MemoryTag>& tags);
  // Maps memory again under every released tag given, at the same addresses, and writes the
  // static state back. kResourceExhausted when the device is still full (retry later).
  Result<std::vector<MemoryTagResult>> resume_memory(const std::vector<MemoryTag>& tags);
  MemoryManager& memory() { return memory_; }
  const MemoryManager& memory() const { return memory_; }
  // Why generation cannot run because memory is released ("" when it can).
  std::string memory_blocked_reason() const;

  // ---- weight updates and pause modes ----
  enum class PauseMode : uint8_t { kAbort, kRetract, kInPlace };
  struct PauseCounts {
    uint32_t aborted = 0, retracted = 0, paused = 0;
  };
  // abort: in-flight requests end with finished{abort, "weight_update"}; retract: they get a
  // retracted event and restart from their prompt when generation continues (nothing stale
  // kept); in_place: they keep their state and continue, their tokens' versions showing the
  // switch. New requests are accepted and queued while paused.
  PauseCounts pause(PauseMode mode, std::vector<EngineEvent>& out);
  uint32_t resume();  // returns the number of requests that can continue
  bool paused() const { return paused_; }
  WeightUpdater& updater() { return updater_; }
  const WeightUpdater& updater() const { return updater_; }
  // Fails every request in flight with `error` (the model stopped being whole under them).
  size_t fail_all(const Status& error, std::vector<EngineEvent>& out);
  // Ends every request whose deadline is at or before `now` with finished{abort, "deadline"};
  // returns how many. Cheap when none is due (one comparison).
  size_t expire(std::chrono::steady_clock::time_point now, std::vector<EngineEvent>& out);
  // The earliest deadline of a request in flight, if any (it may be one already gone: then
  // expire() finds nothing and recomputes it).
  std::optional<std::chrono::steady_clock::time_point> next_deadline() const { return next_deadline_; }
  // One scheduling step: admit, grow the running requests' KV (preempting the most recently
  // admitted ones when the pool runs dry), run one forward pass, sample, emit events.
  // A forward failure fails the affected requests (failed events) and is returned.
  Status step(std::vector<EngineEvent>& out);

  EngineStats stats() const;
  uint64_t weight_version() const { return weight_version_; }
  void set_weight_version(uint64_t v) { weight_version_ = v; }
  const ModelConfig& model_config() const { return model_->config(); }
  MoeDecoder& model() { return *model_; }
  bool contains(const std::string& rid) const { return by_rid_.count(rid) != 0; }

 private:
  struct Sequence {
    RequestSpec spec;
    std::vector<int32_t> tokens;   // prompt, then generated
    int64_t prompt_len = 0;
    int64_t num_computed = 0;      // tokens whose KV is cached
    uint32_t num_generated = 0;
    std::vector<int32_t> blocks;
    // Sliding pool: the block of each logical block index [0, sliding_blocks.size()), -1 for
    // the first sliding_freed ones, which no position still to be computed can see (freed).
    std::vector<int32_t> sliding_blocks;
    int64_t sliding_freed = 0;
    bool running = false;
    bool prompt_counted = false;   // prompt tokens counted in the stats (once per request)
    int64_t routed_sent = 0;       // positions below this have had their expert records streamed
    // In flight (SPEC 11.6): some prefill computed since it last started; stays so through a
    // preemption, cleared by a retraction. Pause counts, retracted events and resume count these.
    bool started = false;
    // Waiting and never begun: counts against --max-waiting. A request admitted and sent back
    // before it began is new again; one preempted or retracted after it began is not (it was
    // accepted work in progress).
    bool is_new = true;
    // Prefix cache. Blocks [0, hashed_blocks) are keyed (found in the cache or put there),
    // chain_key the last one's key; pending_rows holds the routed-expert ids of positions
    // hashed_blocks * block_size .. num_computed - 1 (-1 where the step recorded none). Not
    // cacheable: its KV straddles a weight change (in_place), until it is computed again.
    bool cacheable = true;
    int64_t hashed_blocks = 0;
    int64_t reused_tokens = 0;  // positions of this admission whose KV came from the cache
    // This admission's lookup (prompt tokens looked up, tokens reused), counted in the engine's
    // totals when the request first computes after it: one sent back before that (a weight
    // change dropped the KV it was lent, or admission's own churn) is counted once, when it runs.
    int64_t uncounted_queried = 0, uncounted_hit = 0;
    uint64_t chain_key = PrefixCache::kRoot;
    std::vector<int32_t> pending_rows;
    // Records of the positions [prefix_rows_from, num_computed) whose KV came from the cache,
    // sent with the request's next event.
    int64_t prefix_rows_from = 0;
    std::vector<int32_t> prefix_rows;
  };

  Engine(std::unique_ptr<MoeDecoder> model, const EngineOptions& options);
  void admit();
  // Sends a running request back to the head of the queue, its blocks freed and its tokens
  // (prompt and generated) kept: it computes their KV again when readmitted, then samples on.
  void preempt(Sequence& s);
  // Blocks for the positions [num_computed, num_computed + n) of each planned slice; the
  // pool running dry preempts the most recently admitted requests (and drops their slices).
  struct Planned {
    Sequence* seq;
    int64_t count;
  };
  void reserve_blocks(std::vector<Planned>& planned);
  // Gives back every KV block a request holds (both pools).
  void release_blocks(Sequence& s);
  // Sliding pool: frees the request's blocks that lie wholly before the window of its next
  // position (num_computed): no later query sees them.
  void trim_sliding(Sequence& s);
  // Prefix cache: forget what a request computed (its KV is dropped or will be recomputed);
  // reuse cached blocks at admission (returns the blocks, retained); key the blocks a step
  // filled.
  void reset_cached_prefix(Sequence& s);
  PrefixCache::Hit reuse_prefix(Sequence& s);
  // True when a running request is computing the block after the `reused` cached blocks of
  // `s` (the same tokens up to it): admitting `s` a step later lets it reuse that block too.
  bool waits_for_prefix(const Sequence& s, int64_t reused) const;
  void cache_filled_blocks(Sequence& s, const std::vector<int32_t>* rows, int64_t first_row, int64_t count);
  void finish(Sequence& s, std::string reason, std::string abort_reason, std::vector<EngineEvent>& out);
  void fail(Sequence& s, const Status& error, std::vector<EngineEvent>& out);
  void remove(const std::string& rid);

  std::unique_ptr<MoeDecoder> model_;
  EngineOptions options_;
  KvBlockPool kv_;
  std::unique_ptr<KvBlockPool> sliding_;  // null without a sliding pool
  std::unique_ptr<PrefixCache> cache_;  // null without EngineOptions::prefix_cache
  uint64_t cache_epoch_ = 0;            // WeightUpdater::epoch() the cached KV was computed under
  uint64_t prefix_queried_tokens_total_ = 0;
  uint64_t prefix_hit_tokens_total_ = 0;
  RoutedExpertRecorder recorder_;
  Sampler sampler_;
  TopLogprobs top_;  // host sampling's top log-probs of the current row
  std::vector<SamplingRow> sample_rows_;  // device sampling's per-step rows, reused
  std::unordered_map<std::string, std::unique_ptr<Sequence>> by_rid_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  WeightUpdater updater_;
  MemoryManager memory_;
  bool paused_ = false;
  uint64_t weight_version_ = 0;
  uint64_t requests_total_ = 0;
  uint64_t prompt_tokens_total_ = 0;
  uint64_t generated_tokens_total_ = 0;
  uint64_t preemptions_total_ = 0;
  uint64_t recomputed_tokens_total_ = 0;
  uint64_t deadline_aborts_total_ = 0;
  size_t num_waiting_new_ = 0;  // requests in waiting_ with is_new: the --max-waiting bound
  size_t num_in_flight() const;  // requests with `started`, running or waiting
  std::optional<std::chrono::steady_clock::time_point> next_deadline_;
};

}  // namespace rolloutd::core
