// The CPU backend: FP32 reference for every op, and the memory ops of the host.
// Elementwise ops and `linear` live here; attention and the MoE ops in their own files.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/bf16.hpp"
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/cpu_sampling.hpp"
#include "kernels/cpu/op_checks.hpp"

namespace rolloutd {
namespace cpu {
namespace {

constexpr size_t kAlignment = 64;  // a cache line, and enough for any SIMD load

Status check_ctx(const ExecContext& ctx) { return op_checks::context(ctx, DeviceKind::kCpu); }

Status alloc(const ExecContext& ctx, size_t bytes, void** out) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (out == nullptr) return Status(ErrorCode::kInvalidArgument, "null output pointer", "out");
  *out = nullptr;
  if (bytes == 0) return Status::Ok();
  // aligned_alloc requires a size that is a multiple of the alignment.
  if (bytes > SIZE_MAX - kAlignment)
    return Status(ErrorCode::kResourceExhausted, "allocation size overflows", "bytes");
  const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  *out = std::aligned_alloc(kAlignment, rounded);
  if (*out == nullptr)
    return Status(ErrorCode::kResourceExhausted,
                  "host allocation of " + std::to_string(bytes) + " bytes failed", "bytes");
  return Status::Ok();
}

Status free_mem(const ExecContext& ctx, void* ptr) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  std::free(ptr);
  return Status::Ok();
}

Status copy(const ExecContext& ctx, void* dst, const void* src, size_t bytes, CopyKind kind) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (kind != CopyKind::kHostToHost)
    return Status(ErrorCode::kInvalidArgument, "the CPU backend copies host to host only",
                  "kind");
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr)
    return Status(ErrorCode::kInvalidArgument, "null pointer in a copy of " +
                                                   std::to_string(bytes) + " bytes",
                  dst == nullptr ? "dst" : "src");
  std::memmove(dst, src, bytes);  // memmove: overlapping ranges stay defined
  return Status::Ok();
}

Status synchronize(const ExecContext& ctx) { return check_ctx(ctx); }

}  // namespace

Status embedding(const ExecContext& ctx, TensorView out, TensorView table, TensorView ids) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::embedding(ctx, out, table, ids));
  const int64_t num_tokens = ids.size(0), vocab = table.size(0), hidden = table.size(1);
  const int32_t* id = ids.as<const int32_t>();
  // Every id first: a bad one leaves `out` untouched.
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (id[t] < 0 || id[t] >= vocab)
      return Status(ErrorCode::kOutOfRange,
                    "token id " + std::to_string(id[t]) + " at row " + std::to_string(t) +
                        " outside [0, " + std::to_string(vocab) + ")",
                    "ids");
  }
  const float* tab = table.as<const float>();
  float* o = out.as<float>();
  for (int64_t t = 0; t < num_tokens; ++t)
    std::memcpy(o + t * hidden, tab + id[t] * hidden, static_cast<size_t>(hidden) * sizeof(float));
  return Status::Ok();
}

namespace {
// One row of RMSNorm: the arithmetic every CPU op that normalises shares, so the fused ops equal
// `rmsnorm` bit for bit. `out` may alias `x`.
void rmsnorm_row(float* out, const float* x, const float* w, int64_t hidden, float eps) {
  const float mean_sq = dot(x, x, hidden) / static_cast<float>(hidden);
  const float inv = 1.0f / std::sqrt(mean_sq + eps);
  // Hugging Face order: normalise, then scale by the weight.
  for (int64_t i = 0; i < hidden; ++i) out[i] = w[i] * (x[i] * inv);
}
}  // namespace

Status rmsnorm(const ExecContext& ctx, TensorView out, TensorView x, TensorView w, float eps) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::rmsnorm(ctx, out, x, w, eps));
  const int64_t hidden = x.size(x.rank() - 1);
  const int64_t rows = x.numel() / hidden;
  for (int64_t r = 0; r < rows; ++r)
    rmsnorm_row(out.as<float>() + r * hidden, x.as<const float>() + r * hidden, w.as<const float>(), hidden, eps);
  return Status::Ok();
}

Status add_rmsnorm(const ExecContext& ctx, TensorView out, TensorView out_bf16, TensorView h, TensorView r,
                   TensorView r_bias, TensorView w, float eps) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::add_rmsnorm(ctx, out, out_bf16, h, r, r_bias, w, eps));
  const float* rb = r_bias.data != nullptr ? r_bias.as<const float>() : nullptr;
  const int64_t hidden = h.size(h.rank() - 1);
  const int64_t rows = h.numel() / hidden;
  std::vector<float> normed(out.data == nullptr ? static_cast<size_t>(hidden) : 0);
  for (int64_t row = 0; row < rows; ++row) {
    float* hr = h.as<float>() + row * hidden;
    if (r.data != nullptr) {
      const float* rr = r.as<const float>() + row * hidden;
      if (rb != nullptr) {
        for (int64_t i = 0; i < hidden; ++i) hr[i] = hr[i] + (rr[i] + rb[i]);  // add_bias's rounding, then add's
      } else {
        for (int64_t i = 0; i < hidden; ++i) hr[i] = hr[i] + rr[i];  // add's one rounding
      }
    }
    if (out.data == nullptr && out_bf16.data == nullptr) continue;
    float* o = out.data != nullptr ? out.as<float>() + row * hidden : normed.data();
    rmsnorm_row(o, hr, w.as<const float>(), hidden, eps);
    if (out_bf16.data == nullptr) continue;
    auto* ob = out_bf16.as<uint16_t>() + row * hidden;
    for (int64_t i = 0; i < hidden; ++i) ob[i] = f32_to_bf16_bits(o[i]);  // convert's rounding
  }
  return Status::Ok();
}

Status linear(const ExecContext& ctx, TensorView y, TensorView x, TensorView w) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::linear(ctx, y, x, w));
  const int64_t n_out = w.size(0), k_in = w.size(1);
  const int64_t rows = x.numel() / k_in;
  if (w.dtype == DType::kBF16) {
    // BF16 operands widened exactly to FP32 (the CUDA path's cuBLAS call accumulates in FP32
    // too); a reference for the parity tests, not a fast path.
    const auto* xb = x.as<const uint16_t>();
    const auto* wb = w.as<const uint16_t>();
    float* yp = y.as<float>();
    std::vector<float> xr(static_cast<size_t>(k_in)), wr(static_cast<size_t>(k_in));
    for (int64_t n = 0; n < n_out; ++n) {
      for (int64_t i = 0; i < k_in; ++i) wr[static_cast<size_t>(i)] = bf16_bits_to_f32(wb[n * k_in + i]);
      for (int64_t m = 0; m < rows; ++m) {
        for (int64_t i = 0; i < k_in; ++i) xr[static_cast<size_t>(i)] = bf16_bits_to_f32(xb[m * k_in + i]);
        yp[m * n_out + n] = dot(xr.data(), wr.data(), k_in);
      }
    }
    return Status::Ok();
  }
  const float* xp = x.as<const float>();
  const float* wp = w.as<const float>();
  float* yp = y.as<float>();
  // In the [N, K] layout every output is a contiguous x-row . w-row dot product. A tile
  // of w rows (kWRowsPerTile * K floats, 64 KiB at K = 256) stays in cache while every
  // x row passes over it, so prefill reads w from memory once instead of once per token.
  constexpr int64_t kWRowsPerTile = 64;
  for (int64_t n0 = 0; n0 < n_out; n0 += kWRowsPerTile) {
    const int64_t n1 = n0 + kWRowsPerTile < n_out ? n0 + kWRowsPerTile : n_out;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xr = xp + m * k_in;
      float* yr = yp + m * n_out;
      for (int64_t n = n0; n < n1; ++n) yr[n] = dot(xr, wp + n * k_in, k_in);
    }
  }
  return Status::Ok();
}

Status add(const ExecContext& ctx, TensorView out, TensorView a, TensorView b) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::add(ctx, out, a, b));
  const int64_t n = a.numel();
  const float* ap = a.as<const float>();
  const float* bp = b.as<const float>();
  float* op = out.as<float>();
  for (int64_t i = 0; i < n; ++i) op[i] = ap[i] + bp[i];
  return Status::Ok();
}

namespace {
// Rotates x[T, heads, D] in place by angle pos[t] * inv_freq[i] (FP32), cos/sin times `scale`.
void rotate(TensorView x, TensorView positions, const float* inv_freq, float scale) {
  const int64_t num_tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int64_t half = head_dim / 2;
  const int32_t* pos = positions.as<const int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float p = static_cast<float>(pos[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = p * inv_freq[i];
      const float c = std::cos(angle) * scale, s = std::sin(angle) * scale;
      for (int64_t h = 0; h < heads; ++h) {
        float* row = x.as<float>() + (t * heads + h) * head_dim;
        const float x1 = row[i], x2 = row[i + half];
        row[i] = x1 * c - x2 * s;
        row[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

// theta^(-2i/D) in double, rounded once to float: the CUDA twin computes the same
// expression, so both start from the same float frequency (Hugging Face keeps
// inv_freq and the angle in float32 too).
std::vector<float> theta_inv_freq(float theta, int64_t head_dim) {
  std::vector<float> inv_freq(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = static_cast<float>(
        1.0 / std::pow(static_cast<double>(theta), 2.0 * static_cast<double>(i) / static_cast<double>(head_dim)));
  return inv_freq;
}
}  // namespace

Status rope(const ExecContext& ctx, TensorView x, TensorView positions, float theta) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::rope(ctx, x, positions, theta));
  rotate(x, positions, theta_inv_freq(theta, x.size(2)).data(), 1.0f);
  return Status::Ok();
}

Status rope_table(const ExecContext& ctx, TensorView x, TensorView positions, TensorView inv_freq, float scale) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::rope_table(ctx, x, positions, inv_freq, scale));
  rotate(x, positions, inv_freq.as<const float>(), scale);
  return Status::Ok();
}

Status kv_store(const ExecContext& ctx, TensorView k_cache, TensorView v_cache, TensorView k, TensorView v,
                TensorView slot_mapping);
Status kv_slots_in_range(const TensorView& k_cache, const TensorView& slot_mapping);
Status rope_qk_rows(const RopeQkArgs& a);

// The unfused sequence, op by op on the same helpers: (fused form) the split of qkv's rows and
// add_bias on q, k and v, then rmsnorm of every q head and every k head, then the rotation of q
// and of k, then (with the caches) kv_store of k and v.
Status rope_qk(const ExecContext& ctx, const RopeQkArgs& a) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::rope_qk(ctx, a));
  // A slot past the cache is refused before anything is written, as kv_store refuses it.
  if (a.k_cache.data != nullptr) RD_RETURN_IF_ERROR(kv_slots_in_range(a.k_cache, a.slot_mapping));
  RD_RETURN_IF_ERROR(rope_qk_rows(a));
  if (a.k_cache.data == nullptr) return Status::Ok();
  return kv_store(ctx, a.k_cache, a.v_cache, a.k, a.v, a.slot_mapping);
}

// rope_qk's arithmetic on checked arguments.
Status rope_qk_rows(const RopeQkArgs& a) {
  const int64_t head_dim = a.q.size(2);
  if (a.qkv.data != nullptr) {  // split the fused projection's rows first: q | k | v
    const int64_t t = a.q.size(0), qd = a.q.size(1) * head_dim, kvd = a.k.size(1) * head_dim;
    const float* src = a.qkv.as<const float>();
    for (int64_t r = 0; r < t; ++r) {
      const float* row = src + r * (qd + 2 * kvd);
      std::copy(row, row + qd, a.q.as<float>() + r * qd);
      std::copy(row + qd, row + qd + kvd, a.k.as<float>() + r * kvd);
      std::copy(row + qd + kvd, row + qd + 2 * kvd, a.v.as<float>() + r * kvd);
    }
    if (a.q_bias.data != nullptr) {  // add_bias's arithmetic, on each of the three
      for (const auto& [y, b] : {std::pair{a.q, a.q_bias}, std::pair{a.k, a.k_bias}, std::pair{a.v, a.v_bias}}) {
        const int64_t n = b.size(0);
        for (int64_t r = 0; r < t; ++r)
          for (int64_t i = 0; i < n; ++i) y.as<float>()[r * n + i] += b.as<const float>()[i];
      }
    }
  }
  if (a.q_norm.data != nullptr) {
    for (const auto& [x, w] : {std::pair{a.q, a.q_norm}, std::pair{a.k, a.k_norm}}) {
      const int64_t rows = x.numel() / head_dim;
      for (int64_t r = 0; r < rows; ++r)
        rmsnorm_row(x.as<float>() + r * head_dim, x.as<const float>() + r * head_dim, w.as<const float>(), head_dim,
                    a.eps);
    }
  }
  if (a.inv_freq.data != nullptr) {
    rotate(a.q, a.positions, a.inv_freq.as<const float>(), a.scale);
    rotate(a.k, a.positions, a.inv_freq.as<const float>(), a.scale);
    return Status::Ok();
  }
  const std::vector<float> inv_freq = theta_inv_freq(a.theta, head_dim);
  rotate(a.q, a.positions, inv_freq.data(), a.scale);
  rotate(a.k, a.positions, inv_freq.data(), a.scale);
  return Status::Ok();
}

Status add_bias(const ExecContext& ctx, TensorView y, TensorView bias) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::add_bias(ctx, y, bias));
  const int64_t n = bias.size(0), rows = n ? y.numel() / n : 0;
  const float* b = bias.as<const float>();
  float* yp = y.as<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) yp[r * n + i] += b[i];
  return Status::Ok();
}

Status transpose(const ExecContext& ctx, TensorView dst, TensorView src) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::transpose(ctx, dst, src));
  const int rank = src.rank();
  const int64_t batch = rank == 3 ? src.size(0) : 1, rows = src.size(rank - 2), cols = src.size(rank - 1);
  auto run = [&](auto* d, const auto* s) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) d[(b * cols + c) * rows + r] = s[(b * rows + r) * cols + c];
  };
  if (dtype_size(src.dtype) == 4) run(static_cast<uint32_t*>(dst.data), static_cast<const uint32_t*>(src.data));
  else run(static_cast<uint16_t*>(dst.data), static_cast<const uint16_t*>(src.data));
  return Status::Ok();
}

// Every slot of slot_mapping below the cache's block_size * blocks (negative: padding).
Status kv_slots_in_range(const TensorView& k_cache, const TensorView& slot_mapping) {
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int32_t* slot = slot_mapping.as<const int32_t>();
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    if (slot[t] >= num_slots)
      return Status(ErrorCode::kOutOfRange,
                    "slot " + std::to_string(slot[t]) + " at row " + std::to_string(t) +
                        " outside the cache's " + std::to_string(num_slots) + " slots",
                    "slot_mapping");
  }
  return Status::Ok();
}

Status kv_store(const ExecContext& ctx, TensorView k_cache, TensorView v_cache, TensorView k,
                TensorView v, TensorView slot_mapping) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::kv_store(ctx, k_cache, v_cache, k, v, slot_mapping));
  const int64_t num_tokens = k.size(0);
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const int32_t* slot = slot_mapping.as<const int32_t>();
  RD_RETURN_IF_ERROR(kv_slots_in_range(k_cache, slot_mapping));
  const size_t row_bytes = static_cast<size_t>(row) * sizeof(float);
  const bool bf16 = k_cache.dtype == DType::kBF16;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot[t] < 0) continue;  // padding row
    if (bf16) {  // rounded to nearest even, as the CUDA twin rounds
      const float* ks = k.as<const float>() + t * row;
      const float* vs = v.as<const float>() + t * row;
      uint16_t* kd = k_cache.as<uint16_t>() + slot[t] * row;
      uint16_t* vd = v_cache.as<uint16_t>() + slot[t] * row;
      for (int64_t c = 0; c < row; ++c) {
        kd[c] = f32_to_bf16_bits(ks[c]);
        vd[c] = f32_to_bf16_bits(vs[c]);
      }
      continue;
    }
    std::memcpy(k_cache.as<float>() + slot[t] * row, k.as<const float>() + t * row, row_bytes);
    std::memcpy(v_cache.as<float>() + slot[t] * row, v.as<const float>() + t * row, row_bytes);
  }
  return Status::Ok();
}

}  // namespace cpu

namespace cpu {
Status convert(const ExecContext& ctx, void* dst, DType dt, const void* src, DType st, size_t n) {
  if (ctx.device.kind != DeviceKind::kCpu)
    return Status(ErrorCode::kInvalidArgument, "CPU convert with a non-CPU context", "ctx");
  if (n == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr)
    return Status(ErrorCode::kInvalidArgument, "null pointer", dst == nullptr ? "dst" : "src");
  if (dt == st) {
    std::memcpy(dst, src, n * dtype_size(dt));
  } else if (dt == DType::kF32 && st == DType::kBF16) {
    auto* d = static_cast<float*>(dst);
    const auto* s = static_cast<const uint16_t*>(src);
    for (size_t i = 0; i < n; ++i) d[i] = bf16_bits_to_f32(s[i]);
  } else if (dt == DType::kBF16 && st == DType::kF32) {
    auto* d = static_cast<uint16_t*>(dst);
    const auto* s = static_cast<const float*>(src);
    for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16_bits(s[i]);
  } else {
    return Status(ErrorCode::kInvalidArgument, "unsupported conversion", "dst_dtype");
  }
  return Status::Ok();
}
Status copy_2d(const ExecContext& ctx, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
               size_t height, CopyKind kind) {
  if (width == 0 || height == 0) return Status::Ok();
  if (dst_pitch < width || src_pitch < width)
    return Status(ErrorCode::kInvalidArgument, "a pitch is smaller than the row width", "pitch");
  for (size_t i = 0; i < height; ++i)
    RD_RETURN_IF_ERROR(copy(ctx, static_cast<char*>(dst) + i * dst_pitch,
                            static_cast<const char*>(src) + i * src_pitch, width, kind));
  return Status::Ok();
}
Status copy_3d(const ExecContext& ctx, void* dst, size_t dst_pitch, size_t dst_slice_pitch, const void* src,
               size_t src_pitch, size_t src_slice_pitch, size_t width, size_t height, size_t depth, CopyKind kind) {
  RD_RETURN_IF_ERROR(op_checks::copy_3d_shape(dst_pitch, dst_slice_pitch, src_pitch, src_slice_pitch, width, height));
  for (size_t k = 0; k < depth && width && height; ++k)
    RD_RETURN_IF_ERROR(copy_2d(ctx, static_cast<char*>(dst) + k * dst_slice_pitch, dst_pitch,
                               static_cast<const char*>(src) + k * src_slice_pitch, src_pitch, width, height, kind));
  return Status::Ok();
}

// Virtual memory on the host: a reservation is an anonymous PROT_NONE mapping (no memory, no
// swap reserved); map makes pages accessible (the kernel supplies zero pages on first touch);
// unmap replaces the range with a fresh PROT_NONE mapping in one call (MAP_FIXED), which
// discards the pages -- their memory goes back to the system -- and keeps the addresses.
namespace {
size_t page_size() {
  static const size_t p = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}
Status check_vm_range(const void* addr, size_t bytes) {
  const size_t g = page_size();
  if (addr == nullptr || bytes == 0) return Status(ErrorCode::kInvalidArgument, "empty virtual range", "addr");
  if (reinterpret_cast<uintptr_t>(addr) % g != 0 || bytes % g != 0)
    return Status(ErrorCode::kInvalidArgument, "virtual range not aligned to the page size", "addr");
  return Status::Ok();
}
Status errno_status(const char* what, size_t bytes) {
  const int e = errno;
  return Status(e == ENOMEM ? ErrorCode::kResourceExhausted : ErrorCode::kInternal,
                std::string(what) + " of " + std::to_string(bytes) + " bytes failed: " + std::strerror(e), "bytes");
}
}  // namespace

Status vm_granularity(const ExecContext& ctx, size_t* out) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  *out = page_size();
  return Status::Ok();
}
Status vm_reserve(const ExecContext& ctx, size_t bytes, void** out) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  *out = nullptr;
  if (bytes == 0 || bytes % page_size() != 0)
    return Status(ErrorCode::kInvalidArgument, "reservation size not a positive multiple of the page size", "bytes");
  void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return errno_status("address reservation", bytes);
  *out = p;
  return Status::Ok();
}
Status vm_free(const ExecContext& ctx, void* base, size_t bytes) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(check_vm_range(base, bytes));
  if (::munmap(base, bytes) != 0) return errno_status("munmap", bytes);
  return Status::Ok();
}
Status vm_map(const ExecContext& ctx, void* addr, size_t bytes) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(check_vm_range(addr, bytes));
  if (::mprotect(addr, bytes, PROT_READ | PROT_WRITE) != 0) return errno_status("mprotect", bytes);
  return Status::Ok();
}
Status vm_unmap(const ExecContext& ctx, void* addr, size_t bytes) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(check_vm_range(addr, bytes));
  void* p = ::mmap(addr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return errno_status("mmap(MAP_FIXED, PROT_NONE)", bytes);
  return Status::Ok();
}

Status copy_valid_rows(const ExecContext& ctx, TensorView dst, TensorView src, TensorView count, int32_t fill) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::copy_valid_rows(ctx, dst, src, count));
  const int64_t rows = src.size(0), cols = src.size(1);
  const int32_t n = *count.as<const int32_t>();
  if (n < 0 || n > rows)
    return Status(ErrorCode::kOutOfRange,
                  "row count " + std::to_string(n) + " outside [0, " + std::to_string(rows) + "]", "count");
  const int32_t* s = src.as<const int32_t>();
  int32_t* d = dst.as<int32_t>();
  std::memcpy(d, s, static_cast<size_t>(n * cols) * sizeof(int32_t));
  std::fill(d + n * cols, d + rows * cols, fill);
  return Status::Ok();
}

// core::Sampler's algorithm per row (kernels/cpu/cpu_sampling.cpp); every row's parameters are
// checked before any output is written.
Status sample(const ExecContext& ctx, const SampleArgs& a) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  RD_RETURN_IF_ERROR(op_checks::sample(ctx, a));
  const int64_t rows = a.logits.size(0), V = a.logits.size(1);
  std::vector<SamplingRow> params(static_cast<size_t>(rows));
  if (rows > 0) std::memcpy(params.data(), a.rows.data, params.size() * sizeof(SamplingRow));
  for (size_t r = 0; r < params.size(); ++r) {
    if (Status st = check_sampling_row(params[r]); !st.ok())
      return st.with_field_prefix("rows[" + std::to_string(r) + "]");  // "rows[3].top_p"
  }
  thread_local SamplingScratch scratch;
  for (int64_t r = 0; r < rows; ++r) {
    const SampledRow s = sample_row(a.logits.as<const float>() + r * V, V, params[static_cast<size_t>(r)], scratch);
    a.tokens.as<int32_t>()[r] = s.token;
    a.logprobs.as<float>()[r] = s.logprob;
    if (a.top_ids.data != nullptr) {
      const int64_t n = a.top_ids.size(1);
      top_logprobs_row(a.logits.as<const float>() + r * V, V, s.log_z, n, a.top_ids.as<int32_t>() + r * n,
                       a.top_logprobs.as<float>() + r * n, scratch);
    }
  }
  return Status::Ok();
}

// No graphs on the host: callers run the body directly.
Status graph_capture(const ExecContext& ctx, Backend::GraphBody, void*, void** graph) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  if (graph) *graph = nullptr;
  return Status(ErrorCode::kUnimplemented, "the CPU backend has no graphs", "graph");
}
Status graph_launch(const ExecContext& ctx, void*) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  return Status(ErrorCode::kUnimplemented, "the CPU backend has no graphs", "graph");
}
Status graph_destroy(const ExecContext& ctx, void*) {
  RD_RETURN_IF_ERROR(check_ctx(ctx));
  return Status(ErrorCode::kUnimplemented, "the CPU backend has no graphs", "graph");
}
}  // namespace cpu

const Backend& cpu_backend() {
  static const Backend kCpuBackend{
      "cpu",
      DeviceKind::kCpu,
      cpu::alloc,
      cpu::free_mem,
      cpu::copy,
      cpu::synchronize,
      cpu::embedding,
      cpu::rmsnorm,
      cpu::linear,
      cpu::add,
      cpu::rope,
      cpu::kv_store,
      cpu::paged_attention,
      cpu::router_softmax_topk,
      cpu::moe_experts,
      cpu::sample,
      cpu::convert,
      cpu::copy_2d,
      cpu::copy_3d,
      cpu::alloc,
      cpu::free_mem,
      cpu::copy_valid_rows,
      cpu::graph_capture,
      cpu::graph_launch,
      cpu::graph_destroy,
      cpu::paged_attention_ex,
      cpu::rope_table,
      cpu::add_bias,
      cpu::transpose,
      cpu::vm_granularity,
      cpu::vm_reserve,
      cpu::vm_free,
      cpu::vm_map,
      cpu::vm_unmap,
      cpu::add_rmsnorm,
      cpu::rope_qk,
      cpu::router,
  };
  return kCpuBackend;
}

}  // namespace rolloutd
