// Every op of the backend seam on every backend against the CPU reference, in the manner
// of ggml's test-backend-ops: one parameterised test over {op x shape (x dtype: FP32 for
// now)}. Each case builds random inputs from a fixed seed, poisons its outputs with NaN
// (INT32_MIN for integer outputs) before every run, checks that every element was written,
// and compares with ||out - ref|| / ||ref|| <= the op's tolerance (integer outputs: exact;
// BF16 outputs widened to FP32, under their own bound: one rounding step apart where the FP32
// values straddle a rounding boundary).
//
// The CPU half runs everywhere; the CUDA half skips itself without a CUDA build or a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/bf16.hpp"

#if defined(ROLLOUTD_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace rolloutd {
namespace {

// ---- deterministic inputs -------------------------------------------------------------

// SplitMix64: tiny, fixed across platforms and standard libraries (std:: distributions
// are not), so a failing case reproduces bit for bit anywhere.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi), 24 random bits.
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  }
  int32_t below(int64_t n) { return static_cast<int32_t>(next() % static_cast<uint64_t>(n)); }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next() % i]);
  }

 private:
  uint64_t state_;
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// ---- cases ----------------------------------------------------------------------------

enum class Role { kIn, kOut, kInOut };

struct CaseTensor {
  std::string name;
  DType dtype;
  Shape shape;
  Role role;
  std::vector<uint8_t> bytes;  // initial contents (ignored for kOut: poisoned instead)
  double tolerance = -1;       // >= 0: this tensor's bound instead of the case's
};

using OpRun =
    std::function<Status(const Backend&, const ExecContext&, const std::vector<TensorView>&)>;

struct ParityCase {
  std::string name;
  double tolerance = 1e-5;  // relative L2 error allowed on float outputs
  std::vector<CaseTensor> tensors;
  OpRun run;  // views are in the order of `tensors`

  size_t add(std::string tname, DType dtype, Shape shape, Role role,
             std::vector<uint8_t> bytes = {}) {
    if (role == Role::kOut) bytes.assign(static_cast<size_t>(shape.numel()) * dtype_size(dtype), 0);
    tensors.push_back({std::move(tname), dtype, shape, role, std::move(bytes), -1});
    return tensors.size() - 1;
  }
  size_t add_f32(std::string tname, Shape shape, Role role, const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * sizeof(float));
    std::memcpy(b.data(), v.data(), b.size());
    return add(std::move(tname), DType::kF32, shape, role, std::move(b));
  }
  size_t add_i32(std::string tname, Shape shape, const std::vector<int32_t>& v) {
    std::vector<uint8_t> b(v.size() * sizeof(int32_t));
    std::memcpy(b.data(), v.data(), b.size());
    return add(std::move(tname), DType::kI32, shape, Role::kIn, std::move(b));
  }
  size_t add_out(std::string tname, DType dtype, Shape shape) {
    return add(std::move(tname), dtype, shape, Role::kOut);
  }
};

std::vector<float> random_f32(Rng& rng, int64_t n, float lo, float hi) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = rng.uniform(lo, hi);
  return v;
}

// BF16 bytes of random values in [lo, hi) (each rounded to nearest even).
std::vector<uint8_t> random_bf16(Rng& rng, int64_t n, float lo, float hi) {
  const std::vector<float> f = random_f32(rng, n, lo, hi);
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * 2);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t b = f32_to_bf16_bits(f[static_cast<size_t>(i)]);
    std::memcpy(&bytes[static_cast<size_t>(i) * 2], &b, 2);
  }
  return bytes;
}

struct CaseMaker {
  std::string name;  // gtest parameter name: letters, digits, '_'
  std::function<ParityCase(Rng&)> make;
};
void PrintTo(const CaseMaker& m, std::ostream* os) { *os << m.name; }

std::vector<CaseMaker>& registry() {
  static std::vector<CaseMaker> cases;
  return cases;
}

void reg(std::string name, std::function<ParityCase(Rng&)> make) {
  registry().push_back({std::move(name), std::move(make)});
}

std::string dims(std::initializer_list<std::pair<const char*, int64_t>> kv) {
  std::string s;
  for (const auto& [k, v] : kv) s += std::string("_") + k + std::to_string(v);
  return s;
}

// -- embedding: a copy, so exact.
void embedding_cases() {
  struct P {
    int64_t t, v, h;
  };
  for (const P p : {P{1, 17, 8}, P{37, 1000, 65}, P{128, 50, 256}}) {
    const int64_t t = p.t, v = p.v, h = p.h;
    reg("embedding" + dims({{"T", t}, {"V", v}, {"H", h}}), [=](Rng& rng) {
      ParityCase c;
      c.tolerance = 0.0;
      c.add_f32("table", {v, h}, Role::kIn, random_f32(rng, v * h, -1, 1));
      std::vector<int32_t> ids(static_cast<size_t>(t));
      for (auto& id : ids) id = rng.below(v);
      ids.back() = static_cast<int32_t>(v - 1);  // the last row of the table too
      c.add_i32("ids", {t}, ids);
      c.add_out("out", DType::kF32, {t, h});
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.embedding(x, a[2], a[0], a[1]);
      };
      return c;
    });
  }
}

void rmsnorm_cases() {
  struct P {
    int64_t rows, h;
  };
  // CUDA takes rows of H % 4 == 0 up to 8192 in registers (1-8 float4s per thread, 32-256
  // threads) and the rest with the plain loop: both kinds, each register count.
  for (const P p : {P{1, 64}, P{7, 33}, P{130, 1000}, P{3, 4096}, P{1, 2880}, P{2, 8192}, P{5, 16}, P{1, 9000},
                    P{4, 2048}}) {
    const int64_t rows = p.rows, h = p.h;
    reg("rmsnorm" + dims({{"R", rows}, {"H", h}}), [=](Rng& rng) {
      ParityCase c;
      c.add_f32("x", {rows, h}, Role::kIn, random_f32(rng, rows * h, -2, 2));
      c.add_f32("w", {h}, Role::kIn, random_f32(rng, h, 0.5f, 1.5f));
      c.add_out("out", DType::kF32, {rows, h});
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.rmsnorm(x, a[2], a[0], a[1], 1e-6f);
      };
      return c;
    });
  }
  // In place (the decoder's per-head QK-norm): out aliases x.
  reg("rmsnorm_in_place_R96_H64", [](Rng& rng) {
    ParityCase c;
    c.add_f32("x", {96, 64}, Role::kInOut, random_f32(rng, 96 * 64, -2, 2));
    c.add_f32("w", {64}, Role::kIn, random_f32(rng, 64, 0.5f, 1.5f));
    c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
      return b.rmsnorm(x, a[0], a[0], a[1], 1e-6f);
    };
    return c;
  });
  reg("rmsnorm_rank3_T2_S5_H48", [](Rng& rng) {
    ParityCase c;
    c.add_f32("x", {2, 5, 48}, Role::kIn, random_f32(rng, 480, -2, 2));
    c.add_f32("w", {48}, Role::kIn, random_f32(rng, 48, 0.5f, 1.5f));
    c.add_out("out", DType::kF32, {2, 5, 48});
    c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
      return b.rmsnorm(x, a[2], a[0], a[1], 1e-5f);
    };
    return c;
  });
}

void linear_cases() {
  struct P {
    int64_t m, k, n;
  };
  for (const P p : {P{1, 64, 64}, P{3, 5, 7}, P{1, 256, 1000}, P{33, 257, 129},
                    P{128, 256, 1000}, P{256, 1024, 512}}) {
    const int64_t m = p.m, k = p.k, n = p.n;
    reg("linear" + dims({{"M", m}, {"K", k}, {"N", n}}), [=](Rng& rng) {
      ParityCase c;
      const float amp = 1.0f / std::sqrt(static_cast<float>(k));
      c.add_f32("x", {m, k}, Role::kIn, random_f32(rng, m * k, -1, 1));
      c.add_f32("w", {n, k}, Role::kIn, random_f32(rng, n * k, -amp, amp));
      c.add_out("y", DType::kF32, {m, n});
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.linear(x, a[2], a[0], a[1]);
      };
      return c;
    });
  }
  // BF16 x BF16 with FP32 accumulation (the decoder's dense projections on CUDA): both backends
  // multiply the same BF16 values, so only the summation order differs.
  // CUDA takes 1-4 rows with K % 8 == 0 and N <= 8192 through its own GEMV (linear_decode.cu: a
  // warp per weight row, up to 16 runs of 512 bytes in flight, several rounds past K = 4096),
  // cuBLAS otherwise: both paths, every row count, a partial last CTA (N % 8), K below one run (40)
  // and with a partial last run (2880), two rounds (8200), the decoder's q/k/v and o_proj shapes.
  for (const P p : {P{1, 64, 64}, P{3, 40, 24}, P{1, 2880, 512}, P{33, 257, 129}, P{256, 1024, 512},
                    P{1, 2880, 5120}, P{4, 4096, 2880}, P{2, 8200, 20}, P{4, 2880, 1}, P{3, 2880, 36},
                    P{5, 4096, 2880}, P{32, 2880, 1000}, P{1, 64, 8200}, P{1, 64, 8192}, P{2, 36, 24}}) {
    const int64_t m = p.m, k = p.k, n = p.n;
    reg("linear_bf16" + dims({{"M", m}, {"K", k}, {"N", n}}), [=](Rng& rng) {
      ParityCase c;
      const float amp = 1.0f / std::sqrt(static_cast<float>(k));
      c.add("x", DType::kBF16, {m, k}, Role::kIn, random_bf16(rng, m * k, -1, 1));
      c.add("w", DType::kBF16, {n, k}, Role::kIn, random_bf16(rng, n * k, -amp, amp));
      c.add_out("y", DType::kF32, {m, n});
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.linear(x, a[2], a[0], a[1]);
      };
      return c;
    });
  }
  reg("linear_rank3_B2_S3_K40_N24", [](Rng& rng) {
    ParityCase c;
    c.add_f32("x", {2, 3, 40}, Role::kIn, random_f32(rng, 240, -1, 1));
    c.add_f32("w", {24, 40}, Role::kIn, random_f32(rng, 960, -0.2f, 0.2f));
    c.add_out("y", DType::kF32, {2, 3, 24});
    c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
      return b.linear(x, a[2], a[0], a[1]);
    };
    return c;
  });
}

void add_cases() {
  struct P {
    int64_t r, h;
  };
  for (const P p : {P{1, 1}, P{1, 1000}, P{3, 77}, P{64, 1024}}) {
    const int64_t r = p.r, h = p.h;
    reg("add" + dims({{"R", r}, {"H", h}}), [=](Rng& rng) {
      ParityCase c;
      c.tolerance = 0.0;  // one rounding, the same everywhere
      c.add_f32("a", {r, h}, Role::kIn, random_f32(rng, r * h, -1, 1));
      c.add_f32("b", {r, h}, Role::kIn, random_f32(rng, r * h, -1, 1));
      c.add_out("out", DType::kF32, {r, h});
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.add(x, a[2], a[0], a[1]);
      };
      return c;
    });
  }
}

void rope_cases() {
  struct P {
    int64_t t, heads, d, max_pos;
    float theta;
  };
  for (const P p : {P{1, 1, 2, 8, 10000.0f}, P{5, 3, 64, 64, 10000.0f}, P{17, 4, 128, 4096, 1e6f},
                    P{9, 2, 6, 100000, 500000.0f}}) {
    reg("rope" + dims({{"T", p.t}, {"Heads", p.heads}, {"D", p.d}, {"MaxPos", p.max_pos}}),
        [=](Rng& rng) {
          ParityCase c;
          c.add_f32("x", {p.t, p.heads, p.d}, Role::kInOut,
                    random_f32(rng, p.t * p.heads * p.d, -1, 1));
          std::vector<int32_t> pos(static_cast<size_t>(p.t));
          for (auto& q : pos) q = rng.below(p.max_pos);
          c.add_i32("positions", {p.t}, pos);
          c.run = [theta = p.theta](const Backend& b, const ExecContext& x,
                                    const std::vector<TensorView>& a) {
            return b.rope(x, a[0], a[1], theta);
          };
          return c;
        });
  }
}

void kv_store_cases() {
  struct P {
    int64_t blocks, block_size, kv_heads, d, t, padding;
    bool bf16;  // BF16 caches: every backend rounds each value to nearest even, the same bits
  };
  for (const P p : {P{4, 16, 2, 64, 1, 0, false}, P{4, 16, 2, 64, 5, 2, false}, P{3, 1, 1, 8, 3, 1, false},
                    P{16, 16, 8, 128, 37, 4, false}, P{4, 16, 2, 64, 5, 2, true}, P{3, 1, 1, 6, 3, 1, true},
                    P{16, 16, 8, 128, 37, 4, true}}) {
    reg(std::string(p.bf16 ? "kv_store_bf16" : "kv_store") +
            dims({{"NB", p.blocks}, {"BS", p.block_size}, {"KVH", p.kv_heads}, {"D", p.d}, {"T", p.t},
                  {"Pad", p.padding}}),
        [=](Rng& rng) {
          ParityCase c;
          c.tolerance = 0.0;  // a copy, or the same rounding
          const int64_t cache = p.blocks * p.block_size * p.kv_heads * p.d;
          const int64_t rows = p.t * p.kv_heads * p.d;
          // Caches start random, so a slot written by mistake (or not written) shows.
          const Shape cs{p.blocks, p.block_size, p.kv_heads, p.d};
          if (p.bf16) {
            c.add("k_cache", DType::kBF16, cs, Role::kInOut, random_bf16(rng, cache, -1, 1));
            c.add("v_cache", DType::kBF16, cs, Role::kInOut, random_bf16(rng, cache, -1, 1));
          } else {
            c.add_f32("k_cache", cs, Role::kInOut, random_f32(rng, cache, -1, 1));
            c.add_f32("v_cache", cs, Role::kInOut, random_f32(rng, cache, -1, 1));
          }
          c.add_f32("k", {p.t, p.kv_heads, p.d}, Role::kIn, random_f32(rng, rows, -1, 1));
          c.add_f32("v", {p.t, p.kv_heads, p.d}, Role::kIn, random_f32(rng, rows, -1, 1));
          // Distinct slots: two writers of one slot would race on the GPU.
          std::vector<int32_t> slots(static_cast<size_t>(p.blocks * p.block_size));
          std::iota(slots.begin(), slots.end(), 0);
          rng.shuffle(slots);
          slots.resize(static_cast<size_t>(p.t));
          for (int64_t i = 0; i < p.padding; ++i) slots[static_cast<size_t>(rng.below(p.t))] = -1;
          c.add_i32("slot_mapping", {p.t}, slots);
          c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
            return b.kv_store(x, a[0], a[1], a[2], a[3], a[4]);
          };
          return c;
        });
  }
}

// The BF16 output's bound: CPU and CUDA round FP32 values that differ by ~1e-7
// relative, so an element lands one BF16 step (2^-8 relative) apart only where it straddles a
// rounding boundary; a systematic error (truncation, the wrong half) is ~1e-3.
constexpr double kBf16OutputTolerance = 2e-4;

// Sequences are described by (tokens already in the cache + new tokens, new tokens): the
// new tokens are the last positions, token i of them seeing ctx = total - new + i + 1.
// Decode is new = 1; prefill is new = total; chunked prefill anything between.
struct SeqSpec {
  int64_t total, fresh;
};

ParityCase attention_case(Rng& rng, std::vector<SeqSpec> seqs, int64_t q_heads, int64_t kv_heads,
                          int64_t d, int64_t block_size, int64_t padding_tokens, bool sinks = false,
                          int64_t window = 0, bool out_bf16 = false, bool split = false,
                          int32_t split_ctas = 0, bool kv_bf16 = false) {
  ParityCase c;
  int64_t max_blocks = 1, blocks_needed = 0, num_tokens = padding_tokens;
  for (const auto& s : seqs) {
    const int64_t nb = (s.total + block_size - 1) / block_size;
    max_blocks = std::max(max_blocks, nb + 1);  // one spare entry that must never be followed
    blocks_needed += nb;
    num_tokens += s.fresh;
  }
  const int64_t num_blocks = blocks_needed + 3;  // a few blocks nobody owns
  const int64_t cache = num_blocks * block_size * kv_heads * d;
  c.add_f32("q", {num_tokens, q_heads, d}, Role::kIn,
            random_f32(rng, num_tokens * q_heads * d, -2, 2));
  // BF16 caches (kv_store's rounding): both backends widen the same bits, so the FP32 bound holds.
  if (kv_bf16) {
    c.add("k_cache", DType::kBF16, {num_blocks, block_size, kv_heads, d}, Role::kIn, random_bf16(rng, cache, -1, 1));
    c.add("v_cache", DType::kBF16, {num_blocks, block_size, kv_heads, d}, Role::kIn, random_bf16(rng, cache, -1, 1));
  } else {
    c.add_f32("k_cache", {num_blocks, block_size, kv_heads, d}, Role::kIn, random_f32(rng, cache, -1, 1));
    c.add_f32("v_cache", {num_blocks, block_size, kv_heads, d}, Role::kIn, random_f32(rng, cache, -1, 1));
  }
  // Blocks handed out in shuffled order: tables are not contiguous ranges.
  std::vector<int32_t> free_blocks(static_cast<size_t>(num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  rng.shuffle(free_blocks);
  const auto num_seqs = static_cast<int64_t>(seqs.size());
  std::vector<int32_t> table(static_cast<size_t>(num_seqs * max_blocks), -1);
  size_t next_free = 0;
  std::vector<int32_t> seq_of, ctx_len;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqSpec spec = seqs[static_cast<size_t>(s)];
    const int64_t nb = (spec.total + block_size - 1) / block_size;
    for (int64_t j = 0; j < nb; ++j) table[static_cast<size_t>(s * max_blocks + j)] = free_blocks[next_free++];
    for (int64_t i = 0; i < spec.fresh; ++i) {
      seq_of.push_back(static_cast<int32_t>(s));
      ctx_len.push_back(static_cast<int32_t>(spec.total - spec.fresh + i + 1));
    }
  }
  for (int64_t i = 0; i < padding_tokens; ++i) {  // padding rows: see nothing, output zero
    seq_of.push_back(0);
    ctx_len.push_back(0);
  }
  c.add_i32("block_tables", {num_seqs, max_blocks}, table);
  c.add_i32("seq_of", {num_tokens}, seq_of);
  c.add_i32("ctx_len", {num_tokens}, ctx_len);
  // BF16 out (the decoder's o_proj input): the FP32 result rounded once.
  const size_t out_i = c.add_out("out", out_bf16 ? DType::kBF16 : DType::kF32, {num_tokens, q_heads, d});
  if (out_bf16) c.tensors[out_i].tolerance = kBf16OutputTolerance;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  if (!sinks && window == 0 && !split) {
    c.run = [scale](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
      return b.paged_attention(x, a[6], a[0], a[1], a[2], a[3], a[4], a[5], scale);
    };
    return c;
  }
  // gpt-oss: sinks comparable to the scores (some heads' sinks dominate), a sliding window.
  c.add_f32("sinks", {q_heads}, Role::kIn, random_f32(rng, q_heads, -2, 3));
  // Split rows: the workspace, zero-filled (an input: its contents after the call are scratch).
  if (split)
    c.add("workspace", DType::kU8, {paged_attention_workspace_bytes(num_tokens, q_heads, d)}, Role::kIn,
          std::vector<uint8_t>(static_cast<size_t>(paged_attention_workspace_bytes(num_tokens, q_heads, d)), 0));
  c.run = [scale, sinks, window, split, split_ctas](const Backend& b, const ExecContext& x,
                                                     const std::vector<TensorView>& a) {
    AttentionOptions o;
    o.sinks = sinks ? a[7] : TensorView{};
    o.window = window;
    o.workspace = split ? a[8] : TensorView{};
    o.split_ctas = split_ctas;
    return b.paged_attention_ex(x, a[6], a[0], a[1], a[2], a[3], a[4], a[5], scale, o);
  };
  return c;
}

// BF16 caches at D = 64 take CUDA's tensor-core kernel (split or not), which rounds q and p to
// BF16 for the mma (scores, softmax and sums stay FP32): its rows are within BF16 tolerance of the
// FP32-q reference (DESIGN: BF16 ~ 1e-2), not within FP32's.
ParityCase mma_bound(ParityCase c) {
  for (auto& t : c.tensors)
    if (t.name == "out") t.tolerance = 1e-2;
  return c;
}

void attention_cases() {
  reg("paged_attention_decode_single_token_ctx1", [](Rng& rng) {
    return attention_case(rng, {{1, 1}}, 4, 4, 64, 16, 0);
  });
  reg("paged_attention_decode_batch_multiblock_gqa", [](Rng& rng) {
    return attention_case(rng, {{37, 1}, {1, 1}, {100, 1}, {16, 1}}, 8, 2, 128, 16, 0);
  });
  reg("paged_attention_prefill_gqa_QH8_KVH2", [](Rng& rng) {
    return attention_case(rng, {{40, 40}}, 8, 2, 64, 16, 0);
  });
  reg("paged_attention_chunked_prefill_and_decode_with_padding", [](Rng& rng) {
    return attention_case(rng, {{50, 13}, {9, 1}, {23, 23}}, 4, 1, 64, 8, 3);
  });
  reg("paged_attention_odd_head_dim_D40_block3", [](Rng& rng) {
    return attention_case(rng, {{11, 4}, {7, 7}}, 6, 3, 40, 3, 1);
  });
  reg("paged_attention_D256_block1", [](Rng& rng) {
    return attention_case(rng, {{5, 2}}, 2, 1, 256, 1, 0);
  });
  reg("paged_attention_long_context_1000", [](Rng& rng) {
    return attention_case(rng, {{1000, 1}, {777, 2}}, 16, 4, 128, 16, 0);
  });
  // The CUDA kernel takes up to 8 query heads of one KV head per CTA: more than 8 per KV head
  // (a second CTA per KV head), 16 and 64 of them, and head dimensions off the common ones
  // (10: the scalar path; 16, 200, 512: the float4 path with 4, 64 and 128 lanes of 4).
  reg("paged_attention_gqa_QH16_KVH1_D64", [](Rng& rng) {
    return attention_case(rng, {{70, 1}, {9, 9}}, 16, 1, 64, 16, 0);
  });
  reg("paged_attention_gqa_QH64_KVH4_D128", [](Rng& rng) {
    return attention_case(rng, {{33, 1}, {300, 1}}, 64, 4, 128, 16, 1);
  });
  reg("paged_attention_ex_sinks_QH2_KVH1_D512", [](Rng& rng) {
    return attention_case(rng, {{20, 3}}, 2, 1, 512, 4, 0, true, 0);
  });
  // The CUDA kernel takes 2 query heads per CTA while the grid with 8 would be at most 64 CTAs
  // and a KV head has more than 2 (most decode cases above; a prefill of 40 tokens is past it);
  // the next two grids are larger (8 heads per CTA), the D 512 one takes 2 heads per CTA with 128
  // lanes of 4 dimensions (the group partial sums fill its q buffer exactly).
  reg("paged_attention_prefill_300_tokens_QH8_KVH1", [](Rng& rng) {
    return attention_case(rng, {{300, 300}}, 8, 1, 64, 16, 0);
  });
  reg("paged_attention_ex_sinks_window_prefill_QH16_KVH2", [](Rng& rng) {
    return attention_case(rng, {{200, 90}, {40, 1}}, 16, 2, 64, 16, 2, true, 33);
  });
  reg("paged_attention_decode_QH8_KVH1_D512", [](Rng& rng) {
    return attention_case(rng, {{45, 1}, {7, 1}}, 8, 1, 512, 8, 0);
  });
  reg("paged_attention_QH3_KVH1_D200", [](Rng& rng) {
    return attention_case(rng, {{140, 1}, {5, 5}}, 3, 1, 200, 8, 0);
  });
  reg("paged_attention_QH4_KVH2_D16", [](Rng& rng) {
    return attention_case(rng, {{17, 2}}, 4, 2, 16, 16, 0);
  });
  reg("paged_attention_ex_window5_QH2_KVH1_D10", [](Rng& rng) {
    return attention_case(rng, {{23, 4}, {3, 1}}, 2, 1, 10, 3, 1, true, 5);
  });
  // The CUDA kernel's shared-memory V path (and its next-chunk K prefetch in small grids) at every
  // head dimension it takes, D / 4 = 1, 2, 8 (16 above, 64 throughout): rows over several
  // 128-key chunks, a last chunk of one key, short rows, a window, a split.
  reg("paged_attention_multichunk_D32_QH8_KVH1", [](Rng& rng) {
    return attention_case(rng, {{300, 1}, {129, 1}, {5, 1}, {260, 3}}, 8, 1, 32, 16, 1);
  });
  reg("paged_attention_split_multichunk_D8_QH4_KVH2", [](Rng& rng) {
    return attention_case(rng, {{700, 1}, {257, 1}, {40, 1}}, 4, 2, 8, 8, 0, false, 0, false, true);
  });
  reg("paged_attention_ex_multichunk_window200_D4_QH2_KVH1", [](Rng& rng) {
    return attention_case(rng, {{400, 2}, {130, 1}}, 2, 1, 4, 16, 0, true, 200);
  });
  // gpt-oss options: sinks alone, a window alone (prefill crossing it, decode far past it, a
  // context shorter than it), both with padding rows.
  reg("paged_attention_ex_sinks_decode_and_prefill", [](Rng& rng) {
    return attention_case(rng, {{37, 1}, {12, 12}, {1, 1}}, 8, 2, 64, 16, 0, true, 0);
  });
  reg("paged_attention_ex_window8_prefill_and_decode", [](Rng& rng) {
    return attention_case(rng, {{40, 40}, {300, 1}, {5, 5}}, 4, 2, 64, 16, 0, false, 8);
  });
  reg("paged_attention_ex_sinks_window128_chunked_padding", [](Rng& rng) {
    return attention_case(rng, {{200, 30}, {129, 1}, {128, 1}, {9, 2}}, 8, 1, 64, 16, 2, true, 128);
  });
  reg("paged_attention_ex_window1_block3", [](Rng& rng) {
    return attention_case(rng, {{11, 4}, {7, 7}}, 6, 3, 40, 3, 1, true, 1);
  });
  // BF16 output, plain and with gpt-oss options, padding rows (zeros) included.
  reg("paged_attention_bf16_out_gqa_padding", [](Rng& rng) {
    return attention_case(rng, {{37, 1}, {1, 1}, {100, 1}, {16, 16}}, 8, 2, 64, 16, 2, false, 0, true);
  });
  reg("paged_attention_ex_bf16_out_sinks_window8_D200", [](Rng& rng) {
    return attention_case(rng, {{40, 40}, {300, 1}}, 16, 2, 200, 16, 1, true, 8, true);
  });
  // Split rows (AttentionOptions::workspace): a row past 256 keys is cut into at most 16 parts of
  // whole 128-key chunks (2 at least) and combined by the row's last CTA. Contexts at and around
  // the bounds: 256 (one part, the unsplit kernel), 257 (two parts, the second of one key), 1000
  // (4 parts of 2 chunks), 2048 (8 of 2), 5000 (40 chunks: 14 parts of 3, the last of one chunk
  // holding 8 keys); windows inside one part and across parts, sinks, padding rows, BF16 out, 2
  // and 8 query heads per CTA, and CTAs taking all parts of a row, 1, or 3 at a time.
  reg("paged_attention_split_decode_contexts_QH8_KVH2", [](Rng& rng) {
    return attention_case(rng, {{256, 1}, {257, 1}, {2048, 1}, {5000, 1}, {1000, 1}, {3, 1}}, 8, 2, 64, 16, 2,
                          false, 0, false, true);
  });
  reg("paged_attention_split_sinks_window700_chunked_QH16_KVH2", [](Rng& rng) {
    return attention_case(rng, {{1500, 5}, {700, 1}, {701, 1}, {2000, 1}}, 16, 2, 64, 16, 1, true, 700, false,
                          true);
  });
  reg("paged_attention_split_bf16_out_sinks_QH64_KVH8_D64", [](Rng& rng) {
    return attention_case(rng, {{1300, 1}, {40, 1}, {600, 1}}, 64, 8, 64, 16, 0, true, 0, true, true);
  });
  reg("paged_attention_split_one_cta_per_row_D128", [](Rng& rng) {
    return attention_case(rng, {{3000, 1}, {520, 2}}, 8, 1, 128, 16, 0, false, 0, false, true, 1);
  });
  reg("paged_attention_split_three_ctas_per_row_sinks_D16", [](Rng& rng) {
    return attention_case(rng, {{1800, 1}, {300, 3}}, 4, 2, 16, 8, 1, true, 0, false, true, 3);
  });
  reg("paged_attention_split_scalar_path_D42_ignores_workspace", [](Rng& rng) {
    return attention_case(rng, {{900, 1}, {11, 4}}, 6, 3, 42, 3, 1, true, 0, false, true);
  });
  // BF16 caches on every path of the CUDA kernels: shared-memory V with and without the next
  // chunk's K ahead (D 64, 16 and 8: rows of 8, 2 and 1 16-byte pieces; 2 and 8 heads a CTA),
  // register V (D 4: under one piece; D 40: 5 pieces; D 128: past the shared-memory bound), the
  // scalar path (D 42), the tensor-core kernel at D 64 split and unsplit, sinks, windows, padding
  // rows and a BF16 out.
  reg("paged_attention_kv_bf16_decode_multichunk_QH64_KVH8_D64", [](Rng& rng) {  // 32 CTAs: unsplit, few
    return mma_bound(attention_case(rng, {{700, 1}, {129, 1}, {5, 1}}, 64, 8, 64, 16, 1, true, 0, true, false, 0, true));
  });
  reg("paged_attention_kv_bf16_prefill_window128_QH16_KVH2_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{300, 40}, {260, 1}}, 16, 2, 64, 16, 2, true, 128, false, false, 0, true));
  });
  // The tensor-core kernel's own cases (BF16 caches, D 64, unsplit grids of more than 64 8-head
  // CTAs): decode rows from 1 to 1,000 keys (tiles of 32 split over 4 warps, some warps with
  // none) with sinks and padding; a window with a BF16 out; 64 query heads of one KV head (4
  // CTAs of 16 heads a token).
  reg("paged_attention_kv_bf16_mma_decode_sinks_QH64_KVH8_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{700, 1}, {129, 1}, {5, 1}, {33, 1}, {300, 1}, {1, 1}, {64, 1}, {65, 1},
                                          {1000, 1}, {17, 1}},
                                    64, 8, 64, 16, 2, true, 0, false, false, 0, true));
  });
  reg("paged_attention_kv_bf16_mma_window128_bf16_out_QH16_KVH2_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{400, 36}, {129, 1}, {127, 1}}, 16, 2, 64, 16, 1, false, 128, true, false, 0,
                                    true));
  });
  reg("paged_attention_kv_bf16_mma_head_groups_QH64_KVH1_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{150, 40}}, 64, 1, 64, 16, 0, true, 0, false, false, 0, true));
  });
  reg("paged_attention_kv_bf16_multichunk_D16_QH4_KVH2", [](Rng& rng) {
    return attention_case(rng, {{400, 1}, {200, 3}}, 4, 2, 16, 8, 0, false, 0, false, false, 0, true);
  });
  reg("paged_attention_kv_bf16_multichunk_D8_QH8_KVH1", [](Rng& rng) {
    return attention_case(rng, {{300, 1}, {130, 2}}, 8, 1, 8, 16, 1, false, 0, false, false, 0, true);
  });
  reg("paged_attention_kv_bf16_D4_window200_QH2_KVH1", [](Rng& rng) {
    return attention_case(rng, {{400, 2}, {130, 1}}, 2, 1, 4, 16, 0, true, 200, false, false, 0, true);
  });
  reg("paged_attention_kv_bf16_D40_block3", [](Rng& rng) {
    return attention_case(rng, {{140, 4}, {7, 7}}, 6, 3, 40, 3, 1, true, 0, false, false, 0, true);
  });
  reg("paged_attention_kv_bf16_D128_QH8_KVH2", [](Rng& rng) {
    return attention_case(rng, {{300, 1}, {33, 2}}, 8, 2, 128, 16, 0, false, 0, false, false, 0, true);
  });
  reg("paged_attention_kv_bf16_scalar_D42", [](Rng& rng) {
    return attention_case(rng, {{150, 1}, {11, 4}}, 6, 3, 42, 3, 1, true, 0, false, false, 0, true);
  });
  // Split rows over BF16 caches at D 64: the tensor-core kernel's split form (257 keys: parts of
  // 256 and 1; 5,000: 14 parts of 384; a window of 700 keys in 3 parts).
  reg("paged_attention_kv_bf16_split_sinks_QH8_KVH2_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{2048, 1}, {257, 1}, {5000, 1}, {3, 1}}, 8, 2, 64, 16, 1, true, 0, false,
                                    true, 0, true));
  });
  reg("paged_attention_kv_bf16_split_window700_bf16_out_QH64_KVH8_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{1500, 1}, {701, 1}}, 64, 8, 64, 16, 0, true, 700, true, true, 0, true));
  });
  reg("paged_attention_kv_bf16_split_three_ctas_head_groups_QH64_KVH1_D64", [](Rng& rng) {
    return mma_bound(attention_case(rng, {{1100, 1}, {40, 1}, {2000, 1}}, 64, 1, 64, 16, 0, true, 0, false, true, 3,
                                    true));
  });
}

// gpt-oss ops: rotary from a frequency table, bias add, transpose.
void gpt_oss_op_cases() {
  struct R {
    int64_t t, heads, d, max_pos;
    float scale;
  };
  for (const R p : {R{1, 1, 2, 8, 1.0f}, R{17, 4, 64, 131072, 1.3465736f}, R{9, 2, 6, 4096, 0.5f}}) {
    reg("rope_table" + dims({{"T", p.t}, {"Heads", p.heads}, {"D", p.d}, {"MaxPos", p.max_pos}}), [=](Rng& rng) {
      ParityCase c;
      c.add_f32("x", {p.t, p.heads, p.d}, Role::kInOut, random_f32(rng, p.t * p.heads * p.d, -1, 1));
      std::vector<int32_t> pos(static_cast<size_t>(p.t));
      for (auto& q : pos) q = rng.below(p.max_pos);
      c.add_i32("positions", {p.t}, pos);
      c.add_f32("inv_freq", {p.d / 2}, Role::kIn, random_f32(rng, p.d / 2, 1e-4f, 1.0f));
      c.run = [scale = p.scale](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.rope_table(x, a[0], a[1], a[2], scale);
      };
      return c;
    });
  }
  struct B {
    int64_t r, n;
  };
  for (const B p : {B{1, 1}, B{7, 33}, B{64, 2880}}) {
    reg("add_bias" + dims({{"R", p.r}, {"N", p.n}}), [=](Rng& rng) {
      ParityCase c;
      c.tolerance = 0.0;  // one rounding
      c.add_f32("y", {p.r, p.n}, Role::kInOut, random_f32(rng, p.r * p.n, -1, 1));
      c.add_f32("bias", {p.n}, Role::kIn, random_f32(rng, p.n, -1, 1));
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.add_bias(x, a[0], a[1]);
      };
      return c;
    });
  }
  struct T {
    int64_t b, r, c;
    bool bf16;
  };
  for (const T p : {T{1, 1, 1, false}, T{3, 33, 70, false}, T{2, 64, 96, true}, T{1, 100, 7, true}}) {
    reg("transpose" + dims({{"B", p.b}, {"R", p.r}, {"C", p.c}}) + (p.bf16 ? "_bf16" : "_f32"), [=](Rng& rng) {
      ParityCase c;
      c.tolerance = 0.0;  // a permutation
      const int64_t n = p.b * p.r * p.c;
      if (p.bf16) {
        std::vector<uint8_t> bytes(static_cast<size_t>(n) * 2);
        for (auto& v : bytes) v = static_cast<uint8_t>(rng.below(120));  // finite BF16 values
        c.add("src", DType::kBF16, {p.b, p.r, p.c}, Role::kIn, bytes);
        c.add_out("dst", DType::kBF16, {p.b, p.c, p.r});
      } else {
        c.add_f32("src", {p.b, p.r, p.c}, Role::kIn, random_f32(rng, n, -1, 1));
        c.add_out("dst", DType::kF32, {p.b, p.c, p.r});
      }
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.transpose(x, a[1], a[0]);
      };
      return c;
    });
  }
}

void router_cases() {
  struct P {
    int64_t t, e, k;
    bool renormalize;
    int levels;  // > 0: logits drawn from this many values, so exact ties are common
  };
  for (const P p : {P{1, 8, 2, true, 0}, P{33, 64, 8, false, 0}, P{5, 3, 3, true, 0},
                    P{100, 128, 4, true, 0}, P{64, 16, 4, false, 4}, P{17, 40, 6, true, 3}}) {
    reg("router_softmax_topk" + dims({{"T", p.t}, {"E", p.e}, {"K", p.k}}) +
            (p.renormalize ? "_renorm" : "_plain") + (p.levels ? "_ties" : ""),
        [=](Rng& rng) {
          ParityCase c;
          std::vector<float> logits = random_f32(rng, p.t * p.e, -3, 3);
          if (p.levels)
            for (float& l : logits) l = static_cast<float>(rng.below(p.levels)) - 1.0f;
          c.add_f32("logits", {p.t, p.e}, Role::kIn, logits);
          c.add_out("ids", DType::kI32, {p.t, p.k});
          c.add_out("weights", DType::kF32, {p.t, p.k});
          c.run = [renorm = p.renormalize](const Backend& b, const ExecContext& x,
                                           const std::vector<TensorView>& a) {
            return b.router_softmax_topk(x, a[1], a[2], a[0], renorm);
          };
          return c;
        });
  }
}

// Backend::router: the gate GEMM, the bias and the selection. CUDA takes one launch up to 64
// tokens (a thread block cluster per token, its own dot-product order), or above 64 experts and
// up to 16 tokens two (the spread kernels: the same sums; 97 experts leave a CTA's last warp
// without a row, H = 4000 takes two rounds of loads), cuBLAS + two kernels above 64 tokens;
// H % 4 != 0 takes the three ops at any T. Ids must be equal: the random logits' gaps are
// far above the FP32 summation-order differences (an equal-logit tie cannot arise from random
// products).
void router_fused_cases() {
  struct P {
    int64_t t, h, e, k;
    bool bias, renormalize;
  };
  for (const P p : {P{1, 2880, 32, 4, true, true}, P{1, 2048, 128, 8, false, true}, P{7, 64, 8, 2, true, false},
                    P{64, 2880, 128, 4, true, true}, P{65, 256, 16, 4, false, false}, P{130, 2880, 32, 4, true, true},
                    P{3, 102, 12, 3, true, false}, P{2, 512, 1024, 8, false, true}, P{16, 2880, 128, 4, true, true},
                    P{3, 4000, 97, 2, false, false}}) {
    reg("router" + dims({{"T", p.t}, {"H", p.h}, {"E", p.e}, {"K", p.k}}) + (p.bias ? "_bias" : "") +
            (p.renormalize ? "_renorm" : "_plain"),
        [=](Rng& rng) {
          ParityCase c;
          c.add_f32("x", {p.t, p.h}, Role::kIn, random_f32(rng, p.t * p.h, -1, 1));
          c.add_f32("w", {p.e, p.h}, Role::kIn, random_f32(rng, p.e * p.h, -0.05f, 0.05f));
          c.add_f32("bias", {p.e}, Role::kIn, random_f32(rng, p.e, -0.1f, 0.1f));
          c.add_out("logits", DType::kF32, {p.t, p.e});
          c.add_out("ids", DType::kI32, {p.t, p.k});
          c.add_out("weights", DType::kF32, {p.t, p.k});
          c.run = [p](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
            RouterArgs r;
            r.x = a[0];
            r.w = a[1];
            if (p.bias) r.bias = a[2];
            r.logits = a[3];
            r.ids = a[4];
            r.weights = a[5];
            r.renormalize = p.renormalize;
            return b.router(x, r);
          };
          return c;
        });
  }
}

void moe_cases() {
  struct P {
    int64_t t, valid, h, inter, e_logical, e_phys, k;
  };
  for (const P p : {P{1, 1, 64, 32, 4, 4, 2}, P{13, 10, 48, 40, 8, 10, 2},
                    P{64, 64, 256, 128, 16, 16, 4}, P{7, 7, 33, 17, 5, 7, 3},
                    P{8, 0, 32, 16, 4, 4, 2},
                    // With a workspace: padding counted on the device, opt-in shared memory for
                    // the down kernel's K x I row, many tokens.
                    P{2, 1, 40, 24, 8, 8, 2}, P{1, 1, 32, 4096, 4, 4, 4}, P{600, 590, 32, 16, 8, 8, 4},
                    P{13, 10, 96, 64, 8, 10, 2}}) {
  // With padding, the count also comes from device memory (a graph replay's count) instead of
  // the host argument.
  // Variant 2 adds the workspace: the CUDA op's two-kernel path (decode-shaped grids).
  // Variant 3: the gpt-oss activation (a small clamp limit, so the clamps bind often) with expert
  // biases, on the two-kernel path; variant 4 the same on the one-block path; variants 5 and 6
  // those two with MXFP4 experts (H and I multiples of 32 only).
  for (const int variant : {0, 1, 2, 3, 4, 5, 6}) {
    const bool mxfp4 = variant >= 5;
    if (mxfp4 && (p.h % 32 != 0 || p.inter % 32 != 0)) continue;
    const bool gpt_oss = variant >= 3;
    const bool device_count = (variant == 1 || variant == 2 || variant == 3 || variant == 5) && p.valid != p.t,
               workspace = variant == 2 || variant == 3 || variant == 5;
    if (variant == 1 && !device_count) continue;
    reg("moe_experts" + dims({{"T", p.t}, {"Valid", p.valid}, {"H", p.h}, {"I", p.inter},
                              {"El", p.e_logical}, {"Ep", p.e_phys}, {"K", p.k}}) +
            (device_count ? "_devcount" : "") + (workspace ? "_ws" : "") + (gpt_oss ? "_gptoss_bias" : "") +
            (mxfp4 ? "_mxfp4" : ""),
        [=](Rng& rng) {
          ParityCase c;
          const float amp_in = 1.0f / std::sqrt(static_cast<float>(p.h));
          const float amp_down = 1.0f / std::sqrt(static_cast<float>(p.inter));
          c.add_f32("x", {p.t, p.h}, Role::kIn, random_f32(rng, p.t * p.h, -1, 1));
          c.add_f32("w_gate_up", {p.e_phys, 2 * p.inter, p.h}, Role::kIn,
                    random_f32(rng, p.e_phys * 2 * p.inter * p.h, -amp_in, amp_in));
          c.add_f32("w_down", {p.e_phys, p.h, p.inter}, Role::kIn,
                    random_f32(rng, p.e_phys * p.h * p.inter, -amp_down, amp_down));
          // Real rows route to k distinct logical experts, as a router would; padding rows
          // carry garbage that must never be read.
          std::vector<int32_t> ids(static_cast<size_t>(p.t * p.k));
          for (int64_t t = 0; t < p.t; ++t) {
            std::vector<int32_t> experts(static_cast<size_t>(p.e_logical));
            std::iota(experts.begin(), experts.end(), 0);
            rng.shuffle(experts);
            for (int64_t k = 0; k < p.k; ++k)
              ids[static_cast<size_t>(t * p.k + k)] =
                  t < p.valid ? experts[static_cast<size_t>(k)] : -1000000 - static_cast<int32_t>(k);
          }
          c.add_i32("topk_ids", {p.t, p.k}, ids);
          c.add_f32("topk_weights", {p.t, p.k}, Role::kIn, random_f32(rng, p.t * p.k, 0.05f, 1));
          // Identity when there are as many slots as experts, else a scattered placement
          // into more slots than experts (as redundant replicas leave it).
          std::vector<int32_t> slots(static_cast<size_t>(p.e_phys));
          std::iota(slots.begin(), slots.end(), 0);
          if (p.e_phys != p.e_logical) rng.shuffle(slots);
          slots.resize(static_cast<size_t>(p.e_logical));
          c.add_i32("logical_to_physical", {p.e_logical}, slots);
          c.add_out("out", DType::kF32, {p.t, p.h});
          c.add_i32("num_valid_device", {1}, {static_cast<int32_t>(p.valid)});
          c.add_f32("workspace", {p.t * p.k * p.inter}, Role::kIn,
                    std::vector<float>(static_cast<size_t>(p.t * p.k * p.inter), 0.0f));
          // Half the shapes read the experts' gate/up rows interleaved (the registry's kernel
          // layout), half concatenated.
          const bool interleaved = (p.e_phys + p.t) % 2 == 1;
          c.add_f32("b_gate_up", {p.e_phys, 2 * p.inter}, Role::kIn, random_f32(rng, p.e_phys * 2 * p.inter, -0.5f, 0.5f));
          c.add_f32("b_down", {p.e_phys, p.h}, Role::kIn, random_f32(rng, p.e_phys * p.h, -0.5f, 0.5f));
          // MXFP4 experts: random element codes, scales around 2^0 (codes 120..131).
          auto mx_bytes = [&](int64_t n, int lo, int span) {
            std::vector<uint8_t> v(static_cast<size_t>(n));
            for (auto& b : v) b = static_cast<uint8_t>(lo + rng.below(span));
            return v;
          };
          c.add("gu_blocks", DType::kU8, {p.e_phys, 2 * p.inter, p.h / 32, 16}, Role::kIn,
                mx_bytes(p.e_phys * 2 * p.inter * (p.h / 32) * 16, 0, 256));
          c.add("gu_scales", DType::kU8, {p.e_phys, 2 * p.inter, p.h / 32}, Role::kIn,
                mx_bytes(p.e_phys * 2 * p.inter * (p.h / 32), 118, 8));
          c.add("dn_blocks", DType::kU8, {p.e_phys, p.h, p.inter / 32, 16}, Role::kIn,
                mx_bytes(p.e_phys * p.h * (p.inter / 32) * 16, 0, 256));
          c.add("dn_scales", DType::kU8, {p.e_phys, p.h, p.inter / 32}, Role::kIn,
                mx_bytes(p.e_phys * p.h * (p.inter / 32), 118, 8));
          c.run = [valid = p.valid, t = p.t, interleaved, device_count, workspace, gpt_oss, mxfp4](
                      const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
            MoeExpertsArgs args;
            args.gate_up_interleaved = interleaved;
            args.x = a[0];
            args.w_gate_up = a[1];
            args.w_down = a[2];
            args.topk_ids = a[3];
            args.topk_weights = a[4];
            args.logical_to_physical = a[5];
            args.out = a[6];
            args.num_valid_tokens = device_count ? -1 : (valid == t ? -1 : valid);
            if (device_count) args.num_valid_device = a[7];
            if (workspace) args.workspace = a[8];
            if (gpt_oss) {
              args.activation = MoeExpertsArgs::Activation::kGptOss;
              args.swiglu_limit = 0.3f;
              args.swiglu_alpha = 1.702f;
              args.b_gate_up = a[9];
              args.b_down = a[10];
            }
            if (mxfp4) {
              args.w_gate_up_blocks = a[11];
              args.w_gate_up_scales = a[12];
              args.w_down_blocks = a[13];
              args.w_down_scales = a[14];
            }
            return b.moe_experts(x, args);
          };
          return c;
        });
  }
  }
}

// Routed-expert capture of a padded step: rows below the device-held count copied, the rest
// filled.
void copy_valid_rows_cases() {
  struct P {
    int64_t t, c, count;
  };
  for (const P p : {P{1, 1, 1}, P{8, 4, 3}, P{5, 8, 0}, P{16, 6, 16}, P{300, 8, 257}}) {
    reg("copy_valid_rows" + dims({{"T", p.t}, {"C", p.c}, {"N", p.count}}), [=](Rng& rng) {
      ParityCase c;
      std::vector<int32_t> src(static_cast<size_t>(p.t * p.c));
      for (auto& v : src) v = static_cast<int32_t>(rng.below(1000));
      c.add_i32("src", {p.t, p.c}, src);
      c.add_i32("count", {1}, {static_cast<int32_t>(p.count)});
      c.add_out("dst", DType::kI32, {p.t, p.c});
      c.run = [](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        return b.copy_valid_rows(x, a[2], a[0], a[1], -1);
      };
      return c;
    });
  }
}

// Fused decoder ops. add_rmsnorm: every combination of residual and outputs, on the shapes that
// take each CUDA path (register kernel at 1/2/4/8 float4s per thread, the loop for H % 4 != 0
// and H > 8192). BF16 outputs: kBf16OutputTolerance (above attention_case).

void fused_op_cases() {
  struct P {
    int64_t rows, h;
  };
  enum Outputs { kF32 = 1, kBf16 = 2, kBoth = 3 };
  const auto add_rmsnorm_case = [](const char* name, P p, bool residual, int outputs, bool alias_out = false,
                                   bool bias = false) {
    reg(std::string(name) + dims({{"R", p.rows}, {"H", p.h}}), [=](Rng& rng) {
      ParityCase c;
      const int64_t rows = p.rows, h = p.h;
      c.add_f32("h", {rows, h}, Role::kInOut, random_f32(rng, rows * h, -2, 2));
      const size_t r = residual ? c.add_f32("r", {rows, h}, Role::kIn, random_f32(rng, rows * h, -1, 1)) : 0;
      const size_t rb = bias ? c.add_f32("r_bias", {h}, Role::kIn, random_f32(rng, h, -0.5f, 0.5f)) : 0;
      const size_t w = c.add_f32("w", {h}, Role::kIn, random_f32(rng, h, 0.5f, 1.5f));
      const size_t out = (outputs & kF32) && !alias_out ? c.add_out("out", DType::kF32, {rows, h}) : 0;
      const size_t out_b = (outputs & kBf16) ? c.add_out("out_bf16", DType::kBF16, {rows, h}) : 0;
      if (out_b) c.tensors[out_b].tolerance = kBf16OutputTolerance;
      c.run = [=](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        const TensorView none;
        const TensorView o = alias_out ? a[0] : (out ? a[out] : none);
        return b.add_rmsnorm(x, o, out_b ? a[out_b] : none, a[0], residual ? a[r] : none, bias ? a[rb] : none, a[w],
                             1e-6f);
      };
      return c;
    });
  };
  for (const P p : {P{1, 64}, P{7, 33}, P{130, 1000}, P{3, 4096}, P{1, 2880}, P{2, 8192}, P{5, 16}, P{1, 9000},
                    P{4, 2048}, P{32, 2880}})
    add_rmsnorm_case("add_rmsnorm", p, true, kBoth);
  // With o_proj's bias (gpt-oss): the register kernel, the loop (H % 4 != 0, H > 8192), the add alone.
  for (const P p : {P{1, 2880}, P{32, 2880}, P{7, 33}, P{1, 9000}})
    add_rmsnorm_case("add_rmsnorm_r_bias", p, true, kBoth, false, true);
  add_rmsnorm_case("add_rmsnorm_r_bias_f32_only", P{4, 2880}, true, kF32, false, true);
  add_rmsnorm_case("add_rmsnorm_r_bias_no_output", P{3, 77}, true, 0, false, true);
  add_rmsnorm_case("add_rmsnorm_bf16_only", P{1, 2880}, true, kBf16);
  add_rmsnorm_case("add_rmsnorm_bf16_only", P{7, 33}, true, kBf16);
  add_rmsnorm_case("add_rmsnorm_f32_only", P{4, 2880}, true, kF32);
  add_rmsnorm_case("add_rmsnorm_no_output", P{3, 77}, true, 0);
  add_rmsnorm_case("add_rmsnorm_out_is_h", P{3, 2880}, true, kF32, true);
  add_rmsnorm_case("add_rmsnorm_out_is_h", P{2, 9000}, true, kF32, true);
  add_rmsnorm_case("rmsnorm_bf16", P{1, 2880}, false, kBf16);
  add_rmsnorm_case("rmsnorm_bf16", P{3, 4096}, false, kBf16);
  add_rmsnorm_case("rmsnorm_bf16", P{7, 33}, false, kBf16);
  add_rmsnorm_case("rmsnorm_f32_and_bf16", P{16, 2880}, false, kBoth);
  add_rmsnorm_case("rmsnorm_f32_and_bf16", P{2, 9000}, false, kBoth);

  // rope_qk: q and k in one launch, theta or table frequencies, with or without the QK-norm;
  // D below, at and above one warp's pairs (2, 6, 64, 128, 200), GQA ratios 1-8.
  struct R {
    int64_t t, qh, kvh, d, max_pos;
    bool table, norm;
    float theta_or_scale;
  };
  // fused: the qkv form (rows q | k | v of one projection in; q, k written rotated, v copied);
  // bias: with the projections' biases (gpt-oss), fused form only; store: with the KV caches and
  // slots (fused form only: k and v also written at each token's slot, one padding row).
  const auto rope_qk_case = [](const R p, bool fused, bool bias, bool store = false, bool store_bf16 = false) {
    const std::string name = std::string(fused ? "rope_qk_qkv_" : "rope_qk_") + (p.table ? "table" : "theta") +
                             (p.norm ? "_qknorm" : "") + (bias ? "_bias" : "") + (store ? "_store" : "") +
                             (store_bf16 ? "_bf16" : "") +
                             (fused ? dims({{"T", p.t}, {"QH", p.qh}, {"KVH", p.kvh}, {"D", p.d}})
                                    : dims({{"T", p.t}, {"QH", p.qh}, {"KVH", p.kvh}, {"D", p.d}, {"MaxPos", p.max_pos}}));
    reg(name, [=](Rng& rng) {
      ParityCase c;
      size_t qkv = 0, v = 0;
      if (fused) {
        const int64_t width = (p.qh + 2 * p.kvh) * p.d;
        qkv = c.add_f32("qkv", {p.t, width}, Role::kIn, random_f32(rng, p.t * width, -1, 1));
      }
      const size_t q = fused ? c.add_out("q", DType::kF32, {p.t, p.qh, p.d})
                             : c.add_f32("q", {p.t, p.qh, p.d}, Role::kInOut, random_f32(rng, p.t * p.qh * p.d, -1, 1));
      const size_t k = fused ? c.add_out("k", DType::kF32, {p.t, p.kvh, p.d})
                             : c.add_f32("k", {p.t, p.kvh, p.d}, Role::kInOut, random_f32(rng, p.t * p.kvh * p.d, -1, 1));
      if (fused) v = c.add_out("v", DType::kF32, {p.t, p.kvh, p.d});
      std::vector<int32_t> pos(static_cast<size_t>(p.t));
      for (auto& x : pos) x = rng.below(p.max_pos);
      const size_t positions = c.add_i32("positions", {p.t}, pos);
      const size_t inv_freq = c.add_f32("inv_freq", {p.d / 2}, Role::kIn, random_f32(rng, p.d / 2, 1e-4f, 1.0f));
      const size_t q_norm = c.add_f32("q_norm", {p.d}, Role::kIn, random_f32(rng, p.d, 0.5f, 1.5f));
      const size_t k_norm = c.add_f32("k_norm", {p.d}, Role::kIn, random_f32(rng, p.d, 0.5f, 1.5f));
      size_t q_bias = 0, k_bias = 0, v_bias = 0;
      if (bias) {
        q_bias = c.add_f32("q_bias", {p.qh * p.d}, Role::kIn, random_f32(rng, p.qh * p.d, -2, 2));
        k_bias = c.add_f32("k_bias", {p.kvh * p.d}, Role::kIn, random_f32(rng, p.kvh * p.d, -2, 2));
        v_bias = c.add_f32("v_bias", {p.kvh * p.d}, Role::kIn, random_f32(rng, p.kvh * p.d, -2, 2));
      }
      size_t k_cache = 0, v_cache = 0, slot_mapping = 0;
      if (store) {
        // Caches start random (a slot written by mistake, or not written, shows); distinct slots,
        // the last row padding (-1) when there are two or more.
        const int64_t blocks = (p.t + 7) / 8 + 1, cache = blocks * 8 * p.kvh * p.d;
        if (store_bf16) {
          // BF16 caches: each backend rounds its FP32 k (and v) once, so a value whose FP32 results
          // straddle a rounding boundary lands one BF16 step apart (the BF16 output bound).
          k_cache = c.add("k_cache", DType::kBF16, {blocks, 8, p.kvh, p.d}, Role::kInOut, random_bf16(rng, cache, -1, 1));
          v_cache = c.add("v_cache", DType::kBF16, {blocks, 8, p.kvh, p.d}, Role::kInOut, random_bf16(rng, cache, -1, 1));
          c.tensors[k_cache].tolerance = kBf16OutputTolerance;
          c.tensors[v_cache].tolerance = kBf16OutputTolerance;
        } else {
          k_cache = c.add_f32("k_cache", {blocks, 8, p.kvh, p.d}, Role::kInOut, random_f32(rng, cache, -1, 1));
          v_cache = c.add_f32("v_cache", {blocks, 8, p.kvh, p.d}, Role::kInOut, random_f32(rng, cache, -1, 1));
        }
        std::vector<int32_t> slots(static_cast<size_t>(blocks * 8));
        std::iota(slots.begin(), slots.end(), 0);
        rng.shuffle(slots);
        slots.resize(static_cast<size_t>(p.t));
        if (p.t > 1) slots.back() = -1;
        slot_mapping = c.add_i32("slot_mapping", {p.t}, slots);
      }
      c.run = [=](const Backend& b, const ExecContext& x, const std::vector<TensorView>& a) {
        RopeQkArgs args;
        args.q = a[q];
        args.k = a[k];
        if (fused) {
          args.qkv = a[qkv];
          args.v = a[v];
        }
        if (bias) {
          args.q_bias = a[q_bias];
          args.k_bias = a[k_bias];
          args.v_bias = a[v_bias];
        }
        args.positions = a[positions];
        if (p.table) {
          args.inv_freq = a[inv_freq];
          args.scale = p.theta_or_scale;
        } else {
          args.theta = p.theta_or_scale;
        }
        if (p.norm) {
          args.q_norm = a[q_norm];
          args.k_norm = a[k_norm];
        }
        args.eps = 1e-6f;
        if (store) {
          args.k_cache = a[k_cache];
          args.v_cache = a[v_cache];
          args.slot_mapping = a[slot_mapping];
        }
        return b.rope_qk(x, args);
      };
      return c;
    });
  };
  for (const R p : {R{1, 1, 1, 2, 8, false, false, 10000.0f}, R{5, 4, 2, 64, 64, false, false, 10000.0f},
                    R{17, 8, 4, 128, 4096, false, false, 1e6f}, R{9, 2, 2, 6, 100000, false, false, 500000.0f},
                    R{1, 32, 4, 128, 4096, false, true, 1e6f}, R{33, 8, 2, 128, 40000, false, true, 1e6f},
                    R{3, 3, 1, 200, 1000, false, true, 10000.0f}, R{4, 2, 1, 6, 50, false, true, 10000.0f},
                    R{1, 64, 8, 64, 131072, true, false, 1.3465736f}, R{17, 4, 2, 64, 4096, true, false, 1.0f},
                    R{9, 2, 1, 6, 4096, true, false, 0.5f}, R{4, 4, 2, 128, 4096, true, true, 1.3465736f}})
    rope_qk_case(p, false, false);
  for (const R p : {R{1, 64, 8, 64, 131072, true, false, 1.3465736f}, R{5, 32, 4, 128, 40000, false, true, 1e6f},
                    R{17, 8, 2, 64, 4096, false, false, 10000.0f}, R{3, 3, 1, 6, 100, true, true, 0.5f}})
    rope_qk_case(p, true, false);
  // gpt-oss's shape (YaRN table, no norm) at decode and prefill sizes; the norm with biases.
  for (const R p : {R{1, 64, 8, 64, 131072, true, false, 1.3465736f}, R{33, 64, 8, 64, 4096, true, false, 1.3465736f},
                    R{3, 3, 1, 6, 100, false, true, 10000.0f}})
    rope_qk_case(p, true, true);
  // The KV store in the same launch: gpt-oss's shape at decode and prefill sizes, Qwen3's norm.
  for (const R p : {R{1, 64, 8, 64, 131072, true, false, 1.3465736f}, R{33, 64, 8, 64, 4096, true, false, 1.3465736f}})
    rope_qk_case(p, true, true, true);
  rope_qk_case(R{5, 32, 4, 128, 40000, false, true, 1e6f}, true, false, true);
  // The same into BF16 caches.
  rope_qk_case(R{33, 64, 8, 64, 4096, true, false, 1.3465736f}, true, true, true, true);
  rope_qk_case(R{5, 32, 4, 128, 40000, false, true, 1e6f}, true, false, true, true);
}

const std::vector<CaseMaker>& all_cases() {
  static const bool built = [] {
    embedding_cases();
    rmsnorm_cases();
    linear_cases();
    add_cases();
    rope_cases();
    kv_store_cases();
    attention_cases();
    gpt_oss_op_cases();
    router_cases();
    router_fused_cases();
    moe_cases();
    copy_valid_rows_cases();
    fused_op_cases();
    return true;
  }();
  (void)built;
  return registry();
}

// ---- running a case on a backend ------------------------------------------------------

using HostResult = std::vector<std::vector<uint8_t>>;  // every tensor's bytes after the op

// Allocates every tensor through the backend's own memory ops, uploads inputs and poisoned
// outputs, runs the op, downloads everything.
Status run_case(const Backend& be, const ExecContext& ctx, const ParityCase& c,
                HostResult* result) {
  const bool host = be.kind == DeviceKind::kCpu;
  const CopyKind up = host ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
  const CopyKind down = host ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  std::vector<void*> buffers(c.tensors.size(), nullptr);
  struct Release {
    const Backend& be;
    const ExecContext& ctx;
    std::vector<void*>& bufs;
    ~Release() {
      for (void* p : bufs) (void)be.free(ctx, p);
    }
  } release{be, ctx, buffers};

  std::vector<std::vector<uint8_t>> staged(c.tensors.size());
  std::vector<TensorView> views;
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const CaseTensor& t = c.tensors[i];
    const size_t nbytes = static_cast<size_t>(t.shape.numel()) * dtype_size(t.dtype);
    staged[i] = t.bytes;
    if (t.role == Role::kOut) {
      if (t.dtype == DType::kBF16) {
        const uint16_t nan = 0xffff;  // a BF16 NaN
        for (size_t j = 0; j < nbytes; j += 2) std::memcpy(&staged[i][j], &nan, 2);
      } else if (t.dtype == DType::kF32) {
        const float nan = std::numeric_limits<float>::quiet_NaN();
        for (size_t j = 0; j < nbytes; j += 4) std::memcpy(&staged[i][j], &nan, 4);
      } else {
        const int32_t poison = std::numeric_limits<int32_t>::min();
        for (size_t j = 0; j < nbytes; j += 4) std::memcpy(&staged[i][j], &poison, 4);
      }
    }
    RD_RETURN_IF_ERROR(be.alloc(ctx, nbytes, &buffers[i]));
    RD_RETURN_IF_ERROR(be.copy(ctx, buffers[i], staged[i].data(), nbytes, up));
    views.push_back(TensorView::contiguous(buffers[i], t.dtype, t.shape, ctx.device));
  }
  RD_RETURN_IF_ERROR(c.run(be, ctx, views));
  RD_RETURN_IF_ERROR(be.synchronize(ctx));
  result->assign(c.tensors.size(), {});
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    (*result)[i].resize(staged[i].size());
    RD_RETURN_IF_ERROR(be.copy(ctx, (*result)[i].data(), buffers[i], staged[i].size(), down));
  }
  return be.synchronize(ctx);
}

template <class T>
std::vector<T> as_vec(const std::vector<uint8_t>& b) {
  std::vector<T> v(b.size() / sizeof(T));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

bool is_output(const CaseTensor& t) { return t.role != Role::kIn; }

// A float tensor's values as FP32 (BF16 widened exactly).
std::vector<float> as_floats(const CaseTensor& t, const std::vector<uint8_t>& b) {
  if (t.dtype == DType::kF32) return as_vec<float>(b);
  const auto bits = as_vec<uint16_t>(b);
  std::vector<float> v(bits.size());
  for (size_t j = 0; j < v.size(); ++j) v[j] = bf16_bits_to_f32(bits[j]);
  return v;
}
bool is_float(const CaseTensor& t) { return t.dtype == DType::kF32 || t.dtype == DType::kBF16; }

// Every element of a kOut tensor was overwritten (no poison left) and is finite.
void expect_all_written(const ParityCase& c, const HostResult& r, const char* backend) {
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const CaseTensor& t = c.tensors[i];
    if (!is_output(t)) continue;
    if (is_float(t)) {
      const auto v = as_floats(t, r[i]);
      const auto bad = std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
      EXPECT_EQ(bad, v.end()) << backend << ": " << t.name << "[" << (bad - v.begin())
                              << "] is not finite (unwritten?)";
    } else {
      const auto v = as_vec<int32_t>(r[i]);
      const auto bad = std::find(v.begin(), v.end(), std::numeric_limits<int32_t>::min());
      EXPECT_EQ(bad, v.end()) << backend << ": " << t.name << "[" << (bad - v.begin())
                              << "] was not written";
    }
  }
}

void expect_close(const ParityCase& c, const HostResult& out, const HostResult& ref) {
  for (size_t i = 0; i < c.tensors.size(); ++i) {
    const CaseTensor& t = c.tensors[i];
    if (!is_output(t)) continue;
    if (!is_float(t)) {
      const auto a = as_vec<int32_t>(out[i]), b = as_vec<int32_t>(ref[i]);
      for (size_t j = 0; j < a.size(); ++j)
        ASSERT_EQ(a[j], b[j]) << t.name << "[" << j << "] differs";
      continue;
    }
    const auto a = as_floats(t, out[i]), b = as_floats(t, ref[i]);
    const double tolerance = t.tolerance >= 0 ? t.tolerance : c.tolerance;
    double diff2 = 0, ref2 = 0, worst = 0;
    size_t worst_at = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      const double d = static_cast<double>(a[j]) - static_cast<double>(b[j]);
      diff2 += d * d;
      ref2 += static_cast<double>(b[j]) * b[j];
      if (!(std::fabs(d) <= worst)) {  // NaN-safe: a NaN becomes the worst element
        worst = std::fabs(d);
        worst_at = j;
      }
    }
    const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
    // The margin to the tolerance is what tells a kernel change apart from noise.
    std::printf("[ parity   ] %s %s: relative L2 error %.3g (tolerance %.3g)\n",
                c.name.c_str(), t.name.c_str(), rel, tolerance);
    EXPECT_LE(rel, tolerance) << t.name << ": relative L2 error " << rel << " (tolerance "
                              << tolerance << "); worst element " << worst_at << ": "
                              << a[worst_at] << " vs reference " << b[worst_at];
  }
}

// ---- the parameterised test -----------------------------------------------------------

class BackendParity : public ::testing::TestWithParam<CaseMaker> {
 protected:
  ParityCase make_case() const {
    Rng rng(fnv1a(GetParam().name));  // each case its own fixed seed
    ParityCase c = GetParam().make(rng);
    c.name = GetParam().name;
    return c;
  }
};

TEST_P(BackendParity, CpuReferenceWritesEveryOutputDeterministically) {
  const ParityCase c = make_case();
  const ExecContext ctx{Device::cpu(), nullptr};
  HostResult first, second;
  const Status st = run_case(cpu_backend(), ctx, c, &first);
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_all_written(c, first, "cpu");
  ASSERT_TRUE(run_case(cpu_backend(), ctx, c, &second).ok());
  EXPECT_TRUE(first == second) << "the CPU reference is not deterministic";
}

TEST_P(BackendParity, CudaMatchesCpuReference) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ParityCase c = make_case();
  HostResult ref, out;
  const Status ref_st = run_case(cpu_backend(), ExecContext{Device::cpu(), nullptr}, c, &ref);
  ASSERT_TRUE(ref_st.ok()) << ref_st.to_string();

  ExecContext ctx{Device::cuda(0), nullptr};
#if defined(ROLLOUTD_WITH_CUDA)
  // A non-default stream: the ops must launch on the context's stream, not stream 0.
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ctx.stream = stream;
#endif
  const Status st = run_case(*cuda, ctx, c, &out);
#if defined(ROLLOUTD_WITH_CUDA)
  (void)cudaStreamDestroy(stream);
#endif
  ASSERT_TRUE(st.ok()) << st.to_string();
  expect_all_written(c, out, "cuda");
  expect_close(c, out, ref);
}

INSTANTIATE_TEST_SUITE_P(AllOps, BackendParity, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<CaseMaker>& info) {
                           return info.param.name;
                         });

// ---- argument checks agree --------------------------------------------------------------

// Host-side validation is shared, so a CUDA build rejects exactly what the CPU reference
// rejects, with the same code and field. This runs without a GPU: every call below fails
// before anything touches the device.
struct BadCall {
  const char* what;
  std::function<Status(const Backend&, const ExecContext&, void* data)> call;
};

std::vector<BadCall> bad_calls() {
  auto f = [](void* p, const ExecContext& x, Shape s) {
    return TensorView::contiguous(p, DType::kF32, s, x.device);
  };
  auto i = [](void* p, const ExecContext& x, Shape s) {
    return TensorView::contiguous(p, DType::kI32, s, x.device);
  };
  // rope_qk's calls: q [2, 2, 8], k [2, 1, k_dim], positions [2]; the rest at byte offsets of p.
  auto rope = [=](void* p, const ExecContext& x, int64_t k_dim = 8) {
    RopeQkArgs a;
    a.q = f(p, x, {2, 2, 8});
    a.k = f(static_cast<char*>(p) + 256, x, {2, 1, k_dim});
    a.positions = i(static_cast<char*>(p) + 512, x, {2});
    return a;
  };
  auto fat = [=](void* p, int64_t offset, const ExecContext& x, Shape s) { return f(static_cast<char*>(p) + offset, x, s); };
  // rope_qk's fused form: q/k as above, the projection rows qkv [2, width] and v [2, 1, 8].
  auto rope_fused = [=](void* p, const ExecContext& x, int64_t width = 32) {
    RopeQkArgs a = rope(p, x);
    a.qkv = fat(p, 1024, x, {2, width});
    a.v = fat(p, 768, x, {2, 1, 8});
    return a;
  };
  return {
      {"linear K mismatch",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.linear(x, f(p, x, {2, 3}), f(p, x, {2, 4}), f(p, x, {3, 5}));
       }},
      {"linear bf16 weight with f32 x",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.linear(x, f(p, x, {2, 3}), f(p, x, {2, 4}),
                         TensorView::contiguous(p, DType::kBF16, {3, 4}, x.device));
       }},
      {"linear int32 weight",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.linear(x, f(p, x, {2, 3}), f(p, x, {2, 4}), i(p, x, {3, 4}));
       }},
      {"embedding rank-2 ids",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.embedding(x, f(p, x, {2, 4}), f(p, x, {8, 4}), i(p, x, {2, 1}));
       }},
      {"rmsnorm weight length",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.rmsnorm(x, f(p, x, {2, 4}), f(p, x, {2, 4}), f(p, x, {5}), 1e-6f);
       }},
      {"add shapes",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.add(x, f(p, x, {2, 4}), f(p, x, {2, 4}), f(p, x, {4, 2}));
       }},
      {"rope odd head dim",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.rope(x, f(p, x, {2, 1, 5}), i(p, x, {2}), 10000.0f);
       }},
      {"kv_store head mismatch",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.kv_store(x, f(p, x, {2, 4, 2, 8}), f(p, x, {2, 4, 2, 8}), f(p, x, {3, 1, 8}),
                           f(p, x, {3, 1, 8}), i(p, x, {3}));
       }},
      {"attention gqa ratio",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.paged_attention(x, f(p, x, {1, 3, 8}), f(p, x, {1, 3, 8}),
                                  f(p, x, {2, 4, 2, 8}), f(p, x, {2, 4, 2, 8}), i(p, x, {1, 2}),
                                  i(p, x, {1}), i(p, x, {1}), 1.0f);
       }},
      {"router top-k above experts",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.router_softmax_topk(x, i(p, x, {2, 9}), f(p, x, {2, 9}), f(p, x, {2, 8}), true);
       }},
      {"moe w_down shape",
       [=](const Backend& b, const ExecContext& x, void* p) {
         MoeExpertsArgs a;
         a.out = f(p, x, {2, 8});
         a.x = f(p, x, {2, 8});
         a.w_gate_up = f(p, x, {4, 6, 8});
         a.w_down = f(p, x, {4, 8, 4});
         a.topk_ids = i(p, x, {2, 2});
         a.topk_weights = f(p, x, {2, 2});
         a.logical_to_physical = i(p, x, {4});
         return b.moe_experts(x, a);
       }},
      {"moe num_valid_device shape",
       [=](const Backend& b, const ExecContext& x, void* p) {
         MoeExpertsArgs a;
         a.out = f(p, x, {2, 8});
         a.x = f(p, x, {2, 8});
         a.w_gate_up = f(p, x, {4, 6, 8});
         a.w_down = f(p, x, {4, 8, 3});
         a.topk_ids = i(p, x, {2, 2});
         a.topk_weights = f(p, x, {2, 2});
         a.logical_to_physical = i(p, x, {4});
         a.num_valid_device = i(p, x, {2});
         return b.moe_experts(x, a);
       }},
      {"copy_valid_rows shape",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.copy_valid_rows(x, i(p, x, {4, 3}), i(static_cast<char*>(p) + 64, x, {4, 2}), i(p, x, {1}), -1);
       }},
      {"copy_valid_rows count",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.copy_valid_rows(x, i(p, x, {4, 2}), i(static_cast<char*>(p) + 64, x, {4, 2}), f(p, x, {1}), -1);
       }},
      {"moe num_valid_tokens",
       [=](const Backend& b, const ExecContext& x, void* p) {
         MoeExpertsArgs a;
         a.out = f(p, x, {2, 8});
         a.x = f(p, x, {2, 8});
         a.w_gate_up = f(p, x, {4, 6, 8});
         a.w_down = f(p, x, {4, 8, 3});
         a.topk_ids = i(p, x, {2, 2});
         a.topk_weights = f(p, x, {2, 2});
         a.logical_to_physical = i(p, x, {4});
         a.num_valid_tokens = 3;
         return b.moe_experts(x, a);
       }},
      {"add_rmsnorm residual shape",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.add_rmsnorm(x, f(static_cast<char*>(p) + 256, x, {2, 4}), {}, f(p, x, {2, 4}),
                              f(static_cast<char*>(p) + 512, x, {4, 2}), {}, f(static_cast<char*>(p) + 768, x, {4}),
                              1e-6f);
       }},
      {"add_rmsnorm r_bias without r",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.add_rmsnorm(x, f(static_cast<char*>(p) + 256, x, {2, 4}), {}, f(p, x, {2, 4}), {},
                              f(static_cast<char*>(p) + 640, x, {4}), f(static_cast<char*>(p) + 768, x, {4}), 1e-6f);
       }},
      {"add_rmsnorm r_bias length",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.add_rmsnorm(x, f(static_cast<char*>(p) + 256, x, {2, 4}), {}, f(p, x, {2, 4}),
                              f(static_cast<char*>(p) + 512, x, {2, 4}), f(static_cast<char*>(p) + 640, x, {3}),
                              f(static_cast<char*>(p) + 768, x, {4}), 1e-6f);
       }},
      {"add_rmsnorm f32 view as the bf16 output",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.add_rmsnorm(x, {}, f(static_cast<char*>(p) + 256, x, {2, 4}), f(p, x, {2, 4}), {}, {},
                              f(static_cast<char*>(p) + 768, x, {4}), 1e-6f);
       }},
      {"add_rmsnorm bf16 output over h",
       [=](const Backend& b, const ExecContext& x, void* p) {
         return b.add_rmsnorm(x, {}, TensorView::contiguous(p, DType::kBF16, {2, 4}, x.device), f(p, x, {2, 4}), {},
                              {}, f(static_cast<char*>(p) + 768, x, {4}), 1e-6f);
       }},
      {"rope_qk k head dim",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope(p, x, 6);
         return b.rope_qk(x, a);
       }},
      {"rope_qk qkv without v",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope(p, x);
         a.qkv = fat(p, 1024, x, {2, 32});
         return b.rope_qk(x, a);
       }},
      {"rope_qk qkv width",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope_fused(p, x, 24);
         return b.rope_qk(x, a);
       }},
      {"rope_qk bias without qkv",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope(p, x);
         a.q_bias = fat(p, 1536, x, {16});
         a.k_bias = fat(p, 1600, x, {8});
         a.v_bias = fat(p, 1632, x, {8});
         return b.rope_qk(x, a);
       }},
      {"rope_qk two biases of three",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope_fused(p, x);
         a.q_bias = fat(p, 1536, x, {16});
         a.k_bias = fat(p, 1600, x, {8});
         return b.rope_qk(x, a);
       }},
      {"rope_qk k_bias length",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope_fused(p, x);
         a.q_bias = fat(p, 1536, x, {16});
         a.k_bias = fat(p, 1600, x, {16});
         a.v_bias = fat(p, 1664, x, {8});
         return b.rope_qk(x, a);
       }},
      {"rope_qk one norm weight",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RopeQkArgs a = rope(p, x);
         a.q_norm = fat(p, 768, x, {8});
         return b.rope_qk(x, a);
       }},
      {"router x / w hidden mismatch",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RouterArgs a;
         a.x = fat(p, 0, x, {2, 8});
         a.w = fat(p, 256, x, {4, 7});
         a.logits = fat(p, 512, x, {2, 4});
         a.ids = i(static_cast<char*>(p) + 768, x, {2, 2});
         a.weights = fat(p, 1024, x, {2, 2});
         return b.router(x, a);
       }},
      {"router logits overlapping x",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RouterArgs a;
         a.x = fat(p, 0, x, {2, 8});
         a.w = fat(p, 256, x, {4, 8});
         a.logits = fat(p, 16, x, {2, 4});
         a.ids = i(static_cast<char*>(p) + 768, x, {2, 2});
         a.weights = fat(p, 1024, x, {2, 2});
         return b.router(x, a);
       }},
      {"router bias length",
       [=](const Backend& b, const ExecContext& x, void* p) {
         RouterArgs a;
         a.x = fat(p, 0, x, {2, 8});
         a.w = fat(p, 256, x, {4, 8});
         a.bias = fat(p, 1280, x, {3});
         a.logits = fat(p, 512, x, {2, 4});
         a.ids = i(static_cast<char*>(p) + 768, x, {2, 2});
         a.weights = fat(p, 1024, x, {2, 2});
         return b.router(x, a);
       }},
      {"view on the other device",
       [=](const Backend& b, const ExecContext& x, void* p) {
         TensorView w = f(p, x, {3, 4});
         w.device = x.device.kind == DeviceKind::kCpu ? Device::cuda(0) : Device::cpu();
         return b.linear(x, f(p, x, {2, 3}), f(p, x, {2, 4}), w);
       }},
  };
}

TEST(BackendParityChecks, CudaRejectsExactlyWhatCpuRejects) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr) GTEST_SKIP() << "CUDA backend not built";
  std::vector<float> host(4096, 0.0f);
  // Never dereferenced when the checks work; with a GPU present it is real device memory
  // anyway, so a check that wrongly passes cannot fault the context for later tests.
  const ExecContext cuda_ctx{Device::cuda(0), nullptr};
  void* device_buf = reinterpret_cast<void*>(uintptr_t{4096});
  const bool have_gpu = cuda_device_count() > 0;
  if (have_gpu) {
    ASSERT_TRUE(cuda->alloc(cuda_ctx, host.size() * sizeof(float), &device_buf).ok());
  }
  for (const BadCall& bc : bad_calls()) {
    const Status ref = bc.call(cpu_backend(), ExecContext{Device::cpu(), nullptr}, host.data());
    const Status got = bc.call(*cuda, cuda_ctx, device_buf);
    EXPECT_FALSE(ref.ok()) << bc.what;
    EXPECT_EQ(got.code(), ref.code()) << bc.what << ": " << got.to_string() << " vs "
                                      << ref.to_string();
    EXPECT_EQ(got.field(), ref.field()) << bc.what;
  }
  if (have_gpu) {
    EXPECT_TRUE(cuda->free(cuda_ctx, device_buf).ok());
  }
}

// ---- device-side index policy ----------------------------------------------------------

// Device buffers through the backend's memory ops, freed at scope exit.
class DeviceArena {
 public:
  DeviceArena(const Backend& be, ExecContext ctx) : be_(be), ctx_(ctx) {}
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() {
    for (void* p : buffers_) (void)be_.free(ctx_, p);
  }
  template <class T>
  TensorView upload(const std::vector<T>& v, Shape shape) {
    static_assert(sizeof(T) == 4 || std::is_same_v<T, uint16_t>, "float, int32 or BF16 bits");
    const DType dtype = std::is_same_v<T, float> ? DType::kF32 : std::is_same_v<T, uint16_t> ? DType::kBF16 : DType::kI32;
    void* p = nullptr;
    EXPECT_TRUE(be_.alloc(ctx_, v.size() * sizeof(T), &p).ok());
    buffers_.push_back(p);
    EXPECT_TRUE(be_.copy(ctx_, p, v.data(), v.size() * sizeof(T), CopyKind::kHostToDevice).ok());
    EXPECT_TRUE(be_.synchronize(ctx_).ok());
    return TensorView::contiguous(p, dtype, shape, ctx_.device);
  }
  std::vector<float> download(const TensorView& v) {
    std::vector<float> out(static_cast<size_t>(v.numel()));
    EXPECT_TRUE(be_.copy(ctx_, out.data(), v.data, v.nbytes(), CopyKind::kDeviceToHost).ok());
    EXPECT_TRUE(be_.synchronize(ctx_).ok());
    return out;
  }

 private:
  const Backend& be_;
  ExecContext ctx_;
  std::vector<void*> buffers_;
};

TensorView host_f32(std::vector<float>& v, Shape s) {
  return TensorView::contiguous(v.data(), DType::kF32, s);
}
TensorView host_i32(std::vector<int32_t>& v, Shape s) {
  return TensorView::contiguous(v.data(), DType::kI32, s);
}

void expect_near_all(const std::vector<float>& a, const std::vector<float>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t j = 0; j < a.size(); ++j) EXPECT_NEAR(a[j], b[j], tol) << "element " << j;
}

// What backend.hpp promises for index values the host never sees: clamped or skipped,
// never read out of bounds (run under compute-sanitizer memcheck on the GPU host).
TEST(CudaBackend, OutOfRangeDeviceIndicesAreClampedOrSkipped) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext ctx{Device::cuda(0), nullptr};
  const ExecContext cpu_ctx{Device::cpu(), nullptr};
  DeviceArena d(*cuda, ctx);
  Rng rng(7);

  // embedding: ids -1, V and far beyond give zero rows.
  const std::vector<float> table{0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32};
  const TensorView emb = d.upload(std::vector<float>(12, NAN), {4, 3});
  ASSERT_TRUE(cuda->embedding(ctx, emb, d.upload(table, {4, 3}),
                              d.upload(std::vector<int32_t>{1, -1, 4, 1000000}, {4}))
                  .ok());
  EXPECT_EQ(d.download(emb), (std::vector<float>{10, 11, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0}));

  // kv_store: slot 4 of a 4-slot cache is skipped, slot 1 written.
  const TensorView kc = d.upload(std::vector<float>(8, 0.0f), {2, 2, 1, 2});
  const TensorView vc = d.upload(std::vector<float>(8, 0.0f), {2, 2, 1, 2});
  ASSERT_TRUE(cuda->kv_store(ctx, kc, vc, d.upload(std::vector<float>{1, 2, 3, 4}, {2, 1, 2}),
                             d.upload(std::vector<float>{5, 6, 7, 8}, {2, 1, 2}),
                             d.upload(std::vector<int32_t>{4, 1}, {2}))
                  .ok());
  EXPECT_EQ(d.download(kc), (std::vector<float>{0, 0, 3, 4, 0, 0, 0, 0}));
  EXPECT_EQ(d.download(vc), (std::vector<float>{0, 0, 7, 8, 0, 0, 0, 0}));

  // paged_attention: block 9999 is skipped, sequence 7 (of 1) gives zeros, ctx_len 1000 is
  // clamped to the table's 4 positions. Expected: attention over block 0 alone.
  std::vector<float> k = random_f32(rng, 8, -1, 1), v = random_f32(rng, 8, -1, 1);
  std::vector<float> q = random_f32(rng, 6, -1, 1);
  const TensorView att = d.upload(std::vector<float>(6, NAN), {3, 1, 2});
  ASSERT_TRUE(cuda->paged_attention(ctx, att, d.upload(q, {3, 1, 2}), d.upload(k, {2, 2, 1, 2}),
                                    d.upload(v, {2, 2, 1, 2}),
                                    d.upload(std::vector<int32_t>{0, 9999}, {1, 2}),
                                    d.upload(std::vector<int32_t>{0, 7, 0}, {3}),
                                    d.upload(std::vector<int32_t>{4, 3, 1000}, {3}), 0.5f)
                  .ok());
  std::vector<float> ref(6, NAN);
  std::vector<int32_t> table_ok{0, 1}, seq_ok{0, 0, 0}, len_ok{2, 2, 2};
  ASSERT_TRUE(cpu_backend()
                  .paged_attention(cpu_ctx, host_f32(ref, {3, 1, 2}), host_f32(q, {3, 1, 2}),
                                   host_f32(k, {2, 2, 1, 2}), host_f32(v, {2, 2, 1, 2}),
                                   host_i32(table_ok, {1, 2}), host_i32(seq_ok, {3}),
                                   host_i32(len_ok, {3}), 0.5f)
                  .ok());
  ref[2] = ref[3] = 0.0f;
  expect_near_all(d.download(att), ref, 1e-6);
  // The same with D = 4: the kernel's float4 path (the one above is scalar), which computes the
  // V rows of a chunk from the table itself.
  {
    std::vector<float> k4 = random_f32(rng, 16, -1, 1), v4 = random_f32(rng, 16, -1, 1);
    std::vector<float> q4 = random_f32(rng, 12, -1, 1);
    const TensorView att4 = d.upload(std::vector<float>(12, NAN), {3, 1, 4});
    ASSERT_TRUE(cuda->paged_attention(ctx, att4, d.upload(q4, {3, 1, 4}), d.upload(k4, {2, 2, 1, 4}),
                                      d.upload(v4, {2, 2, 1, 4}), d.upload(std::vector<int32_t>{0, 9999}, {1, 2}),
                                      d.upload(std::vector<int32_t>{0, 7, 0}, {3}),
                                      d.upload(std::vector<int32_t>{4, 3, 1000}, {3}), 0.5f)
                    .ok());
    std::vector<float> ref4(12, NAN);
    ASSERT_TRUE(cpu_backend()
                    .paged_attention(cpu_ctx, host_f32(ref4, {3, 1, 4}), host_f32(q4, {3, 1, 4}),
                                     host_f32(k4, {2, 2, 1, 4}), host_f32(v4, {2, 2, 1, 4}),
                                     host_i32(table_ok, {1, 2}), host_i32(seq_ok, {3}), host_i32(len_ok, {3}), 0.5f)
                    .ok());
    for (int j = 4; j < 8; ++j) ref4[static_cast<size_t>(j)] = 0.0f;
    expect_near_all(d.download(att4), ref4, 1e-6);
  }

  // moe_experts: an id outside [0, E_logical) and an id whose map entry is outside
  // [0, E_phys) contribute nothing; the remaining expert is weighed as usual.
  std::vector<float> x = random_f32(rng, 4, -1, 1);                 // [T=1, H=4]
  std::vector<float> gate_up = random_f32(rng, 2 * 4 * 4, -1, 1);   // [E=2, 2I=4, H=4]
  std::vector<float> down = random_f32(rng, 2 * 4 * 2, -1, 1);      // [E=2, H=4, I=2]
  MoeExpertsArgs a;
  a.out = d.upload(std::vector<float>(4, NAN), {1, 4});
  a.x = d.upload(x, {1, 4});
  a.w_gate_up = d.upload(gate_up, {2, 4, 4});
  a.w_down = d.upload(down, {2, 4, 2});
  a.topk_ids = d.upload(std::vector<int32_t>{-3, 2, 1}, {1, 3});
  a.topk_weights = d.upload(std::vector<float>{1, 1, 0.5f}, {1, 3});
  a.logical_to_physical = d.upload(std::vector<int32_t>{0, 1, 99}, {3});
  ASSERT_TRUE(cuda->moe_experts(ctx, a).ok());
  std::vector<float> moe_ref(4, NAN), w_ref{0.5f};
  std::vector<int32_t> ids_ref{1}, map_ref{0, 1, 0};
  MoeExpertsArgs r;
  r.out = host_f32(moe_ref, {1, 4});
  r.x = host_f32(x, {1, 4});
  r.w_gate_up = host_f32(gate_up, {2, 4, 4});
  r.w_down = host_f32(down, {2, 4, 2});
  r.topk_ids = host_i32(ids_ref, {1, 1});
  r.topk_weights = host_f32(w_ref, {1, 1});
  r.logical_to_physical = host_i32(map_ref, {3});
  ASSERT_TRUE(cpu_backend().moe_experts(cpu_ctx, r).ok());
  expect_near_all(d.download(a.out), moe_ref, 1e-5);
}

// The fused decoder ops against CUDA's own unfused sequence on the same inputs (the parity cases
// hold both to the CPU): add_rmsnorm is rmsnorm's kernel with the add and the rounding folded in,
// so FP32 outputs stay within rmsnorm's bound of add + rmsnorm (the reduction order is the same)
// and the BF16 output is convert's rounding of the FP32 one; rope_qk within rope's bound of
// rmsnorm (q heads) + rmsnorm (k heads) + rope / rope_table on q and on k.
TEST(CudaBackend, FusedOpsMatchTheUnfusedCudaSequence) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext ctx{Device::cuda(0), nullptr};
  DeviceArena d(*cuda, ctx);
  Rng rng(11);
  const auto rel_l2 = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      num += (static_cast<double>(a[j]) - b[j]) * (static_cast<double>(a[j]) - b[j]);
      den += static_cast<double>(b[j]) * b[j];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  };
  const auto download_bf16 = [&](const void* p, size_t n) {
    std::vector<uint16_t> bits(n);
    EXPECT_TRUE(cuda->copy(ctx, bits.data(), p, n * 2, CopyKind::kDeviceToHost).ok());
    EXPECT_TRUE(cuda->synchronize(ctx).ok());
    return bits;
  };
  for (const auto& [rows, hidden] : std::vector<std::pair<int64_t, int64_t>>{{1, 2880}, {32, 2880}, {3, 4096},
                                                                             {7, 33}, {2, 9000}}) {
    const size_t n = static_cast<size_t>(rows * hidden);
    const Shape shape{rows, hidden};
    const std::vector<float> h0 = random_f32(rng, static_cast<int64_t>(n), -2, 2);
    const std::vector<float> r = random_f32(rng, static_cast<int64_t>(n), -1, 1);
    const std::vector<float> w = random_f32(rng, hidden, 0.5f, 1.5f);
    const TensorView rv = d.upload(r, shape), wv = d.upload(w, {hidden});
    // Unfused: add, rmsnorm, convert.
    const TensorView h_ref = d.upload(h0, shape), x_ref = d.upload(std::vector<float>(n, NAN), shape);
    const TensorView b_ref = d.upload(std::vector<float>((n + 1) / 2, NAN), {static_cast<int64_t>((n + 1) / 2)});
    ASSERT_TRUE(cuda->add(ctx, h_ref, h_ref, rv).ok());
    ASSERT_TRUE(cuda->rmsnorm(ctx, x_ref, h_ref, wv, 1e-6f).ok());
    ASSERT_TRUE(cuda->convert(ctx, b_ref.data, DType::kBF16, x_ref.data, DType::kF32, n).ok());
    // Fused.
    const TensorView h = d.upload(h0, shape), x = d.upload(std::vector<float>(n, NAN), shape);
    const TensorView b = d.upload(std::vector<float>((n + 1) / 2, NAN), {static_cast<int64_t>((n + 1) / 2)});
    ASSERT_TRUE(
        cuda->add_rmsnorm(ctx, x, TensorView::contiguous(b.data, DType::kBF16, shape, ctx.device), h, rv, {}, wv,
                          1e-6f)
            .ok());
    EXPECT_EQ(d.download(h), d.download(h_ref)) << rows << "x" << hidden << ": h += r is add's one rounding";
    const std::vector<float> xs = d.download(x), xs_ref = d.download(x_ref);
    EXPECT_LE(rel_l2(xs, xs_ref), 1e-5) << rows << "x" << hidden;
    const std::vector<uint16_t> bits = download_bf16(b.data, n), bits_ref = download_bf16(b_ref.data, n);
    for (size_t j = 0; j < n; ++j) {
      ASSERT_EQ(bits[j], f32_to_bf16_bits(xs[j])) << "out_bf16[" << j << "] is not convert's rounding of out";
      if (xs[j] == xs_ref[j]) {
        ASSERT_EQ(bits[j], bits_ref[j]) << "element " << j;
      }
    }
    // With r's bias (o_proj's, gpt-oss): add_bias on a copy of r, then add, bit for bit, through the
    // normalising kernel and through the add alone; r itself is only read.
    const TensorView rbv = d.upload(random_f32(rng, hidden, -0.5f, 0.5f), {hidden});
    const TensorView hb_ref = d.upload(h0, shape), r_copy = d.upload(r, shape);
    ASSERT_TRUE(cuda->add_bias(ctx, r_copy, rbv).ok());
    ASSERT_TRUE(cuda->add(ctx, hb_ref, hb_ref, r_copy).ok());
    const TensorView hb = d.upload(h0, shape), hb_add = d.upload(h0, shape);
    const TensorView xb_ref = d.upload(std::vector<float>(n, NAN), shape);
    ASSERT_TRUE(cuda->rmsnorm(ctx, xb_ref, hb_ref, wv, 1e-6f).ok());
    ASSERT_TRUE(cuda->add_rmsnorm(ctx, x, {}, hb, rv, rbv, wv, 1e-6f).ok());
    EXPECT_LE(rel_l2(d.download(x), d.download(xb_ref)), 1e-5) << rows << "x" << hidden << " (with r_bias)";
    ASSERT_TRUE(cuda->add_rmsnorm(ctx, {}, {}, hb_add, rv, rbv, wv, 1e-6f).ok());
    const std::vector<float> hb_want = d.download(hb_ref);
    EXPECT_NE(hb_want, h0);
    EXPECT_EQ(d.download(hb), hb_want) << rows << "x" << hidden << ": h += (r + r_bias) is add_bias, then add";
    EXPECT_EQ(d.download(hb_add), hb_want) << rows << "x" << hidden << " (the add alone)";
    EXPECT_EQ(d.download(rv), r) << "r is read, not written";
  }
  for (const bool table : {false, true}) {
    const int64_t T = 5, QH = 8, KVH = 2, D = 128;
    const std::vector<float> q0 = random_f32(rng, T * QH * D, -1, 1), k0 = random_f32(rng, T * KVH * D, -1, 1);
    const TensorView pos = d.upload(std::vector<int32_t>{0, 1, 17, 4095, 40000}, {T});
    const TensorView inv = d.upload(random_f32(rng, D / 2, 1e-4f, 1.0f), {D / 2});
    const TensorView qw = d.upload(random_f32(rng, D, 0.5f, 1.5f), {D});
    const TensorView kw = d.upload(random_f32(rng, D, 0.5f, 1.5f), {D});
    const float scale = table ? 1.3465736f : 1.0f, theta = 1e6f;
    const TensorView q_ref = d.upload(q0, {T, QH, D}), k_ref = d.upload(k0, {T, KVH, D});
    ASSERT_TRUE(cuda->rmsnorm(ctx, q_ref, q_ref, qw, 1e-6f).ok());
    ASSERT_TRUE(cuda->rmsnorm(ctx, k_ref, k_ref, kw, 1e-6f).ok());
    for (const TensorView& v : {q_ref, k_ref})
      ASSERT_TRUE((table ? cuda->rope_table(ctx, v, pos, inv, scale) : cuda->rope(ctx, v, pos, theta)).ok());
    RopeQkArgs a;
    a.q = d.upload(q0, {T, QH, D});
    a.k = d.upload(k0, {T, KVH, D});
    a.positions = pos;
    if (table) a.inv_freq = inv;
    a.theta = theta;
    a.scale = scale;
    a.q_norm = qw;
    a.k_norm = kw;
    a.eps = 1e-6f;
    ASSERT_TRUE(cuda->rope_qk(ctx, a).ok());
    EXPECT_LE(rel_l2(d.download(a.q), d.download(q_ref)), 1e-5) << (table ? "table" : "theta");
    EXPECT_LE(rel_l2(d.download(a.k), d.download(k_ref)), 1e-5) << (table ? "table" : "theta");
  }
}

// The BF16 decode linear (1-4 rows): each row's result is the same bits as that row alone (an
// m = 1 call on it), in a call of 1, 2, 3 or 4 rows, and nothing past y is written.
TEST(CudaBackend, DecodeLinearRowsAreTheSameBitsWhateverTheBatch) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA backend or no visible GPU";
  if (const char* v = std::getenv("ROLLOUTD_DENSE_DECODE"); v != nullptr && std::string_view(v) == "0")
    GTEST_SKIP() << "ROLLOUTD_DENSE_DECODE=0: cuBLAS, which promises no such invariance";
  const ExecContext ctx{Device::cuda(0), nullptr};
  const int64_t k = 2880, n = 520, kRows = 4;
  Rng rng(7);
  auto bf16_words = [&](int64_t count, float amp) {
    std::vector<uint16_t> v(static_cast<size_t>(count));
    for (auto& e : v) e = f32_to_bf16_bits(rng.uniform(-amp, amp));
    return v;
  };
  const std::vector<uint16_t> w = bf16_words(n * k, 0.02f);
  const std::vector<uint16_t> x = bf16_words(kRows * k, 1.0f);
  const size_t y_floats = static_cast<size_t>(kRows * n + 64);
  void *dw = nullptr, *dx = nullptr, *dy = nullptr;
  ASSERT_TRUE(cuda->alloc(ctx, w.size() * 2, &dw).ok());
  ASSERT_TRUE(cuda->alloc(ctx, x.size() * 2, &dx).ok());
  ASSERT_TRUE(cuda->alloc(ctx, y_floats * sizeof(float), &dy).ok());
  ASSERT_TRUE(cuda->copy(ctx, dw, w.data(), w.size() * 2, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(cuda->copy(ctx, dx, x.data(), x.size() * 2, CopyKind::kHostToDevice).ok());
  // y of rows [first, first + m) of x, after filling y with a sentinel.
  auto run = [&](int64_t first, int64_t m) {
    const std::vector<float> sentinel(y_floats, -777.0f);
    std::vector<float> y(y_floats);
    EXPECT_TRUE(cuda->copy(ctx, dy, sentinel.data(), y_floats * 4, CopyKind::kHostToDevice).ok());
    EXPECT_TRUE(cuda->linear(ctx, TensorView::contiguous(dy, DType::kF32, Shape{m, n}, ctx.device),
                             TensorView::contiguous(static_cast<uint16_t*>(dx) + first * k, DType::kBF16,
                                                    Shape{m, k}, ctx.device),
                             TensorView::contiguous(dw, DType::kBF16, Shape{n, k}, ctx.device))
                    .ok());
    EXPECT_TRUE(cuda->copy(ctx, y.data(), dy, y_floats * 4, CopyKind::kDeviceToHost).ok());
    EXPECT_TRUE(cuda->synchronize(ctx).ok());
    for (size_t j = static_cast<size_t>(m * n); j < y.size(); ++j) EXPECT_EQ(y[j], -777.0f) << "written past y, m = " << m;
    return y;
  };
  std::vector<std::vector<float>> alone;
  for (int64_t r = 0; r < kRows; ++r) alone.push_back(run(r, 1));
  for (int64_t m = 2; m <= kRows; ++m) {
    const std::vector<float> y = run(0, m);
    for (int64_t r = 0; r < m; ++r)
      EXPECT_EQ(std::memcmp(y.data() + r * n, alone[static_cast<size_t>(r)].data(), static_cast<size_t>(n) * 4), 0)
          << "row " << r << " differs from itself alone, m = " << m;
  }
  EXPECT_TRUE(cuda->free(ctx, dw).ok());
  EXPECT_TRUE(cuda->free(ctx, dx).ok());
  EXPECT_TRUE(cuda->free(ctx, dy).ok());
}

// Backend::router on CUDA: a token's logits, ids and weights are the same bits alone as inside
// batches of 16 and 40 tokens. Above 64 experts, up to ROLLOUTD_ROUTER_SPREAD_MAX_TOKENS tokens
// (default 16) take the spread kernels and more take the cluster kernel, so a row alone against
// the same row among 40 compares the two (their sums are meant to be identical); at 32 experts
// the cluster kernel runs both. The decoder relies on it: a request's routing does not depend on
// what else runs.
TEST(CudaBackend, RouterRowsAreTheSameBitsWhateverTheBatch) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  if (const char* v = std::getenv("ROLLOUTD_ROUTER_SPREAD_MAX_TOKENS"); v != nullptr && *v != '\0')
    std::printf("note: ROLLOUTD_ROUTER_SPREAD_MAX_TOKENS=%s; at 0 or 40 and above a row alone and the batch of 40 "
                "take the same kernel, and the spread/cluster comparison is not made\n", v);
  const ExecContext ctx{Device::cuda(0), nullptr};
  struct P {
    int64_t h, e, k;
    bool bias, renormalize;
  };
  for (const P p : {P{2880, 128, 4, true, false}, P{2048, 128, 8, false, true}, P{512, 1024, 8, true, true},
                    P{4000, 97, 2, false, false}, P{2880, 32, 4, true, true}}) {
    SCOPED_TRACE("H " + std::to_string(p.h) + ", E " + std::to_string(p.e));
    constexpr int64_t kMaxT = 40;
    Rng rng(static_cast<uint64_t>(p.h * 7 + p.e));
    std::vector<float> x(static_cast<size_t>(kMaxT * p.h)), w(static_cast<size_t>(p.e * p.h)),
        bias(static_cast<size_t>(p.e));
    for (auto& v : x) v = rng.uniform(-1.0f, 1.0f);
    for (auto& v : w) v = rng.uniform(-0.05f, 0.05f);
    for (auto& v : bias) v = rng.uniform(-0.1f, 0.1f);
    void *dx = nullptr, *dw = nullptr, *db = nullptr, *dl = nullptr, *di = nullptr, *dwt = nullptr;
    ASSERT_TRUE(cuda->alloc(ctx, x.size() * 4, &dx).ok());
    ASSERT_TRUE(cuda->alloc(ctx, w.size() * 4, &dw).ok());
    ASSERT_TRUE(cuda->alloc(ctx, bias.size() * 4, &db).ok());
    ASSERT_TRUE(cuda->alloc(ctx, static_cast<size_t>(kMaxT * p.e) * 4, &dl).ok());
    ASSERT_TRUE(cuda->alloc(ctx, static_cast<size_t>(kMaxT * p.k) * 4, &di).ok());
    ASSERT_TRUE(cuda->alloc(ctx, static_cast<size_t>(kMaxT * p.k) * 4, &dwt).ok());
    ASSERT_TRUE(cuda->copy(ctx, dx, x.data(), x.size() * 4, CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(cuda->copy(ctx, dw, w.data(), w.size() * 4, CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(cuda->copy(ctx, db, bias.data(), bias.size() * 4, CopyKind::kHostToDevice).ok());
    struct Out {
      std::vector<float> logits, weights;
      std::vector<int32_t> ids;
    };
    // Rows [first, first + t) of x routed in one call, into outputs poisoned first (NaN logits and
    // weights, INT32_MIN ids), so that a row the call did not write cannot pass as equal.
    auto run = [&](int64_t first, int64_t t) {
      const std::vector<float> nan_f(static_cast<size_t>(kMaxT * p.e), std::numeric_limits<float>::quiet_NaN());
      const std::vector<int32_t> bad_i(static_cast<size_t>(kMaxT * p.k), std::numeric_limits<int32_t>::min());
      EXPECT_TRUE(cuda->copy(ctx, dl, nan_f.data(), nan_f.size() * 4, CopyKind::kHostToDevice).ok());
      EXPECT_TRUE(cuda->copy(ctx, dwt, nan_f.data(), static_cast<size_t>(kMaxT * p.k) * 4, CopyKind::kHostToDevice).ok());
      EXPECT_TRUE(cuda->copy(ctx, di, bad_i.data(), bad_i.size() * 4, CopyKind::kHostToDevice).ok());
      RouterArgs r;
      r.x = TensorView::contiguous(static_cast<float*>(dx) + first * p.h, DType::kF32, Shape{t, p.h}, ctx.device);
      r.w = TensorView::contiguous(dw, DType::kF32, Shape{p.e, p.h}, ctx.device);
      if (p.bias) r.bias = TensorView::contiguous(db, DType::kF32, Shape{p.e}, ctx.device);
      r.logits = TensorView::contiguous(dl, DType::kF32, Shape{t, p.e}, ctx.device);
      r.ids = TensorView::contiguous(di, DType::kI32, Shape{t, p.k}, ctx.device);
      r.weights = TensorView::contiguous(dwt, DType::kF32, Shape{t, p.k}, ctx.device);
      r.renormalize = p.renormalize;
      Out o{std::vector<float>(static_cast<size_t>(t * p.e)), std::vector<float>(static_cast<size_t>(t * p.k)),
            std::vector<int32_t>(static_cast<size_t>(t * p.k))};
      EXPECT_TRUE(cuda->router(ctx, r).ok());
      EXPECT_TRUE(cuda->copy(ctx, o.logits.data(), dl, o.logits.size() * 4, CopyKind::kDeviceToHost).ok());
      EXPECT_TRUE(cuda->copy(ctx, o.weights.data(), dwt, o.weights.size() * 4, CopyKind::kDeviceToHost).ok());
      EXPECT_TRUE(cuda->copy(ctx, o.ids.data(), di, o.ids.size() * 4, CopyKind::kDeviceToHost).ok());
      EXPECT_TRUE(cuda->synchronize(ctx).ok());
      return o;
    };
    for (const int64_t t : {int64_t{16}, kMaxT}) {
      const Out batch = run(0, t);
      for (const int64_t row : {int64_t{0}, int64_t{5}, t - 1}) {
        const Out alone = run(row, 1);
        EXPECT_EQ(std::memcmp(alone.logits.data(), batch.logits.data() + row * p.e, static_cast<size_t>(p.e) * 4), 0)
            << "logits of row " << row << " alone differ from the batch of " << t;
        EXPECT_EQ(std::memcmp(alone.weights.data(), batch.weights.data() + row * p.k, static_cast<size_t>(p.k) * 4),
                  0)
            << "weights of row " << row << " alone differ from the batch of " << t;
        for (int64_t j = 0; j < p.k; ++j)
          EXPECT_EQ(alone.ids[static_cast<size_t>(j)], batch.ids[static_cast<size_t>(row * p.k + j)])
              << "row " << row << ", pick " << j << ", batch of " << t;
      }
    }
    for (void* ptr : {dx, dw, db, dl, di, dwt}) EXPECT_TRUE(cuda->free(ctx, ptr).ok());
  }
}

// Paged attention at gpt-oss's shape (64 query heads, 8 KV heads, D 64): a decode token's output
// is the same bits alone (its 8-head grid would be 8 CTAs, at most kAttnFewMaxCtas = 64, so the
// kernel runs 32 CTAs of 2 query heads) as inside a batch of 40 tokens of other sequences and
// lengths (320 CTAs of 8 heads), without options, and with sinks and a window of 128 (one chunk
// of keys) or 200 (two chunks, the rescaling between them), contexts from 1 to 320. The decode
// step relies on it: a request's tokens do not depend on what else runs. (A threshold at or past
// 320 CTAs would make both calls take the same grid and this test a weaker one.)
TEST(CudaBackend, AttentionRowsAreTheSameBitsAloneAndInABatch) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext ctx{Device::cuda(0), nullptr};
  DeviceArena d(*cuda, ctx);
  Rng rng(11);
  const int64_t qh = 64, kvh = 8, dim = 64, bs = 16, num_seqs = 40, max_blocks = 20;  // 320 positions
  const int64_t num_blocks = num_seqs * max_blocks;
  const TensorView k = d.upload(random_f32(rng, num_blocks * bs * kvh * dim, -1, 1), {num_blocks, bs, kvh, dim});
  const TensorView v = d.upload(random_f32(rng, num_blocks * bs * kvh * dim, -1, 1), {num_blocks, bs, kvh, dim});
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::iota(table.begin(), table.end(), 0);
  rng.shuffle(table);
  const TensorView tables = d.upload(table, {num_seqs, max_blocks});
  std::vector<int32_t> seq_of(static_cast<size_t>(num_seqs)), ctx_len(static_cast<size_t>(num_seqs));
  for (int64_t i = 0; i < num_seqs; ++i) {
    seq_of[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % num_seqs);
    ctx_len[static_cast<size_t>(i)] = i == 0 ? 1 : i == 1 ? 320 : i == 2 ? 129 : 1 + rng.below(300);
  }
  const std::vector<float> q = random_f32(rng, num_seqs * qh * dim, -2, 2);
  const TensorView sinks = d.upload(random_f32(rng, qh, -2, 3), {qh});
  const size_t row = static_cast<size_t>(qh * dim);
  for (const int64_t window : {int64_t{0}, int64_t{128}, int64_t{200}}) {
    AttentionOptions opt;
    opt.sinks = window > 0 ? sinks : TensorView{};
    opt.window = window;
    const TensorView out = d.upload(std::vector<float>(q.size(), NAN), {num_seqs, qh, dim});
    ASSERT_TRUE(cuda->paged_attention_ex(ctx, out, d.upload(q, {num_seqs, qh, dim}), k, v, tables,
                                         d.upload(seq_of, {num_seqs}), d.upload(ctx_len, {num_seqs}), 0.125f, opt)
                    .ok());
    const std::vector<float> batch = d.download(out);
    for (const int64_t t : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{17}, int64_t{39}}) {
      const std::vector<float> q1(q.begin() + static_cast<ptrdiff_t>(t * qh * dim),
                                  q.begin() + static_cast<ptrdiff_t>((t + 1) * qh * dim));
      const TensorView out1 = d.upload(std::vector<float>(row, -777.0f), {1, qh, dim});  // not the batch's NaN: an unwritten element fails
      ASSERT_TRUE(cuda->paged_attention_ex(ctx, out1, d.upload(q1, {1, qh, dim}), k, v, tables,
                                           d.upload(std::vector<int32_t>{seq_of[static_cast<size_t>(t)]}, {1}),
                                           d.upload(std::vector<int32_t>{ctx_len[static_cast<size_t>(t)]}, {1}), 0.125f, opt)
                      .ok());
      const std::vector<float> alone = d.download(out1);
      EXPECT_EQ(std::memcmp(alone.data(), batch.data() + t * static_cast<int64_t>(row), row * 4), 0)
          << "token " << t << " (context " << ctx_len[static_cast<size_t>(t)] << ", window " << window
          << ") differs alone and in the batch";
    }
  }
}

// Every key position reaches the output on the tensor-core kernel (BF16 caches, gpt-oss's shape,
// 12 decode rows: a grid of 96 CTAs), unsplit and split (needles at part starts and ends too).
// Each token's context holds one needle key whose score (32) leaves every other key
// (|score| <= 0.4) a weight below e^-31: the output of every head is the needle's V row (half of
// it with sinks of 32), within BF16 rounding of p (the needle's p is exp(0) = 1, exact).
// Needles at tile (32 keys) and warp (4 tiles) boundaries, the first and the last key, contexts
// of 1 to 1,500 keys. A random-data parity case cannot see one key lost out of 1,000 (its share
// is under the BF16 bound); this can. With a window of 128 keys a needle outside it must be
// ignored (the output is then an average of small values, far from the needle's row).
TEST(CudaBackend, TensorCoreAttentionSeesEveryKeyPosition) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext ctx{Device::cuda(0), nullptr};
  DeviceArena d(*cuda, ctx);
  Rng rng(33);
  const int64_t qh = 64, kvh = 8, dim = 64, bs = 16, num_seqs = 12, max_blocks = 96;  // 1,536 positions
  const int64_t num_blocks = num_seqs * max_blocks;
  // Split (parts of 256 keys from the first key seen): 511 ends part 0, 256 and 768 start parts
  // 1 and 3, 1024 is the only key of its part, 999 the last key of its row.
  const std::vector<int32_t> ctx_len{1, 31, 33, 64, 129, 256, 300, 511, 700, 1000, 1025, 1500};
  const std::vector<int32_t> needle{0, 30, 32, 63, 127, 128, 159, 255, 256, 999, 1024, 768};
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::iota(table.begin(), table.end(), 0);
  rng.shuffle(table);
  const size_t rows = static_cast<size_t>(num_blocks * bs * kvh);
  std::vector<float> kf = random_f32(rng, static_cast<int64_t>(rows) * dim, -0.05f, 0.05f);
  std::vector<float> vf = random_f32(rng, static_cast<int64_t>(rows) * dim, -1, 1);
  std::vector<float> q(static_cast<size_t>(num_seqs * qh * dim));
  for (int64_t t = 0; t < num_seqs; ++t) {
    std::vector<float> sign(static_cast<size_t>(dim));
    for (auto& x : sign) x = rng.below(2) ? 1.0f : -1.0f;
    for (int64_t h = 0; h < qh; ++h)
      std::copy(sign.begin(), sign.end(), q.begin() + (t * qh + h) * dim);
    const int64_t j = needle[static_cast<size_t>(t)];
    const int64_t slot = static_cast<int64_t>(table[static_cast<size_t>(t * max_blocks + j / bs)]) * bs + j % bs;
    for (int64_t g = 0; g < kvh; ++g)
      for (int64_t e = 0; e < dim; ++e) kf[static_cast<size_t>((slot * kvh + g) * dim + e)] = 4.0f * sign[static_cast<size_t>(e)];
  }
  std::vector<uint16_t> kb(kf.size()), vb(vf.size());
  for (size_t i = 0; i < kf.size(); ++i) {
    kb[i] = f32_to_bf16_bits(kf[i]);
    vb[i] = f32_to_bf16_bits(vf[i]);
  }
  const TensorView k = d.upload(kb, {num_blocks, bs, kvh, dim});
  const TensorView v = d.upload(vb, {num_blocks, bs, kvh, dim});
  std::vector<int32_t> seq_of(static_cast<size_t>(num_seqs));
  std::iota(seq_of.begin(), seq_of.end(), 0);
  const int64_t ws_bytes = paged_attention_workspace_bytes(num_seqs, qh, dim);
  const TensorView ws_words = d.upload(std::vector<int32_t>(static_cast<size_t>(ws_bytes / 4), 0), {ws_bytes / 4});
  const TensorView ws = TensorView::contiguous(ws_words.data, DType::kU8, Shape{ws_bytes}, ctx.device);
  // split_ctas -1: no workspace (unsplit); 0: the auto split (96 rows: split on a GPU of more
  // than 96 SMs, e.g. an H200's 132); 3: three CTAs a row taking every third part. A window of
  // 700 splits the longer rows from their window's first key. With sinks equal to the needle's
  // score (32) the needle and the sink share the weight: the output is half the needle's row,
  // so a sink dropped (the row) or counted twice (a third) in any combine is seen.
  const TensorView sinks = d.upload(std::vector<float>(static_cast<size_t>(qh), 32.0f), {qh});
  for (const int64_t window : {int64_t{0}, int64_t{128}, int64_t{700}})
  for (const int32_t split_ctas : {-1, 0, 3})
  for (const bool with_sinks : {false, true}) {
    AttentionOptions opt;
    opt.window = window;
    opt.workspace = split_ctas >= 0 ? ws : TensorView{};
    opt.split_ctas = split_ctas >= 0 ? split_ctas : 0;
    opt.sinks = with_sinks ? sinks : TensorView{};
    const float share = with_sinks ? 0.5f : 1.0f;
    const TensorView out = d.upload(std::vector<float>(q.size(), NAN), {num_seqs, qh, dim});
    ASSERT_TRUE(cuda->paged_attention_ex(ctx, out, d.upload(q, {num_seqs, qh, dim}), k, v,
                                         d.upload(table, {num_seqs, max_blocks}), d.upload(seq_of, {num_seqs}),
                                         d.upload(ctx_len, {num_seqs}), 0.125f, opt)
                    .ok());
    const std::vector<float> o = d.download(out);
    for (int64_t t = 0; t < num_seqs; ++t) {
      const int64_t j = needle[static_cast<size_t>(t)], n = ctx_len[static_cast<size_t>(t)];
      const bool seen = window == 0 || j >= n - window;
      const int64_t slot = static_cast<int64_t>(table[static_cast<size_t>(t * max_blocks + j / bs)]) * bs + j % bs;
      for (int64_t h = 0; h < qh; ++h) {
        const int64_t g = h / (qh / kvh);
        double worst = 0;
        for (int64_t e = 0; e < dim; ++e) {
          const float want = share * bf16_bits_to_f32(vb[static_cast<size_t>((slot * kvh + g) * dim + e)]);
          worst = std::max(worst, std::fabs(static_cast<double>(o[static_cast<size_t>((t * qh + h) * dim + e)]) - want));
        }
        if (seen)
          EXPECT_LE(worst, 1e-4) << "token " << t << " (context " << n << ", needle " << j << ", window " << window
                                 << ", split_ctas " << split_ctas << ", sinks " << with_sinks << ") head " << h
                                 << ": not the needle's value row (times its share)";
        else
          EXPECT_GT(worst, 0.1) << "token " << t << " (context " << n << ", needle " << j << ", window " << window
                                << ", split_ctas " << split_ctas << ", sinks " << with_sinks << ") head " << h
                                << ": a key outside the window was seen";
      }
    }
  }
}

// Split rows (AttentionOptions::workspace) at gpt-oss's shape: a row's parts depend on its number
// of keys alone, so a token gets the same bits in a batch of 12 split 2 CTAs a row, alone (auto:
// 8 rows, fewer than any GPU's SMs, so split), and alone with 1 or 3 CTAs taking every part; with
// sinks, a window of 700 keys (three parts) and without; contexts from 1 (unsplit) to 5,000 (14
// parts of 3 chunks). Every one of those launches reuses one workspace of 12 tokens, as the
// decoder does across steps of other sizes (a 12-token launch after 1-token ones must not read
// their partials as counters), and its counters are zero after each (the next launch, or a CUDA
// graph replay, starts from them). The split did happen: a row of more than 256 keys differs in
// its bits from the same row without a workspace, by no more than rounding. And auto leaves a
// grid of 48 tokens (384 rows, more than any GPU's SMs) unsplit: the same bits as without.
// FP32 caches run the float4 kernel; BF16 caches the tensor-core kernel (split and unsplit rows
// then differ by BF16 rounding of p, relative to each part's max instead of the row's).
void expect_split_rows_same_bits_in_every_grid(bool kv_bf16) {
  const Backend* cuda = cuda_backend();
  if (cuda == nullptr || cuda_device_count() == 0)
    GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext ctx{Device::cuda(0), nullptr};
  DeviceArena d(*cuda, ctx);
  Rng rng(12);
  const int64_t qh = 64, kvh = 8, dim = 64, bs = 16, num_seqs = 12, max_blocks = 320;  // 5,120 positions
  const int64_t num_blocks = num_seqs * max_blocks;
  auto cache = [&] {
    const std::vector<float> f = random_f32(rng, num_blocks * bs * kvh * dim, -1, 1);
    if (!kv_bf16) return d.upload(f, {num_blocks, bs, kvh, dim});
    std::vector<uint16_t> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16_bits(f[i]);
    return d.upload(b, {num_blocks, bs, kvh, dim});
  };
  const TensorView k = cache();
  const TensorView v = cache();
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::iota(table.begin(), table.end(), 0);
  rng.shuffle(table);
  const TensorView tables = d.upload(table, {num_seqs, max_blocks});
  const std::vector<int32_t> seq_of{3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11};
  const std::vector<int32_t> ctx_len{1, 256, 257, 700, 1000, 2048, 2049, 3333, 4100, 5000, 5120, 129};
  const std::vector<float> q = random_f32(rng, num_seqs * qh * dim, -2, 2);
  const TensorView sinks = d.upload(random_f32(rng, qh, -2, 3), {qh});
  const size_t row = static_cast<size_t>(qh * dim);
  // A zero-filled workspace for `tokens` tokens; its counters as floats (zero bits: zero).
  auto workspace = [&](int64_t tokens, TensorView* counters) {
    const int64_t bytes = paged_attention_workspace_bytes(tokens, qh, dim);
    const TensorView w = d.upload(std::vector<int32_t>(static_cast<size_t>(bytes / 4), 0), {bytes / 4});
    *counters = TensorView::contiguous(w.data, DType::kF32, Shape{tokens * qh}, ctx.device);
    return TensorView::contiguous(w.data, DType::kU8, Shape{bytes}, ctx.device);
  };
  TensorView shared_counters;
  const TensorView shared = workspace(num_seqs, &shared_counters);
  auto expect_counters_zero = [&](const TensorView& counters, const char* what) {
    const std::vector<float> c = d.download(counters);
    EXPECT_EQ(std::count(c.begin(), c.end(), 0.0f), static_cast<ptrdiff_t>(c.size())) << what << ": counters left set";
  };
  for (const int64_t window : {int64_t{0}, int64_t{700}}) {
    for (const bool with_sinks : {false, true}) {
      AttentionOptions opt;
      opt.sinks = with_sinks ? sinks : TensorView{};
      opt.window = window;
      const TensorView& counters = shared_counters;
      opt.workspace = shared;
      opt.split_ctas = 2;
      const TensorView out = d.upload(std::vector<float>(q.size(), NAN), {num_seqs, qh, dim});
      ASSERT_TRUE(cuda->paged_attention_ex(ctx, out, d.upload(q, {num_seqs, qh, dim}), k, v, tables,
                                           d.upload(seq_of, {num_seqs}), d.upload(ctx_len, {num_seqs}), 0.125f, opt)
                      .ok());
      const std::vector<float> batch = d.download(out);
      expect_counters_zero(counters, "batch");
      {
        // 48 tokens: the 12 rows four times over. Auto with a workspace == no workspace, bit for bit.
        const int64_t big = 4 * num_seqs;
        std::vector<int32_t> seq4, len4;
        std::vector<float> q4;
        for (int r = 0; r < 4; ++r) {
          seq4.insert(seq4.end(), seq_of.begin(), seq_of.end());
          len4.insert(len4.end(), ctx_len.begin(), ctx_len.end());
          q4.insert(q4.end(), q.begin(), q.end());
        }
        std::vector<float> got[2];
        for (const bool with_ws : {false, true}) {
          AttentionOptions big_opt = opt;
          big_opt.split_ctas = 0;
          TensorView c4;
          big_opt.workspace = with_ws ? workspace(big, &c4) : TensorView{};
          const TensorView o4 = d.upload(std::vector<float>(q4.size(), NAN), {big, qh, dim});
          ASSERT_TRUE(cuda->paged_attention_ex(ctx, o4, d.upload(q4, {big, qh, dim}), k, v, tables,
                                               d.upload(seq4, {big}), d.upload(len4, {big}), 0.125f, big_opt)
                          .ok());
          got[with_ws ? 1 : 0] = d.download(o4);
        }
        EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * 4), 0)
            << "window " << window << ", sinks " << with_sinks << ": a grid of " << big
            << " tokens was split (or changed) by an auto workspace";
        // got[0]'s first 12 rows: the batch's rows unsplit. Rows of up to 256 keys are one part,
        // the unsplit arithmetic; longer ones agree to rounding, and some differ in their bits
        // (one part may round as unsplit does: 257 keys are parts of 256 and 1).
        int differing = 0;
        for (int64_t t = 0; t < num_seqs; ++t) {
          const int64_t keys = window > 0 ? std::min<int64_t>(window, ctx_len[static_cast<size_t>(t)])
                                          : ctx_len[static_cast<size_t>(t)];
          const float* unsplit = got[0].data() + t * static_cast<int64_t>(row);
          const float* split = batch.data() + t * static_cast<int64_t>(row);
          float worst = 0.0f;
          for (size_t i = 0; i < row; ++i) {
            const float diff = std::fabs(unsplit[i] - split[i]);
            if (!(diff <= worst)) worst = diff;  // a NaN (a row never combined) sticks
          }
          EXPECT_LE(worst, kv_bf16 ? 4e-3f : 1e-4f)
              << "token " << t << " (" << keys << " keys, BF16 caches " << kv_bf16 << "): split and unsplit disagree";
          if (keys > kAttentionSplitMinKeys)
            differing += std::memcmp(unsplit, split, row * 4) != 0;
          else
            EXPECT_EQ(std::memcmp(unsplit, split, row * 4), 0) << "token " << t << " (" << keys << " keys)";
        }
        EXPECT_GT(differing, 0) << "window " << window << ", sinks " << with_sinks
                                << ": every split row has the unsplit bits, so nothing split (ROLLOUTD_ATTN_SPLIT=0?)";
      }
      for (int64_t t = 0; t < num_seqs; ++t) {
        const std::vector<float> q1(q.begin() + static_cast<ptrdiff_t>(t * qh * dim),
                                    q.begin() + static_cast<ptrdiff_t>((t + 1) * qh * dim));
        for (const int32_t ctas : {0, 1, 3}) {
          AttentionOptions one = opt;
          one.split_ctas = ctas;
          const TensorView out1 = d.upload(std::vector<float>(row, -777.0f), {1, qh, dim});
          ASSERT_TRUE(cuda->paged_attention_ex(ctx, out1, d.upload(q1, {1, qh, dim}), k, v, tables,
                                               d.upload(std::vector<int32_t>{seq_of[static_cast<size_t>(t)]}, {1}),
                                               d.upload(std::vector<int32_t>{ctx_len[static_cast<size_t>(t)]}, {1}),
                                               0.125f, one)
                          .ok());
          const std::vector<float> alone = d.download(out1);
          EXPECT_EQ(std::memcmp(alone.data(), batch.data() + t * static_cast<int64_t>(row), row * 4), 0)
              << "token " << t << " (context " << ctx_len[static_cast<size_t>(t)] << ", window " << window
              << ", sinks " << with_sinks << ", split_ctas " << ctas << ") differs alone and in the batch";
          expect_counters_zero(shared_counters, "alone");
        }
      }
    }
  }
}

TEST(CudaBackend, AttentionSplitRowsAreTheSameBitsInEveryGrid) { expect_split_rows_same_bits_in_every_grid(false); }
TEST(CudaBackend, TensorCoreAttentionSplitRowsAreTheSameBitsInEveryGrid) {
  expect_split_rows_same_bits_in_every_grid(true);
}

// The CPU reference refuses a device-held count outside [0, T] and leaves dst untouched (the
// CUDA twin clamps it: it cannot read the count without a synchronisation).
TEST(BackendParityChecks, CopyValidRowsCountOutsideRowsIsOutOfRange) {
  const ExecContext ctx{Device::cpu(), nullptr};
  std::vector<int32_t> src(8, 7), dst(8, 3);
  for (const int32_t n : {-1, 5}) {
    int32_t count = n;
    const Status st = cpu_backend().copy_valid_rows(
        ctx, TensorView::contiguous(dst.data(), DType::kI32, Shape{4, 2}, ctx.device),
        TensorView::contiguous(src.data(), DType::kI32, Shape{4, 2}, ctx.device),
        TensorView::contiguous(&count, DType::kI32, Shape{1}, ctx.device), -1);
    EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << n;
    EXPECT_EQ(st.field(), "count");
    EXPECT_EQ(dst, std::vector<int32_t>(8, 3)) << "dst written on a refused call";
  }
}

TEST(BackendParityChecks, DeviceCountIsZeroWithoutCuda) {
  if (cuda_backend() == nullptr) {
    EXPECT_EQ(cuda_device_count(), 0);
  }
  EXPECT_GE(cuda_device_count(), 0);  // never an error, whatever the machine
}

}  // namespace
}  // namespace rolloutd
