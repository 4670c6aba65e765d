#include <algorithm>
// CUDA twins of the elementwise ops: embedding, rmsnorm, add, rope, kv_store, and the fused
// decoder ops add_rmsnorm and rope_qk.
// Index values live on the device and are not checked on the host (that would need a
// synchronisation): an embedding id outside [0, V) gives a zero row, a slot outside the
// cache is skipped. Nothing is ever read or written out of bounds.
#include "kernels/bf16.hpp"
#include "kernels/cpu/op_checks.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace rolloutd::cuda {
namespace {

constexpr int kThreads = 256;

// One block per token row; threads stride over the hidden dimension (coalesced).
__global__ void embedding_kernel(float* __restrict__ out, const float* __restrict__ table,
                                 const int32_t* __restrict__ ids, int64_t vocab,
                                 int64_t hidden) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  const bool valid = id >= 0 && id < vocab;
  float* orow = out + t * hidden;
  const float* trow = table + (valid ? static_cast<int64_t>(id) : 0) * hidden;
  for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) orow[c] = valid ? trow[c] : 0.0f;
}

// One block per row: sum of squares by a block reduction, then the scaled write. Every
// thread reads its elements before the reduction's barrier and writes the same elements
// after it, so `out` may alias `x`.
//
// The same kernel serves add_rmsnorm (kAdd: x += r, or x += (r + rb) with r's bias rb [hidden]
// when rb is not null, written back to x, before the sum of squares; kOut: write the f32 result;
// kBf16: write it rounded to BF16 as `convert` rounds): one template, so the fused op reduces in
// exactly rmsnorm's order.
template <bool kAdd, bool kOut, bool kBf16>
__global__ void rmsnorm_kernel(float* out, uint16_t* out_bf16, float* x, const float* r, const float* rb,
                               const float* __restrict__ w, int64_t hidden, float eps) {
  __shared__ float warp_partial[kThreads / 32];
  pdl_begin();
  const int64_t row = blockIdx.x;
  float* xr = x + row * hidden;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = xr[i];
    if constexpr (kAdd) {
      v = rb != nullptr ? v + (r[row * hidden + i] + rb[i]) : v + r[row * hidden + i];
      xr[i] = v;  // read back below by this thread alone
    }
    ss += v * v;
  }
  ss = warp_sum(ss);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_partial[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    ss = lane < kThreads / 32 ? warp_partial[lane] : 0.0f;
    ss = warp_sum(ss);
    if (lane == 0) warp_partial[0] = ss;
  }
  __syncthreads();
  const float inv = rsqrtf(warp_partial[0] / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float o = w[i] * (xr[i] * inv);
    if constexpr (kOut) out[row * hidden + i] = o;
    if constexpr (kBf16) out_bf16[row * hidden + i] = f32_to_bf16_bits(o);
  }
}

// The same op with the row held in registers as float4s (kPer per thread, blockDim.x threads, a
// multiple of 32): one read of x, every load of a thread issued before the first is used. The
// loop above issues one dependent-latency load per element pass, ~9 us per 2,880-wide row at
// one token (ncu). Needs hidden % 4 == 0, 16-byte aligned rows and hidden / 4 <= kPer * blockDim.x
// (and an 8-byte aligned out_bf16 for kBf16). kAdd / kOut / kBf16 as rmsnorm_kernel's: the residual
// add joins the load, the BF16 rounding the store, and the reduction is rmsnorm's own.
template <int kPer, bool kAdd, bool kOut, bool kBf16>
__global__ void rmsnorm_vec_kernel(float* out, uint16_t* out_bf16, float* x, const float* r, const float* rb,
                                   const float* __restrict__ w, int64_t hidden, float eps) {
  __shared__ float warp_partial[32];
  pdl_begin();
  const int64_t row = blockIdx.x;
  const int n4 = static_cast<int>(hidden / 4);
  float4* xr = reinterpret_cast<float4*>(x + row * hidden);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4 v[kPer], g[kPer];
  // Every load (x, the residual and its bias, the norm weight) before the first store: a load
  // after a store to x or out, which may alias r, rb or w as far as the compiler knows, would wait
  // for that store and serialize one global round trip per float4.
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    v[i] = idx < n4 ? xr[idx] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    g[i] = idx < n4 ? __ldg(w4 + idx) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if constexpr (kAdd) {
    const float4* rr = reinterpret_cast<const float4*>(r + row * hidden);
    float4 b[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + i * blockDim.x;
      b[i] = idx < n4 ? rr[idx] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (rb != nullptr) {  // add_bias's rounding first
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        if (idx >= n4) continue;
        const float4 c = reinterpret_cast<const float4*>(rb)[idx];
        b[i] = make_float4(b[i].x + c.x, b[i].y + c.y, b[i].z + c.z, b[i].w + c.w);
      }
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + i * blockDim.x;
      if (idx >= n4) continue;
      v[i] = make_float4(v[i].x + b[i].x, v[i].y + b[i].y, v[i].z + b[i].z, v[i].w + b[i].w);  // add's one rounding
      xr[idx] = v[i];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
  ss = warp_sum(ss);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) warp_partial[warp] = ss;
  __syncthreads();  // every thread has read its x before any writes out (out may alias x)
  float total = 0.0f;
  for (int i = 0; i < warps; ++i) total += warp_partial[i];
  const float inv = rsqrtf(total / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    if (idx >= n4) continue;
    const float4 o = make_float4(g[i].x * (v[i].x * inv), g[i].y * (v[i].y * inv), g[i].z * (v[i].z * inv),
                                 g[i].w * (v[i].w * inv));
    if constexpr (kOut) reinterpret_cast<float4*>(out + row * hidden)[idx] = o;
    if constexpr (kBf16) {
      const uint2 packed = make_uint2(
          static_cast<uint32_t>(f32_to_bf16_bits(o.x)) | (static_cast<uint32_t>(f32_to_bf16_bits(o.y)) << 16),
          static_cast<uint32_t>(f32_to_bf16_bits(o.z)) | (static_cast<uint32_t>(f32_to_bf16_bits(o.w)) << 16));
      reinterpret_cast<uint2*>(out_bf16 + row * hidden)[idx] = packed;  // little-endian: .x first
    }
  }
}

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

// out = a + (b + bias[column]) over rows of `cols`: add_bias on b, then add, without writing b.
__global__ void add_biased_kernel(float* out, const float* a, const float* b, const float* __restrict__ bias,
                                  int64_t cols, int64_t n) {
  pdl_begin();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + (b[i] + bias[i % cols]);
}

// One thread per (token, head, pair). The frequency is computed in double and rounded
// once to float, exactly as the CPU reference does, so both rotate by the same angle.
__global__ void rope_kernel(float* x, const int32_t* __restrict__ positions, int64_t heads,
                            int64_t head_dim, float theta, int64_t total_pairs) {
  const int64_t half = head_dim / 2;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       idx < total_pairs; idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t th = idx / half;  // t * heads + h
    const int64_t t = th / heads;
    const float inv_freq = static_cast<float>(
        1.0 / pow(static_cast<double>(theta),
                  2.0 * static_cast<double>(i) / static_cast<double>(head_dim)));
    const float angle = static_cast<float>(positions[t]) * inv_freq;
    const float c = cosf(angle), s = sinf(angle);
    float* row = x + th * head_dim;
    const float x1 = row[i], x2 = row[i + half];
    row[i] = x1 * c - x2 * s;
    row[i + half] = x2 * c + x1 * s;
  }
}

// One value into a KV cache at element i: FP32 as it is, or BF16 rounded to nearest even (the
// CPU's kv_store rounding, kernels/bf16.hpp).
__device__ __forceinline__ void cache_put(void* cache, bool bf16, int64_t i, float v) {
  if (bf16) static_cast<uint16_t*>(cache)[i] = f32_to_bf16_bits(v);
  else static_cast<float*>(cache)[i] = v;
}

__global__ void kv_store_kernel(void* __restrict__ k_cache, void* __restrict__ v_cache, bool bf16,
                                const float* __restrict__ k, const float* __restrict__ v,
                                const int32_t* __restrict__ slots, int64_t num_slots,
                                int64_t row) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0 || slot >= num_slots) return;  // padding (or a bad slot: skipped)
  for (int64_t c = threadIdx.x; c < row; c += blockDim.x) {
    cache_put(k_cache, bf16, slot * row + c, k[t * row + c]);
    cache_put(v_cache, bf16, slot * row + c, v[t * row + c]);
  }
}

}  // namespace

// dst[t, c] = t < *count ? src[t, c] : fill; the count is clamped to [0, rows] on the device.
__global__ void copy_valid_rows_kernel(int32_t* __restrict__ dst, const int32_t* __restrict__ src,
                                       const int32_t* __restrict__ count, int64_t rows, int64_t cols,
                                       int32_t fill) {
  pdl_begin();
  int64_t n = *count;
  n = n < 0 ? 0 : (n > rows ? rows : n);
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = i / cols < n ? src[i] : fill;
}

Status copy_valid_rows(const ExecContext& ctx, TensorView dst, TensorView src, TensorView count, int32_t fill) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::copy_valid_rows(ctx, dst, src, count));
  const int64_t total = src.numel();
  if (total == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  (void)launch_dependent(copy_valid_rows_kernel, blocks_for(total, kThreads, 1024), kThreads, 0, stream_of(ctx),
                         dst.as<int32_t>(), src.as<const int32_t>(), count.as<const int32_t>(), src.size(0),
                         src.size(1), fill);
  RD_CUDA_CHECK_LAUNCH("copy_valid_rows_kernel");
  return Status::Ok();
}

Status embedding(const ExecContext& ctx, TensorView out, TensorView table, TensorView ids) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::embedding(ctx, out, table, ids));
  const int64_t num_tokens = ids.size(0);
  if (num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  (void)launch_dependent(embedding_kernel, static_cast<unsigned int>(num_tokens), kThreads, 0, stream_of(ctx),
                         out.as<float>(), table.as<const float>(), ids.as<const int32_t>(), table.size(0),
                         table.size(1));
  RD_CUDA_CHECK_LAUNCH("embedding_kernel");
  return Status::Ok();
}

namespace {
template <bool A, bool O, bool B>
struct RmsFlags {
  static constexpr bool kAdd = A, kOut = O, kBf16 = B;
};

// rmsnorm and add_rmsnorm: rows of `hidden` floats in x (updated in place by x += r when r is
// given), out and out_bf16 each optional. The register kernel when the row fits it (float4s
// rounded up to a warp, at most 256 threads, then 1-8 float4s per thread), the loop otherwise.
template <bool kAdd, bool kOut, bool kBf16>
void launch_rmsnorm(cudaStream_t stream, float* out, uint16_t* out_bf16, float* x, const float* r, const float* rb,
                    const float* w, int64_t rows, int64_t hidden, float eps) {
  const auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  const int64_t n4 = hidden / 4;
  if (hidden % 4 == 0 && aligned(out, 16) && aligned(x, 16) && aligned(r, 16) && aligned(rb, 16) &&
      aligned(w, 16) && aligned(out_bf16, 8) && n4 <= 8 * 256) {
    const int threads = static_cast<int>(std::min<int64_t>(256, (n4 + 31) / 32 * 32));
    const int64_t per = (n4 + threads - 1) / threads;
    const auto launch = [&](auto kernel) {
      (void)launch_dependent(kernel, static_cast<unsigned int>(rows), threads, 0, stream, out, out_bf16, x, r, rb,
                             w, hidden, eps);
    };
    if (per <= 1) launch(rmsnorm_vec_kernel<1, kAdd, kOut, kBf16>);
    else if (per <= 2) launch(rmsnorm_vec_kernel<2, kAdd, kOut, kBf16>);
    else if (per <= 4) launch(rmsnorm_vec_kernel<4, kAdd, kOut, kBf16>);
    else launch(rmsnorm_vec_kernel<8, kAdd, kOut, kBf16>);
    return;
  }
  (void)launch_dependent(rmsnorm_kernel<kAdd, kOut, kBf16>, static_cast<unsigned int>(rows), kThreads, 0, stream, out,
                         out_bf16, x, r, rb, w, hidden, eps);
}
}  // namespace

Status rmsnorm(const ExecContext& ctx, TensorView out, TensorView x, TensorView w, float eps) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::rmsnorm(ctx, out, x, w, eps));
  const int64_t hidden = x.size(x.rank() - 1);
  const int64_t rows = x.numel() / hidden;
  if (rows == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  // x is only read (kAdd off).
  launch_rmsnorm<false, true, false>(stream_of(ctx), out.as<float>(), nullptr, x.as<float>(), nullptr, nullptr,
                                     w.as<const float>(), rows, hidden, eps);
  RD_CUDA_CHECK_LAUNCH("rmsnorm");
  return Status::Ok();
}

Status add_rmsnorm(const ExecContext& ctx, TensorView out, TensorView out_bf16, TensorView h, TensorView r,
                   TensorView r_bias, TensorView w, float eps) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::add_rmsnorm(ctx, out, out_bf16, h, r, r_bias, w, eps));
  const float* rb = r_bias.data != nullptr ? r_bias.as<const float>() : nullptr;
  const int64_t hidden = h.size(h.rank() - 1);
  const int64_t rows = h.numel() / hidden;
  const bool add = r.data != nullptr, f32 = out.data != nullptr, bf16 = out_bf16.data != nullptr;
  if (rows == 0 || (!add && !f32 && !bf16)) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const auto launch = [&](auto kernel_flags) {
    using F = decltype(kernel_flags);
    launch_rmsnorm<F::kAdd, F::kOut, F::kBf16>(stream_of(ctx), out.as<float>(), out_bf16.as<uint16_t>(),
                                               h.as<float>(), r.as<const float>(), rb, w.as<const float>(), rows,
                                               hidden, eps);
  };
  // Runtime flags to template parameters; every combination the contract allows.
  const int which = (add ? 4 : 0) | (f32 ? 2 : 0) | (bf16 ? 1 : 0);
  switch (which) {
    case 1: launch(RmsFlags<false, false, true>{}); break;
    case 2: launch(RmsFlags<false, true, false>{}); break;
    case 3: launch(RmsFlags<false, true, true>{}); break;
    case 4:  // no output: the add alone
      if (rb != nullptr)
        (void)launch_dependent(add_biased_kernel, blocks_for(h.numel(), kThreads), kThreads, 0, stream_of(ctx),
                               h.as<float>(), h.as<const float>(), r.as<const float>(), rb, hidden, h.numel());
      else
        (void)launch_dependent(add_kernel, blocks_for(h.numel(), kThreads), kThreads, 0, stream_of(ctx), h.as<float>(),
                               h.as<const float>(), r.as<const float>(), h.numel());
      break;
    case 5: launch(RmsFlags<true, false, true>{}); break;
    case 6: launch(RmsFlags<true, true, false>{}); break;
    default: launch(RmsFlags<true, true, true>{}); break;
  }
  RD_CUDA_CHECK_LAUNCH("add_rmsnorm");
  return Status::Ok();
}

Status add(const ExecContext& ctx, TensorView out, TensorView a, TensorView b) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::add(ctx, out, a, b));
  const int64_t n = a.numel();
  if (n == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  (void)launch_dependent(add_kernel, blocks_for(n, kThreads), kThreads, 0, stream_of(ctx), out.as<float>(),
                         a.as<const float>(), b.as<const float>(), n);
  RD_CUDA_CHECK_LAUNCH("add_kernel");
  return Status::Ok();
}

Status rope(const ExecContext& ctx, TensorView x, TensorView positions, float theta) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::rope(ctx, x, positions, theta));
  const int64_t total_pairs = x.numel() / 2;
  if (total_pairs == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  rope_kernel<<<blocks_for(total_pairs, kThreads), kThreads, 0, stream_of(ctx)>>>(
      x.as<float>(), positions.as<const int32_t>(), x.size(1), x.size(2), theta, total_pairs);
  RD_CUDA_CHECK_LAUNCH("rope_kernel");
  return Status::Ok();
}

Status kv_store(const ExecContext& ctx, TensorView k_cache, TensorView v_cache, TensorView k,
                TensorView v, TensorView slot_mapping) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::kv_store(ctx, k_cache, v_cache, k, v, slot_mapping));
  const int64_t num_tokens = k.size(0);
  if (num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  (void)launch_dependent(
      kv_store_kernel, static_cast<unsigned int>(num_tokens), kThreads, 0, stream_of(ctx),
      k_cache.data, v_cache.data, k_cache.dtype == DType::kBF16, k.as<const float>(), v.as<const float>(),
      slot_mapping.as<const int32_t>(), k_cache.size(0) * k_cache.size(1),
      k_cache.size(2) * k_cache.size(3));
  RD_CUDA_CHECK_LAUNCH("kv_store_kernel");
  return Status::Ok();
}

// ---- dtype conversion (device-resident checkpoint tensors) ----
namespace {
__global__ void bf16_to_f32_kernel(float* __restrict__ dst, const uint16_t* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}
__global__ void f32_to_bf16_kernel(uint16_t* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = f32_to_bf16_bits(src[i]);  // kernels/bf16.hpp: the CPU's rounding, bit for bit
}
}  // namespace

Status convert(const ExecContext& ctx, void* dst, DType dt, const void* src, DType st, size_t n) {
  if (ctx.device.kind != DeviceKind::kCuda)
    return Status(ErrorCode::kInvalidArgument, "CUDA convert with a non-CUDA context", "ctx");
  if (n == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr)
    return Status(ErrorCode::kInvalidArgument, "null pointer", dst == nullptr ? "dst" : "src");
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  cudaStream_t stream = static_cast<cudaStream_t>(ctx.stream);
  const int64_t count = static_cast<int64_t>(n);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((count + kThreads - 1) / kThreads, 65535 * 8));
  if (dt == st) {
    RD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * dtype_size(dt), cudaMemcpyDeviceToDevice, stream));
  } else if (dt == DType::kF32 && st == DType::kBF16) {
    bf16_to_f32_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(dst), static_cast<const uint16_t*>(src), count);
    RD_CUDA_CHECK_LAUNCH("bf16_to_f32_kernel");
  } else if (dt == DType::kBF16 && st == DType::kF32) {
    f32_to_bf16_kernel<<<grid, kThreads, 0, stream>>>(static_cast<uint16_t*>(dst), static_cast<const float*>(src), count);
    RD_CUDA_CHECK_LAUNCH("f32_to_bf16_kernel");
  } else {
    return Status(ErrorCode::kInvalidArgument, "unsupported conversion", "dst_dtype");
  }
  return Status::Ok();
}

// ---- gpt-oss ops: rotary from a frequency table, bias add, transpose ----
namespace {
__global__ void rope_table_kernel(float* x, const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
                                  int64_t heads, int64_t head_dim, float scale, int64_t total_pairs) {
  const int64_t half = head_dim / 2;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total_pairs;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t th = idx / half;  // t * heads + h
    const float angle = static_cast<float>(positions[th / heads]) * inv_freq[i];
    const float c = cosf(angle) * scale, s = sinf(angle) * scale;
    float* row = x + th * head_dim;
    const float x1 = row[i], x2 = row[i + half];
    row[i] = x1 * c - x2 * s;
    row[i + half] = x2 * c + x1 * s;
  }
}

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t n, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += bias[i % n];
}

// 32 x 32 tiles through shared memory (one padding column against bank conflicts): reads of src
// rows and writes of dst rows are both coalesced. grid: (C tiles, R tiles, B).
template <typename T>
__global__ void transpose_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t rows, int64_t cols) {
  __shared__ T tile[32][33];
  const int64_t b = blockIdx.z;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * 32, r0 = static_cast<int64_t>(blockIdx.y) * 32;
  const T* s = src + b * rows * cols;
  T* d = dst + b * rows * cols;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = s[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) d[c * rows + r] = tile[threadIdx.x][i];
  }
}
}  // namespace

Status rope_table(const ExecContext& ctx, TensorView x, TensorView positions, TensorView inv_freq, float scale) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::rope_table(ctx, x, positions, inv_freq, scale));
  const int64_t total_pairs = x.numel() / 2;
  if (total_pairs == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  rope_table_kernel<<<blocks_for(total_pairs, kThreads), kThreads, 0, stream_of(ctx)>>>(
      x.as<float>(), positions.as<const int32_t>(), inv_freq.as<const float>(), x.size(1), x.size(2), scale,
      total_pairs);
  RD_CUDA_CHECK_LAUNCH("rope_table_kernel");
  return Status::Ok();
}

namespace {
// rope_qk: one warp per (token, head) row of q then k (q's heads first for each token), rows by
// grid stride. kNorm: the head's RMSNorm first (a warp reduction over its D values; each lane
// reads, normalises, rotates and writes only its own pairs, so in place is safe); kTable: the
// frequencies from inv_freq, else theta^(-2i/D) as rope_kernel computes it. The rotation is
// rope_kernel's / rope_table_kernel's arithmetic.
constexpr int kRopeWarps = 4;

template <bool kNorm, bool kTable>
// With qkv (the fused projection, rows q | k | v), q and k rows are read from it, and v's rows
// (heads q_heads + kv_heads ..) are copied from it to v. With slots (and the caches), every k and
// v row is also written at its token's cache slot: kv_store in the same launch.
__global__ void rope_qk_kernel(float* q, float* k, const int32_t* __restrict__ positions,
                               const float* __restrict__ inv_freq, const float* __restrict__ q_norm,
                               const float* __restrict__ k_norm, int64_t num_tokens, int64_t q_heads,
                               int64_t kv_heads, int64_t head_dim, float theta, float scale, float eps,
                               const float* __restrict__ qkv, float* __restrict__ v, const float* __restrict__ q_bias,
                               const float* __restrict__ k_bias, const float* __restrict__ v_bias,
                               void* __restrict__ k_cache, void* __restrict__ v_cache, bool cache_bf16,
                               const int32_t* __restrict__ slots, int64_t num_slots) {
  pdl_begin();
  const int64_t half = head_dim / 2, rot_heads = q_heads + kv_heads;
  const int64_t heads = rot_heads + (qkv != nullptr ? kv_heads : 0), total = num_tokens * heads;
  const int64_t width = (q_heads + 2 * kv_heads) * head_dim;
  const int lane = threadIdx.x & 31;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRopeWarps + (threadIdx.x >> 5); row < total;
       row += static_cast<int64_t>(gridDim.x) * kRopeWarps) {  // warp-uniform: whole warps loop
    const int64_t t = row / heads, h = row % heads;
    // With the caches: the token's k and v head rows at its slot too (kv_store_kernel's rule: a
    // slot outside [0, num_slots) is not written).
    int64_t slot = -1;
    if (slots != nullptr && h >= q_heads) {
      slot = slots[t];
      if (slot >= num_slots) slot = -1;
    }
    if (h >= rot_heads) {  // a v head: copied as it is
      const float* src = qkv + t * width + h * head_dim;
      float* dst = v + (t * kv_heads + (h - rot_heads)) * head_dim;
      const int64_t cbase = slot >= 0 ? (slot * kv_heads + (h - rot_heads)) * head_dim : -1;
      const float* vb = v_bias != nullptr ? v_bias + (h - rot_heads) * head_dim : nullptr;
      for (int64_t i = lane; i < head_dim; i += 32) {
        const float val = vb != nullptr ? src[i] + vb[i] : src[i];
        dst[i] = val;
        if (cbase >= 0) cache_put(v_cache, cache_bf16, cbase + i, val);
      }
      continue;
    }
    const bool is_q = h < q_heads;
    float* x = is_q ? q + (t * q_heads + h) * head_dim : k + (t * kv_heads + (h - q_heads)) * head_dim;
    const float* in = qkv != nullptr ? qkv + t * width + h * head_dim : x;
    // The projection's bias (fused form only), added as add_bias would before anything else.
    const float* b = q_bias == nullptr ? nullptr
                     : is_q            ? q_bias + h * head_dim
                                       : k_bias + (h - q_heads) * head_dim;
    const auto at = [&](int64_t i) { return b != nullptr ? in[i] + b[i] : in[i]; };
    float inv = 1.0f;
    if constexpr (kNorm) {
      float ss = 0.0f;
      for (int64_t i = lane; i < half; i += 32) {
        const float u1 = at(i), u2 = at(i + half);
        ss += u1 * u1 + u2 * u2;
      }
      ss = warp_sum(ss);
      inv = rsqrtf(ss / static_cast<float>(head_dim) + eps);
    }
    const float* w = is_q ? q_norm : k_norm;
    const int64_t kbase = !is_q && slot >= 0 ? (slot * kv_heads + (h - q_heads)) * head_dim : -1;
    const float p = static_cast<float>(positions[t]);
    for (int64_t i = lane; i < half; i += 32) {
      float x1 = at(i), x2 = at(i + half);
      if constexpr (kNorm) {
        x1 = w[i] * (x1 * inv);
        x2 = w[i + half] * (x2 * inv);
      }
      float f;
      if constexpr (kTable) {
        f = inv_freq[i];
      } else {
        f = static_cast<float>(
            1.0 / pow(static_cast<double>(theta), 2.0 * static_cast<double>(i) / static_cast<double>(head_dim)));
      }
      const float angle = p * f;
      const float c = cosf(angle) * scale, s = sinf(angle) * scale;
      const float y1 = x1 * c - x2 * s, y2 = x2 * c + x1 * s;
      x[i] = y1;
      x[i + half] = y2;
      if (kbase >= 0) {
        cache_put(k_cache, cache_bf16, kbase + i, y1);
        cache_put(k_cache, cache_bf16, kbase + i + half, y2);
      }
    }
  }
}
}  // namespace

Status rope_qk(const ExecContext& ctx, const RopeQkArgs& a) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::rope_qk(ctx, a));
  const int64_t rows = a.q.size(0) * (a.q.size(1) + a.k.size(1) * (a.qkv.data != nullptr ? 2 : 1));
  if (rows == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const bool norm = a.q_norm.data != nullptr, table = a.inv_freq.data != nullptr;
  const auto launch = [&](auto kernel) {
    (void)launch_dependent(
        kernel, blocks_for(rows, kRopeWarps), kRopeWarps * 32, 0, stream_of(ctx), a.q.as<float>(), a.k.as<float>(),
        a.positions.as<const int32_t>(), a.inv_freq.as<const float>(),
        a.q_norm.as<const float>(), a.k_norm.as<const float>(), a.q.size(0), a.q.size(1), a.k.size(1), a.q.size(2),
        a.theta, a.scale, a.eps, a.qkv.as<const float>(), a.v.as<float>(), a.q_bias.as<const float>(),
        a.k_bias.as<const float>(), a.v_bias.as<const float>(), a.k_cache.data, a.v_cache.data,
        a.k_cache.dtype == DType::kBF16,
        a.slot_mapping.as<const int32_t>(), a.k_cache.data != nullptr ? a.k_cache.size(0) * a.k_cache.size(1) : 0);
  };
  if (norm && table) launch(rope_qk_kernel<true, true>);
  else if (norm) launch(rope_qk_kernel<true, false>);
  else if (table) launch(rope_qk_kernel<false, true>);
  else launch(rope_qk_kernel<false, false>);
  RD_CUDA_CHECK_LAUNCH("rope_qk_kernel");
  return Status::Ok();
}

Status add_bias(const ExecContext& ctx, TensorView y, TensorView bias) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::add_bias(ctx, y, bias));
  const int64_t total = y.numel();
  if (total == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  add_bias_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream_of(ctx)>>>(y.as<float>(), bias.as<const float>(),
                                                                             bias.size(0), total);
  RD_CUDA_CHECK_LAUNCH("add_bias_kernel");
  return Status::Ok();
}

Status transpose(const ExecContext& ctx, TensorView dst, TensorView src) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::transpose(ctx, dst, src));
  const int rank = src.rank();
  const int64_t batch = rank == 3 ? src.size(0) : 1, rows = src.size(rank - 2), cols = src.size(rank - 1);
  if (src.numel() == 0) return Status::Ok();
  if (batch > 65535 || (rows + 31) / 32 > 65535)
    return Status(ErrorCode::kUnimplemented, "transpose grid too large", "src");
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32),
                  static_cast<unsigned>(batch));
  const dim3 block(32, 8);
  if (dtype_size(src.dtype) == 4)
    transpose_kernel<uint32_t><<<grid, block, 0, stream_of(ctx)>>>(dst.as<uint32_t>(), src.as<const uint32_t>(), rows, cols);
  else
    transpose_kernel<uint16_t><<<grid, block, 0, stream_of(ctx)>>>(dst.as<uint16_t>(), src.as<const uint16_t>(), rows, cols);
  RD_CUDA_CHECK_LAUNCH("transpose_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
