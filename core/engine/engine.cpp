#include "core/engine/engine.hpp"

#include <algorithm>
#include <string>

namespace rolloutd::core {

Engine::Engine(std::unique_ptr<MoeDecoder> model, const EngineOptions& options)
    : model_(std::move(model)),
      options_(options),
      kv_(options.step.num_kv_blocks, options.step.kv_block_size),
      sliding_(options.step.num_sliding_kv_blocks > 0
                   ? std::make_unique<KvBlockPool>(options.step.num_sliding_kv_blocks, options.step.kv_block_size)
                   : nullptr),
      cache_(options.prefix_cache ? std::make_unique<PrefixCache>(
                                        kv_, model_->config().num_moe_layers() * model_->config().num_experts_per_tok)
                                  : nullptr),
      recorder_(model_->config().num_moe_layers(), model_->config().num_experts_per_tok,
                options.step.max_tokens),
      updater_(model_->weights()) {
  memory_.add_arena(&model_->arena(MemoryTag::kWeights));
  memory_.add_arena(&model_->arena(MemoryTag::kKvCache));
  memory_.add_static_state(&model_->weights().static_state());
  // The layout-permutation staging buffer holds nothing between sessions: give it back with
  // the weights, the next session allocates it again.
  const ExecContext ctx = model_->context();
  memory_.add_release_hook(MemoryTag::kWeights, [ctx]() -> Result<size_t> {
    if (ctx.device.kind == DeviceKind::kCpu) return size_t{0};
    return release_device_staging(ctx);
  });
}

std::string Engine::memory_blocked_reason() const {
  if (memory_.released(MemoryTag::kWeights))
    return "the weights memory is released (release_memory): resume_memory, then push weights";
  if (memory_.released(MemoryTag::kKvCache))
    return "the kv_cache memory is released (release_memory): resume_memory{kv_cache} first";
  return "";
}

Result<std::vector<Engine::MemoryTagResult>> Engine::release_memory(const std::vector<MemoryTag>& tags) {
  if (has_requests())
    return Status(ErrorCode::kFailedPrecondition,
                  std::to_string(by_rid_.size()) +
                      " requests are in flight: finish or abort them (pause_generation{abort}) before release_memory");
  if (updater_.session_open())
    return Status(ErrorCode::kFailedPrecondition,
                  "weight-update session " + std::to_string(updater_.session_id()) +
                      " is open: end or abort it before release_memory");
  std::vector<MemoryTagResult> out;
  for (MemoryTag t : tags) {
    // Cached blocks lose their KV with the memory (and keep nothing worth it across the weight
    // change that usually follows).
    if (cache_ && t == MemoryTag::kKvCache) cache_->clear();
    RD_ASSIGN_OR_RETURN(MemoryOpResult r, memory_.release(t));
    if (t == MemoryTag::kWeights && r.changed) {
      model_->weights().set_resident(false);
      updater_.mark_all_lost(
          "the weights memory was released (release_memory): resume_memory{weights}, then push weights "
          "(a completed weight-update session that writes every parameter)");
    }
    out.push_back({t, r});
  }
  return out;
}

Result<std::vector<Engine::MemoryTagResult>> Engine::resume_memory(const std::vector<MemoryTag>& tags) {
  std::vector<MemoryTagResult> out;
  for (MemoryTag t : tags) {
    RD_ASSIGN_OR_RETURN(MemoryOpResult r, memory_.resume(t));
    if (t == MemoryTag::kWeights && r.changed) model_->weights().set_resident(true);
    out.push_back({t, r});
  }
  return out;
}

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<MoeDecoder> model,
                                               const EngineOptions& options) {
  if (!model) return Status(ErrorCode::kInvalidArgument, "no model", "model");
  const StepLimits& m = model->limits();
  const StepLimits& o = options.step;
  if (m.max_tokens != o.max_tokens || m.max_seqs != o.max_seqs ||
      m.num_kv_blocks != o.num_kv_blocks || m.kv_block_size != o.kv_block_size ||
      m.max_blocks_per_seq != o.max_blocks_per_seq || m.graph_max_batch != o.graph_max_batch ||
      m.kv_dtype != o.kv_dtype || m.num_sliding_kv_blocks != o.num_sliding_kv_blocks)
    return Status(ErrorCode::kInvalidArgument, "engine and model were built with different limits",
                  "step");
  if (options.max_running <= 0 || options.max_running > o.max_seqs)
    return Status(ErrorCode::kInvalidArgument, "max_running must be in [1, max_seqs]", "max_running");
  if (options.max_waiting <= 0)
    return Status(ErrorCode::kInvalidArgument, "max_waiting must be positive", "max_waiting");
  if (o.num_sliding_kv_blocks > 0) {
    // One request computing a whole step's tokens must fit, or it would preempt itself forever.
    const int64_t w = model->config().sliding_window, bs = o.kv_block_size;
    const int64_t one = (w + bs - 1) / bs + 2 + (o.max_tokens + bs - 1) / bs;
    if (o.num_sliding_kv_blocks < one)
      return Status(ErrorCode::kInvalidArgument,
                    "the sliding KV pool holds " + std::to_string(o.num_sliding_kv_blocks) +
                        " blocks; one request's window and a step's tokens need " + std::to_string(one),
                    "num_sliding_kv_blocks");
  }
  if (options.prefix_cache && o.num_sliding_kv_blocks > 0)
    return Status(ErrorCode::kInvalidArgument,
                  "the prefix cache and a sliding KV pool cannot be combined (cached prompts would need the "
                  "sliding blocks the pool frees)",
                  "prefix_cache");
  // Decode graphs are captured once, here, before anything else runs on the model; weight
  // updates and memory release/resume keep every address they use.
  RD_RETURN_IF_ERROR(model->capture_graphs());
  return std::unique_ptr<Engine>(new Engine(std::move(model), options));
}

Status Engine::submit(RequestSpec spec) {
  const ModelConfig& c = model_->config();
  if (spec.rid.empty()) return Status(ErrorCode::kInvalidArgument, "empty request id", "rid");
  if (!updater_.broken_reason().empty())
    return Status(ErrorCode::kNotReady, "the model is not whole: " + updater_.broken_reason());
  if (const std::string why = memory_blocked_reason(); !why.empty()) return Status(ErrorCode::kNotReady, why);
  if (by_rid_.count(spec.rid))
    return Status(ErrorCode::kDuplicateRid, "request id '" + spec.rid + "' is already in flight", "rid");
  if (spec.input_ids.empty())
    return Status(ErrorCode::kInvalidArgument, "input_ids is empty", "input_ids");
  for (size_t i = 0; i < spec.input_ids.size(); ++i) {
    const int32_t t = spec.input_ids[i];
    if (t < 0 || t >= c.vocab_size)
      return Status(ErrorCode::kOutOfRange,
                    "token id " + std::to_string(t) + " outside the vocabulary [0, " +
                        std::to_string(c.vocab_size) + ")",
                    "input_ids[" + std::to_string(i) + "]");
  }
  for (size_t i = 0; i < spec.stop_token_ids.size(); ++i) {
    const int32_t t = spec.stop_token_ids[i];
    if (t < 0 || t >= c.vocab_size)
      return Status(ErrorCode::kOutOfRange, "stop token id outside the vocabulary",
                    "stop_token_ids[" + std::to_string(i) + "]");
  }
  if (spec.max_new_tokens == 0)
    return Status(ErrorCode::kOutOfRange, "max_new_tokens must be >= 1", "max_new_tokens");
  RD_RETURN_IF_ERROR(validate(spec.sampling));
  if (spec.top_logprobs_num > std::min<int64_t>(kMaxTopLogprobs, c.vocab_size))
    return Status(ErrorCode::kOutOfRange,
                  "top_logprobs_num " + std::to_string(spec.top_logprobs_num) + " above " +
                      std::to_string(std::min<int64_t>(kMaxTopLogprobs, c.vocab_size)) +
                      " (the limit, or the vocabulary)",
                  "top_logprobs_num");
  const int64_t prompt = static_cast<int64_t>(spec.input_ids.size());
  const int64_t total = prompt + static_cast<int64_t>(spec.max_new_tokens);
  if (total > c.max_position_embeddings)
    return Status(ErrorCode::kOutOfRange,
                  "prompt (" + std::to_string(prompt) + ") + max_new_tokens (" +
                      std::to_string(spec.max_new_tokens) + ") exceeds the context length " +
                      std::to_string(c.max_position_embeddings),
                  "max_new_tokens");
  // The last sampled token is never fed back, so total - 1 positions need KV.
  const int64_t blocks = kv_.blocks_for(total - 1);
  if (blocks > options_.step.max_blocks_per_seq || blocks > kv_.num_blocks())
    return Status(ErrorCode::kOutOfRange,
                  "request needs " + std::to_string(blocks) + " KV blocks; this daemon holds at most " +
                      std::to_string(std::min<int64_t>(options_.step.max_blocks_per_seq, kv_.num_blocks())) +
                      " per request",
                  "max_new_tokens");
  // Preempted and retracted requests wait too, but they had begun: only new ones count (is_new).
  if (static_cast<int64_t>(num_waiting_new_) >= options_.max_waiting)
    return Status(ErrorCode::kOverloaded,
                  "waiting queue is full (" + std::to_string(options_.max_waiting) + " requests)");

  auto seq = std::make_unique<Sequence>();
  seq->prompt_len = prompt;
  seq->tokens = spec.input_ids;
  seq->tokens.reserve(static_cast<size_t>(total));
  seq->spec = std::move(spec);
  Sequence* raw = seq.get();
  if (raw->spec.deadline && (!next_deadline_ || *raw->spec.deadline < *next_deadline_))
    next_deadline_ = raw->spec.deadline;
  by_rid_.emplace(raw->spec.rid, std::move(seq));
  waiting_.push_back(raw);
  ++num_waiting_new_;
  ++requests_total_;
  return Status::Ok();
}

void Engine::admit() {
  // FIFO without overtaking: a large request at the head waits for blocks rather than
  // being starved by smaller ones behind it. A request takes the blocks of the tokens it
  // computes before its next sample (its prompt; for a preempted one, prompt and generated
  // tokens); decode steps add blocks as they need them (reserve_blocks). While others run,
  // admission leaves ~1 % of the pool free for their growth, so that admitting does not
  // at once preempt.
  const int64_t headroom = std::max<int64_t>(1, (kv_.num_blocks() + 99) / 100);
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_running) {
    Sequence* s = waiting_.front();
    PrefixCache::Hit hit;
    if (cache_) {
      hit = reuse_prefix(*s);
      // Requests submitted together (a GRPO group's samples) would all compute the prompt: the
      // first one admitted computes it, the others wait for its blocks (FIFO: nothing behind
      // them is admitted meanwhile, as SGLang's in-batch prefix check does).
      if (waits_for_prefix(*s, static_cast<int64_t>(hit.blocks.size()))) {
        (void)kv_.release(hit.blocks);
        break;
      }
    }
    const int64_t need =
        kv_.blocks_for(static_cast<int64_t>(s->tokens.size())) - static_cast<int64_t>(hit.blocks.size());
    const int64_t want = need + (running_.empty() ? 0 : headroom);
    if (cache_ && want > kv_.num_free()) cache_->evict(want - kv_.num_free());
    if (want > kv_.num_free()) {
      (void)kv_.release(hit.blocks);
      break;
    }
    s->blocks = std::move(hit.blocks);
    Status st = kv_.allocate(need, s->blocks);
    if (!st.ok()) {
      (void)kv_.release(s->blocks);
      break;
    }
    if (cache_ && s->num_computed == 0) {
      // The cached blocks' KV is this request's: it computes from the first position after them.
      s->uncounted_queried = static_cast<int64_t>(s->tokens.size()) - 1;
      const int64_t n = static_cast<int64_t>(s->blocks.size()) - need, bs = kv_.block_size();
      if (n > 0) {
        s->num_computed = n * bs;
        s->reused_tokens = n * bs;
        s->hashed_blocks = n;
        s->chain_key = hit.key;
        s->uncounted_hit = n * bs;
        if (s->spec.return_routed_experts) {
          const int64_t from = std::max<int64_t>(s->spec.routed_experts_start_len, s->routed_sent);
          const int64_t per_token = model_->config().num_moe_layers() * model_->config().num_experts_per_tok;
          s->prefix_rows_from = from;
          s->prefix_rows.clear();
          for (int64_t pos = from; pos < n * bs; ++pos) {
            const std::vector<uint16_t>& rec = *hit.records[static_cast<size_t>(pos / bs)];
            const auto at = rec.begin() + (pos % bs) * per_token;
            s->prefix_rows.insert(s->prefix_rows.end(), at, at + per_token);  // widened to int32
          }
        }
      }
    }
    waiting_.pop_front();
    if (s->is_new) {
      s->is_new = false;
      --num_waiting_new_;
    }
    s->running = true;
    running_.push_back(s);
  }
}

void Engine::release_blocks(Sequence& s) {
  (void)kv_.release(s.blocks);
  if (!sliding_) return;
  std::vector<int32_t> held(s.sliding_blocks.begin() + s.sliding_freed, s.sliding_blocks.end());
  (void)sliding_->release(held);
  s.sliding_blocks.clear();
  s.sliding_freed = 0;
}

void Engine::trim_sliding(Sequence& s) {
  // Position num_computed (the next to compute) sees (num_computed + 1 - window ..]: blocks wholly
  // before its first visible position are read by no later step.
  const int64_t first = s.num_computed + 1 - model_->config().sliding_window;
  const int64_t keep_from = std::min<int64_t>(first > 0 ? first / kv_.block_size() : 0,
                                              static_cast<int64_t>(s.sliding_blocks.size()));
  if (keep_from <= s.sliding_freed) return;
  std::vector<int32_t> gone(s.sliding_blocks.begin() + s.sliding_freed, s.sliding_blocks.begin() + keep_from);
  (void)sliding_->release(gone);
  std::fill(s.sliding_blocks.begin() + s.sliding_freed, s.sliding_blocks.begin() + keep_from, -1);
  s.sliding_freed = keep_from;
}

void Engine::preempt(Sequence& s) {
  running_.erase(std::remove(running_.begin(), running_.end(), &s), running_.end());
  release_blocks(s);
  // Admitted and sent back in one step, before any KV of this admission: nothing is lost, so
  // it is no preemption, and one that never began is a new request again. (KV the prefix cache
  // lent it was not computed by it: the cache keeps it.)
  if (s.num_computed > s.reused_tokens) {
    recomputed_tokens_total_ += static_cast<uint64_t>(s.num_computed - s.reused_tokens);
    ++preemptions_total_;
  }
  if (!s.started && !s.is_new) {
    s.is_new = true;
    ++num_waiting_new_;
  }
  s.num_computed = 0;
  reset_cached_prefix(s);
  s.running = false;
  waiting_.push_front(&s);
}

void Engine::reset_cached_prefix(Sequence& s) {
  s.cacheable = true;  // everything is computed again, under the weights of then
  s.hashed_blocks = 0;
  s.reused_tokens = 0;
  s.uncounted_queried = 0;  // that lookup is void: the next admission looks up again
  s.uncounted_hit = 0;
  s.chain_key = PrefixCache::kRoot;
  s.pending_rows.clear();
  s.prefix_rows.clear();
}

PrefixCache::Hit Engine::reuse_prefix(Sequence& s) {
  // Only a request with nothing computed (new, preempted or retracted) reuses blocks, up to
  // its last token but one: the step must compute at least the position it samples from.
  if (s.num_computed != 0) return {};
  const int64_t tokens = static_cast<int64_t>(s.tokens.size());
  const int64_t records_from =
      s.spec.return_routed_experts ? std::max<int64_t>(s.spec.routed_experts_start_len, s.routed_sent) : -1;
  return cache_->lookup(s.tokens, tokens - 1, records_from);
}

bool Engine::waits_for_prefix(const Sequence& s, int64_t reused) const {
  const int64_t bs = kv_.block_size();
  const int64_t end = (reused + 1) * bs;  // the next block `s` could reuse ends here
  if (end > static_cast<int64_t>(s.tokens.size()) - 1) return false;
  for (const Sequence* r : running_) {
    // r will compute and cache that block: it has not yet, it keys its blocks, and it holds the
    // records `s` needs (a step records when any of its requests asks).
    if (!r->cacheable || r->num_computed >= end || static_cast<int64_t>(r->tokens.size()) < end) continue;
    if (s.spec.return_routed_experts && !r->spec.return_routed_experts) continue;
    if (std::equal(s.tokens.begin(), s.tokens.begin() + end, r->tokens.begin())) return true;
  }
  return false;
}

void Engine::cache_filled_blocks(Sequence& s, const std::vector<int32_t>* rows, int64_t first_row, int64_t count) {
  const int64_t per_token = model_->config().num_moe_layers() * model_->config().num_experts_per_tok;
  const int64_t bs = kv_.block_size();
  if (!s.cacheable) return;
  // The positions just computed, [num_computed - count, num_computed): their records (-1 where
  // this step recorded none).
  if (rows) {
    const auto at = rows->begin() + first_row * per_token;
    s.pending_rows.insert(s.pending_rows.end(), at, at + count * per_token);
  } else {
    s.pending_rows.insert(s.pending_rows.end(), static_cast<size_t>(count * per_token), -1);
  }
  int64_t used = 0;
  while ((s.hashed_blocks + 1) * bs <= s.num_computed) {
    const int64_t i = s.hashed_blocks;
    std::span<const int32_t> records(s.pending_rows.data() + used * per_token, static_cast<size_t>(bs * per_token));
    if (std::find(records.begin(), records.end(), -1) != records.end()) records = {};  // some step recorded none
    const std::span<const int32_t> tokens(s.tokens.data() + i * bs, static_cast<size_t>(bs));
    const auto key = cache_->insert(s.chain_key, tokens, s.blocks[static_cast<size_t>(i)], records);
    if (!key) {  // a hash collision with another prompt: key nothing more of this request
      s.cacheable = false;
      s.pending_rows.clear();
      return;
    }
    s.chain_key = *key;
    ++s.hashed_blocks;
    used += bs;
  }
  s.pending_rows.erase(s.pending_rows.begin(), s.pending_rows.begin() + used * per_token);
}

size_t Engine::num_in_flight() const {
  size_t n = 0;
  for (const Sequence* s : running_) n += s->started;
  for (const Sequence* s : waiting_) n += s->started;
  return n;
}

void Engine::reserve_blocks(std::vector<Planned>& planned) {
  for (Planned& p : planned) {
    Sequence* s = p.seq;
    if (!s->running) continue;  // preempted for an older request's growth
    const int64_t need =
        kv_.blocks_for(s->num_computed + p.count) - static_cast<int64_t>(s->blocks.size());
    if (need <= 0) continue;
    // The youngest running request gives its blocks back first, down to this one itself:
    // the oldest requests keep going (vLLM's and SGLang's order). A single request always
    // fits (submit checks it against the pool), so this ends with `s` running or preempted.
    while (need > kv_.num_free() && s->running) {
      // Blocks only the prefix cache holds go first (a preemption may have just left some so).
      if (cache_ && cache_->evict(need - kv_.num_free()) > 0) continue;
      preempt(*running_.back());
    }
    if (s->running) (void)kv_.allocate(need, s->blocks);
  }
  // The sliding pool is sized so that running requests kept to their windows never exhaust it
  // (sliding_kv_blocks_needed); should it run dry all the same, the youngest give theirs back.
  if (sliding_) {
    for (Planned& p : planned) {
      Sequence* s = p.seq;
      if (!s->running) continue;
      const int64_t need =
          kv_.blocks_for(s->num_computed + p.count) - static_cast<int64_t>(s->sliding_blocks.size());
      if (need <= 0) continue;
      while (need > sliding_->num_free() && s->running) preempt(*running_.back());
      if (s->running) (void)sliding_->allocate(need, s->sliding_blocks);
    }
  }
  planned.erase(std::remove_if(planned.begin(), planned.end(), [](const Planned& p) { return !p.seq->running; }),
                planned.end());
}

void Engine::remove(const std::string& rid) {
  auto it = by_rid_.find(rid);
  if (it == by_rid_.end()) return;
  Sequence* s = it->second.get();
  if (s->running) {
    running_.erase(std::remove(running_.begin(), running_.end(), s), running_.end());
  } else {
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), s), waiting_.end());
    if (s->is_new) --num_waiting_new_;
  }
  release_blocks(*s);
  by_rid_.erase(it);
}

void Engine::finish(Sequence& s, std::string reason, std::string abort_reason,
                    std::vector<EngineEvent>& out) {
  EngineEvent e;
  e.kind = EngineEvent::Kind::kFinished;
  e.rid = s.spec.rid;
  e.tag = s.spec.tag;
  e.finish_reason = std::move(reason);
  e.abort_reason = std::move(abort_reason);
  e.prompt_tokens = static_cast<uint32_t>(s.prompt_len);
  e.completion_tokens = s.num_generated;
  out.push_back(std::move(e));
  remove(s.spec.rid);
}

void Engine::fail(Sequence& s, const Status& error, std::vector<EngineEvent>& out) {
  EngineEvent e;
  e.kind = EngineEvent::Kind::kFailed;
  e.rid = s.spec.rid;
  e.tag = s.spec.tag;
  e.error = error;
  e.prompt_tokens = static_cast<uint32_t>(s.prompt_len);
  e.completion_tokens = s.num_generated;
  out.push_back(std::move(e));
  remove(s.spec.rid);
}

bool Engine::abort(const std::string& rid, const std::string& reason, std::vector<EngineEvent>& out) {
  auto it = by_rid_.find(rid);
  if (it == by_rid_.end()) return false;
  finish(*it->second, "abort", reason, out);
  return true;
}

size_t Engine::abort_all(const std::string& reason, std::vector<EngineEvent>& out,
                         std::optional<uint64_t> tag_filter) {
  std::vector<Sequence*> victims;
  for (auto& [rid, s] : by_rid_)
    if (!tag_filter || s->spec.tag == *tag_filter) victims.push_back(s.get());
  // A deterministic order (by rid), the same on every run.
  std::sort(victims.begin(), victims.end(), [](const Sequence* a, const Sequence* b) {
    return a->spec.rid < b->spec.rid;
  });
  for (Sequence* s : victims) finish(*s, "abort", reason, out);
  return victims.size();
}

size_t Engine::expire(std::chrono::steady_clock::time_point now, std::vector<EngineEvent>& out) {
  if (!next_deadline_ || now < *next_deadline_) return 0;
  std::vector<Sequence*> due;
  next_deadline_.reset();
  for (auto& [rid, s] : by_rid_) {
    if (!s->spec.deadline) continue;
    if (*s->spec.deadline <= now) due.push_back(s.get());
    else if (!next_deadline_ || *s->spec.deadline < *next_deadline_) next_deadline_ = s->spec.deadline;
  }
  std::sort(due.begin(), due.end(), [](const Sequence* a, const Sequence* b) { return a->spec.rid < b->spec.rid; });
  for (Sequence* s : due) finish(*s, "abort", "deadline", out);
  deadline_aborts_total_ += due.size();
  return due.size();
}

Engine::PauseCounts Engine::pause(PauseMode mode, std::vector<EngineEvent>& out) {
  PauseCounts c;
  paused_ = true;
  if (mode == PauseMode::kAbort) {
    c.aborted = static_cast<uint32_t>(abort_all("weight_update", out));
  } else if (mode == PauseMode::kRetract) {
    // Every request that has computed anything starts again from its prompt; running ones
    // go back to the head of the queue in their running order, ahead of those never started.
    std::vector<Sequence*> back;
    for (Sequence* s : running_) back.push_back(s);
    for (Sequence* s : waiting_) back.push_back(s);
    running_.clear();
    waiting_.clear();
    for (Sequence* s : back) {
      // In flight: a request preempted mid-prefill has computed nothing now, but had begun
      // (and may have streamed expert records); one admitted but not begun has not.
      if (s->started) {
        EngineEvent e;
        e.kind = EngineEvent::Kind::kRetracted;
        e.rid = s->spec.rid;
        e.tag = s->spec.tag;
        e.num_tokens_discarded = s->num_generated;
        out.push_back(std::move(e));
        ++c.retracted;
      }
      s->tokens.resize(static_cast<size_t>(s->prompt_len));
      s->routed_sent = 0;  // what the client received is void: every record goes out again
      if (s->running && !s->started && !s->is_new) {  // admitted, not begun: new again
        s->is_new = true;
        ++num_waiting_new_;
      }
      s->started = false;
      s->num_computed = 0;
      reset_cached_prefix(*s);
      s->num_generated = 0;
      s->running = false;
      release_blocks(*s);
      waiting_.push_back(s);
    }
  } else {
    c.paused = static_cast<uint32_t>(num_in_flight());  // SPEC 11.6
  }
  return c;
}

uint32_t Engine::resume() {
  if (!paused_) return 0;  // SPEC 11.6: not paused, nothing resumed
  paused_ = false;
  return static_cast<uint32_t>(num_in_flight());
}

size_t Engine::fail_all(const Status& error, std::vector<EngineEvent>& out) {
  std::vector<Sequence*> victims;
  for (auto& [rid, s] : by_rid_) victims.push_back(s.get());
  std::sort(victims.begin(), victims.end(),
            [](const Sequence* a, const Sequence* b) { return a->spec.rid < b->spec.rid; });
  for (Sequence* s : victims) fail(*s, error, out);
  return victims.size();
}

Status Engine::step(std::vector<EngineEvent>& out) {
  if (!can_step()) return Status::Ok();
  if (cache_ && updater_.epoch() != cache_epoch_) {
    // The weights may have changed: cached KV is stale, and so is what requests that kept
    // their state (in_place) computed before; they are keyed again only once recomputed.
    cache_->clear();
    cache_epoch_ = updater_.epoch();
    // A request admitted with reused KV that has computed nothing since (new, or readmitted after
    // a preemption) holds only lent KV: it goes back to the queue (no preemption: nothing it
    // computed is lost) and computes everything under these weights, as it would have without
    // the cache. One that computed since its admission keeps its state, as in_place promises.
    std::vector<Sequence*> lent;
    for (Sequence* s : running_)
      if (s->reused_tokens > 0 && s->num_computed == s->reused_tokens) lent.push_back(s);
    for (auto it = lent.rbegin(); it != lent.rend(); ++it) preempt(**it);  // keeps their order
    for (auto& [rid, seq] : by_rid_)
      if (seq->num_computed > 0) seq->cacheable = false;
  }
  admit();
  if (running_.empty()) return Status::Ok();

  const ModelConfig& c = model_->config();
  const int64_t bs = kv_.block_size();
  const int64_t width = options_.step.max_blocks_per_seq;
  int64_t budget = options_.step.max_tokens;

  struct Slice {
    Sequence* seq;
    int64_t first_row;   // row in the batch
    int64_t start_pos;   // first position computed
    int64_t count;
    bool samples;
  };
  std::vector<Slice> slices;
  StepBatch batch;
  batch.max_blocks_per_seq = static_cast<int32_t>(width);

  // Decode tokens first (one each, they keep latency low), then prefill chunks with the
  // remaining budget; then the blocks those positions need.
  std::vector<Planned> planned;
  for (Sequence* s : running_)
    if (static_cast<int64_t>(s->tokens.size()) - s->num_computed == 1 && budget > 0) {
      planned.push_back({s, 1});
      budget -= 1;
    }
  for (Sequence* s : running_) {
    const int64_t remaining = static_cast<int64_t>(s->tokens.size()) - s->num_computed;
    if (remaining > 1 && budget > 0) {
      planned.push_back({s, std::min(remaining, budget)});
      budget -= planned.back().count;
    }
  }
  reserve_blocks(planned);
  for (const Planned& p : planned) {
    Sequence* s = p.seq;
    const int64_t n = p.count;
    const int64_t seq_index = static_cast<int64_t>(slices.size());
    Slice sl{s, batch.num_tokens(), s->num_computed, n,
             s->num_computed + n == static_cast<int64_t>(s->tokens.size())};
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = s->num_computed + i;
      batch.token_ids.push_back(s->tokens[static_cast<size_t>(pos)]);
      batch.positions.push_back(static_cast<int32_t>(pos));
      batch.seq_of.push_back(static_cast<int32_t>(seq_index));
      batch.slot_mapping.push_back(
          static_cast<int32_t>(s->blocks[static_cast<size_t>(pos / bs)] * bs + pos % bs));
      if (sliding_)
        batch.sliding_slot_mapping.push_back(
            static_cast<int32_t>(s->sliding_blocks[static_cast<size_t>(pos / bs)] * bs + pos % bs));
      batch.ctx_len.push_back(static_cast<int32_t>(pos + 1));
    }
    for (int64_t b = 0; b < width; ++b)
      batch.block_tables.push_back(b < static_cast<int64_t>(s->blocks.size())
                                       ? s->blocks[static_cast<size_t>(b)]
                                       : 0);
    if (sliding_)  // freed and never-allocated entries are -1: a read of one is refused, not served
      for (int64_t b = 0; b < width; ++b)
        batch.sliding_block_tables.push_back(
            b < static_cast<int64_t>(s->sliding_blocks.size()) ? s->sliding_blocks[static_cast<size_t>(b)] : -1);
    if (sl.samples) batch.logits_rows.push_back(static_cast<int32_t>(sl.first_row + n - 1));
    slices.push_back(sl);
  }
  if (slices.empty()) return Status::Ok();

  bool want_records = false;
  for (const Slice& sl : slices) want_records |= sl.seq->spec.return_routed_experts;

  std::span<const float> logits;  // the model's host buffer, valid until its next step
  SampledRows sampled;            // the same, when the device sampled
  const bool on_device = options_.device_sampling && model_->backend().kind == DeviceKind::kCuda;
  Status st;
  int64_t top_n = 0;  // the most top log-probs a sampled row asks for: every row gets that many
  for (const Slice& sl : slices)
    if (sl.samples) top_n = std::max<int64_t>(top_n, sl.seq->spec.top_logprobs_num);
  if (on_device) {
    sample_rows_.clear();
    for (const Slice& sl : slices)
      if (sl.samples) sample_rows_.push_back(sampling_row(sl.seq->spec.sampling, sl.seq->num_generated));
    if (auto r = model_->step_sample(batch, sample_rows_, want_records ? &recorder_ : nullptr, top_n); r.ok())
      sampled = *r;
    else
      st = r.status();
  } else if (auto r = model_->step(batch, want_records ? &recorder_ : nullptr); r.ok()) {
    logits = *r;
  } else {
    st = r.status();
  }
  if (st.ok() && want_records && recorder_.num_layers_captured() != c.num_moe_layers())
    st = Status(ErrorCode::kInternal, "not every MoE layer recorded its experts", "routed_experts");
  if (!st.ok()) {
    for (const Slice& sl : slices) fail(*sl.seq, st, out);
    return st;
  }

  const int64_t L = c.num_moe_layers(), K = c.num_experts_per_tok, V = c.vocab_size;
  size_t logits_row = 0;
  for (const Slice& sl : slices) {
    Sequence& s = *sl.seq;
    s.num_computed += sl.count;
    s.started = true;
    if (sliding_) trim_sliding(s);
    if (cache_) cache_filled_blocks(s, want_records ? &recorder_.rows() : nullptr, sl.first_row, sl.count);
    EngineEvent ev;
    ev.kind = EngineEvent::Kind::kTokens;
    ev.rid = s.spec.rid;
    ev.tag = s.spec.tag;
    if (s.spec.return_routed_experts) {
      if (!s.prefix_rows.empty()) {
        // Positions whose KV came from the prefix cache: their records came with it, and they
        // end where this slice starts.
        ev.routed_start_pos = s.prefix_rows_from;
        ev.routed_num_tokens = sl.start_pos - s.prefix_rows_from;
        ev.routed_rows = std::move(s.prefix_rows);
        s.prefix_rows.clear();
        s.routed_sent = sl.start_pos;
      }
      // After a preemption the request computes its positions again: their records went out
      // the first time (routed_sent), and only the positions never streamed are sent.
      const int64_t from = std::max<int64_t>({sl.start_pos, int64_t{s.spec.routed_experts_start_len}, s.routed_sent});
      const int64_t to = sl.start_pos + sl.count;
      if (from < to) {
        s.routed_sent = to;
        if (ev.routed_num_tokens == 0) ev.routed_start_pos = from;
        ev.routed_num_tokens += to - from;
        const auto& rows = recorder_.rows();
        const int64_t row0 = sl.first_row + (from - sl.start_pos);
        ev.routed_rows.insert(ev.routed_rows.end(), rows.begin() + row0 * L * K,
                              rows.begin() + (row0 + (to - from)) * L * K);
      }
    }
    bool done = false;
    std::string reason;
    if (sl.samples) {
      SampledToken tok;
      const auto n = static_cast<size_t>(s.spec.top_logprobs_num);
      if (on_device) {
        tok = SampledToken{sampled.tokens[logits_row], sampled.logprobs[logits_row]};
        // Row r's list holds top_n entries; the request's n are its first n (one total order).
        const size_t at = logits_row * static_cast<size_t>(sampled.top_n);
        ev.top_ids.insert(ev.top_ids.end(), sampled.top_ids.begin() + at, sampled.top_ids.begin() + at + n);
        ev.top_logprobs.insert(ev.top_logprobs.end(), sampled.top_logprobs.begin() + at,
                               sampled.top_logprobs.begin() + at + n);
      } else {
        std::span<const float> row(logits.data() + logits_row * static_cast<size_t>(V), static_cast<size_t>(V));
        tok = sampler_.sample(row, s.spec.sampling, s.num_generated, static_cast<int64_t>(n), &top_);
        ev.top_ids.insert(ev.top_ids.end(), top_.ids.begin(), top_.ids.end());
        ev.top_logprobs.insert(ev.top_logprobs.end(), top_.logprobs.begin(), top_.logprobs.end());
      }
      ev.top_logprobs_num = s.spec.top_logprobs_num;
      ++logits_row;
      s.tokens.push_back(tok.token);
      ++s.num_generated;
      ++generated_tokens_total_;
      ev.token_ids.push_back(tok.token);
      if (s.spec.return_logprob) ev.logprobs.push_back(tok.logprob);
      ev.weight_versions.push_back(weight_version_);
      if (std::find(s.spec.stop_token_ids.begin(), s.spec.stop_token_ids.end(), tok.token) !=
          s.spec.stop_token_ids.end()) {
        done = true;
        reason = "stop";
      } else if (s.num_generated >= s.spec.max_new_tokens) {
        done = true;
        reason = "length";
      }
    }
    if (!s.prompt_counted) {
      s.prompt_counted = true;
      prompt_tokens_total_ += static_cast<uint64_t>(s.prompt_len);
    }
    // The admission's prefix lookup, now that the request computes with what it found.
    prefix_queried_tokens_total_ += static_cast<uint64_t>(s.uncounted_queried);
    prefix_hit_tokens_total_ += static_cast<uint64_t>(s.uncounted_hit);
    s.uncounted_queried = 0;
    s.uncounted_hit = 0;
    if (!ev.token_ids.empty() || ev.routed_num_tokens > 0) out.push_back(std::move(ev));
    if (done) finish(s, reason, "", out);
  }
  return Status::Ok();
}

EngineStats Engine::stats() const {
  EngineStats st;
  st.num_waiting = waiting_.size();
  st.num_running = running_.size();
  st.num_requests_total = requests_total_;
  st.num_prompt_tokens_total = prompt_tokens_total_;
  st.num_generated_tokens_total = generated_tokens_total_;
  st.num_preemptions_total = preemptions_total_;
  st.num_recomputed_tokens_total = recomputed_tokens_total_;
  st.num_deadline_aborts_total = deadline_aborts_total_;
  st.kv_blocks_free = kv_.num_free();
  st.kv_blocks_total = kv_.num_blocks();
  st.sliding_kv_blocks_free = sliding_ ? sliding_->num_free() : 0;
  st.sliding_kv_blocks_total = sliding_ ? sliding_->num_blocks() : 0;
  st.kv_blocks_cached = cache_ ? cache_->num_blocks() : 0;
  st.kv_blocks_evictable = cache_ ? cache_->num_evictable() : 0;
  st.prefix_cache_enabled = cache_ != nullptr;
  st.num_prefix_cache_queried_tokens_total = prefix_queried_tokens_total_;
  st.num_prefix_cache_hit_tokens_total = prefix_hit_tokens_total_;
  const GraphStats& g = model_->graph_stats();
  st.graph_buckets = static_cast<int64_t>(g.buckets.size());
  st.graph_max_batch = g.buckets.empty() ? 0 : g.buckets.back();
  st.num_graphs = g.num_graphs;
  st.graph_steps = g.graph_steps;
  st.eager_steps = g.eager_steps;
  st.graph_capture_s = g.capture_s;
  return st;
}

}  // namespace rolloutd::core
