#pragma once
// The backend seam: one small table of operations per device kind (ggml's
// ggml-backend-impl.h is the model). The model code in core/ calls only these;
// the CPU table is the FP32 reference, the CUDA table its twin. Every op is
// checked CUDA-vs-CPU by tests/unit/kernels/backend_parity_test.cpp.
//
// Conventions for every op:
// - views are contiguous unless an op says otherwise; shapes are validated and a
//   mismatch returns kInvalidArgument naming the argument (never a crash); so is a view
//   whose device differs from the context's (a host pointer handed to a CUDA op);
// - `linear` follows the Hugging Face Linear layout: y[M,N] = x[M,K] * w[N,K]^T;
// - integer index tensors are int32;
// - index *values* (token ids, slots, block ids, expert ids) are checked by the CPU
//   backend (kOutOfRange naming the tensor, output untouched). The CUDA backend cannot
//   read them without a synchronisation: out-of-range values are clamped or skipped on
//   the device as each op says, never read or written out of bounds. Callers validate
//   ids where they enter (the request, the scheduler);
// - an output never aliases an input unless the op says it may;
// - ops are asynchronous on the context's stream (CUDA) and synchronous on CPU.
#include <cstddef>
#include <cstdint>

#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd {

struct ExecContext {
  Device device;
  void* stream = nullptr;  // cudaStream_t on CUDA; unused on CPU
};

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };

// Parameters of the fused MoE expert op (SwiGLU experts, weighted combine).
struct MoeExpertsArgs {
  TensorView out;             // [T, H] f32, overwritten
  TensorView x;               // [T, H] f32
  TensorView w_gate_up;       // [E_phys, 2*I, H]: rows [0, I) gate, [I, 2I) up (concatenated)
  TensorView w_down;          // [E_phys, H, I]
  TensorView topk_ids;        // [T, K] int32, *logical* expert ids from the router
  TensorView topk_weights;    // [T, K] f32
  TensorView logical_to_physical;  // [E_logical] int32: compute slot of each logical expert
  int64_t num_valid_tokens = -1;   // rows >= this are padding: output zero, never read ids
  // Optional int32 [1] on the context's device: the real row count read at run time, so a
  // captured CUDA graph padded to a bucket masks its padding rows by the count of each replay.
  // Rows >= min(num_valid_tokens, *num_valid_device) are padding. CPU: a count outside [0, T]
  // is kOutOfRange; CUDA: clamped to [0, T].
  TensorView num_valid_device;
  // Optional f32 [>= T * K * I] on the context's device. CUDA: with it, the op runs as two
  // kernels spread over (token, expert, row chunk) -- every SM busy even for one token, which
  // decode needs -- instead of one block per token; the contents are scratch. CPU: ignored.
  TensorView workspace;
  // Row layout of each expert's w_gate_up: false = concatenated (gate rows [0, I), up rows
  // [I, 2I)); true = interleaved (gate j at row 2j, up j at row 2j + 1), the kernel layout the
  // weight registry's expert quant method keeps between sessions.
  bool gate_up_interleaved = false;
  // Optional expert biases (gpt-oss): b_gate_up [E_phys, 2*I] in w_gate_up's row layout, added
  // to the gate/up projections; b_down [E_phys, H], added to each expert's output before its
  // routing weight multiplies it. Empty views: no bias.
  TensorView b_gate_up;
  TensorView b_down;
  // The gated activation h = act(gate) * up:
  //   kSilu:   silu(g) * u (Qwen3-MoE, Mixtral, DeepSeek);
  //   kGptOss: g' = min(g, limit), u' = clamp(u, -limit, limit), h = g' * sigmoid(alpha * g') * (u' + 1).
  // Optional MXFP4 experts in the gpt-oss checkpoint layout (kernels/quant/mxfp4.hpp): when
  // w_gate_up_blocks is set the op reads these and ignores w_gate_up / w_down (which may be
  // empty): w_gate_up_blocks u8 [E_phys, 2*I, H/32, 16] with scales u8 [E_phys, 2*I, H/32] (rows
  // in the gate_up_interleaved order), w_down_blocks u8 [E_phys, H, I/32, 16] with scales
  // [E_phys, H, I/32]; H and I multiples of 32. Each weight is dequantized exactly to FP32 where
  // it is read, so the result equals the FP32 op on the dequantized tensors up to summation order
  // (on the CPU, bit for bit).
  TensorView w_gate_up_blocks, w_gate_up_scales, w_down_blocks, w_down_scales;
  enum class Activation : uint8_t { kSilu, kGptOss };
  Activation activation = Activation::kSilu;
  float swiglu_limit = 7.0f;
  float swiglu_alpha = 1.702f;
};

// Options of paged_attention_ex (gpt-oss attention).
struct AttentionOptions {
  // Optional f32 [QH]: one learned logit per query head that joins every softmax's denominator
  // (exp(sink - max) added to the sum) without a value: the probabilities of the real keys sum
  // to less than 1. Empty: none.
  TensorView sinks;
  // > 0: a token at position p (ctx_len = p + 1) sees only cache positions (p - window, p], the
  // last `window` positions (Hugging Face's sliding_window mask). 0: the whole causal context.
  int64_t window = 0;
  // Optional scratch for splitting a long row's keys over several CTAs (CUDA; the CPU checks it
  // and ignores it): u8 [>= paged_attention_workspace_bytes(T, QH, D)] on the context's device,
  // 16-byte aligned, zero-filled before its first use (the op leaves its counters at zero again),
  // used by one op at a time. It may be reused by launches of any T up to its capacity, with the
  // same QH and D (the layout follows the capacity; another QH or D needs it zeroed again).
  // Empty: every row is one CTA's, as before.
  // When a launch splits, a row of more than kAttentionSplitMinKeys keys (after the window) is
  // cut into at most kAttentionMaxSplits parts whose bounds depend only on that number of keys,
  // each part's softmax partials written here and combined in part order: a row's bits are the
  // same in every split launch (any batch, any split_ctas), but differ (by rounding) from the
  // same row in an unsplit one.
  TensorView workspace;
  // CUDA: CTAs that share one split row (each takes every split_ctas-th part). > 0: split with
  // that many. 0: split only where the unsplit grid would have fewer CTAs than the GPU has SMs
  // (small decode steps; larger grids measured faster unsplit, tests/bench/NOTES.md), with CTAs
  // chosen from the grid size. ROLLOUTD_ATTN_SPLIT=0 (read once) ignores every workspace, =N
  // makes N the value of every split_ctas of 0 (an A/B in one binary).
  int32_t split_ctas = 0;
};

// paged_attention_ex's workspace: at most kAttentionMaxSplits parts of at least
// kAttentionSplitMinKeys keys per row. Bytes for T tokens of QH query heads of dimension D:
// int32 counters [T, QH] (rounded up to 16 bytes), then f32 partial outputs [T, QH, splits, D],
// then f32 (max, sum) pairs [T, QH, splits, 2]; a larger workspace is laid out for its capacity
// (paged_attention_workspace_tokens), the launch using its first T tokens' rows of each region.
inline constexpr int64_t kAttentionMaxSplits = 16;
inline constexpr int64_t kAttentionSplitMinKeys = 256;
// The counters' bytes, the region a fresh workspace must have zeroed (the op keeps it at zero).
inline constexpr int64_t paged_attention_workspace_counter_bytes(int64_t tokens, int64_t q_heads) {
  return (tokens * q_heads * 4 + 15) / 16 * 16;
}
inline constexpr int64_t paged_attention_workspace_bytes(int64_t tokens, int64_t q_heads, int64_t head_dim) {
  return paged_attention_workspace_counter_bytes(tokens, q_heads) +
         tokens * q_heads * kAttentionMaxSplits * (head_dim + 2) * 4;
}
// The layout of a workspace of `bytes` is that of its capacity: the most tokens C with
// paged_attention_workspace_bytes(C, QH, D) <= bytes (counters [C, QH], then partials for C).
inline constexpr int64_t paged_attention_workspace_tokens(int64_t bytes, int64_t q_heads, int64_t head_dim) {
  if (q_heads <= 0 || head_dim <= 0 || bytes <= 0) return 0;
  int64_t c = bytes / (q_heads * (4 + kAttentionMaxSplits * (head_dim + 2) * 4));  // an upper bound
  while (c > 0 && paged_attention_workspace_bytes(c, q_heads, head_dim) > bytes) --c;
  return c;
}

// Per-row parameters of the sampling op: a request's `sampling` fields and which of its sampled
// tokens this is (the draw index), 32 bytes that the device reads as they are.
struct SamplingRow {
  float temperature = 1.0f;  // 0: greedy (argmax, lowest id on ties)
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  int32_t top_k = 0;         // 0: disabled
  uint64_t seed = 0;
  uint64_t draw_index = 0;
};
static_assert(sizeof(SamplingRow) == 32, "SamplingRow travels to the device as 32 raw bytes");

// Most top log-probs the sampling op gives per row (SampleArgs::top_ids).
inline constexpr int64_t kMaxTopLogprobs = 20;

// Parameters of the sampling op.
struct SampleArgs {
  TensorView tokens;    // [R] int32, out: the sampled id of each row
  TensorView logprobs;  // [R] f32, out: log_softmax(logits[r])[token] (raw logits: temperature 1, no filter)
  TensorView logits;    // [R, V] f32, 1 <= V <= INT32_MAX
  TensorView rows;      // [R, 32] u8: one SamplingRow per row, on the context's device
  // Optional (both empty: off): the N most likely tokens of every row under the raw logits,
  // 1 <= N <= min(V, kMaxTopLogprobs). Ordered by logit descending, then id ascending; NaN
  // logits rank below every other, and -0.0 equals +0.0. top_logprobs is computed as `logprobs`
  // is (the same log-sum-exp), so the sampled token's entry equals its log-prob bit for bit.
  TensorView top_ids;       // [R, N] int32, out
  TensorView top_logprobs;  // [R, N] f32, out
};

// Parameters of router: a MoE layer's gate GEMM and expert selection in one call.
struct RouterArgs {
  TensorView ids;      // out: int32 [T, K]
  TensorView weights;  // out: f32 [T, K]
  TensorView logits;   // out: f32 [T, E], the router logits (bias included)
  TensorView x;        // f32 [T, H]
  TensorView w;        // f32 [E, H]
  TensorView bias;     // f32 [E], or empty
  bool renormalize = false;
};

// Parameters of rope_qk: the attention block's per-head work between the q/k projections and
// the KV store, in one call (one CUDA launch) instead of up to four.
struct RopeQkArgs {
  TensorView q;          // [T, QH, D] f32, rotated in place
  TensorView k;          // [T, KVH, D] f32, rotated in place (same T and D as q)
  TensorView positions;  // [T] int32
  // Frequencies: inv_freq f32 [D/2] on the context's device when given (rope_table's form,
  // YaRN and other scaled variants), else theta^(-2i/D) computed as `rope` does.
  TensorView inv_freq;
  float theta = 10000.0f;  // read only without inv_freq
  float scale = 1.0f;      // cos and sin times this (rope_table's `scale`; 1 for rope's form)
  // Optional Qwen3 QK-norm, both or neither: each head's D values are first replaced by
  // rmsnorm(x) * q_norm (q) or * k_norm (k), f32 [D], with `eps`.
  TensorView q_norm, k_norm;
  float eps = 1e-6f;
  // Optional fused projection: qkv f32 [T, (QH + 2 KVH) * D], each row q | k | v (one GEMM over
  // the three weights stored back to back). Then q and k are outputs only (read from qkv, written
  // rotated) and v [T, KVH, D] f32 receives qkv's v columns (plus v_bias, if given). Both or neither.
  TensorView qkv, v;
  // Optional projection biases of the fused form (gpt-oss): f32 [QH * D], [KVH * D], [KVH * D],
  // added to qkv's q, k and v columns first (before the norm and the rotation), as add_bias
  // after each projection would. All three or none, and only with qkv.
  TensorView q_bias, k_bias, v_bias;
  // Optional KV store, fused form only: k_cache and v_cache f32 or bf16 [blocks, block_size, KVH, D] and
  // slot_mapping int32 [T], all three or none. Each token's rotated k and its v are also written
  // at its slot, exactly as kv_store(k_cache, v_cache, k, v, slot_mapping) after this op would
  // (a negative slot is a padding row: not written; CPU refuses a slot past the cache before
  // writing anything, as kv_store does).
  TensorView k_cache, v_cache, slot_mapping;
};

struct Backend {
  const char* name;
  DeviceKind kind;

  // ---- memory ----
  // CPU: 64-byte aligned host memory, copies host to host only. CUDA: cudaMalloc on the
  // context's device; copies are asynchronous on its stream (synchronize before reading).
  Status (*alloc)(const ExecContext&, size_t bytes, void** out);
  Status (*free)(const ExecContext&, void* ptr);
  Status (*copy)(const ExecContext&, void* dst, const void* src, size_t bytes, CopyKind kind);
  Status (*synchronize)(const ExecContext&);

  // ---- ops ----
  // out[T,H] = table[ids[t], :]; ids out of [0, V) -> kOutOfRange (CPU) / zero row (CUDA, checked by caller).
  Status (*embedding)(const ExecContext&, TensorView out, TensorView table, TensorView ids);
  // out = x / sqrt(mean(x^2) + eps) * w, per row of the last dimension. out may alias x.
  Status (*rmsnorm)(const ExecContext&, TensorView out, TensorView x, TensorView w, float eps);
  // y[M,N] = x[M,K] * w[N,K]^T. x may be [..., K] (leading dimensions are rows) with y
  // [..., N] of the same leading dimensions. x and w both FP32, or both BF16 (FP32
  // accumulation: CUDA through cuBLAS's tensor cores, or at 1-4 rows with K % 8 == 0 and up to
  // 8,192 outputs its own GEMV, whose rows are the same bits whatever the number of rows, 1-4);
  // y FP32. CUDA: that GEMV starts reading w before the kernels ahead of it in the stream have
  // completed (it is launched once the kernel just ahead triggers its dependents, and some of ours
  // trigger before their own wait), so no kernel still running then may write w: change weights
  // between steps, with a synchronisation (as weight updates do), never in a kernel just ahead of
  // a linear.
  Status (*linear)(const ExecContext&, TensorView y, TensorView x, TensorView w);
  // out = a + b (same shape); out may alias a or b.
  Status (*add)(const ExecContext&, TensorView out, TensorView a, TensorView b);
  // Rotary embedding in place on x[T, heads, D] (NeoX / Hugging Face rotate_half pairing:
  // element i pairs with i + D/2), angle = pos[t] * theta^(-2i/D).
  Status (*rope)(const ExecContext&, TensorView x, TensorView positions, float theta);
  // Writes k/v rows [T, KVH, D] into caches [blocks, block_size, KVH, D] at slot_mapping[t]
  // (= block * block_size + offset); slot < 0 means "do not write" (padding). A slot past
  // the cache: kOutOfRange (CPU) / skipped (CUDA). Slots of one call must be distinct.
  // The caches are FP32 or BF16 (both alike); into BF16 each value is rounded to nearest even
  // (kernels/bf16.hpp), on every backend the same bits.
  Status (*kv_store)(const ExecContext&, TensorView k_cache, TensorView v_cache, TensorView k,
                     TensorView v, TensorView slot_mapping);
  // Causal attention over a paged cache. q[T, QH, D]; token t belongs to sequence seq_of[t]
  // and sees cache positions [0, ctx_len[t]); block_tables[S, max_blocks] int32. GQA: query
  // head h reads kv head h / (QH / KVH). Caches FP32 or BF16 (kv_store's), read into FP32
  // arithmetic. out[T, QH, D], FP32 or BF16 (the FP32 result rounded
  // once, for a BF16 projection to read directly). ctx_len 0 (a padding row) gives
  // zeros. CPU: seq_of, ctx_len and every block id followed are checked (kOutOfRange).
  // CUDA: a bad sequence gives a zero row, ctx_len is clamped to the table, positions in
  // a bad block are skipped; head dimensions above 512 are kUnimplemented for now.
  Status (*paged_attention)(const ExecContext&, TensorView out, TensorView q, TensorView k_cache,
                            TensorView v_cache, TensorView block_tables, TensorView seq_of,
                            TensorView ctx_len, float scale);
  // Softmax over experts, top-k (ties: lower id first), optional renormalisation of the k
  // weights to sum 1 (Qwen3-MoE norm_topk_prob). logits[T,E] -> ids[T,K] int32, weights[T,K].
  // Experts are ranked on the logits (the probability order, immune to exp() rounding, so
  // every backend records the same ids); NaN ranks last. 1 <= K <= E.
  Status (*router_softmax_topk)(const ExecContext&, TensorView ids, TensorView weights,
                                TensorView logits, bool renormalize);
  // SwiGLU experts: out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
  // e = logical_to_physical[ids[t,k]]. CPU: an id outside [0, E_logical) or a map entry
  // outside [0, E_phys) is kOutOfRange ("topk_ids" / "logical_to_physical"); CUDA: that
  // (t, k) contributes nothing.
  Status (*moe_experts)(const ExecContext&, const MoeExpertsArgs& args);
  // One token per row of logits[R, V] under rows[r]'s parameters. Temperature 0: the argmax
  // (lowest id on ties). Otherwise p = softmax(logits / T) as float (core::Sampler's
  // arithmetic), ordered by p descending then id ascending; the kept set is the shortest prefix
  // of that order allowed by top-k, then top-p (the prefix whose mass first reaches top_p),
  // then min-p (p >= min_p * p_max); one token is drawn from it in proportion to p with a
  // counter-based generator of (seed, draw_index) alone, so a row's token never depends on the
  // other rows. The kept set is the same on every backend (except at float-rounding edges: a
  // top-p mass within ~1e-13 of its boundary; probabilities below FLT_MIN, which CUDA may keep);
  // NaN logits: the CPU compares them as core::Sampler always has (greedy takes id 0 when
  // logits[0] is NaN, the log-prob is NaN), CUDA skips them. The draw within it is not (CPU:
  // inverse CDF in probability order, as core::Sampler; CUDA: inverse CDF in id order): the
  // same seed gives the same tokens on the same backend. CPU: parameters outside
  // core::validate's ranges are kOutOfRange ("rows[r].top_p", ...), outputs untouched. CUDA:
  // they cannot be read without a synchronisation, so a bad value is treated as the nearest
  // safe one (temperature NaN, negative or infinite: greedy; top_k < 0, top_p NaN or above 1,
  // min_p NaN or negative: that filter off; top_p <= 0: one token; min_p above 1: 1) and a
  // non-finite row maximum (+inf, or every logit NaN or -inf) gives the argmax; the token is
  // always in [0, V).
  Status (*sample)(const ExecContext&, const SampleArgs& args);

  // ---- conversion ----
  // dst[i] = src[i] converted, n elements, both on the context's device (same dtype: a copy;
  // FP32 -> BF16 rounds to nearest even, BF16 -> FP32 is exact). Used to load checkpoint
  // tensors that arrive on the device (NCCL, CUDA IPC) in another dtype than the parameter.
  Status (*convert)(const ExecContext&, void* dst, DType dst_dtype, const void* src, DType src_dtype,
                    size_t n);

  // ---- memory, strided ----
  // `height` rows of `width` bytes: row i from src + i * src_pitch to dst + i * dst_pitch
  // (pitches >= width). Asynchronous on CUDA like copy(). Used by layout permutations that
  // move every other row (gate/up interleaving) in one call instead of one copy per row.
  Status (*copy_2d)(const ExecContext&, void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                    size_t width, size_t height, CopyKind kind);
  // `depth` slices of `height` rows of `width` bytes: row i of slice k from
  // src + k * src_slice_pitch + i * src_pitch to dst + k * dst_slice_pitch + i * dst_pitch.
  // Each slice pitch must be a multiple of its row pitch and hold `height` rows (CUDA's pitched
  // 3D copy has that shape). One call moves a row permutation of every expert of a stacked
  // tensor (cudaMemcpy3DAsync), where copy_2d needs one call per expert.
  Status (*copy_3d)(const ExecContext&, void* dst, size_t dst_pitch, size_t dst_slice_pitch, const void* src,
                    size_t src_pitch, size_t src_slice_pitch, size_t width, size_t height, size_t depth,
                    CopyKind kind);

  // ---- page-locked host memory ----
  // Host memory the device copies to and from asynchronously and at full speed (CUDA:
  // cudaHostAlloc; CPU: aligned host memory, as alloc). Step inputs, logits and routed-expert
  // records travel through it, so a step needs one synchronisation.
  Status (*host_alloc)(const ExecContext&, size_t bytes, void** out);
  Status (*host_free)(const ExecContext&, void* ptr);

  // ---- rows by a device-held count ----
  // dst[t, :] = src[t, :] for t < count[0], `fill` for the rest; dst and src int32 [T, C]
  // (distinct), count int32 [1] on the context's device, read where the op runs (a captured
  // graph replays it with each step's count). CPU: a count outside [0, T] is kOutOfRange,
  // dst untouched; CUDA: clamped to [0, T]. Routed-expert capture uses it so rows that only
  // pad a batch are never recorded.
  Status (*copy_valid_rows)(const ExecContext&, TensorView dst, TensorView src, TensorView count, int32_t fill);

  // ---- CUDA graphs ----
  // graph_capture records the work `body` issues on the ExecContext it is handed (a private
  // stream on the context's device, in thread-local capture mode) into an executable graph;
  // nothing runs. The body may issue asynchronous work only: no synchronisation, no
  // allocation, no host read of device memory (a violation fails the capture with kCudaError,
  // and no graph is made). graph_launch replays the graph on the context's stream; every
  // address it was captured with must still be mapped (stable arenas keep them so across
  // weight updates and memory release/resume). graph_destroy frees it. CPU: kUnimplemented.
  using GraphBody = Status (*)(void* arg, const ExecContext& capture_ctx);
  Status (*graph_capture)(const ExecContext&, GraphBody body, void* arg, void** graph);
  Status (*graph_launch)(const ExecContext&, void* graph);
  Status (*graph_destroy)(const ExecContext&, void* graph);

  // ---- gpt-oss ops ----
  // paged_attention with learned sinks and a sliding window (AttentionOptions); with empty
  // options it is paged_attention. sinks: f32 [QH] on the context's device.
  Status (*paged_attention_ex)(const ExecContext&, TensorView out, TensorView q, TensorView k_cache,
                               TensorView v_cache, TensorView block_tables, TensorView seq_of,
                               TensorView ctx_len, float scale, const AttentionOptions& options);
  // Rotary embedding like `rope`, with the inverse frequencies given (f32 [D/2] on the context's
  // device: YaRN and other scaled variants computed by the caller) and cos/sin multiplied by
  // `scale` (YaRN's attention factor): angle = pos[t] * inv_freq[i] in FP32.
  Status (*rope_table)(const ExecContext&, TensorView x, TensorView positions, TensorView inv_freq, float scale);
  // y[..., n] += bias[n] (y [..., N], bias [N], f32), in place.
  Status (*add_bias)(const ExecContext&, TensorView y, TensorView bias);
  // dst[b, c, r] = src[b, r, c]: src [B, R, C] -> dst [B, C, R] (or [R, C] -> [C, R]), any dtype
  // of 2 or 4 bytes, both views of that dtype; dst and src must not overlap. Layout changes of
  // checkpoint tensors stored input-major (gpt-oss experts [E, in, out]).
  Status (*transpose)(const ExecContext&, TensorView dst, TensorView src);

  // ---- virtual memory (stable arenas, memory release/resume) ----
  // A reserved range has addresses but no memory behind them. vm_map backs [addr, addr + bytes)
  // of a reserved range with fresh physical memory, readable and writable (CPU: zero-filled;
  // CUDA: contents undefined); vm_unmap gives that physical memory back and leaves the
  // addresses reserved and inaccessible, so a later vm_map puts memory at the same addresses.
  // Addresses and sizes are multiples of vm_granularity (kInvalidArgument otherwise); vm_unmap
  // takes exactly a range one vm_map mapped; vm_free takes a whole reservation, unmapped.
  // CPU: mmap(PROT_NONE) reservations. CUDA: cuMemAddressReserve / cuMemCreate + cuMemMap +
  // cuMemSetAccess / cuMemUnmap (the driver entry points, found through the runtime: nothing
  // links libcuda, so a machine without a driver still loads the library). vm_unmap waits for
  // the device first: nothing may still read the range.
  Status (*vm_granularity)(const ExecContext&, size_t* out);
  Status (*vm_reserve)(const ExecContext&, size_t bytes, void** out);
  Status (*vm_free)(const ExecContext&, void* base, size_t bytes);
  Status (*vm_map)(const ExecContext&, void* addr, size_t bytes);
  Status (*vm_unmap)(const ExecContext&, void* addr, size_t bytes);

  // ---- fused decoder ops (fewer launches per layer) ----
  // The residual add and the RMSNorm that follows it, one pass over each row: when r is given
  // (f32, h's shape) h += r in place first; then, for the (updated) rows of h [..., H] (f32),
  // out = rmsnorm(h) * w exactly as `rmsnorm` computes it, and out_bf16 = that result rounded
  // to BF16 as `convert` rounds (nearest even). out (f32) and out_bf16 (bf16) have h's shape
  // and are each optional (empty view: not written). out may alias h; nothing else aliases.
  // With r empty it is rmsnorm with an optional BF16 copy (the input of BF16 projections).
  // r_bias (f32 [H], only with r; empty: none) is the bias of the projection that produced r
  // (gpt-oss's o_proj): h += (r + r_bias), which is add_bias on r then the add, bit for bit,
  // without writing r (one launch fewer per layer).
  // Equals add, then rmsnorm, then convert: bit for bit on the CPU; on CUDA it is rmsnorm's
  // kernel with the add and the rounding folded in (the same reduction order).
  Status (*add_rmsnorm)(const ExecContext&, TensorView out, TensorView out_bf16, TensorView h, TensorView r,
                        TensorView r_bias, TensorView w, float eps);
  // Rotary embedding of q and k (RopeQkArgs), with the optional per-head QK-norm before it.
  // Equals rmsnorm(q heads), rmsnorm(k heads), then rope / rope_table on q and on k: bit for
  // bit on the CPU. Checks: rope's / rope_table's on q and on k, k's T and D equal to q's, the
  // norm weights f32 [D] (both or neither), eps as rmsnorm's. With qkv (and v): q and k are
  // read from qkv's rows and written, v gets qkv's v columns; qkv [T, (QH + 2 KVH) * D] and
  // v [T, KVH, D] f32, both or neither, not overlapping q, k or each other. With q/k/v biases
  // (only with qkv; all three or none; f32 [QH * D], [KVH * D], [KVH * D], not overlapping q, k
  // or v): add_bias on q, k and v first, bit for bit on the CPU.
  Status (*rope_qk)(const ExecContext&, const RopeQkArgs& args);
  // A MoE layer's router (RouterArgs): logits = x . w^T (+ bias), then router_softmax_topk on
  // them (its ranking, ties and weights). Checks: linear's on x and w (FP32), bias f32 [E] or
  // empty, logits f32 [T, E], router_softmax_topk's on ids, weights and logits; logits may not
  // overlap x, w or bias. Equals linear, add_bias, router_softmax_topk bit for bit on the CPU;
  // on CUDA, up to kRouterFusedMaxTokens tokens (decode) take one launch (above 64 experts and
  // up to 16 tokens, two spread over the GPU, with the same sums) whose dot products sum in
  // another order than cuBLAS's (FP32 both), more tokens take those three ops.
  Status (*router)(const ExecContext&, const RouterArgs& args);
};

const Backend& cpu_backend();
// nullptr when the CUDA backend was not built; non-null does not imply a GPU is visible.
const Backend* cuda_backend();
// Number of visible CUDA devices (0 without CUDA build, driver or device).
int cuda_device_count();

}  // namespace rolloutd
