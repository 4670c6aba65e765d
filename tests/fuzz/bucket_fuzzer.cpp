// Fuzz target: the weight-bucket table validation and apply path, core::WeightUpdater
// (begin / apply_bucket / end / abort / expire) against the embedded model's registry on
// the CPU backend. The input is a little program of session operations; bucket entries
// take their names from the real parameter and loader-alias names (or fuzzed strings),
// their shapes from the real checkpoint shapes (or mutated ones), and their byte ranges,
// dtypes, checksums and session ids from the input, so every refusal rule is reachable.
//
// Oracles beyond the sanitizers (DESIGN "contracts worth a test each"):
//  - stable storage: no parameter's address ever changes;
//  - bad input changes nothing: on the CPU backend every apply_bucket error is a refusal,
//    it leaves the session open and every parameter's stored bytes untouched;
//  - an accepted bucket reports the entries and bytes it was given;
//  - a completed session leaves every parameter in kernel layout; a session that wrote
//    and then failed (abort, idle deadline) leaves the model not whole.
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/model/embedded_model.hpp"
#include "core/weights/session.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace rolloutd;
using namespace rolloutd::core;

namespace {

constexpr DType kDTypes[] = {DType::kF32,  DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kE8M0,
                             DType::kFP4x2, DType::kU8,  DType::kI8,  DType::kU16,    DType::kI16,
                             DType::kU32,  DType::kI32,  DType::kI64, DType::kBool};

struct World {
  std::unique_ptr<MoeDecoder> model;
  std::vector<std::string> names;         // parameters and loader aliases, some not resolvable
  std::vector<const void*> addresses;     // first-build address of each parameter
  std::vector<uint8_t> pattern;           // bucket filler
};

World& world() {
  static World* w = [] {
    auto* w = new World;
    StepLimits limits;
    limits.max_tokens = 16;
    limits.max_seqs = 2;
    limits.num_kv_blocks = 8;
    limits.kv_block_size = 4;
    limits.max_blocks_per_seq = 4;
    // The embedded model with one decoder layer: every parameter kind, quant method and
    // loader alias is there; four layers would only repeat them at four times the cost of
    // each begin/end (layout permutations), i.e. a quarter of the executions.
    ModelConfig config = embedded_model_config();
    config.num_hidden_layers = 1;
    auto m = MoeDecoder::create(config, limits, cpu_backend(), ExecContext{});
    FUZZ_CHECK(m.ok(), "embedded model: %s", m.status().to_string().c_str());
    FUZZ_CHECK(init_random_weights(**m, kEmbeddedModelSeed).ok(), "init_random_weights");
    w->model = std::move(*m);
    const ModelConfig& c = config;
    for (const auto& p : w->model->weights().parameters()) {
      w->names.push_back(p.name);
      w->addresses.push_back(p.storage.data);
    }
    // Loader aliases (moe_decoder.cpp), one layer and one expert past the end included.
    for (int64_t l = 0; l <= c.num_hidden_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      w->names.push_back(p + "self_attn.qkv_proj.weight");
      for (int64_t e = 0; e <= c.num_experts; e += (e < 2 || e + 1 >= c.num_experts) ? 1 : 5)
        for (const char* k : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"})
          w->names.push_back(p + "mlp.experts." + std::to_string(e) + "." + k);
    }
    w->pattern.resize(1 << 20);
    uint32_t x = 12345;
    for (auto& b : w->pattern) {
      x = x * 1664525u + 1013904223u;
      b = static_cast<uint8_t>(x >> 24);
    }
    return w;
  }();
  return *w;
}

// Stored bytes of every parameter, into a buffer reused across inputs (allocating ~2 MB per
// bucket made the target spend its time in mmap/munmap).
void snapshot(const WeightRegistry& reg, std::vector<uint8_t>& out) {
  out.clear();
  for (const auto& p : reg.parameters()) {
    const auto* b = static_cast<const uint8_t*>(p.storage.data);
    out.insert(out.end(), b, b + p.storage.nbytes());
  }
}

bool unchanged_since(const WeightRegistry& reg, const std::vector<uint8_t>& before) {
  size_t at = 0;
  for (const auto& p : reg.parameters()) {
    const size_t n = p.storage.nbytes();
    if (at + n > before.size() || std::memcmp(before.data() + at, p.storage.data, n) != 0) return false;
    at += n;
  }
  return at == before.size();
}

void check_addresses(const World& w) {
  const auto& params = w.model->weights().parameters();
  for (size_t i = 0; i < params.size(); ++i)
    FUZZ_CHECK(params[i].storage.data == w.addresses[i], "parameter %s moved", params[i].name.c_str());
}

double pick_timeout(uint8_t k) {
  static constexpr double kTimeouts[] = {60.0, 0.5, 3600.0, 1e-9, 0.0, -1.0, 3600.5,
                                         std::numeric_limits<double>::quiet_NaN(),
                                         std::numeric_limits<double>::infinity()};
  return kTimeouts[k % (sizeof(kTimeouts) / sizeof(kTimeouts[0]))];
}

struct Bucket {
  std::vector<BucketEntry> entries;
  std::vector<uint8_t> bytes;
};

// Fills `b` (its buffers are reused across inputs).
void make_bucket(fuzz::ByteReader& in, const World& w, Bucket& b) {
  b.entries.clear();
  const WeightRegistry& reg = w.model->weights();
  const size_t num_entries = in.u8() % 6;
  uint64_t packed = 0;  // next offset when entries are laid out back to back
  for (size_t i = 0; i < num_entries; ++i) {
    BucketEntry e;
    const uint8_t how = in.u8();
    e.name = (how & 0x0f) == 0x0f ? in.str(48) : w.names[in.u16() % w.names.size()];
    e.dtype = kDTypes[(how >> 4) % 8 == 0 ? in.u8() % std::size(kDTypes) : ((how >> 4) % 8 < 6 ? 0 : 1)];
    const CheckpointTensor* t = reg.resolve(e.name);
    const uint8_t shape_mode = in.u8();
    if (t != nullptr && shape_mode % 4 != 0) {
      e.shape = t->shape;
      if (shape_mode % 4 == 3 && !e.shape.empty()) {  // one dimension off
        const size_t k = in.u8() % e.shape.size();
        e.shape[k] += static_cast<int8_t>(in.u8());
      }
    } else {
      const size_t rank = in.u8() % 10;
      for (size_t k = 0; k < rank; ++k) e.shape.push_back(static_cast<int64_t>(in.u32()) - (1 << 16));
    }
    // nbytes: the right product (when it fits), or a fuzzed value.
    const uint8_t size_mode = in.u8();
    uint64_t numel = 1;
    bool fits = true;
    for (int64_t d : e.shape) {
      if (d < 0 || (d != 0 && numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))) fits = false;
      else numel *= static_cast<uint64_t>(d);
    }
    const uint64_t want = fits && numel <= (uint64_t{1} << 40) ? numel * dtype_size(e.dtype) : 0;
    e.nbytes = size_mode % 4 != 0 ? want : (size_mode % 8 == 4 ? in.u64() : want + static_cast<int8_t>(in.u8()));
    // byte_offset: back to back (the common case), overlapping the previous one, or fuzzed.
    const uint8_t off_mode = in.u8();
    if (off_mode % 4 == 0) e.byte_offset = in.u64();
    else if (off_mode % 4 == 1 && packed > 0) e.byte_offset = packed - 1 - in.u8() % packed;
    else e.byte_offset = packed + (off_mode % 4 == 2 ? in.u8() : 0);
    if (e.nbytes <= (uint64_t{1} << 32) && e.byte_offset <= (uint64_t{1} << 32)) packed = e.byte_offset + e.nbytes;
    b.entries.push_back(std::move(e));
  }
  // The buffer: exactly what the entries span (rounded by a fuzzed slack), or a fuzzed size;
  // the tail of the input fills its start, the fixed pattern the rest.
  const uint8_t buf_mode = in.u8();
  uint64_t size = buf_mode % 4 == 0 ? in.u32() : packed + (buf_mode % 4 == 1 ? in.u8() : 0);
  if (buf_mode % 4 == 2 && size > 0) size -= 1 + in.u8() % size;
  size = std::min<uint64_t>(size, w.pattern.size());
  b.bytes.assign(w.pattern.begin(), w.pattern.begin() + static_cast<ptrdiff_t>(size));
  const auto tail = in.take(std::min<size_t>(in.u16(), b.bytes.size()));
  std::copy(tail.begin(), tail.end(), b.bytes.begin());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  WeightRegistry& reg = w.model->weights();
  WeightUpdater u(reg);
  fuzz::ByteReader in(data, size);
  auto now = SteadyClock::time_point{} + std::chrono::hours(1000);
  bool wrote = false;  // the open session wrote at least one bucket
  for (int op = 0; op < 16 && !in.empty(); ++op) {
    const uint8_t code = in.u8();
    const uint64_t session = (code & 0x80) ? in.u64() : u.session_id();
    now += std::chrono::milliseconds(in.u16());
    switch (code % 6) {
      case 0: {  // begin, with a selector of name prefixes
        std::vector<std::string> selector;
        for (size_t k = 0, n = in.u8() % 3; k < n; ++k) {
          const std::string& name = w.names[in.u16() % w.names.size()];
          selector.push_back((in.u8() & 1) ? in.str(16) : name.substr(0, in.u8() % (name.size() + 1)));
        }
        const bool was_open = u.session_open();
        auto r = u.begin(selector, pick_timeout(in.u8()), now);
        if (r.ok()) {
          FUZZ_CHECK(!was_open && u.session_open() && r->session == u.session_id(), "begin bookkeeping");
          wrote = false;
        }
        break;
      }
      case 1: {  // one bucket
        static Bucket b;
        make_bucket(in, w, b);
        const uint8_t crc_mode = in.u8();
        std::optional<uint32_t> crc;
        if (crc_mode % 3 == 1) crc = crc32_of(b.bytes);
        if (crc_mode % 3 == 2) crc = in.u32();
        const bool was_open = u.session_open();
        static std::vector<uint8_t> before;
        snapshot(reg, before);
        auto r = u.apply_bucket(session, b.entries, b.bytes, crc, now);
        static fuzz::Tally tally("bucket");
        tally.count(r.ok());
        if (r.ok()) {
          uint64_t entry_bytes = 0;  // SPEC 11.1: the entries' bytes, not the buffer's
          for (const auto& e : b.entries) entry_bytes += e.nbytes;
          FUZZ_CHECK(r->num_entries == b.entries.size() && r->num_bytes == entry_bytes, "bucket counts");
          wrote = true;
        } else {
          // The CPU backend has no environment faults: every error must be a refusal.
          FUZZ_CHECK(u.session_open() == was_open, "a refused bucket closed the session: %s",
                     r.status().to_string().c_str());
          FUZZ_CHECK(unchanged_since(reg, before), "a refused bucket changed parameters: %s",
                     r.status().to_string().c_str());
        }
        break;
      }
      case 2: {  // end
        auto r = u.end(session, in.u64(), now);
        if (r.ok()) {
          FUZZ_CHECK(!u.session_open(), "end left the session open");
          FUZZ_CHECK(reg.all_kernel_layout(), "end left parameters in checkpoint layout");
          FUZZ_CHECK(r->whole == u.whole(), "end: whole flag disagrees");
        }
        break;
      }
      case 3: {  // abort
        auto r = u.abort(session, "fuzz");
        if (r.ok()) {
          FUZZ_CHECK(!u.session_open() && reg.all_kernel_layout(), "abort left layouts mixed");
          if (wrote) FUZZ_CHECK(!*r && !u.whole(), "abort after a write reported a whole model");
        }
        break;
      }
      case 4: {  // the idle deadline
        const bool was_open = u.session_open();
        now += std::chrono::seconds(in.u16());
        auto expired = u.expire_if_idle(now);
        if (expired) {
          FUZZ_CHECK(was_open && !u.session_open(), "expired a session that was not open");
          FUZZ_CHECK(expired->code() == ErrorCode::kDeadlineExceeded, "expiry code");
          if (wrote) FUZZ_CHECK(!u.whole(), "expiry after a write reported a whole model");
        }
        break;
      }
      case 5: {  // read one parameter back in checkpoint layout
        std::vector<uint8_t> out;
        const size_t i = in.u16() % reg.size();
        FUZZ_CHECK(reg.read_checkpoint(i, out).ok(), "read_checkpoint");
        FUZZ_CHECK(out.size() == reg.parameters()[i].storage.nbytes(), "read_checkpoint size");
        break;
      }
    }
    check_addresses(w);
  }
  // Leave every layout as the next input expects it (kernel), whatever this one did.
  if (u.session_open()) (void)u.abort(u.session_id(), "fuzz input ended");
  FUZZ_CHECK(reg.all_kernel_layout(), "layouts not restored at the end of the input");
  return 0;
}
