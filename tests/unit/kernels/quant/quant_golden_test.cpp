// Every case of the independent goldens, bit for bit, on the CPU reference and (where a GPU is
// visible) on CUDA:
// - tests/reference/quant/numpy_golden.rdqg: a NumPy re-implementation of the spec rules
//   (make_quant_golden.py), committed, always present;
// - tests/reference/quant/torch_golden.rdqg: PyTorch's own float8_e4m3fn / float8_e8m0fnu /
//   float4_e2m1fn_x2 conversions (make_torch_golden.py), made on the GPU host; the tests skip
//   with a message while it has not been generated.
#include <cstring>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "kernels/quant/quant_ops.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::quant {
namespace {

using test::Arena;
using test::Golden;
using test::GoldenTensor;

DType dtype_of(const std::string& name) {
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float32") return DType::kF32;
  if (name == "int32") return DType::kI32;
  return DType::kU8;
}

class CaseRunner {
 public:
  CaseRunner(const Golden& g, std::string prefix, bool gpu) : g_(g), prefix_(std::move(prefix)), a_(gpu) {}

  bool has(const std::string& field) const { return g_.count(prefix_ + field) != 0; }
  const GoldenTensor& get(const std::string& field) const { return g_.at(prefix_ + field); }
  TensorView upload(const std::string& field) {
    const GoldenTensor& t = get(field);
    return a_.make(dtype_of(t.dtype), t.shape, t.bytes.data());
  }
  TensorView output(const std::string& like, DType dtype) { return a_.make(dtype, get(like).shape); }
  void expect(const TensorView& v, const std::string& field) {
    const std::string d = test::diff(a_.read(v), get(field).bytes);
    EXPECT_TRUE(d.empty()) << prefix_ << field << ": " << d;
  }
  // Dequantized values: bit for bit, except that any NaN matches any NaN. Our dequantizers
  // write the canonical NaN (0x7FC0 / 0x7FC00000); torch propagates whatever payload its
  // arithmetic made (0xFFFF seen for bf16 on torch 2.11), and both are NaN.
  void expect_values(const TensorView& v, const std::string& field) {
    const std::vector<uint8_t> got = a_.read(v);
    const std::vector<uint8_t>& want = get(field).bytes;
    ASSERT_EQ(got.size(), want.size()) << prefix_ << field;
    const size_t w = v.dtype == DType::kBF16 ? 2 : 4;
    size_t bad = 0, first = SIZE_MAX;
    for (size_t i = 0; i + w <= got.size(); i += w) {
      uint32_t g = 0, e = 0;
      std::memcpy(&g, got.data() + i, w);
      std::memcpy(&e, want.data() + i, w);
      const bool g_nan = w == 2 ? (g & 0x7f80u) == 0x7f80u && (g & 0x7fu) : (g & 0x7f800000u) == 0x7f800000u && (g & 0x7fffffu);
      const bool e_nan = w == 2 ? (e & 0x7f80u) == 0x7f80u && (e & 0x7fu) : (e & 0x7f800000u) == 0x7f800000u && (e & 0x7fffffu);
      if (g == e || (g_nan && e_nan)) continue;
      if (!bad++) first = i;
    }
    EXPECT_EQ(bad, 0u) << prefix_ << field << ": " << bad << " values differ, first at byte " << first;
  }
  ExecContext ctx() const { return a_.ctx(); }

 private:
  const Golden& g_;
  std::string prefix_;
  Arena a_;
};

#define EXPECT_RUN(expr)                                \
  do {                                                  \
    const ::rolloutd::Status st_ = (expr);              \
    EXPECT_TRUE(st_.ok()) << st_.to_string();           \
  } while (0)

void run_mx(CaseRunner& c, bool fp4) {
  const TensorView x = c.upload("x");
  const char* qname = fp4 ? "blocks" : "q";
  const TensorView q = c.output(qname, DType::kU8), s = c.output("scales", DType::kU8);
  EXPECT_RUN(fp4 ? quantize_mxfp4(c.ctx(), x, q, s) : quantize_mxfp8(c.ctx(), x, q, s));
  c.expect(q, qname);
  c.expect(s, "scales");
  for (const char* out : {"dequant_bf16", "dequant_f32"}) {
    if (!c.has(out)) continue;
    const TensorView gq = c.upload(qname), gs = c.upload("scales");
    const TensorView o = c.output(out, std::string(out) == "dequant_bf16" ? DType::kBF16 : DType::kF32);
    EXPECT_RUN(fp4 ? dequantize_mxfp4(c.ctx(), gq, gs, o) : dequantize_mxfp8(c.ctx(), gq, gs, o));
    c.expect_values(o, out);
  }
}

void run_fp8(CaseRunner& c, Fp8ScaleBlock block) {
  const TensorView x = c.upload("x");
  const TensorView q = c.output("q", DType::kU8), s = c.output("scales", DType::kF32);
  const TensorView p = c.output("scales_ue8m0", DType::kI32);
  EXPECT_RUN(quantize_fp8_blockwise(c.ctx(), x, block, q, s, p));
  c.expect(q, "q");
  c.expect(s, "scales");
  c.expect(p, "scales_ue8m0");
  for (const char* out : {"dequant_bf16", "dequant_f32"}) {
    if (!c.has(out)) continue;
    const DType dt = std::string(out) == "dequant_bf16" ? DType::kBF16 : DType::kF32;
    for (const char* scales : {"scales", "scales_ue8m0"}) {
      const TensorView o = c.output(out, dt);
      EXPECT_RUN(dequantize_fp8_blockwise(c.ctx(), c.upload("q"), c.upload(scales), block, o));
      SCOPED_TRACE(std::string("dequantized through ") + scales);
      c.expect_values(o, out);
    }
  }
}

void run_layout(CaseRunner& c, Mxfp4RowOrder order) {
  const TensorView x = c.upload("x");
  // Quantize to the checkpoint layout, then to the kernel layout in one pass.
  TensorView b = c.output("blocks", DType::kU8), s = c.output("scales", DType::kU8);
  EXPECT_RUN(quantize_mxfp4(c.ctx(), x, b, s));
  c.expect(b, "blocks");
  c.expect(s, "scales");
  TensorView kb = c.output("blocks", DType::kU8), ks = c.output("scales", DType::kU8);
  s = c.output("scales", DType::kU8);
  EXPECT_RUN(quantize_mxfp4_to_kernel_layout(c.ctx(), x, kb, s, ks, order));
  c.expect(kb, "kernel_blocks");
  c.expect(s, "scales");
  c.expect(ks, "kernel_scales");
  // The in-place permutation of the golden checkpoint blocks, and back.
  const TensorView blocks = c.upload("blocks");
  EXPECT_RUN(mxfp4_blocks_to_kernel_layout(c.ctx(), blocks, order));
  c.expect(blocks, "kernel_blocks");
  EXPECT_RUN(mxfp4_blocks_to_checkpoint_layout(c.ctx(), blocks, order));
  c.expect(blocks, "blocks");
  // The scale copies.
  const TensorView scales = c.upload("scales"), kscales = c.output("scales", DType::kU8);
  EXPECT_RUN(mxfp4_scales_to_kernel_layout(c.ctx(), scales, kscales, order));
  c.expect(kscales, "kernel_scales");
  c.expect(scales, "scales");
  const TensorView back = c.output("scales", DType::kU8);
  EXPECT_RUN(mxfp4_scales_to_checkpoint_layout(c.ctx(), kscales, back, order));
  c.expect(back, "scales");
}

// Runs every case of a golden file; returns the ops seen.
std::set<std::string> run_all(const Golden& g, bool gpu) {
  std::set<std::string> cases, ops;
  for (const auto& [name, t] : g) {
    const size_t a = name.find('/'), b = name.find('/', a + 1);
    if (a != std::string::npos && b != std::string::npos) cases.insert(name.substr(0, b + 1));
  }
  for (const std::string& prefix : cases) {
    SCOPED_TRACE(prefix);
    const std::string op = prefix.substr(0, prefix.find('/'));
    ops.insert(op);
    CaseRunner c(g, prefix, gpu);
    if (op == "mxfp4") run_mx(c, true);
    else if (op == "mxfp8") run_mx(c, false);
    else if (op == "fp8_1x128") run_fp8(c, Fp8ScaleBlock::k1x128);
    else if (op == "fp8_128x128") run_fp8(c, Fp8ScaleBlock::k128x128);
    else if (op == "mxfp4_layout_plain") run_layout(c, Mxfp4RowOrder::kPlain);
    else if (op == "mxfp4_layout_gate_up") run_layout(c, Mxfp4RowOrder::kGateUpInterleaved);
    else if (op == "mxfp4_layout_concat") run_layout(c, Mxfp4RowOrder::kGateUpConcatenated);
    else if (!c.has("note")) ADD_FAILURE() << "unknown golden op " << op;
  }
  return ops;
}

std::string golden_path(const char* file) {
  return test::source_root() + "/tests/reference/quant/" + file;
}

TEST(QuantGolden, NumpyOnCpu) {
  Golden g;
  std::string why;
  ASSERT_TRUE(test::read_golden(golden_path("numpy_golden.rdqg"), &g, &why)) << why;
  const auto ops = run_all(g, false);
  EXPECT_EQ(ops, (std::set<std::string>{"mxfp4", "mxfp8", "fp8_1x128", "fp8_128x128",
                                        "mxfp4_layout_plain", "mxfp4_layout_gate_up",
                                        "mxfp4_layout_concat"}));
}

TEST(QuantGolden, NumpyOnCuda) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  Golden g;
  std::string why;
  ASSERT_TRUE(test::read_golden(golden_path("numpy_golden.rdqg"), &g, &why)) << why;
  run_all(g, true);
}

bool load_torch(Golden* g) {
  std::string why;
  return test::read_golden(golden_path("torch_golden.rdqg"), g, &why);
}

TEST(QuantGolden, TorchOnCpu) {
  Golden g;
  if (!load_torch(&g))
    GTEST_SKIP() << "tests/reference/quant/torch_golden.rdqg not generated yet: run "
                    "tests/reference/quant/make_torch_golden.py where torch >= 2.8 is installed";
  const auto ops = run_all(g, false);
  EXPECT_FALSE(ops.empty());
}

TEST(QuantGolden, TorchOnCuda) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  Golden g;
  if (!load_torch(&g)) GTEST_SKIP() << "tests/reference/quant/torch_golden.rdqg not generated yet";
  run_all(g, true);
}

}  // namespace
}  // namespace rolloutd::quant
