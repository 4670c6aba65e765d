#pragma once
// A MoE decoder (the Qwen3-MoE and gpt-oss shapes): token embedding;
// per layer RMSNorm -> rotary GQA attention (optionally QK-norm: per-head RMSNorm of q and k
// before rotary, as Qwen3 does) over a paged KV cache -> residual
// -> RMSNorm -> MoE FFN (softmax top-k router, SwiGLU experts) -> residual;
// final RMSNorm; LM head. gpt-oss adds projection, router and expert biases, learned attention
// sinks, sliding-window layers, YaRN rotary scaling and the clamped SwiGLU. FP32 activations; on
// CUDA, BF16 dense projections (ModelConfig::dense_bf16) and MXFP4 experts on moe::experts (BF16
// activations inside the expert GEMMs). All compute goes through the
// Backend op table, so the same code runs on the CPU reference and on CUDA.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/model/config.hpp"
#include "core/moe/expert_map.hpp"
#include "core/moe/routed_experts.hpp"
#include "core/storage/arena.hpp"
#include "core/weights/registry.hpp"
#include "kernels/backend.hpp"
#include "kernels/quant/mxfp4.hpp"

namespace rolloutd::core {

// One forward step over T tokens drawn from S sequences (prefill chunks and
// decode tokens mixed). Host-side; the model copies it to the device.
struct StepBatch {
  std::vector<int32_t> token_ids;     // [T]
  std::vector<int32_t> positions;     // [T]
  std::vector<int32_t> seq_of;        // [T] row of block_tables
  std::vector<int32_t> slot_mapping;  // [T] KV slot (block * block_size + offset)
  std::vector<int32_t> ctx_len;       // [T] cache positions visible (= position + 1)
  std::vector<int32_t> block_tables;  // [S, max_blocks_per_seq]
  int32_t max_blocks_per_seq = 0;
  // With a sliding pool (StepLimits::num_sliding_kv_blocks > 0) the sliding-window layers keep
  // their KV in blocks of their own: each token's slot there [T] and each sequence's table of
  // them [S, max_blocks_per_seq], indexed by the same logical block (position / block_size).
  // Only the blocks of the positions a row sees (its last `window`) need an entry; the rest are
  // -1 (never read). Empty without a sliding pool.
  std::vector<int32_t> sliding_slot_mapping;
  std::vector<int32_t> sliding_block_tables;
  std::vector<int32_t> logits_rows;   // token rows whose next-token logits are wanted
  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_seqs() const {
    return max_blocks_per_seq ? static_cast<int64_t>(block_tables.size()) / max_blocks_per_seq : 0;
  }
};

struct StepLimits {
  int64_t max_tokens = 512;          // tokens per forward step (prefill chunk budget)
  int64_t max_seqs = 64;             // sequences per step
  int64_t max_blocks_per_seq = 256;  // block-table width
  int64_t num_kv_blocks = 1024;
  int64_t kv_block_size = 16;
  // > 0: the sliding-window layers' K and V live in a pool of this many blocks of their own
  // (StepBatch::sliding_*), where a sequence needs only the blocks of its last window; the
  // num_kv_blocks pool then holds the full-attention layers only. 0: every layer in one pool.
  // sliding_kv_blocks_needed() is a size that a scheduler keeping each running sequence to its
  // window (core::Engine) never exhausts; core::Engine admits by the main pool only, so a smaller
  // pool (it accepts down to one request's window and step) preempts the youngest requests as
  // they grow, and admits them again. Needs a model with sliding-window layers.
  int64_t num_sliding_kv_blocks = 0;
  // Element type of the K and V caches: kF32, or kBF16 (each k and v value rounded to nearest
  // even as it is stored; half the bytes, so twice the blocks in the same memory and half the
  // attention's reads). Attention reads either into FP32 arithmetic.
  DType kv_dtype = DType::kF32;
  // Decode steps (one token per sequence, every row sampled) of up to this many sequences run
  // padded to a bucket (1, 2, 4, ... and this maximum) with the real row count read from
  // device memory, from one CUDA graph per bucket on CUDA; 0: every step runs eagerly at its
  // own size. The CPU backend has no graphs and runs the same padded steps eagerly (what the
  // CPU tests use to check the padding). Capped at max_seqs and max_tokens.
  int64_t graph_max_batch = 0;
};

// Bytes one KV block takes over every layer (its K and V rows at kv_dtype): what a KV memory
// budget is divided by to give StepLimits::num_kv_blocks. With `sliding_pool`, over the layers
// of that pool only: the full-attention layers (sliding = false) or the sliding ones (true).
int64_t kv_cache_bytes_per_block(const ModelConfig& c, int64_t block_size, DType kv_dtype);
int64_t kv_cache_bytes_per_block(const ModelConfig& c, int64_t block_size, DType kv_dtype, bool sliding);
// Sliding-pool blocks that `max_seqs` running sequences, each holding the blocks of its last
// sliding_window positions plus those of the positions it computes in a step (at most
// max_tokens over all of them), can hold at once: max_seqs * (ceil(window / bs) + 2) +
// ceil(max_tokens / bs). 0 for a model without sliding layers.
int64_t sliding_kv_blocks_needed(const ModelConfig& c, const StepLimits& l);

// What the graph path did (MoeDecoder::graph_stats).
struct GraphStats {
  std::vector<int64_t> buckets;   // decode bucket sizes, ascending
  int64_t num_graphs = 0;         // captured executable graphs (CUDA), per bucket x records on/off
  uint64_t graph_steps = 0;       // decode steps replayed from a graph (or padded eagerly on CPU)
  uint64_t eager_steps = 0;       // steps run at their own size
  double capture_s = 0;           // wall time of capture_graphs()
};

// What MoeDecoder::step_sample() returns: per logits row the sampled token and its log-prob, in
// host memory the model owns (page-locked on CUDA), valid until the next step.
struct SampledRows {
  std::span<const int32_t> tokens;
  std::span<const float> logprobs;
  // With top_n > 0: row r's top_n most likely tokens at [r*top_n, (r+1)*top_n) (SampleArgs::top_ids).
  int64_t top_n = 0;
  std::span<const int32_t> top_ids;
  std::span<const float> top_logprobs;
};

class MoeDecoder {
 public:
  // Allocates parameters (weights arena), KV cache (kv arena) and step workspace (scratch
  // arena) once; registers every parameter under its Hugging Face name, with the loader
  // aliases (per-expert tensors, fused QKV). Parameters start in checkpoint layout with
  // unspecified values: a loader writes them, then weights().postprocess_all() moves them to
  // kernel layout (see embedded_model.hpp). forward() refuses to run before that.
  static Result<std::unique_ptr<MoeDecoder>> create(const ModelConfig& config,
                                                     const StepLimits& limits,
                                                     const Backend& backend, ExecContext ctx);

  // Runs one step. On return `logits` holds [logits_rows.size(), vocab] FP32 on the host and,
  // when `recorder` is given, it holds the step's routed-expert rows (logical ids).
  // Decode steps that fit a bucket (StepLimits::graph_max_batch) run padded, from the bucket's
  // graph on CUDA; other steps run eagerly.
  // step(): on return the step's logits, [logits_rows.size(), vocab] FP32, are in host memory the
  // model owns (page-locked on CUDA), valid until the next step; forward() copies them out. A
  // recorder must have this model's MoE layer count and top_k (kInvalidArgument otherwise).
  Result<std::span<const float>> step(const StepBatch& batch, RoutedExpertRecorder* recorder);
  Status forward(const StepBatch& batch, std::vector<float>& logits, RoutedExpertRecorder* recorder);
  // step() with Backend::sample run on the step's logits where they are (rows[r] for logits row
  // r): only R tokens and log-probs come back, not the [R, vocab] logits, still with one
  // synchronisation. On a graph step the op runs after the replay, outside the graph (its work
  // does not depend on the bucket). rows.size() must equal logits_rows.size() (kInvalidArgument);
  // parameters outside core::validate's ranges are kOutOfRange on every backend.
  // top_n in [0, min(kMaxTopLogprobs, vocab)]: also every row's top_n most likely tokens.
  Result<SampledRows> step_sample(const StepBatch& batch, std::span<const SamplingRow> rows,
                                  RoutedExpertRecorder* recorder, int64_t top_n = 0);

  // Captures one graph per decode bucket, with and without routed-expert capture (CUDA; the
  // CPU backend only fixes the buckets). Capture executes nothing; it reads no weight values,
  // only addresses, which weight updates and memory release/resume keep, so the graphs are
  // never re-captured. Call once, while nothing else runs on the model; idempotent.
  Status capture_graphs();
  const GraphStats& graph_stats() const { return graph_stats_; }
  // Whether the routed experts run through moe::experts (CUDA, MXFP4, H and I multiples of 64).
  bool uses_kernel_experts() const { return kernel_experts_; }
  // Whether the dense projections are BF16 parameters (CUDA and ModelConfig::dense_bf16).
  bool uses_bf16_dense() const { return dense_bf16_; }
  // Layers whose q, k and v projections run as one GEMM (CUDA, weights back to back).
  int64_t qkv_fused_layers() const {
    return std::count_if(layers_.begin(), layers_.end(), [](const Layer& L) { return L.qkv_fused; });
  }
  // The bucket a decode step of n sequences runs in; 0 when it runs eagerly.
  int64_t bucket_for(int64_t num_seqs) const;
  // Device table of the last step's routed-expert ids: [num_moe_layers, max_tokens, top_k] int32
  // (rows past the step's real count hold -1). For tests.
  TensorView routed_table() const { return routed_table_; }
  ~MoeDecoder();

  const ModelConfig& config() const { return config_; }
  const StepLimits& limits() const { return limits_; }
  // Every parameter under its checkpoint name, with quant method and layout flag.
  const WeightRegistry& weights() const { return *weights_; }
  WeightRegistry& weights() { return *weights_; }
  const Backend& backend() const { return backend_; }
  const ExecContext& context() const { return ctx_; }
  // The layer's logical->physical map (empty for a dense layer).
  const ExpertMap& expert_map(int64_t layer) const { return layers_[static_cast<size_t>(layer)].expert_map; }
  // The arenas behind parameters (weights), the KV cache (kv_cache) and step workspaces
  // (scratch), for memory release/resume (core/storage/memory_manager.hpp).
  StableArena& arena(MemoryTag tag);

 private:
  struct Layer {
    TensorView input_layernorm, q_proj, k_proj, v_proj, o_proj, post_attention_layernorm;
    TensorView q_norm, k_norm;    // [D], only with config.qk_norm
    // gpt-oss: projection biases (config.attention_bias), learned sinks [QH], the sliding
    // window of this layer (0: full attention), router bias [E], expert biases.
    TensorView q_bias, k_bias, v_bias, o_bias, sinks;
    // CUDA, q/k/v weights back to back in the arena: one view over the three,
    // [(QH + 2 KVH) * D, H], so q, k and v take one GEMM, split by rope_qk (which adds the
    // projection biases, if any).
    bool qkv_fused = false;
    TensorView qkv_proj;
    int64_t window = 0;
    TensorView router_bias;                            // [E]
    TensorView experts_gate_up_bias, experts_down_bias;  // [E, 2I] (interleaved), [E, H]
    // config.experts_mxfp4: the experts as MXFP4 bytes instead of FP32 (checkpoint layout, or
    // with kernel_experts_ the tiled kernel layout between postprocess and restore, plus the
    // kernel-layout copies of the scales that postprocess derives).
    TensorView gu_blocks, gu_scales, dn_blocks, dn_scales;
    TensorView gu_kernel_scales, dn_kernel_scales;
    // Row order of each expert's gate/up weights as the expert op reads them: interleaved (the
    // kernel layout of InterleaveGateUpMethod, gpt-oss's MXFP4 checkpoint), or gate rows then up
    // rows (qwen3_moe's MXFP4 experts, quantized from the checkpoint's order).
    bool gate_up_interleaved = true;
    // A dense layer (mlp_only_layers, decoder_sparse_step) is a SwiGLU MLP: the expert op with
    // one expert that every token takes with weight 1 (dense_ids / dense_weights).
    bool moe = true;
    int64_t moe_index = -1;       // index among the MoE layers (routed-expert records)
    TensorView router;            // [E, H]
    TensorView experts_gate_up;   // [E, 2I, H]
    TensorView experts_down;      // [E, H, I]
    TensorView k_cache, v_cache;  // [blocks, block_size, KVH, D] (sliding pool: its blocks)
    bool sliding_pool = false;    // a window layer whose KV is in the sliding pool
    ExpertMap expert_map;
    TensorView logical_to_physical;  // device copy of expert_map
  };
  struct Workspace {
    // Step inputs, packed in one buffer (`inputs`) so a step uploads them with few copies:
    // [token_ids | positions | seq_of | slot_mapping | ctx_len (| sliding_slot_mapping) :
    // max_tokens each][logits_rows : max_seqs][num_valid : 1][block_tables : max_seqs x
    // max_blocks_per_seq](sliding_block_tables : as block_tables); the parts in brackets with a
    // sliding pool only.
    TensorView inputs;
    TensorView token_ids, positions, seq_of, slot_mapping, ctx_len, block_tables, logits_rows, num_valid;
    TensorView sliding_slot_mapping, sliding_block_tables;
    // attn: shape only (no memory) when every o_proj is BF16 (attention then writes x_bf16).
    TensorView h, x, q, k, v, attn, o, router_logits, topk_ids, topk_weights, moe_out;
    TensorView moe_h;  // expert-op workspace [T * (K * I or I_dense)] (MoeExpertsArgs::workspace); empty when no layer runs the op
    TensorView experts_ws;  // kernel_experts_: moe::experts scratch (uint8, sized for max_tokens)
    TensorView final_rows, final_normed, logits;
    TensorView x_bf16;  // dense_bf16_ or kernel_experts_: BF16 GEMM inputs [max(T, S) * max(H, QH * D)]
    TensorView qkv;     // a layer with qkv_fused: the fused projection's output [T, (QH + 2 KVH) * D]
    // Paged attention's split-row scratch (AttentionOptions::workspace) for steps of at most
    // attn_split_tokens tokens (every decode step); its counters are zeroed at allocation and
    // registered as scratch static state (a release/resume brings the zeros back).
    TensorView attn_split;
    int64_t attn_split_tokens = 0;
  };

  MoeDecoder(const ModelConfig& c, const StepLimits& l, const Backend& b, ExecContext ctx);
  Status allocate();
  Status add_loader_aliases(int64_t layer);
  Status add_expert_aliases(int64_t layer);
  // Allocates stacked MXFP4 experts (blocks [E, rows, cols/32, 16], scales [E, rows, cols/32]) and
  // registers them as `name` (WeightRegistry::add_mxfp4).
  // With kernel_experts_ the blocks move to the tiled kernel layout of moe::experts on postprocess
  // (`order`: the checkpoint's row order) and `kernel_scales` receives the kernel-layout scales.
  Status mxfp4_experts(const std::string& name, int64_t rows, int64_t cols, TensorView& blocks, TensorView& scales,
                       TensorView& kernel_scales, quant::Mxfp4RowOrder order, bool quantize_on_arrival);
  // Fills the host mirror of the inputs for T rows (`num_valid` real, the rest padding) and
  // uploads the used prefix.
  Status stage_inputs(const StepBatch& b, int64_t rows, int64_t seqs);
  // Every device op of a step of T rows, S sequences and R logits rows, issued on `ctx` (the
  // model's, or a capture stream's): no host reads, no synchronisation, so it can be captured.
  Status run_device(const ExecContext& ctx, int64_t T, int64_t S, int64_t R, bool record);
  static Status capture_body(void* arg, const ExecContext& ctx);
  // The routed experts of MoE layer L through moe::experts (kernel_experts_): T rows of x -> out.
  Status kernel_experts(const ExecContext& ctx, const Layer& L, const TensorView& x, const TensorView& out,
                        const TensorView& topk_ids, const TensorView& topk_w, int64_t T);
  // step() and step_sample(): with `sample`, the logits stay on the device and the sampling op
  // runs on them (the returned span is then empty).
  Result<std::span<const float>> step_impl(const StepBatch& batch, RoutedExpertRecorder* recorder,
                                           std::span<const SamplingRow> sample, bool sampled, int64_t top_n);
  // Queues the parameter upload, the sampling op over the first R logits rows and the read-back.
  Status enqueue_sampling(std::span<const SamplingRow> rows, int64_t top_n);
  // Bytes of step_sample()'s top log-probs region: ids, then log-probs, max_seqs * kMaxTopLogprobs each.
  size_t top_region_bytes() const;

  ModelConfig config_;
  StepLimits limits_;
  const Backend& backend_;
  ExecContext ctx_;
  std::unique_ptr<StableArena> weights_arena_, kv_arena_, scratch_arena_;
  std::unique_ptr<WeightRegistry> weights_;
  TensorView embed_tokens_, final_norm_, lm_head_;
  TensorView dense_ids_, dense_weights_;  // [max_tokens, 1]: expert 0, weight 1 (dense layers)
  // Scaled rotary (YaRN): the inverse frequencies [D/2] (static state in weights memory) and the
  // cos/sin factor; empty for the plain rotary of rope_theta.
  TensorView rope_inv_freq_;
  float rope_attention_factor_ = 1.0f;
  std::vector<Layer> layers_;
  int64_t moe_layers_ = 0;
  // MXFP4 routed experts run through moe::experts (kernels/moe: token permutation by expert,
  // grouped MXFP4 GEMMs that read each active expert's weights once per step, BF16 activations)
  // instead of Backend::moe_experts (every (token, expert) pair re-reads its expert). CUDA only,
  // and only where its shapes fit (H and I multiples of 64); the CPU keeps the FP32 op, exact
  // against the Hugging Face goldens.
  bool kernel_experts_ = false;
  // CUDA with ModelConfig::dense_bf16: q/k/v/o and the LM head are BF16 parameters, multiplied
  // by Backend::linear in BF16 (cuBLAS, FP32 accumulation) on inputs rounded to BF16.
  bool dense_bf16_ = false;
  Workspace ws_;
  // Page-locked host staging (Backend::host_alloc): the inputs' host mirror, the logits and the
  // record table come back asynchronously, then one synchronisation ends the step.
  struct HostBuffers {
    const Backend* backend = nullptr;
    ExecContext ctx;
    int32_t* inputs = nullptr;
    float* logits = nullptr;
    int32_t* records = nullptr;
    HostBuffers() = default;
    HostBuffers(const HostBuffers&) = delete;
    HostBuffers& operator=(const HostBuffers&) = delete;
    ~HostBuffers();
  } host_;
  // step_sample()'s buffers, made on its first call: device and page-locked host twins of
  // [rows: max_seqs SamplingRow][tokens: max_seqs int32][logprobs: max_seqs f32]
  // [top ids: max_seqs * kMaxTopLogprobs int32][top log-probs: as many f32].
  struct SampleBuffers {
    const Backend* backend = nullptr;
    ExecContext ctx;
    void* device = nullptr;
    void* host = nullptr;
    SampleBuffers() = default;
    SampleBuffers(const SampleBuffers&) = delete;
    SampleBuffers& operator=(const SampleBuffers&) = delete;
    ~SampleBuffers();
  } sample_;
  size_t tables_offset_ = 0;      // int32 elements before block_tables in `inputs`
  size_t sliding_offset_ = 0;     // ... before sliding_block_tables (0: no sliding pool)
  // Per-token arrays at the head of `inputs`: five, six with a sliding pool.
  int64_t per_token_arrays() const { return limits_.num_sliding_kv_blocks > 0 ? 6 : 5; }
  TensorView routed_table_;       // [num_moe_layers, max_tokens, top_k] int32 (scratch)
  GraphStats graph_stats_;
  bool graphs_ready_ = false;
  std::vector<void*> graphs_;     // [bucket index * 2 + record], CUDA only
};

}  // namespace rolloutd::core
