#include "core/model/moe_decoder.hpp"

#include <algorithm>
#include <chrono>
#include <utility>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/cpu/cpu_sampling.hpp"
#include "kernels/moe/moe_ops.hpp"

namespace rolloutd::core {
namespace {

// A view of the first `rows` rows of a contiguous buffer (workspaces are sized for the
// largest step; each step uses a prefix, so addresses stay fixed).
TensorView rows_of(const TensorView& v, int64_t rows) {
  Shape s = v.shape;
  s[0] = rows;
  return TensorView::contiguous(v.data, v.dtype, s, v.device);
}

// [T, H*D] seen as [T, H, D] (same memory).
TensorView as_heads(const TensorView& v, int64_t heads, int64_t dim) {
  return TensorView::contiguous(v.data, v.dtype, Shape{v.size(0), heads, dim}, v.device);
}

}  // namespace

int64_t kv_cache_bytes_per_block(const ModelConfig& c, int64_t block_size, DType kv_dtype) {
  return c.num_hidden_layers * 2 * block_size * c.num_key_value_heads * c.head_dim *
         static_cast<int64_t>(dtype_size(kv_dtype));
}

int64_t kv_cache_bytes_per_block(const ModelConfig& c, int64_t block_size, DType kv_dtype, bool sliding) {
  const int64_t layers = sliding ? c.num_sliding_layers() : c.num_hidden_layers - c.num_sliding_layers();
  return layers * 2 * block_size * c.num_key_value_heads * c.head_dim * static_cast<int64_t>(dtype_size(kv_dtype));
}

int64_t sliding_kv_blocks_needed(const ModelConfig& c, const StepLimits& l) {
  if (c.num_sliding_layers() == 0 || l.kv_block_size <= 0) return 0;
  const int64_t bs = l.kv_block_size;
  return l.max_seqs * ((c.sliding_window + bs - 1) / bs + 2) + (l.max_tokens + bs - 1) / bs;
}

MoeDecoder::MoeDecoder(const ModelConfig& c, const StepLimits& l, const Backend& b, ExecContext ctx)
    : config_(c), limits_(l), backend_(b), ctx_(ctx) {}

Result<std::unique_ptr<MoeDecoder>> MoeDecoder::create(const ModelConfig& config,
                                                       const StepLimits& limits,
                                                       const Backend& backend, ExecContext ctx) {
  RD_RETURN_IF_ERROR(config.validate());
  if (limits.max_tokens <= 0 || limits.max_seqs <= 0 || limits.max_blocks_per_seq <= 0 ||
      limits.num_kv_blocks <= 0 || limits.kv_block_size <= 0)
    return Status(ErrorCode::kInvalidArgument, "step limits must be positive", "limits");
  if (limits.num_sliding_kv_blocks < 0)
    return Status(ErrorCode::kInvalidArgument, "num_sliding_kv_blocks must not be negative", "limits");
  if (limits.num_sliding_kv_blocks > 0 && config.num_sliding_layers() == 0)
    return Status(ErrorCode::kInvalidArgument, "a sliding KV pool needs a model with sliding-window layers",
                  "num_sliding_kv_blocks");
  if (limits.kv_dtype != DType::kF32 && limits.kv_dtype != DType::kBF16)
    return Status(ErrorCode::kInvalidArgument,
                  std::string("KV cache dtype must be float32 or bfloat16, got ") + std::string(dtype_name(limits.kv_dtype)),
                  "kv_dtype");
  std::unique_ptr<MoeDecoder> m(new MoeDecoder(config, limits, backend, ctx));
  RD_RETURN_IF_ERROR(m->allocate());
  return m;
}

Status MoeDecoder::allocate() {
  const auto& c = config_;
  weights_arena_ = std::make_unique<StableArena>(backend_, ctx_, MemoryTag::kWeights);
  kv_arena_ = std::make_unique<StableArena>(backend_, ctx_, MemoryTag::kKvCache);
  scratch_arena_ = std::make_unique<StableArena>(backend_, ctx_, MemoryTag::kScratch);

  weights_ = std::make_unique<WeightRegistry>(backend_, ctx_);
  auto param = [&](const std::string& name, Shape shape, TensorView& out,
                   std::unique_ptr<QuantMethod> method = nullptr, bool whole_alias = true,
                   DType dtype = DType::kF32) -> Status {
    RD_ASSIGN_OR_RETURN(out, weights_arena_->allocate(dtype, shape));
    return weights_->add(name, out, std::move(method), whole_alias);
  };
  dense_bf16_ = c.dense_bf16 && ctx_.device.kind == DeviceKind::kCuda;
  const DType dense_dt = dense_bf16_ ? DType::kBF16 : DType::kF32;
  auto dense = [&](const std::string& name, Shape shape, TensorView& out) {
    return param(name, shape, out, nullptr, true, dense_dt);
  };
  const int64_t H = c.hidden_size, D = c.head_dim, QH = c.num_attention_heads,
                KVH = c.num_key_value_heads, E = c.num_experts, I = c.moe_intermediate_size;

  const bool input_major = c.moe_layout == MoeLayout::kInputMajorBiased;
  kernel_experts_ = c.grouped_experts && c.experts_mxfp4 && ctx_.device.kind == DeviceKind::kCuda && H % 64 == 0 && I % 64 == 0;
  RD_RETURN_IF_ERROR(param("model.embed_tokens.weight", Shape{c.vocab_size, H}, embed_tokens_));
  if (c.rope_type != "default") {
    // Scaled rotary frequencies, computed once on the host as transformers computes them; like
    // the dense layers' constants, static state that a memory release backs up and restores.
    const RopeFrequencies rf = rope_frequencies(c);
    RD_ASSIGN_OR_RETURN(rope_inv_freq_, weights_arena_->allocate(DType::kF32, Shape{D / 2}));
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, rope_inv_freq_.data, rf.inv_freq.data(), rf.inv_freq.size() * sizeof(float),
                                     ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost
                                                                          : CopyKind::kHostToDevice));
    RD_RETURN_IF_ERROR(weights_->static_state().add("model.rotary_emb.inv_freq", MemoryTag::kWeights, rope_inv_freq_));
    rope_attention_factor_ = rf.attention_factor;
  }
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    RD_RETURN_IF_ERROR(param(p + "input_layernorm.weight", Shape{H}, L.input_layernorm));
    RD_RETURN_IF_ERROR(dense(p + "self_attn.q_proj.weight", Shape{QH * D, H}, L.q_proj));
    RD_RETURN_IF_ERROR(dense(p + "self_attn.k_proj.weight", Shape{KVH * D, H}, L.k_proj));
    RD_RETURN_IF_ERROR(dense(p + "self_attn.v_proj.weight", Shape{KVH * D, H}, L.v_proj));
    RD_RETURN_IF_ERROR(dense(p + "self_attn.o_proj.weight", Shape{H, QH * D}, L.o_proj));
    RD_RETURN_IF_ERROR(param(p + "post_attention_layernorm.weight", Shape{H}, L.post_attention_layernorm));
    if (c.qk_norm) {
      RD_RETURN_IF_ERROR(param(p + "self_attn.q_norm.weight", Shape{D}, L.q_norm));
      RD_RETURN_IF_ERROR(param(p + "self_attn.k_norm.weight", Shape{D}, L.k_norm));
    }
    if (c.attention_bias) {
      RD_RETURN_IF_ERROR(param(p + "self_attn.q_proj.bias", Shape{QH * D}, L.q_bias));
      RD_RETURN_IF_ERROR(param(p + "self_attn.k_proj.bias", Shape{KVH * D}, L.k_bias));
      RD_RETURN_IF_ERROR(param(p + "self_attn.v_proj.bias", Shape{KVH * D}, L.v_bias));
      RD_RETURN_IF_ERROR(param(p + "self_attn.o_proj.bias", Shape{H}, L.o_bias));
    }
    // One GEMM for q, k and v on CUDA (two launches fewer per layer, each ~6 us at decode sizes)
    // when the arena placed their weights back to back (it allocates in order, so they are
    // unless a segment ended between them). Projection biases (gpt-oss) are added by rope_qk as
    // it splits the rows (three add_bias launches fewer). The CPU keeps three projections: its
    // results stay those of the checkpoint's, bit for bit.
    if (ctx_.device.kind == DeviceKind::kCuda && c.fuse_qkv) {
      const auto next_to = [](const TensorView& a, const TensorView& b) {
        return static_cast<const char*>(a.data) + a.nbytes() == static_cast<const char*>(b.data);
      };
      L.qkv_fused = next_to(L.q_proj, L.k_proj) && next_to(L.k_proj, L.v_proj);
      if (L.qkv_fused)
        L.qkv_proj = TensorView::contiguous(L.q_proj.data, L.q_proj.dtype, Shape{(QH + 2 * KVH) * D, H},
                                            L.q_proj.device);
    }
    if (c.attention_sinks) RD_RETURN_IF_ERROR(param(p + "self_attn.sinks", Shape{QH}, L.sinks));
    if (c.is_sliding_layer(l)) L.window = c.sliding_window;
    L.sliding_pool = L.window > 0 && limits_.num_sliding_kv_blocks > 0;
    const Shape cache{L.sliding_pool ? limits_.num_sliding_kv_blocks : limits_.num_kv_blocks, limits_.kv_block_size,
                      KVH, D};
    RD_ASSIGN_OR_RETURN(L.k_cache, kv_arena_->allocate(limits_.kv_dtype, cache));
    RD_ASSIGN_OR_RETURN(L.v_cache, kv_arena_->allocate(limits_.kv_dtype, cache));

    L.moe = c.is_moe_layer(l);
    if (!L.moe) {
      // Dense SwiGLU MLP ([1, 2Id, H] fused gate/up so the expert op runs it; checkpoint names
      // mlp.{gate,up,down}_proj.weight).
      const int64_t Id = c.intermediate_size;
      RD_RETURN_IF_ERROR(param(p + "mlp.gate_up_proj", Shape{1, 2 * Id, H}, L.experts_gate_up,
                               std::make_unique<InterleaveGateUpMethod>(Id)));
      RD_RETURN_IF_ERROR(param(p + "mlp.down_proj.weight", Shape{H, Id}, L.experts_down));
      L.experts_down = TensorView::contiguous(L.experts_down.data, DType::kF32, Shape{1, H, Id}, L.experts_down.device);
      const size_t gu = weights_->index_of(p + "mlp.gate_up_proj");
      RD_RETURN_IF_ERROR(weights_->add_alias({p + "mlp.gate_proj.weight", {Id, H}, {RowCopy{gu, 0, 0, 1, 0, 1, Id}}}));
      RD_RETURN_IF_ERROR(weights_->add_alias({p + "mlp.up_proj.weight", {Id, H}, {RowCopy{gu, 0, 0, 1, Id, 1, Id}}}));
      RD_RETURN_IF_ERROR(add_loader_aliases(l));
      if (dense_ids_.data == nullptr) {
        // Constant inputs of the dense layers' expert op: not checkpoint tensors, so (like the
        // logical_to_physical tables) static state a memory release must back up and restore.
        const int64_t T = limits_.max_tokens;
        RD_ASSIGN_OR_RETURN(dense_ids_, weights_arena_->allocate(DType::kI32, Shape{T, 1}));
        RD_ASSIGN_OR_RETURN(dense_weights_, weights_arena_->allocate(DType::kF32, Shape{T, 1}));
        const std::vector<int32_t> zeros(static_cast<size_t>(T), 0);
        const std::vector<float> ones(static_cast<size_t>(T), 1.0f);
        const CopyKind k = ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
        RD_RETURN_IF_ERROR(backend_.copy(ctx_, dense_ids_.data, zeros.data(), zeros.size() * sizeof(int32_t), k));
        RD_RETURN_IF_ERROR(backend_.copy(ctx_, dense_weights_.data, ones.data(), ones.size() * sizeof(float), k));
        RD_RETURN_IF_ERROR(weights_->static_state().add("model.dense_mlp.expert_ids", MemoryTag::kWeights, dense_ids_));
        RD_RETURN_IF_ERROR(
            weights_->static_state().add("model.dense_mlp.expert_weights", MemoryTag::kWeights, dense_weights_));
      }
      L.expert_map = ExpertMap::identity(1);
    } else if (input_major) {
      // MoeLayout::kInputMajorBiased, transformers' GptOssExperts: router with bias; stacked experts stored input-major
      // (gate_up_proj [E, H, 2I] with gate/up columns interleaved, down_proj [E, I, H]), used as
      // x @ W[e] + b[e]. The kernel layout is their transpose: [E, 2I, H] with interleaved rows,
      // [E, H, I] (TransposeMethod, same memory viewed in each layout).
      L.moe_index = moe_layers_++;
      RD_RETURN_IF_ERROR(param(p + "mlp.router.weight", Shape{E, H}, L.router));
      RD_RETURN_IF_ERROR(param(p + "mlp.router.bias", Shape{E}, L.router_bias));
      if (c.experts_mxfp4) {
        // MXFP4 as published ([E, rows, cols/32, 16] blocks, [E, rows, cols/32] scales, gate/up rows
        // interleaved), read by the expert op as they are. transformers' BF16 tensors of the
        // unsuffixed names are input-major ([E, H, 2I], [E, I, H]: the dequantized blocks
        // transposed), so they are registered to be transposed back per expert and quantized on
        // arrival (a BF16 trainer's update; a BF16 checkpoint with --quantize-experts mxfp4), not
        // quantized along their rows: down_proj is square in the published models, so that
        // would transpose it silently.
        RD_RETURN_IF_ERROR(mxfp4_experts(p + "mlp.experts.gate_up_proj", 2 * I, H, L.gu_blocks, L.gu_scales,
                                         L.gu_kernel_scales, quant::Mxfp4RowOrder::kGateUpInterleaved,
                                         /*quantize_on_arrival=*/false));
        RD_RETURN_IF_ERROR(mxfp4_experts(p + "mlp.experts.down_proj", H, I, L.dn_blocks, L.dn_scales,
                                         L.dn_kernel_scales, quant::Mxfp4RowOrder::kPlain,
                                         /*quantize_on_arrival=*/false));
        const int64_t gu_in[] = {E, H, 2 * I}, dn_in[] = {E, I, H};
        RD_RETURN_IF_ERROR(weights_->add_mxfp4_input_major(p + "mlp.experts.gate_up_proj", gu_in,
                                                           p + "mlp.experts.gate_up_proj"));
        RD_RETURN_IF_ERROR(weights_->add_mxfp4_input_major(p + "mlp.experts.down_proj", dn_in,
                                                           p + "mlp.experts.down_proj"));
        RD_RETURN_IF_ERROR(param(p + "mlp.experts.gate_up_proj_bias", Shape{E, 2 * I}, L.experts_gate_up_bias));
        RD_RETURN_IF_ERROR(param(p + "mlp.experts.down_proj_bias", Shape{E, H}, L.experts_down_bias));
      } else {
        TensorView gu, down;
        RD_RETURN_IF_ERROR(
            param(p + "mlp.experts.gate_up_proj", Shape{E, H, 2 * I}, gu, std::make_unique<TransposeMethod>()));
        RD_RETURN_IF_ERROR(param(p + "mlp.experts.gate_up_proj_bias", Shape{E, 2 * I}, L.experts_gate_up_bias));
        RD_RETURN_IF_ERROR(
            param(p + "mlp.experts.down_proj", Shape{E, I, H}, down, std::make_unique<TransposeMethod>()));
        RD_RETURN_IF_ERROR(param(p + "mlp.experts.down_proj_bias", Shape{E, H}, L.experts_down_bias));
        L.experts_gate_up = TensorView::contiguous(gu.data, DType::kF32, Shape{E, 2 * I, H}, gu.device);
        L.experts_down = TensorView::contiguous(down.data, DType::kF32, Shape{E, H, I}, down.device);
      }
      RD_RETURN_IF_ERROR(add_loader_aliases(l));
      L.expert_map = ExpertMap::identity(E);
    } else {
      L.moe_index = moe_layers_++;
      RD_RETURN_IF_ERROR(param(p + "mlp.gate.weight", Shape{E, H}, L.router));
      if (c.experts_mxfp4) {
        // Quantized on arrival from the checkpoint's BF16/FP32 tensors (stacked, or per expert:
        // add_expert_aliases), at load and in every weight update. Each row of the [out, in]
        // tensors quantizes on its own along `in`, so the blocks keep the stacked tensor's row
        // order, gate rows then up rows, which the expert op reads as they are.
        RD_RETURN_IF_ERROR(mxfp4_experts(p + "mlp.experts.gate_up_proj", 2 * I, H, L.gu_blocks, L.gu_scales,
                                         L.gu_kernel_scales, quant::Mxfp4RowOrder::kGateUpConcatenated,
                                         /*quantize_on_arrival=*/true));
        RD_RETURN_IF_ERROR(mxfp4_experts(p + "mlp.experts.down_proj", H, I, L.dn_blocks, L.dn_scales,
                                         L.dn_kernel_scales, quant::Mxfp4RowOrder::kPlain,
                                         /*quantize_on_arrival=*/true));
        L.gate_up_interleaved = false;
      } else {
        // Stacked expert tensors as transformers 5 stores them (gate rows, then up rows); the
        // kernel layout interleaves gate/up rows (InterleaveGateUpMethod).
        RD_RETURN_IF_ERROR(param(p + "mlp.experts.gate_up_proj", Shape{E, 2 * I, H}, L.experts_gate_up,
                                 std::make_unique<InterleaveGateUpMethod>(I), !c.gate_up_checkpoint_interleaved));
        RD_RETURN_IF_ERROR(param(p + "mlp.experts.down_proj", Shape{E, H, I}, L.experts_down));
      }
      RD_RETURN_IF_ERROR(add_loader_aliases(l));
      L.expert_map = ExpertMap::identity(E);
    }
    const int64_t num_slots = static_cast<int64_t>(L.expert_map.table().size());
    RD_ASSIGN_OR_RETURN(L.logical_to_physical, weights_arena_->allocate(DType::kI32, Shape{num_slots}));
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, L.logical_to_physical.data, L.expert_map.table().data(),
                                     static_cast<size_t>(num_slots) * sizeof(int32_t),
                                     ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost
                                                                          : CopyKind::kHostToDevice));
    // Not a checkpoint tensor, yet in weights memory: kept across a release of the weights.
    RD_RETURN_IF_ERROR(weights_->static_state().add(p + "mlp.experts.logical_to_physical", MemoryTag::kWeights,
                                                    L.logical_to_physical));
  }
  for (int64_t left = c.synthetic_param_bytes, i = 0; left > 0; ++i) {
    const int64_t bytes = std::min<int64_t>(left, int64_t{256} << 20) & ~int64_t{1};
    if (bytes <= 0) break;
    TensorView t;
    RD_ASSIGN_OR_RETURN(t, weights_arena_->allocate(DType::kBF16, Shape{bytes / 2}));
    RD_RETURN_IF_ERROR(weights_->add("synthetic." + std::to_string(i) + ".weight", t, nullptr));
    left -= bytes;
  }
  for (int64_t left = c.synthetic_mxfp4_bytes, i = 0; left > 0; ++i) {
    constexpr int64_t kCols = 4096, kFullRows = (int64_t{256} << 20) / 2 / kCols;
    const int64_t rows = std::min<int64_t>(kFullRows, std::max<int64_t>(1, left / 2 / kCols));
    TensorView blocks, scales;
    RD_ASSIGN_OR_RETURN(blocks, weights_arena_->allocate(DType::kU8, Shape{rows, kCols / 32, 16}));
    RD_ASSIGN_OR_RETURN(scales, weights_arena_->allocate(DType::kU8, Shape{rows, kCols / 32}));
    const int64_t shape[] = {rows, kCols};
    RD_RETURN_IF_ERROR(weights_->add_mxfp4("synthetic_mx." + std::to_string(i) + ".weight", shape, blocks, scales));
    left -= rows * kCols * 2;
  }
  for (int64_t left = c.synthetic_fp8_bytes, i = 0; left > 0; ++i) {
    constexpr int64_t kCols = 4096, kFullRows = (int64_t{256} << 20) / 2 / kCols;
    const int64_t rows = std::min<int64_t>(kFullRows, std::max<int64_t>(1, left / 2 / kCols));
    TensorView q, scale_inv;
    RD_ASSIGN_OR_RETURN(q, weights_arena_->allocate(DType::kF8E4M3, Shape{rows, kCols}));
    RD_ASSIGN_OR_RETURN(scale_inv, weights_arena_->allocate(DType::kF32, Shape{(rows + 127) / 128, kCols / 128}));
    RD_RETURN_IF_ERROR(weights_->add_fp8_blockwise("synthetic_fp8." + std::to_string(i) + ".weight", q, scale_inv));
    left -= rows * kCols * 2;
  }
  for (int64_t i = 0; i < c.synthetic_small_params; ++i) {
    TensorView t;
    RD_ASSIGN_OR_RETURN(t, weights_arena_->allocate(DType::kBF16, Shape{1024}));
    RD_RETURN_IF_ERROR(weights_->add("synthetic_small." + std::to_string(i) + ".weight", t, nullptr));
  }
  RD_RETURN_IF_ERROR(param("model.norm.weight", Shape{H}, final_norm_));
  RD_RETURN_IF_ERROR(dense("lm_head.weight", Shape{c.vocab_size, H}, lm_head_));

  const int64_t T = limits_.max_tokens, S = limits_.max_seqs, K = c.num_experts_per_tok;
  auto ws = [&](DType t, Shape s, TensorView& out) -> Status {
    RD_ASSIGN_OR_RETURN(out, scratch_arena_->allocate(t, s));
    return Status::Ok();
  };
  {
    // The step inputs in one buffer (layout in moe_decoder.hpp): one upload per step.
    const int64_t W = limits_.max_blocks_per_seq;
    const int64_t P = per_token_arrays();
    tables_offset_ = static_cast<size_t>(P * T + S + 1);
    sliding_offset_ = limits_.num_sliding_kv_blocks > 0 ? tables_offset_ + static_cast<size_t>(S * W) : 0;
    const int64_t total = static_cast<int64_t>(tables_offset_) + S * W + (sliding_offset_ ? S * W : 0);
    RD_RETURN_IF_ERROR(ws(DType::kI32, Shape{total}, ws_.inputs));
    host_.backend = &backend_;
    host_.ctx = ctx_;
    void* p = nullptr;
    RD_RETURN_IF_ERROR(backend_.host_alloc(ctx_, static_cast<size_t>(total) * sizeof(int32_t), &p));
    host_.inputs = static_cast<int32_t*>(p);
    std::fill(host_.inputs, host_.inputs + total, 0);
    // host_.logits ([max_seqs, vocab] page-locked) is made by the first step() that returns
    // logits: with device sampling (step_sample) it is never needed, and at a vocabulary of
    // 151,936 and 256 sequences it would pin 156 MB of host memory for nothing.
    auto part = [&](int64_t offset, Shape shape) {
      return TensorView::contiguous(static_cast<int32_t*>(ws_.inputs.data) + offset, DType::kI32, shape,
                                    ws_.inputs.device);
    };
    ws_.token_ids = part(0, Shape{T});
    ws_.positions = part(T, Shape{T});
    ws_.seq_of = part(2 * T, Shape{T});
    ws_.slot_mapping = part(3 * T, Shape{T});
    ws_.ctx_len = part(4 * T, Shape{T});
    ws_.logits_rows = part(P * T, Shape{S});
    ws_.num_valid = part(P * T + S, Shape{1});
    ws_.block_tables = part(static_cast<int64_t>(tables_offset_), Shape{S, W});
    if (sliding_offset_) {
      ws_.sliding_slot_mapping = part(5 * T, Shape{T});
      ws_.sliding_block_tables = part(static_cast<int64_t>(sliding_offset_), Shape{S, W});
    }
  }
  if (moe_layers_ > 0) {
    RD_RETURN_IF_ERROR(ws(DType::kI32, Shape{moe_layers_, T, K}, routed_table_));
    void* p = nullptr;
    RD_RETURN_IF_ERROR(backend_.host_alloc(ctx_, static_cast<size_t>(moe_layers_ * T * K) * sizeof(int32_t), &p));
    host_.records = static_cast<int32_t*>(p);
  }
  // Decode buckets: powers of two below the maximum, then the maximum.
  const int64_t max_bucket = std::min({limits_.graph_max_batch, S, T});
  for (int64_t b = 1; b < max_bucket; b *= 2) graph_stats_.buckets.push_back(b);
  if (max_bucket > 0) graph_stats_.buckets.push_back(max_bucket);
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, H}, ws_.h));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, H}, ws_.x));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, QH * D}, ws_.q));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, KVH * D}, ws_.k));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, KVH * D}, ws_.v));
  // Attention's FP32 output feeds only FP32 o_projs; with every o_proj in BF16 the attention
  // writes o_proj's input into x_bf16, and ws_.attn keeps only its shape (no memory: T * QH * D
  // floats, 128 MiB at 8,192 tokens and 64 x 64 heads).
  if (std::any_of(layers_.begin(), layers_.end(), [](const Layer& L) { return L.o_proj.dtype != DType::kBF16; }))
    RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, QH * D}, ws_.attn));
  else
    ws_.attn = TensorView::contiguous(nullptr, DType::kF32, Shape{T, QH * D}, ctx_.device);
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, H}, ws_.o));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, E}, ws_.router_logits));
  RD_RETURN_IF_ERROR(ws(DType::kI32, Shape{T, K}, ws_.topk_ids));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, K}, ws_.topk_weights));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, H}, ws_.moe_out));
  // Also the MXFP4 expert kernels' BF16 input, written by post_attention_layernorm.
  if (dense_bf16_ || kernel_experts_)
    RD_RETURN_IF_ERROR(ws(DType::kBF16, Shape{std::max(T, S) * std::max(H, QH * D)}, ws_.x_bf16));
  if (std::any_of(layers_.begin(), layers_.end(), [](const Layer& L) { return L.qkv_fused; }))
    RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T, (QH + 2 * KVH) * D}, ws_.qkv));
  // The expert op's workspace, for the layers that run Backend::moe_experts: MoE layers unless
  // moe::experts takes them (K * I per token), dense layers (one expert of intermediate_size).
  int64_t moe_h_per_token = 0;
  for (const Layer& L : layers_)
    moe_h_per_token = std::max(moe_h_per_token, !L.moe ? c.intermediate_size : (kernel_experts_ ? 0 : K * I));
  if (moe_h_per_token > 0) RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{T * moe_h_per_token}, ws_.moe_h));
  if (kernel_experts_)
    RD_RETURN_IF_ERROR(ws(DType::kU8, Shape{moe::experts_workspace_bytes(T, K, H, I, E, moe::ActPrecision::kBF16)},
                          ws_.experts_ws));
  {
    // Split attention rows in steps of up to max_seqs tokens (decode steps; a long prefill chunk
    // has CTAs enough): a row's bits then depend on its context alone, whatever else the step
    // holds (AttentionOptions::workspace).
    const int64_t tokens = std::min(T, S);
    ws_.attn_split_tokens = tokens;
    RD_RETURN_IF_ERROR(ws(DType::kU8, Shape{paged_attention_workspace_bytes(tokens, QH, D)}, ws_.attn_split));
    const std::vector<uint8_t> zeros(static_cast<size_t>(paged_attention_workspace_counter_bytes(tokens, QH)), 0);
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, ws_.attn_split.data, zeros.data(), zeros.size(),
                                     ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice));
    RD_RETURN_IF_ERROR(weights_->static_state().add(
        "model.attention.split_counters", MemoryTag::kScratch,
        TensorView::contiguous(ws_.attn_split.data, DType::kU8, Shape{static_cast<int64_t>(zeros.size())}, ctx_.device)));
  }
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{S, H}, ws_.final_rows));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{S, H}, ws_.final_normed));
  RD_RETURN_IF_ERROR(ws(DType::kF32, Shape{S, c.vocab_size}, ws_.logits));
  return Status::Ok();
}

StableArena& MoeDecoder::arena(MemoryTag tag) {
  switch (tag) {
    case MemoryTag::kWeights: return *weights_arena_;
    case MemoryTag::kKvCache: return *kv_arena_;
    default: return *scratch_arena_;
  }
}

Status MoeDecoder::add_loader_aliases(int64_t l) {
  const auto& c = config_;
  const int64_t H = c.hidden_size, D = c.head_dim, QH = c.num_attention_heads, KVH = c.num_key_value_heads;
  const std::string p = "model.layers." + std::to_string(l) + ".";
  if (layers_[static_cast<size_t>(l)].moe && c.moe_layout == MoeLayout::kOutputMajor) RD_RETURN_IF_ERROR(add_expert_aliases(l));
  // Fused QKV (rows q, then k, then v).
  const size_t q = weights_->index_of(p + "self_attn.q_proj.weight");
  const size_t k = weights_->index_of(p + "self_attn.k_proj.weight");
  const size_t v = weights_->index_of(p + "self_attn.v_proj.weight");
  return weights_->add_alias({p + "self_attn.qkv_proj.weight",
                              {(QH + 2 * KVH) * D, H},
                              {RowCopy{q, -1, 0, 1, 0, 1, QH * D}, RowCopy{k, -1, QH * D, 1, 0, 1, KVH * D},
                               RowCopy{v, -1, (QH + KVH) * D, 1, 0, 1, KVH * D}}});
}

Status MoeDecoder::mxfp4_experts(const std::string& name, int64_t rows, int64_t cols, TensorView& blocks,
                                 TensorView& scales, TensorView& kernel_scales, quant::Mxfp4RowOrder order,
                                 bool quantize_on_arrival) {
  const int64_t E = config_.num_experts;
  RD_ASSIGN_OR_RETURN(blocks, weights_arena_->allocate(DType::kU8, Shape{E, rows, cols / 32, 16}));
  RD_ASSIGN_OR_RETURN(scales, weights_arena_->allocate(DType::kU8, Shape{E, rows, cols / 32}));
  const int64_t shape[] = {E, rows, cols};
  if (!kernel_experts_) return weights_->add_mxfp4(name, shape, blocks, scales, quantize_on_arrival);
  // Weights memory, not a checkpoint tensor and not static state: every postprocess of the
  // scales rewrites it (and the weights are pushed again after a memory release anyway).
  RD_ASSIGN_OR_RETURN(kernel_scales, weights_arena_->allocate(DType::kU8, Shape{E, rows, cols / 32}));
  return weights_->add_mxfp4(name, shape, blocks, scales, quantize_on_arrival,
                             std::make_unique<Mxfp4BlocksMethod>(order),
                             std::make_unique<Mxfp4ScalesMethod>(order, kernel_scales));
}

Status MoeDecoder::add_expert_aliases(int64_t l) {
  const auto& c = config_;
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const std::string p = "model.layers." + std::to_string(l) + ".";
  if (c.experts_mxfp4) {
    // Per-expert tensors quantized on arrival into their expert's rows of the stacked blocks and
    // scales (the stacked names quantize as a whole: add_mxfp4). ModelConfig::validate refuses an
    // interleaved fused gate_up_proj with MXFP4 experts.
    const int64_t gate_shape[] = {I, H}, down_shape[] = {H, I};
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      RD_RETURN_IF_ERROR(weights_->add_mxfp4_rows(x + "gate_proj.weight", gate_shape, p + "mlp.experts.gate_up_proj", e, 0));
      RD_RETURN_IF_ERROR(weights_->add_mxfp4_rows(x + "up_proj.weight", gate_shape, p + "mlp.experts.gate_up_proj", e, I));
      RD_RETURN_IF_ERROR(weights_->add_mxfp4_rows(x + "down_proj.weight", down_shape, p + "mlp.experts.down_proj", e, 0));
    }
    return Status::Ok();
  }
  const size_t gate_up = weights_->index_of(p + "mlp.experts.gate_up_proj");
  const size_t down = weights_->index_of(p + "mlp.experts.down_proj");
  // Per-expert tensors (Hugging Face checkpoints before transformers 5, Mixtral, Qwen3-MoE).
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
    RD_RETURN_IF_ERROR(weights_->add_alias({x + "gate_proj.weight", {I, H}, {RowCopy{gate_up, e, 0, 1, 0, 1, I}}}));
    RD_RETURN_IF_ERROR(weights_->add_alias({x + "up_proj.weight", {I, H}, {RowCopy{gate_up, e, 0, 1, I, 1, I}}}));
    RD_RETURN_IF_ERROR(weights_->add_alias({x + "down_proj.weight", {H, I}, {RowCopy{down, e, 0, 1, 0, 1, H}}}));
  }
  if (c.gate_up_checkpoint_interleaved) {
    // Fused tensor with gate j at row 2j and up j at row 2j + 1 of each expert (gpt-oss order).
    CheckpointTensor t{p + "mlp.experts.gate_up_proj", {E, 2 * I, H}, {}};
    for (int64_t e = 0; e < E; ++e) {
      t.pieces.push_back(RowCopy{gate_up, e, e * 2 * I, 2, 0, 1, I});
      t.pieces.push_back(RowCopy{gate_up, e, e * 2 * I + 1, 2, I, 1, I});
    }
    RD_RETURN_IF_ERROR(weights_->add_alias(std::move(t)));
  }
  return Status::Ok();
}

MoeDecoder::HostBuffers::~HostBuffers() {
  if (backend == nullptr) return;
  for (void* p : {static_cast<void*>(inputs), static_cast<void*>(logits), static_cast<void*>(records)})
    if (p) (void)backend->host_free(ctx, p);
}

MoeDecoder::~MoeDecoder() {
  for (void* g : graphs_)
    if (g) (void)backend_.graph_destroy(ctx_, g);
}

int64_t MoeDecoder::bucket_for(int64_t num_seqs) const {
  for (int64_t b : graph_stats_.buckets)
    if (b >= num_seqs) return b;
  return 0;
}

Status MoeDecoder::stage_inputs(const StepBatch& b, int64_t rows, int64_t seqs) {
  const int64_t maxT = limits_.max_tokens, maxS = limits_.max_seqs, W = limits_.max_blocks_per_seq;
  const int64_t n = b.num_tokens(), given_seqs = b.num_seqs(), R = static_cast<int64_t>(b.logits_rows.size());
  int32_t* in = host_.inputs;
  // Rows past the batch are padding: token 0 at position 0 of its own (empty) sequence, no KV
  // slot (kv_store skips -1), no visible context (attention gives a zero row). Table entries past
  // the batch's width are -1: a context reaching them is refused (CPU) or skipped (CUDA), never
  // read from another sequence's block.
  for (int64_t t = 0; t < rows; ++t) {
    const bool real = t < n;
    const size_t i = static_cast<size_t>(t);
    in[t] = real ? b.token_ids[i] : 0;
    in[maxT + t] = real ? b.positions[i] : 0;
    in[2 * maxT + t] = real ? b.seq_of[i] : static_cast<int32_t>(t);
    in[3 * maxT + t] = real ? b.slot_mapping[i] : -1;
    in[4 * maxT + t] = real ? b.ctx_len[i] : 0;
  }
  const int64_t P = per_token_arrays();
  int32_t* tail = in + P * maxT;
  for (int64_t r = 0; r < maxS; ++r) tail[r] = r < R ? b.logits_rows[static_cast<size_t>(r)] : static_cast<int32_t>(r);
  tail[maxS] = static_cast<int32_t>(n);
  int32_t* tables = in + tables_offset_;
  const int64_t width = b.max_blocks_per_seq;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t c = 0; c < W; ++c)
      tables[s * W + c] = s < given_seqs && c < width ? b.block_tables[static_cast<size_t>(s * width + c)] : -1;

  if (sliding_offset_) {
    // The sliding pool's slots and tables, padded as above (a padding row writes no KV).
    int32_t* sslots = in + 5 * maxT;
    int32_t* stables = in + sliding_offset_;
    for (int64_t t = 0; t < rows; ++t) sslots[t] = t < n ? b.sliding_slot_mapping[static_cast<size_t>(t)] : -1;
    for (int64_t s = 0; s < seqs; ++s)
      for (int64_t c = 0; c < W; ++c)
        stables[s * W + c] =
            s < given_seqs && c < width ? b.sliding_block_tables[static_cast<size_t>(s * width + c)] : -1;
  }

  const CopyKind h2d = ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
  // Two copies: the per-token arrays (their first `rows` entries), then logits rows, count and
  // the first `seqs` block-table rows, which are contiguous. A sliding pool adds a copy of the
  // first `seqs` rows of its tables.
  const size_t pitch = static_cast<size_t>(maxT) * sizeof(int32_t);
  RD_RETURN_IF_ERROR(backend_.copy_2d(ctx_, ws_.inputs.data, pitch, in, pitch,
                                      static_cast<size_t>(rows) * sizeof(int32_t), static_cast<size_t>(P), h2d));
  const size_t tail_elems = tables_offset_ - static_cast<size_t>(P * maxT) + static_cast<size_t>(seqs * W);
  RD_RETURN_IF_ERROR(backend_.copy(ctx_, static_cast<int32_t*>(ws_.inputs.data) + P * maxT, tail,
                                   tail_elems * sizeof(int32_t), h2d));
  if (!sliding_offset_) return Status::Ok();
  return backend_.copy(ctx_, static_cast<int32_t*>(ws_.inputs.data) + sliding_offset_, in + sliding_offset_,
                       static_cast<size_t>(seqs * W) * sizeof(int32_t), h2d);
}

Status MoeDecoder::forward(const StepBatch& b, std::vector<float>& logits, RoutedExpertRecorder* recorder) {
  RD_ASSIGN_OR_RETURN(std::span<const float> out, step(b, recorder));
  logits.assign(out.begin(), out.end());
  return Status::Ok();
}

Result<std::span<const float>> MoeDecoder::step(const StepBatch& b, RoutedExpertRecorder* recorder) {
  return step_impl(b, recorder, {}, false, 0);
}

MoeDecoder::SampleBuffers::~SampleBuffers() {
  if (backend == nullptr) return;
  if (device) (void)backend->free(ctx, device);
  if (host) (void)backend->host_free(ctx, host);
}

Result<SampledRows> MoeDecoder::step_sample(const StepBatch& b, std::span<const SamplingRow> rows,
                                             RoutedExpertRecorder* recorder, int64_t top_n) {
  if (rows.size() != b.logits_rows.size())
    return Status(ErrorCode::kInvalidArgument, "one sampling row per logits row", "rows");
  if (top_n < 0 || top_n > std::min<int64_t>(kMaxTopLogprobs, config_.vocab_size))
    return Status(ErrorCode::kOutOfRange,
                  "top_n " + std::to_string(top_n) + " outside [0, min(" + std::to_string(kMaxTopLogprobs) +
                      ", vocab)]",
                  "top_n");
  for (size_t r = 0; r < rows.size(); ++r) {
    if (Status st = cpu::check_sampling_row(rows[r]); !st.ok())
      return st.with_field_prefix("rows[" + std::to_string(r) + "]");
  }
  const auto S = static_cast<size_t>(limits_.max_seqs);
  if (sample_.backend == nullptr) {
    // Both buffers or neither: a failed allocation leaves nothing half made for the next call.
    const size_t bytes = S * (sizeof(SamplingRow) + sizeof(int32_t) + sizeof(float)) + top_region_bytes();
    SampleBuffers made;
    made.backend = &backend_;
    made.ctx = ctx_;
    RD_RETURN_IF_ERROR(backend_.alloc(ctx_, bytes, &made.device));
    RD_RETURN_IF_ERROR(backend_.host_alloc(ctx_, bytes, &made.host));
    // Defined contents: the read-back copies every slot, used or not.
    std::memset(made.host, 0, bytes);
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, made.device, made.host, bytes,
                                     ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost
                                                                          : CopyKind::kHostToDevice));
    RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));  // the host mirror is rewritten next
    std::swap(sample_.backend, made.backend);
    std::swap(sample_.ctx, made.ctx);
    std::swap(sample_.device, made.device);
    std::swap(sample_.host, made.host);
  }
  RD_RETURN_IF_ERROR(step_impl(b, recorder, rows, true, top_n).status());
  const auto* out = static_cast<const char*>(sample_.host) + S * sizeof(SamplingRow);
  SampledRows sampled;
  sampled.tokens = std::span<const int32_t>(reinterpret_cast<const int32_t*>(out), rows.size());
  sampled.logprobs = std::span<const float>(reinterpret_cast<const float*>(out + S * sizeof(int32_t)), rows.size());
  if (top_n > 0) {
    const auto* top = out + S * (sizeof(int32_t) + sizeof(float));
    const size_t n = rows.size() * static_cast<size_t>(top_n);
    sampled.top_n = top_n;
    sampled.top_ids = std::span<const int32_t>(reinterpret_cast<const int32_t*>(top), n);
    sampled.top_logprobs =
        std::span<const float>(reinterpret_cast<const float*>(top + top_region_bytes() / 2), n);
  }
  return sampled;
}

size_t MoeDecoder::top_region_bytes() const {
  return static_cast<size_t>(limits_.max_seqs * kMaxTopLogprobs) * (sizeof(int32_t) + sizeof(float));
}

Status MoeDecoder::enqueue_sampling(std::span<const SamplingRow> rows, int64_t top_n) {
  const bool cpu = ctx_.device.kind == DeviceKind::kCpu;
  const auto R = static_cast<int64_t>(rows.size());
  const auto S = static_cast<size_t>(limits_.max_seqs);
  // The host mirror is free: the previous step synchronised before returning.
  std::memcpy(sample_.host, rows.data(), rows.size_bytes());
  RD_RETURN_IF_ERROR(backend_.copy(ctx_, sample_.device, sample_.host, rows.size_bytes(),
                                   cpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice));
  auto* dev = static_cast<char*>(sample_.device);
  SampleArgs args;
  args.rows = TensorView::contiguous(dev, DType::kU8, Shape{R, static_cast<int64_t>(sizeof(SamplingRow))}, ctx_.device);
  args.tokens = TensorView::contiguous(dev + S * sizeof(SamplingRow), DType::kI32, Shape{R}, ctx_.device);
  args.logprobs = TensorView::contiguous(dev + S * (sizeof(SamplingRow) + sizeof(int32_t)), DType::kF32, Shape{R},
                                         ctx_.device);
  args.logits = TensorView::contiguous(ws_.logits.data, DType::kF32, Shape{R, config_.vocab_size}, ctx_.device);
  char* const top = dev + S * (sizeof(SamplingRow) + sizeof(int32_t) + sizeof(float));
  if (top_n > 0) {
    args.top_ids = TensorView::contiguous(top, DType::kI32, Shape{R, top_n}, ctx_.device);
    args.top_logprobs = TensorView::contiguous(top + top_region_bytes() / 2, DType::kF32, Shape{R, top_n}, ctx_.device);
  }
  RD_RETURN_IF_ERROR(backend_.sample(ctx_, args));
  // Tokens and log-probs of every slot in one copy (8 bytes a row, at most max_seqs rows), which
  // extends over the whole top log-probs region when asked (8 bytes per entry, max_seqs * 20).
  const CopyKind d2h = cpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  const size_t out_bytes = S * (sizeof(int32_t) + sizeof(float)) + (top_n > 0 ? top_region_bytes() : 0);
  return backend_.copy(ctx_, static_cast<char*>(sample_.host) + S * sizeof(SamplingRow), dev + S * sizeof(SamplingRow),
                       out_bytes, d2h);
}

Result<std::span<const float>> MoeDecoder::step_impl(const StepBatch& b, RoutedExpertRecorder* recorder,
                                                     std::span<const SamplingRow> sample, bool sampled,
                                                     int64_t top_n) {
  const auto& c = config_;
  const int64_t T = b.num_tokens();
  const int64_t S = b.num_seqs();
  const int64_t R = static_cast<int64_t>(b.logits_rows.size());
  // Host-side validation: the batch is built by the scheduler, but a bad batch must fail
  // with a status, never index out of bounds in a kernel.
  if (!weights_->all_kernel_layout())
    return Status(ErrorCode::kFailedPrecondition,
                  "parameters are not in kernel layout (a weight update is in progress or was never finished)",
                  "weights");
  if (T <= 0 || T > limits_.max_tokens)
    return Status(ErrorCode::kInternal, "step token count outside [1, max_tokens]", "token_ids");
  if (S <= 0 || S > limits_.max_seqs || b.max_blocks_per_seq > limits_.max_blocks_per_seq ||
      static_cast<int64_t>(b.block_tables.size()) != S * b.max_blocks_per_seq)
    return Status(ErrorCode::kInternal, "step sequence count or block table width out of range",
                  "block_tables");
  if (static_cast<int64_t>(b.positions.size()) != T || static_cast<int64_t>(b.seq_of.size()) != T ||
      static_cast<int64_t>(b.slot_mapping.size()) != T || static_cast<int64_t>(b.ctx_len.size()) != T)
    return Status(ErrorCode::kInternal, "per-token arrays disagree in length", "positions");
  if (sliding_offset_ && (static_cast<int64_t>(b.sliding_slot_mapping.size()) != T ||
                          b.sliding_block_tables.size() != b.block_tables.size()))
    return Status(ErrorCode::kInternal, "a model with a sliding KV pool needs the batch's sliding slots and tables",
                  "sliding_block_tables");
  // The logits buffer holds max_seqs rows (one sampling row per sequence in a step).
  if (R > limits_.max_seqs)
    return Status(ErrorCode::kInternal, "more logits rows than the step's sequence capacity",
                  "logits_rows");
  bool decode = T == S && R == T;  // one token per sequence, each sampled, in order
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = b.token_ids[static_cast<size_t>(t)];
    if (id < 0 || id >= c.vocab_size)
      return Status(ErrorCode::kOutOfRange, "token id outside the vocabulary", "token_ids");
    if (b.seq_of[static_cast<size_t>(t)] < 0 || b.seq_of[static_cast<size_t>(t)] >= S)
      return Status(ErrorCode::kInternal, "seq_of out of range", "seq_of");
    decode = decode && b.seq_of[static_cast<size_t>(t)] == t;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int32_t row = b.logits_rows[static_cast<size_t>(r)];
    if (row < 0 || row >= T) return Status(ErrorCode::kInternal, "logits row out of range", "logits_rows");
    decode = decode && row == r;
  }

  if (sliding_offset_) {
    // Every sliding block a row sees must be held: the CUDA attention skips an entry outside the
    // pool (a silently wrong row), so a scheduler bug that freed one early is stopped here, on
    // every backend, at the cost of a look at each row's window.
    const int64_t bs = limits_.kv_block_size, width = b.max_blocks_per_seq, w = c.sliding_window;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t len = b.ctx_len[static_cast<size_t>(t)], seq = b.seq_of[static_cast<size_t>(t)];
      const int32_t slot = b.sliding_slot_mapping[static_cast<size_t>(t)];
      if (len <= 0 || (len + bs - 1) / bs > width || slot < 0 || slot >= limits_.num_sliding_kv_blocks * bs)
        return Status(ErrorCode::kInternal, "a sliding slot or context length outside the pool", "sliding_slot_mapping");
      for (int64_t j = std::max<int64_t>(0, len - w) / bs; j <= (len - 1) / bs; ++j) {
        const int32_t blk = b.sliding_block_tables[static_cast<size_t>(seq * width + j)];
        if (blk < 0 || blk >= limits_.num_sliding_kv_blocks)
          return Status(ErrorCode::kInternal,
                        "token " + std::to_string(t) + " sees sliding block " + std::to_string(j) +
                            " of its sequence, which is not held (" + std::to_string(blk) + ")",
                        "sliding_block_tables");
      }
    }
  }
  // A decode step that fits a bucket runs padded to it (from its graph on CUDA).
  const int64_t bucket = decode ? bucket_for(T) : 0;
  const int64_t rows = bucket ? bucket : T, seqs = bucket ? bucket : S, run_r = bucket ? bucket : R;
  const bool record = recorder != nullptr && moe_layers_ > 0;
  if (recorder) {
    // The record buffers are sized for this model: a recorder of another shape would read past them.
    if (recorder->num_moe_layers() != moe_layers_ || recorder->top_k() != c.num_experts_per_tok)
      return Status(ErrorCode::kInvalidArgument, "the recorder's MoE layers or top_k differ from the model's",
                    "recorder");
    RD_RETURN_IF_ERROR(recorder->begin_step(T));
  }
  const CopyKind d2h = ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  const size_t num_logits = static_cast<size_t>(R * c.vocab_size);
  // Everything from the input upload to the read-back is queued on the stream; a failure part way
  // still waits for what was queued, so the next step cannot overwrite page-locked memory a copy
  // is still reading.
  const auto enqueue = [&]() -> Status {
    RD_RETURN_IF_ERROR(stage_inputs(b, rows, seqs));
    if (bucket && graphs_ready_) {
      const size_t at = static_cast<size_t>(
          std::find(graph_stats_.buckets.begin(), graph_stats_.buckets.end(), bucket) - graph_stats_.buckets.begin());
      RD_RETURN_IF_ERROR(backend_.graph_launch(ctx_, graphs_[at * 2 + (record ? 1 : 0)]));
    } else {
      RD_RETURN_IF_ERROR(run_device(ctx_, rows, seqs, run_r, record));
    }
    // A padded step counts as a graph step where it replayed one (CUDA) or where there are no
    // graphs to replay (the CPU's padded path).
    ++(bucket && (graphs_ready_ || ctx_.device.kind == DeviceKind::kCpu) ? graph_stats_.graph_steps
                                                                         : graph_stats_.eager_steps);
    // Logits and records come back asynchronously into page-locked memory; one synchronisation.
    if (R > 0 && sampled) RD_RETURN_IF_ERROR(enqueue_sampling(sample, top_n));
    if (R > 0 && !sampled) {
      if (host_.logits == nullptr) {
        void* p = nullptr;
        RD_RETURN_IF_ERROR(backend_.host_alloc(
            ctx_, static_cast<size_t>(limits_.max_seqs * c.vocab_size) * sizeof(float), &p));
        host_.logits = static_cast<float*>(p);
      }
      RD_RETURN_IF_ERROR(backend_.copy(ctx_, host_.logits, ws_.logits.data, num_logits * sizeof(float), d2h));
    }
    if (record && T > 0) {
      const size_t row_bytes = static_cast<size_t>(T * c.num_experts_per_tok) * sizeof(int32_t);
      RD_RETURN_IF_ERROR(backend_.copy_2d(ctx_, host_.records, row_bytes, routed_table_.data,
                                          static_cast<size_t>(limits_.max_tokens * c.num_experts_per_tok) * sizeof(int32_t),
                                          row_bytes, static_cast<size_t>(moe_layers_), d2h));
    }
    return Status::Ok();
  };
  if (Status st = enqueue(); !st.ok()) {
    (void)backend_.synchronize(ctx_);
    return st;
  }
  RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
  if (recorder) RD_RETURN_IF_ERROR(recorder->capture_layer_major(record ? host_.records : nullptr, T));
  return std::span<const float>(host_.logits, sampled ? 0 : num_logits);
}

Status MoeDecoder::capture_body(void* arg, const ExecContext& ctx) {
  auto* job = static_cast<std::pair<MoeDecoder*, std::pair<int64_t, bool>>*>(arg);
  const int64_t bucket = job->second.first;
  return job->first->run_device(ctx, bucket, bucket, bucket, job->second.second);
}

Status MoeDecoder::capture_graphs() {
  if (graphs_ready_ || graph_stats_.buckets.empty() || ctx_.device.kind != DeviceKind::kCuda) return Status::Ok();
  const auto started = std::chrono::steady_clock::now();
  std::vector<void*> graphs;
  auto discard = [&] {
    for (void* g : graphs) (void)backend_.graph_destroy(ctx_, g);
  };
  for (int64_t bucket : graph_stats_.buckets) {
    // Inputs of an all-padding step: no KV written, no records (count 0). One eager run first
    // makes every lazy initialisation (the cuBLAS handle, kernel attributes) happen outside
    // the capture, where allocation is not allowed.
    StepBatch empty;
    Status st = stage_inputs(empty, bucket, bucket);
    if (st.ok()) st = run_device(ctx_, bucket, bucket, bucket, moe_layers_ > 0);
    if (st.ok()) st = backend_.synchronize(ctx_);
    for (bool record : {false, true}) {
      std::pair<MoeDecoder*, std::pair<int64_t, bool>> job{this, {bucket, record && moe_layers_ > 0}};
      void* g = nullptr;
      if (st.ok()) st = backend_.graph_capture(ctx_, &MoeDecoder::capture_body, &job, &g);
      if (g) graphs.push_back(g);
    }
    if (!st.ok()) {
      discard();
      return Status(st.code(), "capturing the decode graph of bucket " + std::to_string(bucket) + ": " + st.message(),
                    st.field());
    }
  }
  if (Status st = backend_.synchronize(ctx_); !st.ok()) {
    discard();
    return st;
  }
  graphs_ = std::move(graphs);
  graphs_ready_ = true;
  graph_stats_.num_graphs = static_cast<int64_t>(graphs_.size());
  graph_stats_.capture_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return Status::Ok();
}

Status MoeDecoder::run_device(const ExecContext& ctx, int64_t T, int64_t S, int64_t R, bool record) {
  const auto& c = config_;
  const int64_t D = c.head_dim, QH = c.num_attention_heads, KVH = c.num_key_value_heads, K = c.num_experts_per_tok;
  const TensorView ids = rows_of(ws_.token_ids, T);
  const TensorView pos = rows_of(ws_.positions, T);
  const TensorView seq_of = rows_of(ws_.seq_of, T);
  const TensorView slots = rows_of(ws_.slot_mapping, T);
  const TensorView ctx_len = rows_of(ws_.ctx_len, T);
  const TensorView tables = rows_of(ws_.block_tables, S);
  const TensorView sliding_slots = sliding_offset_ ? rows_of(ws_.sliding_slot_mapping, T) : TensorView{};
  const TensorView sliding_tables = sliding_offset_ ? rows_of(ws_.sliding_block_tables, S) : TensorView{};
  const TensorView h = rows_of(ws_.h, T), x = rows_of(ws_.x, T), q = rows_of(ws_.q, T),
                   k = rows_of(ws_.k, T), v = rows_of(ws_.v, T), attn = rows_of(ws_.attn, T),
                   o = rows_of(ws_.o, T), router_logits = rows_of(ws_.router_logits, T),
                   topk_ids = rows_of(ws_.topk_ids, T), topk_w = rows_of(ws_.topk_weights, T),
                   moe_out = rows_of(ws_.moe_out, T);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float theta = static_cast<float>(c.rope_theta);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // The BF16 input of dense projections with BF16 weights (dense_bf16_): the x_bf16 workspace,
  // which the projections of one input share, written by the op before them (a norm, attention).
  auto bf16_of = [&](const TensorView& xin) {
    return TensorView::contiguous(ws_.x_bf16.data, DType::kBF16, xin.shape, xin.device);
  };
  // A norm whose output feeds dense projections writes their BF16 input in the same pass (one
  // launch instead of rmsnorm + convert); the FP32 rows are then not needed, and not written.
  auto norm_for_dense = [&](const TensorView& out, const TensorView& hin, const TensorView& residual,
                            const TensorView& w, const TensorView& proj, TensorView& xin) -> Status {
    if (proj.dtype != DType::kBF16) {
      xin = out;
      return backend_.add_rmsnorm(ctx, out, {}, hin, residual, {}, w, eps);
    }
    xin = bf16_of(out);
    return backend_.add_rmsnorm(ctx, {}, xin, hin, residual, {}, w, eps);
  };
  TensorView xd;
  // The residual not yet added to h: each layer's MoE (or MLP) output joins h in the next layer's
  // input_layernorm (one launch for add + norm); the last layer's in a plain add.
  TensorView pending;
  RopeQkArgs rope_args;
  rope_args.positions = pos;
  rope_args.inv_freq = rope_inv_freq_;  // empty: rope's theta form
  rope_args.theta = theta;
  rope_args.scale = rope_inv_freq_.data ? rope_attention_factor_ : 1.0f;
  rope_args.eps = eps;

  RD_RETURN_IF_ERROR(backend_.embedding(ctx, h, embed_tokens_, ids));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    // Attention block.
    RD_RETURN_IF_ERROR(norm_for_dense(x, h, pending, L.input_layernorm, L.q_proj, xd));
    pending = {};
    if (L.qkv_fused) {
      // One GEMM into rows q | k | v; rope_qk splits them.
      const TensorView qkv = rows_of(ws_.qkv, T);
      RD_RETURN_IF_ERROR(backend_.linear(ctx, qkv, xd, L.qkv_proj));
      rope_args.qkv = qkv;
      rope_args.v = as_heads(v, KVH, D);
      rope_args.q_bias = L.q_bias;  // empty without projection biases
      rope_args.k_bias = L.k_bias;
      rope_args.v_bias = L.v_bias;
    } else {
      RD_RETURN_IF_ERROR(backend_.linear(ctx, q, xd, L.q_proj));
      RD_RETURN_IF_ERROR(backend_.linear(ctx, k, xd, L.k_proj));
      RD_RETURN_IF_ERROR(backend_.linear(ctx, v, xd, L.v_proj));
      if (L.q_bias.data) {
        RD_RETURN_IF_ERROR(backend_.add_bias(ctx, q, L.q_bias));
        RD_RETURN_IF_ERROR(backend_.add_bias(ctx, k, L.k_bias));
        RD_RETURN_IF_ERROR(backend_.add_bias(ctx, v, L.v_bias));
      }
      rope_args.qkv = {};
      rope_args.v = {};
      rope_args.q_bias = rope_args.k_bias = rope_args.v_bias = {};
    }
    // Rotary on q and k in one launch; Qwen3's QK-norm (RMSNorm over each head's D values, weight
    // shared by the heads) joins it, before the rotation.
    rope_args.q = as_heads(q, QH, D);
    rope_args.k = as_heads(k, KVH, D);
    rope_args.q_norm = c.qk_norm ? L.q_norm : TensorView{};
    rope_args.k_norm = c.qk_norm ? L.k_norm : TensorView{};
    // The fused form also stores k and v at their cache slots (one launch instead of two).
    rope_args.k_cache = L.qkv_fused ? L.k_cache : TensorView{};
    rope_args.v_cache = L.qkv_fused ? L.v_cache : TensorView{};
    // A layer in the sliding pool stores and reads through that pool's slots and tables.
    const TensorView& layer_slots = L.sliding_pool ? sliding_slots : slots;
    const TensorView& layer_tables = L.sliding_pool ? sliding_tables : tables;
    rope_args.slot_mapping = L.qkv_fused ? layer_slots : TensorView{};
    RD_RETURN_IF_ERROR(backend_.rope_qk(ctx, rope_args));
    if (!L.qkv_fused)
      RD_RETURN_IF_ERROR(backend_.kv_store(ctx, L.k_cache, L.v_cache, as_heads(k, KVH, D), as_heads(v, KVH, D),
                                           layer_slots));
    // With BF16 o_proj weights the attention writes o_proj's BF16 input itself (the same rounding
    // as a separate convert, one launch fewer).
    xd = L.o_proj.dtype == DType::kBF16 ? bf16_of(attn) : attn;
    AttentionOptions attn_opt;
    attn_opt.sinks = L.sinks;
    attn_opt.window = L.window;
    if (T <= ws_.attn_split_tokens) attn_opt.workspace = ws_.attn_split;
    RD_RETURN_IF_ERROR(backend_.paged_attention_ex(ctx, as_heads(xd, QH, D), as_heads(q, QH, D), L.k_cache,
                                                   L.v_cache, layer_tables, seq_of, ctx_len, scale, attn_opt));
    RD_RETURN_IF_ERROR(backend_.linear(ctx, o, xd, L.o_proj));
    // MoE block (or the dense MLP as one expert every token takes with weight 1): h += o (plus
    // o_proj's bias, gpt-oss: add_bias's arithmetic without its launch) and its norm in one
    // launch. The router reads x in FP32; the MXFP4 expert kernels take x rounded to BF16 (their
    // GEMM input), which the norm then writes in the same pass into x_bf16 (free once o_proj has
    // read it): the rounding the kernels would do themselves, one launch fewer.
    const bool experts_bf16 = L.moe && kernel_experts_;
    const TensorView x_experts = experts_bf16 ? bf16_of(x) : x;
    RD_RETURN_IF_ERROR(backend_.add_rmsnorm(ctx, x, experts_bf16 ? x_experts : TensorView{}, h, o, L.o_bias,
                                            L.post_attention_layernorm, eps));
    if (L.moe) {
      // Gate GEMM, bias and selection in one op (one launch on CUDA for decode steps). gpt-oss's
      // router (top-k of the logits, softmax over those k) is the softmax top-k with
      // renormalisation (its family sets norm_topk_prob): p_i / sum_k p_k = exp(l_i) / sum_k exp(l_k),
      // the same experts.
      RouterArgs ra;
      ra.ids = topk_ids;
      ra.weights = topk_w;
      ra.logits = router_logits;
      ra.x = x;
      ra.w = L.router;
      ra.bias = L.router_bias;  // empty without a router bias
      ra.renormalize = c.norm_topk_prob;
      RD_RETURN_IF_ERROR(backend_.router(ctx, ra));
      // The single capture point: logical ids straight from the router, into this layer's rows
      // of the record table; rows at or past the step's real count (read on the device) are
      // written -1, so padding is never recorded.
      if (record) {
        const TensorView layer_rows = TensorView::contiguous(
            static_cast<int32_t*>(routed_table_.data) + L.moe_index * limits_.max_tokens * K, DType::kI32,
            Shape{T, K}, routed_table_.device);
        RD_RETURN_IF_ERROR(backend_.copy_valid_rows(ctx, layer_rows, topk_ids, ws_.num_valid, -1));
      }
    }
    if (L.moe && kernel_experts_) {
      RD_RETURN_IF_ERROR(kernel_experts(ctx, L, x_experts, moe_out, topk_ids, topk_w, T));
      pending = moe_out;
      continue;
    }
    MoeExpertsArgs args;
    args.out = moe_out;
    args.x = x;
    args.w_gate_up = L.experts_gate_up;
    args.w_down = L.experts_down;
    args.topk_ids = L.moe ? topk_ids : rows_of(dense_ids_, T);
    args.topk_weights = L.moe ? topk_w : rows_of(dense_weights_, T);
    args.logical_to_physical = L.logical_to_physical;
    args.num_valid_tokens = T;
    args.num_valid_device = ws_.num_valid;  // padding rows of a bucket: no expert work
    args.workspace = ws_.moe_h;             // CUDA: the decode-shaped two-kernel path
    args.gate_up_interleaved = L.gate_up_interleaved;
    args.w_gate_up_blocks = L.gu_blocks;
    args.w_gate_up_scales = L.gu_scales;
    args.w_down_blocks = L.dn_blocks;
    args.w_down_scales = L.dn_scales;
    args.b_gate_up = L.experts_gate_up_bias;
    args.b_down = L.experts_down_bias;
    if (c.expert_activation == ExpertActivation::kClampedSwiGLU) {
      args.activation = MoeExpertsArgs::Activation::kGptOss;
      args.swiglu_limit = static_cast<float>(c.swiglu_limit);
      args.swiglu_alpha = static_cast<float>(c.swiglu_alpha);
    }
    RD_RETURN_IF_ERROR(backend_.moe_experts(ctx, args));
    pending = moe_out;
  }
  if (R == 0) return Status::Ok();  // nothing reads h after the last layer unless rows sample
  if (pending.data) RD_RETURN_IF_ERROR(backend_.add(ctx, h, h, pending));
  // Only the rows that sample need the final norm and the LM head: gather them first
  // (embedding is a row gather).
  const TensorView rows_idx = rows_of(ws_.logits_rows, R);
  const TensorView final_rows = rows_of(ws_.final_rows, R);
  const TensorView final_normed = rows_of(ws_.final_normed, R);
  const TensorView out_logits = rows_of(ws_.logits, R);
  RD_RETURN_IF_ERROR(backend_.embedding(ctx, final_rows, h, rows_idx));
  RD_RETURN_IF_ERROR(norm_for_dense(final_normed, final_rows, {}, final_norm_, lm_head_, xd));
  return backend_.linear(ctx, out_logits, xd, lm_head_);
}

Status MoeDecoder::kernel_experts(const ExecContext& ctx, const Layer& L, const TensorView& x, const TensorView& out,
                                  const TensorView& topk_ids, const TensorView& topk_w, int64_t T) {
  const auto& c = config_;
  moe::ExpertsArgs a;
  a.out = out;
  a.x = x;
  a.topk_ids = topk_ids;  // logical ids (recorded above); the remap happens inside the op
  a.topk_weights = topk_w;
  a.logical_to_physical = L.logical_to_physical;
  a.num_valid_tokens = T;
  a.num_valid_device = ws_.num_valid;  // padding rows of a bucket: no expert work, output 0
  a.weights.format = moe::WeightFormat::kMXFP4;
  a.weights.gate_up_order = L.gate_up_interleaved ? moe::GateUpOrder::kInterleaved : moe::GateUpOrder::kConcatenated;
  a.weights.gate_up = L.gu_blocks;
  a.weights.gate_up_scales = L.gu_kernel_scales;
  a.weights.down = L.dn_blocks;
  a.weights.down_scales = L.dn_kernel_scales;
  a.weights.gate_up_bias = L.experts_gate_up_bias;
  a.weights.down_bias = L.experts_down_bias;
  if (c.expert_activation == ExpertActivation::kClampedSwiGLU) {
    a.activation.kind = moe::ActivationKind::kGptOssSwiGLU;
    a.activation.limit = static_cast<float>(c.swiglu_limit);
    a.activation.alpha = static_cast<float>(c.swiglu_alpha);
  }
  // The CUDA kernels take BF16 or MXFP8 GEMM inputs (FP32 is the CPU reference's mode): x and the
  // SwiGLU output round to BF16, the FP32 accumulation and everything outside the op stay FP32.
  a.precision = moe::ActPrecision::kBF16;
  a.workspace = ws_.experts_ws;
  return moe::experts(ctx, a);
}

}  // namespace rolloutd::core
