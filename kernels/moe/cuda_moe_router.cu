// CUDA twins of the routers (cpu_moe_router.cpp is the reference): one warp per token. Each
// lane scores experts e = lane, lane + 32, ... into the warp's shared-memory slice; the k picks
// are k rounds of a warp arg-max over (value desc, id asc), each round taking the best expert
// ranked strictly after the previous pick (a total order, so no "taken" set is needed). Grouped
// selection picks topk_group groups the same way; an expert is eligible when its group ranks
// at or before the last picked group. Lane 0 then writes the k weights in k order, with the
// same scalar functions as the CPU (moe_math.hpp).
//
// Hash routing: a token id outside the table, or a table entry outside [0, E), yields id -1 and
// weight 0 (the CPU reference rejects the call instead; the device cannot without a sync).
#include <climits>
#include <string>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/moe/moe_math.hpp"
#include "kernels/moe/moe_plan.hpp"

namespace rolloutd::moe::detail {
namespace {

using cuda::DeviceGuard;
using cuda::stream_of;

constexpr int kWarps = 4;

// Floats of one warp's slice: rank[E], value/score[E], group scores[n_group].
__host__ __device__ inline int64_t slice_floats(int64_t e, int ng) { return 2 * e + ng; }

struct Best {
  float v;
  int id;
};

// The best (v, id) over the warp; id -1 when no lane had a candidate.
__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b.v, offset);
    const int oid = __shfl_xor_sync(0xffffffffu, b.id, offset);
    if (oid >= 0 && (b.id < 0 || math::ranks_before(ov, oid, b.v, b.id))) {
      b.v = ov;
      b.id = oid;
    }
  }
  return b;
}

// Maximum of v over the warp ignoring NaN (the CPU's `if (v > m) m = v`), and the sum of
// exp(v - max) (NaN if any v is NaN, as on the CPU).
__device__ __forceinline__ float warp_max_not_nan(float m) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, m, offset);
    if (o > m) m = o;
  }
  return m;
}

__device__ __forceinline__ float score_of(ScoreFunc f, float v) {
  return f == ScoreFunc::kSigmoid ? math::sigmoid(v) : math::sqrt_softplus(v);
}

__global__ void __launch_bounds__(kWarps * 32) router_kernel(const RouterPlan p) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (t >= p.num_tokens) return;  // whole warp
  const int num_e = static_cast<int>(p.num_experts);
  const int k = p.top_k;
  const RouterParams& prm = p.params;
  const RouterKind kind = prm.kind;
  const bool biased =
      kind == RouterKind::kSigmoidGroupedTopK || kind == RouterKind::kSqrtSoftplusTopK;
  const int ng = biased && prm.n_group > 1 ? prm.n_group : 1;
  float* rank = smem + static_cast<int64_t>(warp) * slice_floats(num_e, ng);
  float* val = rank + num_e;  // logits (+ bias), or the unbiased scores of the biased kinds
  float* gscore = val + num_e;
  const float* l = p.logits + t * num_e;
  int32_t* ids = p.ids + t * k;
  float* w = p.weights + t * k;

  const ScoreFunc f = kind == RouterKind::kSigmoidGroupedTopK ? ScoreFunc::kSigmoid
                                                               : ScoreFunc::kSqrtSoftplus;
  for (int e = lane; e < num_e; e += 32) {
    float v = l[e];
    if (p.logit_bias) v = math::add(v, p.logit_bias[e]);
    if (biased) {
      const float s = score_of(f, v);
      val[e] = s;
      rank[e] = math::rank_value(p.correction_bias ? math::add(s, p.correction_bias[e]) : s);
    } else {
      val[e] = v;
      rank[e] = math::rank_value(v);
    }
  }
  __syncwarp();

  // Softmax statistics (kSoftmaxTopK, and kHash scored by softmax).
  float m = -INFINITY, sum = 0.0f;
  if (kind == RouterKind::kSoftmaxTopK ||
      (kind == RouterKind::kHash && prm.hash_score == ScoreFunc::kSoftmax)) {
    for (int e = lane; e < num_e; e += 32)
      if (val[e] > m) m = val[e];
    m = warp_max_not_nan(m);
    for (int e = lane; e < num_e; e += 32) sum = math::add(sum, math::exp(math::sub(val[e], m)));
    sum = cuda::warp_sum(sum);
  }

  if (kind == RouterKind::kHash) {
    if (lane != 0) return;
    const int32_t tok = p.token_ids[t];
    const bool tok_ok = tok >= 0 && tok < p.vocab;
    for (int j = 0; j < k; ++j) {
      const int32_t id = tok_ok ? p.tid2eid[static_cast<int64_t>(tok) * k + j] : -1;
      const bool ok = id >= 0 && id < num_e;
      ids[j] = ok ? id : -1;
      float x = 0.0f;
      if (ok)
        x = prm.hash_score == ScoreFunc::kSoftmax ? math::div(math::exp(math::sub(val[id], m)), sum)
                                                   : score_of(prm.hash_score, val[id]);
      w[j] = x;
    }
    math::normalize_and_scale(w, k, prm.renormalize, prm.routed_scaling_factor);
    return;
  }

  // Grouped selection: the threshold (last picked group) decides eligibility.
  float gate_v = 0.0f;
  int gate_g = -1;
  int group_size = num_e;
  if (ng > 1) {
    group_size = num_e / ng;
    for (int g = lane; g < ng; g += 32) {
      float r1 = -INFINITY, r2 = -INFINITY;
      for (int i = 0; i < group_size; ++i) {
        const float r = rank[g * group_size + i];
        if (r > r1) {
          r2 = r1;
          r1 = r;
        } else if (r > r2) {
          r2 = r;
        }
      }
      gscore[g] = math::rank_value(group_size >= 2 ? math::add(r1, r2) : r1);
    }
    __syncwarp();
    for (int j = 0; j < prm.topk_group; ++j) {
      Best b{-INFINITY, -1};
      for (int g = lane; g < ng; g += 32) {
        const float v = gscore[g];
        if (gate_g >= 0 && !math::ranks_before(gate_v, gate_g, v, g)) continue;
        if (b.id < 0 || math::ranks_before(v, g, b.v, b.id)) b = Best{v, g};
      }
      b = warp_best(b);
      if (b.id < 0) break;
      gate_v = b.v;
      gate_g = b.id;
    }
  }

  float prev_v = 0.0f;
  int prev = -1;
  for (int j = 0; j < k; ++j) {
    Best b{-INFINITY, -1};
    for (int e = lane; e < num_e; e += 32) {
      if (gate_g >= 0) {
        const int g = e / group_size;
        if (g != gate_g && !math::ranks_before(gscore[g], g, gate_v, gate_g)) continue;
      }
      const float v = rank[e];
      if (prev >= 0 && !math::ranks_before(prev_v, prev, v, e)) continue;
      if (b.id < 0 || math::ranks_before(v, e, b.v, b.id)) b = Best{v, e};
    }
    b = warp_best(b);
    if (b.id < 0) break;  // unreachable: K is host-checked against the eligible experts
    prev_v = b.v;
    prev = b.id;
    if (lane == 0) ids[j] = b.id;
  }
  if (lane != 0) return;

  switch (kind) {
    case RouterKind::kSoftmaxTopK: {
      float picked = 0.0f;
      for (int j = 0; j < k; ++j) {
        w[j] = math::div(math::exp(math::sub(val[ids[j]], m)), sum);
        picked = math::add(picked, w[j]);
      }
      if (prm.renormalize)
        for (int j = 0; j < k; ++j) w[j] = math::div(w[j], picked);
      break;
    }
    case RouterKind::kTopKSoftmax: {
      const float m0 = val[ids[0]];
      float s = 0.0f;
      for (int j = 0; j < k; ++j) {
        w[j] = math::exp(math::sub(val[ids[j]], m0));
        s = math::add(s, w[j]);
      }
      for (int j = 0; j < k; ++j) w[j] = math::div(w[j], s);
      break;
    }
    default:  // biased kinds
      for (int j = 0; j < k; ++j) w[j] = val[ids[j]];
      math::normalize_and_scale(w, k, prm.renormalize, prm.routed_scaling_factor);
      break;
  }
}

}  // namespace

Status cuda_route(const ExecContext& ctx, const RouterPlan& p) {
  if (p.num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const bool biased = p.params.kind == RouterKind::kSigmoidGroupedTopK ||
                      p.params.kind == RouterKind::kSqrtSoftplusTopK;
  const int ng = biased && p.params.n_group > 1 ? p.params.n_group : 1;
  const size_t smem = static_cast<size_t>(kWarps * slice_floats(p.num_experts, ng)) * sizeof(float);
  int smem_limit = 0;
  RD_CUDA_CHECK(cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                       ctx.device.index));
  if (smem > static_cast<size_t>(smem_limit))
    return Status(ErrorCode::kUnimplemented,
                  std::to_string(p.num_experts) + " experts exceed the router's shared memory",
                  "logits");
  if (smem > 48 * 1024)
    RD_CUDA_CHECK(cudaFuncSetAttribute(router_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  const int64_t blocks = (p.num_tokens + kWarps - 1) / kWarps;
  if (blocks > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "too many tokens for one router launch", "logits");
  router_kernel<<<static_cast<unsigned int>(blocks), kWarps * 32, smem, stream_of(ctx)>>>(p);
  RD_CUDA_CHECK_LAUNCH("router_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::moe::detail
