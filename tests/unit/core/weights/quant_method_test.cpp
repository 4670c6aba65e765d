// InterleaveGateUpMethod against the interleave written out row by row here, on the CPU and
// (when a GPU is visible) on CUDA, with staging caps that split the experts into groups
// (one expert, a group that does not divide E, all at once).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/weights/quant_method.hpp"
#include "kernels/backend.hpp"
#include "kernels/quant/quant_ops.hpp"

namespace rolloutd::core {
namespace {

constexpr int64_t kE = 5, kI = 3, kH = 4;  // [E, 2I, H] float32
constexpr size_t kRow = kH * sizeof(float), kExpert = 2 * kI * kRow;

std::vector<float> checkpoint_tensor() {
  std::vector<float> v(static_cast<size_t>(kE * 2 * kI * kH));
  std::iota(v.begin(), v.end(), 1.0f);
  return v;
}

// Kernel layout by definition: expert e, row 2j = checkpoint row j (gate), row 2j+1 =
// checkpoint row I+j (up).
std::vector<float> interleaved(const std::vector<float>& c) {
  std::vector<float> k(c.size());
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t j = 0; j < kI; ++j)
      for (int64_t h = 0; h < kH; ++h) {
        const int64_t base = e * 2 * kI * kH;
        k[static_cast<size_t>(base + (2 * j) * kH + h)] = c[static_cast<size_t>(base + j * kH + h)];
        k[static_cast<size_t>(base + (2 * j + 1) * kH + h)] = c[static_cast<size_t>(base + (kI + j) * kH + h)];
      }
  return k;
}

void round_trip_on(const Backend& b, const ExecContext& ctx, size_t max_staging) {
  SCOPED_TRACE("backend " + std::string(b.name) + ", staging cap " + std::to_string(max_staging));
  const std::vector<float> ckpt = checkpoint_tensor();
  const size_t bytes = ckpt.size() * sizeof(float);
  const bool host = ctx.device.kind == DeviceKind::kCpu;
  void* p = nullptr;
  ASSERT_TRUE(b.alloc(ctx, bytes, &p).ok());
  ASSERT_TRUE(b.copy(ctx, p, ckpt.data(), bytes, host ? CopyKind::kHostToHost : CopyKind::kHostToDevice).ok());
  const TensorView s = TensorView::contiguous(p, DType::kF32, {kE, 2 * kI, kH}, ctx.device);
  auto read = [&] {
    std::vector<float> out(ckpt.size());
    EXPECT_TRUE(b.copy(ctx, out.data(), p, bytes, host ? CopyKind::kHostToHost : CopyKind::kDeviceToHost).ok());
    EXPECT_TRUE(b.synchronize(ctx).ok());
    return out;
  };
  InterleaveGateUpMethod m(kI, max_staging);
  ASSERT_TRUE(m.postprocess_after_load(b, ctx, s).ok());
  EXPECT_EQ(read(), interleaved(ckpt));
  ASSERT_TRUE(m.restore_before_load(b, ctx, s).ok());
  EXPECT_EQ(read(), ckpt);
  for (int64_t r = 0; r < 2 * kI; ++r)
    EXPECT_EQ(m.kernel_row(r), r < kI ? 2 * r : 2 * (r - kI) + 1) << "checkpoint row " << r;
  (void)b.free(ctx, p);
}

const size_t kCaps[] = {0, kExpert, 2 * kExpert, kE * kExpert, size_t{64} << 20};

TEST(InterleaveGateUpMethod, PermutesEveryExpertInGroupsOnTheCpu) {
  for (size_t cap : kCaps) round_trip_on(cpu_backend(), ExecContext{Device::cpu(), nullptr}, cap);
}

TEST(InterleaveGateUpMethod, PermutesEveryExpertInGroupsOnCuda) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  for (size_t cap : kCaps) round_trip_on(*cuda, ExecContext{Device::cuda(0), nullptr}, cap);
}

TEST(BackendCopy3d, MovesRowsOfEverySliceAndRejectsBadPitches) {
  const Backend& b = cpu_backend();
  const ExecContext ctx{Device::cpu(), nullptr};
  // 3 slices of 2 rows of 2 bytes; src rows 4 bytes apart, slices 12; dst packed.
  std::vector<uint8_t> src(36);
  std::iota(src.begin(), src.end(), uint8_t{0});
  std::vector<uint8_t> dst(12, 0xff);
  ASSERT_TRUE(b.copy_3d(ctx, dst.data(), 2, 4, src.data(), 4, 12, 2, 2, 3, CopyKind::kHostToHost).ok());
  EXPECT_EQ(dst, (std::vector<uint8_t>{0, 1, 4, 5, 12, 13, 16, 17, 24, 25, 28, 29}));
  // A slice pitch that is not a multiple of the row pitch, or too small for the rows.
  EXPECT_EQ(b.copy_3d(ctx, dst.data(), 2, 4, src.data(), 4, 10, 2, 2, 3, CopyKind::kHostToHost).field(),
            "src_slice_pitch");
  EXPECT_EQ(b.copy_3d(ctx, dst.data(), 2, 2, src.data(), 4, 12, 2, 2, 3, CopyKind::kHostToHost).field(),
            "dst_slice_pitch");
  EXPECT_EQ(b.copy_3d(ctx, dst.data(), 1, 4, src.data(), 4, 12, 2, 2, 3, CopyKind::kHostToHost).field(), "pitch");
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0) return;
  // The same copy on the device.
  const ExecContext g{Device::cuda(0), nullptr};
  void *ds = nullptr, *dd = nullptr;
  ASSERT_TRUE(cuda->alloc(g, src.size(), &ds).ok());
  ASSERT_TRUE(cuda->alloc(g, 12, &dd).ok());
  ASSERT_TRUE(cuda->copy(g, ds, src.data(), src.size(), CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(cuda->copy_3d(g, dd, 2, 4, ds, 4, 12, 2, 2, 3, CopyKind::kDeviceToDevice).ok());
  std::vector<uint8_t> back(12);
  ASSERT_TRUE(cuda->copy(g, back.data(), dd, 12, CopyKind::kDeviceToHost).ok());
  ASSERT_TRUE(cuda->synchronize(g).ok());
  EXPECT_EQ(back, dst);
  (void)cuda->free(g, ds);
  (void)cuda->free(g, dd);
}


// Mxfp4BlocksMethod / Mxfp4ScalesMethod: postprocess gives the bytes of the quant ops (blocks in
// place, scales into the kernel copy, checkpoint scales untouched), the host read-back of the
// kernel layout gives the checkpoint bytes, and restore undoes the blocks exactly.
void mxfp4_methods_on(const Backend& b, const ExecContext& ctx, quant::Mxfp4RowOrder order) {
  SCOPED_TRACE("backend " + std::string(b.name) + ", order " + std::to_string(static_cast<int>(order)));
  constexpr int64_t kExperts = 3, kRows = 64, kKb = 4;  // [E, 64, K/32 = 4, 16]
  const size_t nb = kExperts * kRows * kKb * 16, ns = kExperts * kRows * kKb;
  std::vector<uint8_t> blocks(nb), scales(ns);
  for (size_t i = 0; i < nb; ++i) blocks[i] = static_cast<uint8_t>(i * 37 + 11);
  for (size_t i = 0; i < ns; ++i) scales[i] = static_cast<uint8_t>(100 + i % 50);
  std::vector<uint8_t> want_blocks = blocks, want_scales(ns);
  const Shape bs{kExperts, kRows, kKb, 16}, ss{kExperts, kRows, kKb};
  ASSERT_TRUE(quant::mxfp4_blocks_to_kernel_layout(ExecContext{}, TensorView::contiguous(want_blocks.data(), DType::kU8, bs), order).ok());
  std::vector<uint8_t> sc = scales;
  ASSERT_TRUE(quant::mxfp4_scales_to_kernel_layout(ExecContext{}, TensorView::contiguous(sc.data(), DType::kU8, ss),
                                                   TensorView::contiguous(want_scales.data(), DType::kU8, ss), order)
                  .ok());
  const bool host = ctx.device.kind == DeviceKind::kCpu;
  void *pb = nullptr, *ps = nullptr, *pk = nullptr;
  ASSERT_TRUE(b.alloc(ctx, nb, &pb).ok() && b.alloc(ctx, ns, &ps).ok() && b.alloc(ctx, ns, &pk).ok());
  const CopyKind up = host ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
  const CopyKind down = host ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  ASSERT_TRUE(b.copy(ctx, pb, blocks.data(), nb, up).ok() && b.copy(ctx, ps, scales.data(), ns, up).ok());
  auto read = [&](void* p, size_t n) {
    std::vector<uint8_t> out(n);
    EXPECT_TRUE(b.copy(ctx, out.data(), p, n, down).ok());
    EXPECT_TRUE(b.synchronize(ctx).ok());
    return out;
  };
  const TensorView vb = TensorView::contiguous(pb, DType::kU8, bs, ctx.device);
  const TensorView vs = TensorView::contiguous(ps, DType::kU8, ss, ctx.device);
  Mxfp4BlocksMethod mb(order);
  Mxfp4ScalesMethod ms(order, TensorView::contiguous(pk, DType::kU8, ss, ctx.device));
  EXPECT_TRUE(mb.transforms_layout());
  EXPECT_FALSE(ms.transforms_layout());
  ASSERT_TRUE(mb.postprocess_after_load(b, ctx, vb).ok());
  ASSERT_TRUE(ms.postprocess_after_load(b, ctx, vs).ok());
  const std::vector<uint8_t> kernel = read(pb, nb);
  EXPECT_EQ(kernel, want_blocks);
  EXPECT_EQ(read(pk, ns), want_scales);
  EXPECT_EQ(read(ps, ns), scales);
  std::vector<uint8_t> back(nb);
  mb.kernel_to_checkpoint_host(kernel.data(), back.data(), kExperts, kRows, kKb * 16, 1);
  EXPECT_EQ(back, blocks);
  ASSERT_TRUE(ms.restore_before_load(b, ctx, vs).ok());
  ASSERT_TRUE(mb.restore_before_load(b, ctx, vb).ok());
  EXPECT_EQ(read(pb, nb), blocks);
  EXPECT_EQ(read(ps, ns), scales);
  for (void* p : {pb, ps, pk}) EXPECT_TRUE(b.free(ctx, p).ok());
}

TEST(Mxfp4Methods, KernelLayoutAndExactRestoreOnTheCpu) {
  for (auto o : {quant::Mxfp4RowOrder::kPlain, quant::Mxfp4RowOrder::kGateUpInterleaved,
                 quant::Mxfp4RowOrder::kGateUpConcatenated})
    mxfp4_methods_on(cpu_backend(), ExecContext{}, o);
}

TEST(Mxfp4Methods, KernelLayoutAndExactRestoreOnCuda) {
  if (cuda_backend() == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  ExecContext ctx;
  ctx.device = Device::cuda(0);
  for (auto o : {quant::Mxfp4RowOrder::kPlain, quant::Mxfp4RowOrder::kGateUpInterleaved,
                 quant::Mxfp4RowOrder::kGateUpConcatenated})
    mxfp4_methods_on(*cuda_backend(), ctx, o);
}

}  // namespace
}  // namespace rolloutd::core
