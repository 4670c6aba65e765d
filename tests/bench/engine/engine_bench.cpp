// Decode throughput of the whole engine with CUDA graphs on vs off, the first decode step after a
// weight update against the steady state, and the routed-expert capture overhead (step time
// with records on vs off). Reports numbers (tests/bench/NOTES.md, "CUDA GRAPHS"); asserts
// nothing but that the graph and eager runs generate the same greedy tokens.
//
//   engine_bench [--json FILE] [--models tiny,mid] [--batches 1,32,256] [--new-tokens N]
//                [--model-dir DIR [--peer PEER.json]] [--host-sampling 1] [--quantize-experts mxfp4]
//                [--graphs on|off|both] [--records on|off|both] [--dense-bf16 1] [--fuse-qkv 0] [--grouped-experts 0]
//                [--prefill R,L] [--prefix-groups G,N,L,T] [--device cuda|cpu] [--sliding-kv-pool 1]
//
// With records on, each batch also reports how the decode steps' routing loaded the experts
// (load_of: busy experts, the MXFP4 decode kernel's 8-token passes, the most tokens an expert
// got, against uniform routing; JSON "expert_load").
//
// --model-dir adds model "ckpt": a Hugging Face checkpoint (rolloutctl make-test-model), which
// tests/bench/engine/hf_peer.py runs with transformers `generate` in the same job; --peer reads
// its figures and reports ours / peer. Every row also reports the decode floor: the bytes one
// decode step must read (every non-expert parameter, the experts a batch of B tokens touches,
// E * (1 - (1 - K/E)^B) per layer under uniform routing, and the KV cache at the run's mean
// context) over the same-run device copy bandwidth.
//
// Models: "tiny" is the embedded default (4 layers, hidden 64: launch-bound, where graphs
// matter most); "mid" is 8 layers, hidden 1024, 16 heads of 64, 32 experts top-4, expert
// intermediate 512, vocab 16384 (FP32, the decoder's simple kernels); "tinyv" is tiny with
// Qwen3's vocabulary (151,936), where sampling dominates a step; "h2880" is issue 6's mid size in
// the qwen3_moe shape (8 layers, hidden 2880, 64 query / 8 KV heads of 64, 32 experts top-4,
// intermediate 2880, vocab 16384), without a checkpoint to write; "q2048" has Qwen3-30B-A3B's
// attention (32 query / 4 KV heads of 128, QK-norm) and expert shape (2048 -> 768, top-8) in 8
// layers of 32 experts. Weights are random
// (init_random_weights), never zeros. --host-sampling 1 copies the logits back and samples on
// the host (EngineOptions::device_sampling off; NOTES "Device sampling"). --quantize-experts mxfp4
// stores every model's routed experts as MXFP4 (the daemon's flag: the checkpoint's BF16/FP32
// experts quantized on load; random MXFP4 codes for the random models); the checkpoint's peer
// still runs the unquantized model. --dense-bf16 1 stores the built-in models' dense projections
// in BF16 (ModelConfig::dense_bf16, what a BF16 checkpoint gets; the checkpoint follows its own
// dtype).
//
// Prefill: --prefill R,L (default 8,512; 0 to skip) builds a second engine per model, after the
// decode runs (whose limits it leaves alone), with room for R sequences of L + 1 tokens and a step
// token budget of R * L, submits R requests of L-token prompts and one new token each, and
// reports prompt tokens / s from the first step to the last one, best of two runs after a
// warm-up (JSON "prefill"; the peer: one forward of the same prompts, hf_peer.py --prefill).
//
// Prefix cache: --prefix-groups G,N,L,T (default 0: skip) submits G groups of N samples of an
// L-token prompt (a GRPO step: T new tokens each, temperature 1, seeds 0..N-1) at once, on an
// engine without and one with EngineOptions::prefix_cache (graphs on, a step budget of 2,048
// tokens), and reports the wall time from the first step to the last, generated tokens / s and
// the prompt tokens the cache lent (JSON "prefix_cache"; README "Prefix cache").
//
// --sliding-kv-pool 1 gives the decode and prefill engines of a model with sliding-window layers
// (a gpt_oss checkpoint) the sliding layers' own KV pool (StepLimits::num_sliding_kv_blocks,
// sliding_kv_blocks_needed; README "Sliding KV pool"): the step times against a run without it
// show its cost (one more table upload a step), JSON "kv_cache_bytes" what it saves.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/engine/engine.hpp"
#include "core/model/embedded_model.hpp"
#include "core/model/hf_checkpoint.hpp"
#include "core/weights/session.hpp"

#if defined(ROLLOUTD_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace rolloutd {
namespace {

using Clock = std::chrono::steady_clock;
using core::Engine;
using core::EngineEvent;

void submit_or_exit(Engine& e, const core::RequestSpec& s) {
  if (Status st = e.submit(s); !st.ok()) {
    std::fprintf(stderr, "submit failed: %s\n", st.to_string().c_str());
    std::exit(1);
  }
}

// Steps until nothing is left to run; returns the steps taken. A failed step ends the bench.
int64_t step_until_idle(Engine& e, std::vector<EngineEvent>& events) {
  int64_t steps = 0;
  for (; e.has_work(); ++steps) {
    if (Status st = e.step(events); !st.ok()) {
      std::fprintf(stderr, "step failed: %s\n", st.to_string().c_str());
      std::exit(1);
    }
  }
  return steps;
}

core::ModelConfig model_config(const std::string& name) {
  core::ModelConfig c = core::embedded_model_config();
  if (name == "mid") {
    c.name = "bench:mid";
    c.vocab_size = 16384;
    c.hidden_size = 1024;
    c.num_hidden_layers = 8;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 4;
    c.head_dim = 64;
    c.num_experts = 32;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 512;
    c.intermediate_size = 2048;
  }
  if (name == "h2880") {  // issue 6's mid size (hidden 2880, 32 experts top-4, intermediate 2880)
    c.name = "bench:h2880";
    c.vocab_size = 16384;
    c.hidden_size = 2880;
    c.num_hidden_layers = 8;
    c.num_attention_heads = 64;
    c.num_key_value_heads = 8;
    c.head_dim = 64;
    c.num_experts = 32;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 2880;
    c.intermediate_size = 2880;
  }
  if (name == "q2048") {  // Qwen3-30B-A3B's attention (32 heads of 128 over 4 KV heads, QK-norm)
                           // and expert shape (2048 -> 768, top-8) in 8 layers of 32 experts
    c.name = "bench:q2048";
    c.vocab_size = 16384;
    c.hidden_size = 2048;
    c.num_hidden_layers = 8;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.qk_norm = true;
    c.num_experts = 32;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
    c.intermediate_size = 6144;
  }
  if (name == "tinyv") {  // tiny with Qwen3's vocabulary: the steps where sampling dominates
    c.name = "bench:tinyv";
    c.vocab_size = 151936;
  }
  return c;
}

// Device-to-device copy bandwidth (bytes/s), 1 GiB, best of 5: the ceiling a decode step's
// reads are held against (METHOD: the same-run ceiling).
double copy_bandwidth() {
#if defined(ROLLOUTD_WITH_CUDA)
  const size_t n = size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) return 0;
  cudaMemset(a, 1, n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int i = 0; i < 6; ++i) {
    cudaEventRecord(e0);
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i > 0) best = std::min(best, ms);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(n) / (best * 1e-3);  // read + write
#else
  return 0;
#endif
}

// Bytes a decode step of `batch` tokens reads at mean context `ctx` (see the header).
double decode_step_bytes(const core::MoeDecoder& m, int64_t batch, double ctx) {
  const core::ModelConfig& c = m.config();
  const double kv_elem = static_cast<double>(dtype_size(m.limits().kv_dtype));
  double bytes = 0;
  for (const auto& p : m.weights().parameters()) {
    const double b = static_cast<double>(p.storage.nbytes());
    if (p.name.find("mlp.experts.") != std::string::npos) {
      const double e = static_cast<double>(c.num_experts), k = static_cast<double>(c.num_experts_per_tok);
      bytes += b * (1.0 - std::pow(1.0 - k / e, static_cast<double>(batch)));  // experts touched
    } else if (p.name == "model.embed_tokens.weight") {
      bytes += static_cast<double>(batch * c.hidden_size) * 4;  // the rows looked up
    } else {
      bytes += b;
    }
  }
  // K and V (FP32 or BF16, the cache's dtype) of the context each layer attends to: a sliding-window layer reads at most its
  // window (min of the mean context and the window: a bound that is exact while every step's
  // context is on the same side of the window).
  double layer_ctx = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool sliding = l < static_cast<int64_t>(c.layer_types.size()) &&
                         c.layer_types[static_cast<size_t>(l)] == "sliding_attention" && c.sliding_window > 0;
    layer_ctx += sliding ? std::min(ctx, static_cast<double>(c.sliding_window)) : ctx;
  }
  bytes += 2.0 * static_cast<double>(batch * c.num_key_value_heads * c.head_dim) * kv_elem * layer_ctx;
  return bytes;
}

struct RunResult {
  double decode_tokens_per_s = 0;
  double step_median_ms = 0;
  double step_p90_ms = 0;
  double first_step_ms = 0;  // first decode step of the run
  uint64_t graph_steps = 0, eager_steps = 0;
  std::vector<int32_t> tokens;  // every request's tokens, in rid order
  nlohmann::json expert_load;   // records on: load_of() over the decode steps
};

// How a batch's (token, expert) pairs spread over the experts, per MoE layer of a decode step:
// the MXFP4 decode kernel passes over an expert's tokens 8 at a time (one n-tile) while the
// batch averages at most 4 a busy expert, streaming (and dequantizing) the expert's weights once
// a pass, so its work goes with sum ceil(count / 8), not with the busy experts. `rows` holds, per
// decode step, the batch's records [batch, layers, top_k] (logical ids; no replicas here, so
// logical = physical). Also the same figures under uniform routing (each token k distinct
// experts drawn uniformly, seeded), to tell a skewed router from chance.
nlohmann::json load_of(const std::vector<std::vector<int32_t>>& steps, int64_t layers, int64_t k, int64_t experts) {
  struct Acc {
    double n = 0, busy = 0, passes = 0, max = 0, over8 = 0;
    void add(const std::vector<int>& c) {
      int b = 0, p = 0, m = 0;
      for (int v : c) {
        b += v > 0;
        p += (v + 7) / 8;
        m = std::max(m, v);
      }
      n += 1;
      busy += b;
      passes += p;
      max += m;
      over8 += m > 8;
    }
    nlohmann::json json() const {
      if (n == 0) return nlohmann::json::object();
      return {{"layer_steps", n},
              {"busy_experts", busy / n},
              {"passes_of_8", passes / n},
              {"extra_passes", busy > 0 ? passes / busy - 1 : 0.0},
              {"max_tokens_per_expert", max / n},
              {"share_over_8", over8 / n}};
    }
  } seen, uniform;
  std::vector<int> c(static_cast<size_t>(experts));
  int64_t batch = 0;
  for (const std::vector<int32_t>& rows : steps) {
    batch = static_cast<int64_t>(rows.size()) / (layers * k);
    for (int64_t l = 0; l < layers; ++l) {
      std::fill(c.begin(), c.end(), 0);
      for (int64_t t = 0; t < batch; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t id = rows[static_cast<size_t>((t * layers + l) * k + j)];
          if (id >= 0 && id < experts) ++c[static_cast<size_t>(id)];
        }
      seen.add(c);
    }
  }
  uint64_t x = 0x9E3779B97F4A7C15ull;  // splitmix64: a fixed, portable stream
  auto next = [&x] {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::vector<int> pick(static_cast<size_t>(experts));
  for (int s = 0; s < 2000 && batch > 0; ++s) {
    std::fill(c.begin(), c.end(), 0);
    for (int64_t t = 0; t < batch; ++t) {
      for (int64_t e = 0; e < experts; ++e) pick[static_cast<size_t>(e)] = static_cast<int>(e);
      for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates: k distinct experts
        const int64_t r = j + static_cast<int64_t>(next() % static_cast<uint64_t>(experts - j));
        std::swap(pick[static_cast<size_t>(j)], pick[static_cast<size_t>(r)]);
        ++c[static_cast<size_t>(pick[static_cast<size_t>(j)])];
      }
    }
    uniform.add(c);
  }
  return {{"batch", batch}, {"decode_steps", steps.size()}, {"routed", seen.json()}, {"uniform", uniform.json()}};
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

// `batch` requests with g_prompt_len-token prompts, greedy, `new_tokens` each (no stop ids): one
// prefill step, then decode steps of exactly `batch` sequences. --prompt-len sets it (default 16:
// the figures in tests/bench/NOTES.md are at 16 unless they say otherwise; longer contexts weigh
// attention and the KV cache as RL rollouts do).
int g_prompt_len = 16;
RunResult run(Engine& e, int64_t batch, uint32_t new_tokens, bool records, const std::string& tag) {
  for (int64_t i = 0; i < batch; ++i) {
    core::RequestSpec s;
    char rid[32];
    std::snprintf(rid, sizeof rid, "%s%06lld", tag.c_str(), static_cast<long long>(i));
    s.rid = rid;
    for (int t = 0; t < g_prompt_len; ++t)
      s.input_ids.push_back(static_cast<int32_t>((i * 131 + t * 17 + 1) % e.model_config().vocab_size));
    s.max_new_tokens = new_tokens;
    s.sampling.temperature = 0.0f;
    s.return_routed_experts = records;
    submit_or_exit(e, s);
  }
  const core::GraphStats g0 = e.model().graph_stats();
  std::vector<EngineEvent> events;
  std::vector<double> step_ms;
  uint64_t decode_tokens = 0;
  double decode_s = 0;
  bool prefilled = false;
  std::map<std::string, std::vector<int32_t>> tokens;
  while (e.has_work()) {
    const size_t before = events.size();
    const auto t0 = Clock::now();
    if (Status st = e.step(events); !st.ok()) {
      std::fprintf(stderr, "step failed: %s\n", st.to_string().c_str());
      std::exit(1);
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    uint64_t n = 0;
    for (size_t i = before; i < events.size(); ++i) n += events[i].token_ids.size();
    if (prefilled) {
      step_ms.push_back(s * 1e3);
      decode_s += s;
      decode_tokens += n;
    }
    prefilled = prefilled || n > 0;
  }
  // Records of the decode steps' input positions (g_prompt_len on), grouped by position: every
  // request decodes in lockstep, so one position is one step of `batch` rows.
  const core::ModelConfig& mc = e.model_config();
  const int64_t layers = mc.num_moe_layers(), k = mc.num_experts_per_tok;
  std::map<int64_t, std::vector<int32_t>> by_pos;
  std::map<int64_t, int64_t> rows_at;
  for (const auto& ev : events) {
    if (ev.kind == EngineEvent::Kind::kTokens)
      tokens[ev.rid].insert(tokens[ev.rid].end(), ev.token_ids.begin(), ev.token_ids.end());
    for (int64_t i = 0; records && i < ev.routed_num_tokens; ++i) {
      const int64_t pos = ev.routed_start_pos + i;
      if (pos < g_prompt_len) continue;
      auto& v = by_pos[pos];
      const auto* row = ev.routed_rows.data() + i * layers * k;
      v.insert(v.end(), row, row + layers * k);
      ++rows_at[pos];
    }
  }
  std::vector<std::vector<int32_t>> steps;
  for (auto& [pos, v] : by_pos)
    if (rows_at[pos] == batch) steps.push_back(std::move(v));
  RunResult r;
  if (records && layers > 0) r.expert_load = load_of(steps, layers, k, mc.num_experts);
  r.decode_tokens_per_s = decode_s > 0 ? static_cast<double>(decode_tokens) / decode_s : 0;
  r.step_median_ms = percentile(step_ms, 0.5);
  r.step_p90_ms = percentile(step_ms, 0.9);
  r.first_step_ms = step_ms.empty() ? 0 : step_ms.front();
  r.graph_steps = e.model().graph_stats().graph_steps - g0.graph_steps;
  r.eager_steps = e.model().graph_stats().eager_steps - g0.eager_steps;
  for (auto& [rid, t] : tokens) r.tokens.insert(r.tokens.end(), t.begin(), t.end());
  return r;
}

struct PrefillResult {
  double tokens_per_s = 0;
  double ms = 0;
  int64_t steps = 0;
};

// R requests of L-token prompts, max_new_tokens 1, greedy, records off; the time from the first
// step to the last one (every request finished).
PrefillResult run_prefill(Engine& e, int64_t requests, int64_t len, const std::string& tag) {
  for (int64_t i = 0; i < requests; ++i) {
    core::RequestSpec s;
    char rid[32];
    std::snprintf(rid, sizeof rid, "%s%06lld", tag.c_str(), static_cast<long long>(i));
    s.rid = rid;
    for (int64_t t = 0; t < len; ++t)
      s.input_ids.push_back(static_cast<int32_t>((i * 131 + t * 17 + 1) % e.model_config().vocab_size));
    s.max_new_tokens = 1;
    s.sampling.temperature = 0.0f;
    submit_or_exit(e, s);
  }
  std::vector<EngineEvent> events;
  PrefillResult r;
  const auto t0 = Clock::now();
  r.steps = step_until_idle(e, events);
  const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
  r.ms = sec * 1e3;
  r.tokens_per_s = sec > 0 ? static_cast<double>(requests * len) / sec : 0;
  return r;
}

struct GroupsResult {
  double ms = 0;
  int64_t steps = 0, generated = 0;
  uint64_t hit_tokens = 0, queried_tokens = 0;
};

// G groups of N samples of an L-token prompt, T new tokens each, submitted at once; the time
// from the first step to the last one. Group g's prompt depends on g + salt only.
GroupsResult run_groups(Engine& e, int64_t groups, int64_t samples, int64_t len, uint32_t new_tokens,
                        const std::string& tag, int64_t salt) {
  const core::EngineStats before = e.stats();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t n = 0; n < samples; ++n) {
      core::RequestSpec s;
      s.rid = tag + "-" + std::to_string(g) + "-" + std::to_string(n);
      for (int64_t t = 0; t < len; ++t)
        s.input_ids.push_back(static_cast<int32_t>(((g + salt) * 7919 + t * 31 + 3) % e.model_config().vocab_size));
      s.max_new_tokens = new_tokens;
      s.sampling.temperature = 1.0f;
      s.sampling.seed = static_cast<uint64_t>(n);
      submit_or_exit(e, s);
    }
  std::vector<EngineEvent> events;
  GroupsResult r;
  const auto t0 = Clock::now();
  r.steps = step_until_idle(e, events);
  r.ms = std::chrono::duration<double>(Clock::now() - t0).count() * 1e3;
  for (const auto& ev : events) r.generated += static_cast<int64_t>(ev.token_ids.size());
  const core::EngineStats after = e.stats();
  r.hit_tokens = after.num_prefix_cache_hit_tokens_total - before.num_prefix_cache_hit_tokens_total;
  r.queried_tokens = after.num_prefix_cache_queried_tokens_total - before.num_prefix_cache_queried_tokens_total;
  return r;
}

// A full weight update with the model's own parameters (what a trainer's push costs the
// decoder: every parameter rewritten, layouts restored and re-applied).
void push_own_weights(Engine& e, uint64_t version) {
  const auto& reg = e.model().weights();
  std::vector<core::BucketEntry> entries;
  std::vector<uint8_t> bytes, one;
  for (size_t i = 0; i < reg.size(); ++i) {
    if (!reg.read_checkpoint(i, one).ok()) std::exit(1);
    const auto& p = reg.parameters()[i];
    entries.push_back({p.name, p.storage.dtype, {p.storage.shape.data(), p.storage.shape.data() + p.storage.rank()},
                       bytes.size(), one.size()});
    bytes.insert(bytes.end(), one.begin(), one.end());
  }
  const auto now = core::SteadyClock::now();
  auto& u = e.updater();
  auto b = u.begin({}, 600, now);
  if (!b.ok() || !u.apply_bucket(b->session, entries, bytes, std::nullopt, now).ok() ||
      !u.end(b->session, version, now).ok()) {
    std::fprintf(stderr, "weight push failed\n");
    std::exit(1);
  }
  e.set_weight_version(version);
}

size_t device_free_bytes() {
#if defined(ROLLOUTD_WITH_CUDA)
  size_t free_b = 0, total = 0;
  if (cudaMemGetInfo(&free_b, &total) == cudaSuccess) return free_b;
#endif
  return 0;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

}  // namespace
}  // namespace rolloutd

int main(int argc, char** argv) {
  using namespace rolloutd;
  // Line-buffered even into a file: a run cut short by its timeout still leaves its table.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string json_path, models = "tiny,mid", batches_arg = "1,32,256", model_dir, peer_path;
  uint32_t new_tokens = 64;
  bool host_sampling = false;  // --host-sampling 1: EngineOptions::device_sampling off
  std::string quantize_arg = "none";  // --quantize-experts none|mxfp4 (the daemon's flag)
  std::string graphs_arg = "both";    // --graphs on|off|both (one mode: e.g. under a profiler)
  std::string records_arg = "both";   // --records on|off|both (off alone: half the device time of an A/B)
  bool dense_bf16 = false;            // --dense-bf16 1: the built-in models' dense projections in BF16
  bool fuse_qkv = true;               // --fuse-qkv 0: three q/k/v GEMMs (ModelConfig::fuse_qkv), every model
  bool grouped_experts = true;        // --grouped-experts 0: ModelConfig::grouped_experts off (FP32 expert op)
  std::string prefill_arg = "8,512";  // --prefill R,L (0: skip)
  std::string groups_arg = "0";       // --prefix-groups G,N,L,T (0: skip)
  std::string device_arg = "cuda";    // --device cpu: a smoke run on the CPU backend
  std::string kv_arg = "float32";     // --kv-dtype float32|bfloat16: the K and V caches (StepLimits::kv_dtype)
  bool sliding_pool = false;          // --sliding-kv-pool 1: the window layers' own pool (decode and prefill)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--json") json_path = argv[i + 1];
    else if (a == "--models") models = argv[i + 1];
    else if (a == "--batches") batches_arg = argv[i + 1];
    else if (a == "--prompt-len") {
      // 1..65536 tokens: the prompts of the largest batch are one prefill step (StepLimits::max_tokens).
      char* end = nullptr;
      const long v = std::strtol(argv[i + 1], &end, 10);
      if (end == argv[i + 1] || *end != '\0' || v < 1 || v > 65536) {
        std::fprintf(stderr, "--prompt-len: an integer in [1, 65536], got %s\n", argv[i + 1]);
        return 2;
      }
      g_prompt_len = static_cast<int>(v);
    }
    else if (a == "--new-tokens") new_tokens = static_cast<uint32_t>(std::atoi(argv[i + 1]));
    else if (a == "--model-dir") model_dir = argv[i + 1];
    else if (a == "--peer") peer_path = argv[i + 1];
    else if (a == "--host-sampling") host_sampling = std::atoi(argv[i + 1]) != 0;
    else if (a == "--quantize-experts") quantize_arg = argv[i + 1];
    else if (a == "--graphs") graphs_arg = argv[i + 1];
    else if (a == "--records") records_arg = argv[i + 1];
    else if (a == "--dense-bf16") dense_bf16 = std::atoi(argv[i + 1]) != 0;
    else if (a == "--fuse-qkv") fuse_qkv = std::atoi(argv[i + 1]) != 0;
    else if (a == "--grouped-experts") grouped_experts = std::atoi(argv[i + 1]) != 0;
    else if (a == "--prefill") prefill_arg = argv[i + 1];
    else if (a == "--prefix-groups") groups_arg = argv[i + 1];
    else if (a == "--device") device_arg = argv[i + 1];
    else if (a == "--kv-dtype") kv_arg = argv[i + 1];
    else if (a == "--sliding-kv-pool") sliding_pool = std::atoi(argv[i + 1]) != 0;
  }
  if (kv_arg != "float32" && kv_arg != "bfloat16") {
    std::fprintf(stderr, "--kv-dtype: float32 or bfloat16, got %s\n", kv_arg.c_str());
    return 2;
  }
  const DType kv_dtype = kv_arg == "bfloat16" ? DType::kBF16 : DType::kF32;
  if (records_arg != "on" && records_arg != "off" && records_arg != "both") {
    std::fprintf(stderr, "--records: on, off or both, got %s\n", records_arg.c_str());
    return 2;
  }
  std::vector<bool> record_modes;
  if (records_arg != "on") record_modes.push_back(false);
  if (records_arg != "off") record_modes.push_back(true);
  std::vector<bool> graph_modes;
  if (graphs_arg != "on") graph_modes.push_back(false);
  if (graphs_arg != "off") graph_modes.push_back(true);
  const auto quantize = core::parse_expert_quantization(quantize_arg);
  if (!quantize.ok()) {
    std::fprintf(stderr, "%s\n", quantize.status().to_string().c_str());
    return 2;
  }
  // --device cpu: the same flow on the CPU backend (a smoke test of the bench itself in CI; the
  // figures mean nothing there: no copy bandwidth, no floor, no graphs).
  if (device_arg != "cpu" && device_arg != "cuda") {
    std::fprintf(stderr, "--device: cuda or cpu, got %s\n", device_arg.c_str());
    return 2;
  }
  if (device_arg == "cpu" && graphs_arg != "off") {
    std::fprintf(stderr, "--device cpu runs without CUDA graphs: add --graphs off\n");
    return 2;
  }
  const Backend* backend = device_arg == "cpu" ? &cpu_backend() : cuda_backend();
  if (device_arg != "cpu" && (backend == nullptr || cuda_device_count() == 0)) {
    std::fprintf(stderr, "engine_bench needs a GPU (or --device cpu)\n");
    return 2;
  }
  const ExecContext ctx{device_arg == "cpu" ? Device::cpu() : Device::cuda(0), nullptr};
  std::vector<int64_t> batches;
  for (const auto& b : split(batches_arg)) batches.push_back(std::atoll(b.c_str()));
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  int64_t prefill_requests = 0, prefill_len = 0;
  if (const auto pf = split(prefill_arg); pf.size() == 2) {
    prefill_requests = std::atoll(pf[0].c_str());
    prefill_len = std::atoll(pf[1].c_str());
  }
  if (prefill_requests <= 0 || prefill_len <= 0) prefill_requests = prefill_len = 0;
  int64_t groups_g = 0, groups_n = 0, groups_len = 0, groups_new = 0;
  if (const auto pg = split(groups_arg); pg.size() == 4) {
    groups_g = std::atoll(pg[0].c_str());
    groups_n = std::atoll(pg[1].c_str());
    groups_len = std::atoll(pg[2].c_str());
    groups_new = std::atoll(pg[3].c_str());
  } else if (groups_arg != "0") {
    std::fprintf(stderr, "--prefix-groups: G,N,L,T (groups, samples, prompt length, new tokens), got %s\n",
                 groups_arg.c_str());
    return 2;
  }
  if (groups_g <= 0 || groups_n <= 0 || groups_len <= 0 || groups_new <= 0) groups_g = 0;

  nlohmann::json peer;
  if (!peer_path.empty()) {
    std::ifstream f(peer_path);
    if (f) peer = nlohmann::json::parse(f, nullptr, false);
  }
  const double bw = device_arg == "cpu" ? 0.0 : copy_bandwidth();
  std::printf("device copy bandwidth (same run): %.1f GB/s\n", bw / 1e9);
  std::vector<std::string> model_names = split(models);
  if (!model_dir.empty()) model_names.push_back("ckpt");
  std::printf("sampling on the %s; routed experts %s\n", host_sampling ? "host" : "device",
              *quantize == core::ExpertQuantization::kMxfp4 ? "MXFP4" : "as stored");
  nlohmann::json out = {{"prefix_cache", nlohmann::json::array()}, {"bench", "engine"}, {"new_tokens", new_tokens},
                        {"prompt_len", g_prompt_len}, {"copy_bandwidth_bytes_per_s", bw},
                        {"device_sampling", !host_sampling},
                        {"quantize_experts", core::expert_quantization_name(*quantize)},
                        {"runs", nlohmann::json::array()}, {"prefill", nlohmann::json::array()}};
  if (!peer.is_null() && !peer.is_discarded()) out["peer"] = peer;
  std::printf("%-5s %5s %-7s %-7s %12s %10s %10s %10s %8s\n", "model", "batch", "graphs", "records", "decode tok/s",
              "step p50", "step p90", "1st step", "graph/eager");
  for (const std::string& model : model_names) {
    core::HfModel hf;
    core::ModelConfig mc = model_config(model);
    if (model == "ckpt") {
      auto opened = core::open_hf_model(model_dir, *quantize);
      if (!opened.ok()) {
        std::fprintf(stderr, "checkpoint: %s\n", opened.status().to_string().c_str());
        return 1;
      }
      hf = std::move(*opened);
      mc = hf.config;
    } else {
      // The built-in models' context (4,096) grows with --prompt-len so that the warm-up's 4 new
      // tokens and the runs' fit; a checkpoint keeps its own and refuses what does not fit.
      mc.max_position_embeddings = std::max<int64_t>(
          mc.max_position_embeddings, g_prompt_len + std::max<int64_t>(new_tokens, 4));
      if (Status st = core::apply_expert_quantization(mc, *quantize); !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", model.c_str(), st.to_string().c_str());
        return 1;
      }
      mc.dense_bf16 = dense_bf16;
    }
    mc.fuse_qkv = fuse_qkv;
    mc.grouped_experts = grouped_experts;
    // The model with its weights (the checkpoint's, or random ones) inside an engine.
    auto build = [&](const core::StepLimits& limits, int64_t max_running,
                     bool prefix_cache = false) -> std::unique_ptr<Engine> {
      auto m = core::MoeDecoder::create(mc, limits, *backend, ctx);
      if (!m.ok()) {
        std::fprintf(stderr, "model: %s\n", m.status().to_string().c_str());
        return nullptr;
      }
      if (model == "ckpt") {
        if (Status st = core::load_checkpoint(**m, *hf.checkpoint); !st.ok()) {
          std::fprintf(stderr, "load: %s\n", st.to_string().c_str());
          return nullptr;
        }
      } else if (!core::init_random_weights(**m, 7).ok()) {
        return nullptr;
      }
      core::EngineOptions eo;
      eo.max_running = max_running;
      eo.step = limits;
      eo.device_sampling = !host_sampling;
      eo.prefix_cache = prefix_cache;
      auto e = Engine::create(std::move(*m), eo);
      if (!e.ok()) {
        std::fprintf(stderr, "engine: %s\n", e.status().to_string().c_str());
        return nullptr;
      }
      return std::move(*e);
    };
    for (const bool graphs : graph_modes) {
      core::StepLimits limits;
      limits.max_seqs = max_batch;
      limits.max_tokens = std::max<int64_t>(max_batch * g_prompt_len, 512);  // the prompts in one prefill step
      limits.kv_block_size = 16;
      limits.max_blocks_per_seq = std::max<int64_t>(16, (g_prompt_len + new_tokens + 15) / 16 + 1);
      limits.num_kv_blocks = max_batch * ((g_prompt_len + new_tokens + 15) / 16 + 1) + 16;
      limits.graph_max_batch = graphs ? max_batch : 0;
      limits.kv_dtype = kv_dtype;
      if (sliding_pool) limits.num_sliding_kv_blocks = core::sliding_kv_blocks_needed(mc, limits);
      const int64_t kv_bytes =
          limits.num_sliding_kv_blocks > 0
              ? limits.num_kv_blocks * core::kv_cache_bytes_per_block(mc, 16, kv_dtype, /*sliding=*/false) +
                    limits.num_sliding_kv_blocks * core::kv_cache_bytes_per_block(mc, 16, kv_dtype, /*sliding=*/true)
              : limits.num_kv_blocks * core::kv_cache_bytes_per_block(mc, 16, kv_dtype);
      const size_t free_before = device_free_bytes();
      std::unique_ptr<Engine> e = build(limits, max_batch);
      if (!e) return 1;
      const size_t free_after = device_free_bytes();
      const core::GraphStats& gs = e->model().graph_stats();
      std::printf("%s: dense projections %s, q/k/v as one GEMM in %lld layers, KV cache %s\n", model.c_str(),
                  e->model().uses_bf16_dense() ? "BF16" : "FP32",
                  static_cast<long long>(e->model().qkv_fused_layers()), kv_arg.c_str());
      nlohmann::json entry = {{"model", model},
                              {"graphs", graphs},
                              {"dense_bf16", e->model().uses_bf16_dense()},
                              {"kv_dtype", kv_arg},
                              {"sliding_kv_blocks", limits.num_sliding_kv_blocks},
                              {"kv_cache_bytes", kv_bytes},
                              {"qkv_fused_layers", e->model().qkv_fused_layers()},
                              {"num_graphs", gs.num_graphs},
                              {"buckets", gs.buckets},
                              {"capture_s", gs.capture_s},
                              {"capture_device_bytes", free_before > free_after ? free_before - free_after : 0},
                              {"batches", nlohmann::json::array()}};
      // Warm-up: lazy initialisation (cuBLAS handle, first-touch) stays out of the figures.
      run(*e, std::min<int64_t>(max_batch, 4), 4, false, "w");
      for (const int64_t batch : batches) {
        nlohmann::json br = {{"batch", batch}};
        const double floor_ms = bw > 0 ? decode_step_bytes(e->model(), batch, g_prompt_len + new_tokens / 2.0) / bw * 1e3 : 0;
        br["floor_ms"] = floor_ms;
        for (const bool records : record_modes) {
          const RunResult r = run(*e, batch, new_tokens, records, records ? "r" : "n");
          std::printf("%-5s %5lld %-7s %-7s %12.0f %9.3fms %9.3fms %9.3fms %5llu/%llu\n", model.c_str(),
                      static_cast<long long>(batch), graphs ? "on" : "off", records ? "on" : "off",
                      r.decode_tokens_per_s, r.step_median_ms, r.step_p90_ms, r.first_step_ms,
                      static_cast<unsigned long long>(r.graph_steps), static_cast<unsigned long long>(r.eager_steps));
          br[records ? "records_on" : "records_off"] = {
              {"decode_tokens_per_s", r.decode_tokens_per_s}, {"step_median_ms", r.step_median_ms},
              {"step_p90_ms", r.step_p90_ms}, {"first_step_ms", r.first_step_ms},
              {"graph_steps", r.graph_steps}, {"eager_steps", r.eager_steps}};
          if (records && r.expert_load.contains("routed") && r.expert_load["routed"].contains("busy_experts")) {
            const auto& ro = r.expert_load["routed"];
            const auto& un = r.expert_load["uniform"];
            br["expert_load"] = r.expert_load;
            std::printf("%-5s %5lld %-7s expert load over %lld layer-steps: busy %.1f, passes of 8 %.2f (+%.1f %%), "
                        "max %.1f, max > 8 in %.0f %%; uniform routing: busy %.1f, passes %.2f (+%.1f %%), max %.1f, "
                        "max > 8 in %.0f %%\n",
                        model.c_str(), static_cast<long long>(batch), graphs ? "on" : "off",
                        static_cast<long long>(ro["layer_steps"].get<double>()), ro["busy_experts"].get<double>(),
                        ro["passes_of_8"].get<double>(), 100 * ro["extra_passes"].get<double>(),
                        ro["max_tokens_per_expert"].get<double>(), 100 * ro["share_over_8"].get<double>(),
                        un["busy_experts"].get<double>(), un["passes_of_8"].get<double>(),
                        100 * un["extra_passes"].get<double>(), un["max_tokens_per_expert"].get<double>(),
                        100 * un["share_over_8"].get<double>());
          }
          if (!records) {
            const size_t digest = std::hash<std::string>{}(
                std::string(reinterpret_cast<const char*>(r.tokens.data()), r.tokens.size() * 4));
            br["tokens_digest"] = digest;
            br["step_over_floor"] = floor_ms > 0 ? r.step_median_ms / floor_ms : 0;
            // The digest in the text too: an A/B of two builds (tests/gpu/ab-kernels.sh) compares
            // the greedy tokens from the tables alone.
            std::printf("%-5s %5lld %-7s floor %.3f ms: step / floor %.2f, tokens %016zx", model.c_str(),
                        static_cast<long long>(batch), graphs ? "on" : "off", floor_ms,
                        floor_ms > 0 ? r.step_median_ms / floor_ms : 0.0, digest);
            if (model == "ckpt" && peer.contains("batches") && peer["batches"].contains(std::to_string(batch))) {
              const auto& pb = peer["batches"][std::to_string(batch)];
              const double ratio = r.decode_tokens_per_s / pb["decode_tokens_per_s"].get<double>();
              const auto first = std::vector<int32_t>(r.tokens.begin(), r.tokens.begin() + new_tokens);
              const auto theirs = pb["first_tokens"].get<std::vector<int32_t>>();
              const bool same = theirs == first;
              // Where the two greedy sequences part (-1: equal), and ours, to tell a late
              // near-tie from an early bug.
              int64_t parted = -1;
              for (size_t i = 0; !same && i < first.size(); ++i)
                if (i >= theirs.size() || theirs[i] != first[i]) {
                  parted = static_cast<int64_t>(i);
                  break;
                }
              if (!same && parted < 0) parted = static_cast<int64_t>(first.size());  // ours is a prefix of theirs
              br["peer_decode_tokens_per_s"] = pb["decode_tokens_per_s"];
              br["over_peer"] = ratio;
              br["first_request_tokens_equal_peer"] = same;
              br["first_request_tokens"] = first;
              br["first_request_parts_from_peer_at"] = parted;
              std::printf(", HF peer %.0f tok/s: %.2f x peer, request 0 greedy tokens %s", 
                          pb["decode_tokens_per_s"].get<double>(), ratio, same ? "equal" : "differ");
              if (!same) std::printf(" from token %lld", static_cast<long long>(parted));
            }
            std::printf("\n");
          }
        }
        // The first decode step after a full weight update, against the steady state.
        push_own_weights(*e, static_cast<uint64_t>(batch));
        const RunResult after = run(*e, batch, new_tokens, false, "u");
        std::printf("%-5s %5lld %-7s after a weight update: first decode step %.3f ms, median %.3f ms\n",
                    model.c_str(), static_cast<long long>(batch), graphs ? "on" : "off", after.first_step_ms,
                    after.step_median_ms);
        br["after_update"] = {{"first_step_ms", after.first_step_ms}, {"step_median_ms", after.step_median_ms}};
        entry["batches"].push_back(br);
      }
      out["runs"].push_back(entry);
    }
    // Prefill, on an engine of its own (the decode runs above keep their limits): R sequences,
    // a step token budget of R * L, blocks for L + 1 tokens each; eager (graphs serve decode).
    if (prefill_requests > 0) {
      core::StepLimits pl;
      pl.max_seqs = prefill_requests;
      pl.max_tokens = prefill_requests * prefill_len;
      pl.kv_block_size = 16;
      pl.max_blocks_per_seq = (prefill_len + 1 + 15) / 16 + 1;
      pl.num_kv_blocks = prefill_requests * pl.max_blocks_per_seq + 16;
      pl.graph_max_batch = 0;
      if (sliding_pool) pl.num_sliding_kv_blocks = core::sliding_kv_blocks_needed(mc, pl);
      std::unique_ptr<Engine> pe = build(pl, prefill_requests);
      if (!pe) return 1;
      run_prefill(*pe, prefill_requests, prefill_len, "pw");  // warm-up
      PrefillResult best;
      for (int i = 0; i < 2; ++i) {
        const PrefillResult r = run_prefill(*pe, prefill_requests, prefill_len, "p" + std::to_string(i));
        if (r.tokens_per_s > best.tokens_per_s) best = r;
      }
      nlohmann::json pj = {{"model", model},         {"requests", prefill_requests}, {"prompt_len", prefill_len},
                           {"tokens_per_s", best.tokens_per_s}, {"ms", best.ms}, {"steps", best.steps}};
      std::printf("%-5s prefill %lld x %lld tokens: %.0f tok/s (%.2f ms, %lld steps)", model.c_str(),
                  static_cast<long long>(prefill_requests), static_cast<long long>(prefill_len), best.tokens_per_s,
                  best.ms, static_cast<long long>(best.steps));
      if (model == "ckpt" && peer.contains("prefill")) {
        const double theirs = peer["prefill"]["tokens_per_s"].get<double>();
        pj["peer_tokens_per_s"] = theirs;
        pj["over_peer"] = theirs > 0 ? best.tokens_per_s / theirs : 0;
        std::printf(", HF peer %.0f tok/s: %.2f x peer", theirs, theirs > 0 ? best.tokens_per_s / theirs : 0.0);
      }
      std::printf("\n");
      out["prefill"].push_back(pj);
    }
    // GRPO groups without and with the prefix cache, each on an engine of its own.
    if (groups_g > 0) {
      core::StepLimits gl;
      gl.max_seqs = std::min<int64_t>(groups_g * groups_n, 256);
      gl.max_tokens = 2048;
      gl.kv_block_size = 16;
      gl.max_blocks_per_seq = (groups_len + groups_new + 15) / 16 + 1;
      gl.num_kv_blocks = groups_g * groups_n * gl.max_blocks_per_seq + 16;
      gl.graph_max_batch = device_arg == "cpu" ? 0 : gl.max_seqs;
      gl.kv_dtype = kv_dtype;
      nlohmann::json gj = {{"model", model}, {"groups", groups_g}, {"samples", groups_n},
                           {"prompt_len", groups_len}, {"new_tokens", groups_new}};
      for (const bool cache : {false, true}) {
        std::unique_ptr<Engine> ge = build(gl, gl.max_seqs, cache);
        if (!ge) return 1;
        run_groups(*ge, 1, 2, groups_len, 4, "w", groups_g);  // warm-up, on a prompt no group shares
        const GroupsResult r =
            run_groups(*ge, groups_g, groups_n, groups_len, static_cast<uint32_t>(groups_new), "g", 0);
        const double tps = r.ms > 0 ? static_cast<double>(r.generated) / (r.ms / 1e3) : 0;
        gj[cache ? "cached" : "uncached"] = {{"ms", r.ms}, {"steps", r.steps}, {"generated_tokens_per_s", tps},
                                             {"hit_tokens", r.hit_tokens}, {"queried_tokens", r.queried_tokens}};
        std::printf("%-5s prefix groups %lld x %lld of %lld + %lld tokens, cache %s: %.2f ms, %lld steps, %.0f "
                    "generated tok/s, %llu of %llu prompt tokens from the cache\n",
                    model.c_str(), static_cast<long long>(groups_g), static_cast<long long>(groups_n),
                    static_cast<long long>(groups_len), static_cast<long long>(groups_new), cache ? "on" : "off", r.ms,
                    static_cast<long long>(r.steps), tps, static_cast<unsigned long long>(r.hit_tokens),
                    static_cast<unsigned long long>(r.queried_tokens));
      }
      out["prefix_cache"].push_back(gj);
    }
  }
  // Graphs must not change what is generated (greedy, same weights).
  int mismatches = 0;
  for (size_t i = 0; graph_modes.size() == 2 && i + 1 < out["runs"].size(); i += 2)
    for (size_t j = 0; j < out["runs"][i]["batches"].size(); ++j)
      if (out["runs"][i]["batches"][j]["tokens_digest"] != out["runs"][i + 1]["batches"][j]["tokens_digest"]) {
        std::printf("token mismatch graphs on/off: model %s batch %s\n",
                    out["runs"][i]["model"].get<std::string>().c_str(),
                    out["runs"][i]["batches"][j]["batch"].dump().c_str());
        ++mismatches;
      }
  out["token_mismatches"] = mismatches;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
