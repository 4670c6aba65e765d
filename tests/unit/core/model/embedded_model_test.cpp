// The embedded model against the independent NumPy reference
// (tests/reference/tiny_moe_reference.py -> tiny_moe_golden.json): weights bit-exact,
// prompt logits within FP32 tolerance, greedy tokens and router ids equal.
#include "core/model/embedded_model.hpp"

#include <cmath>

#include "../test_util.hpp"

namespace rolloutd {
namespace {

using test::load_json;

core::StepBatch full_prompt_batch(const std::vector<int32_t>& tokens, int64_t block_size) {
  core::StepBatch b;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t blocks = (T + block_size - 1) / block_size;
  b.max_blocks_per_seq = static_cast<int32_t>(blocks);
  for (int64_t i = 0; i < blocks; ++i) b.block_tables.push_back(static_cast<int32_t>(i));
  for (int64_t t = 0; t < T; ++t) {
    b.token_ids.push_back(tokens[static_cast<size_t>(t)]);
    b.positions.push_back(static_cast<int32_t>(t));
    b.seq_of.push_back(0);
    b.slot_mapping.push_back(static_cast<int32_t>(t));
    b.ctx_len.push_back(static_cast<int32_t>(t + 1));
    b.logits_rows.push_back(static_cast<int32_t>(t));
  }
  return b;
}

TEST(EmbeddedModel, WeightsMatchReferenceBitForBit) {
  const auto golden = load_json("tests/reference/tiny_moe_golden.json");
  ASSERT_EQ(golden["seed"].get<uint64_t>(), core::kEmbeddedModelSeed);
  auto model = test::embedded_model(test::small_limits());
  for (const auto& [name, values] : golden["weight_samples"].items()) {
    const core::RegisteredParameter* p = model->weights().find(name);
    ASSERT_NE(p, nullptr) << name;
    const float* w = p->storage.as<float>();
    for (size_t i = 0; i < values.size(); ++i)
      EXPECT_EQ(w[i], values[i].get<float>()) << name << "[" << i << "]";
  }
}

TEST(EmbeddedModel, ConfigMatchesReference) {
  const auto golden = load_json("tests/reference/tiny_moe_golden.json");
  const auto c = core::embedded_model_config();
  const auto& g = golden["config"];
  EXPECT_EQ(c.vocab_size, g["vocab_size"].get<int64_t>());
  EXPECT_EQ(c.hidden_size, g["hidden_size"].get<int64_t>());
  EXPECT_EQ(c.num_hidden_layers, g["num_hidden_layers"].get<int64_t>());
  EXPECT_EQ(c.num_experts, g["num_experts"].get<int64_t>());
  EXPECT_EQ(c.num_experts_per_tok, g["num_experts_per_tok"].get<int64_t>());
  EXPECT_EQ(c.moe_intermediate_size, g["moe_intermediate_size"].get<int64_t>());
}

TEST(EmbeddedModel, PromptLogitsAndRouterIdsMatchReference) {
  const auto golden = load_json("tests/reference/tiny_moe_golden.json");
  const auto limits = test::small_limits();
  auto model = test::embedded_model(limits);
  const auto& c = model->config();
  for (const auto& cs : golden["cases"]) {
    const auto prompt = cs["prompt"].get<std::vector<int32_t>>();
    core::StepBatch b = full_prompt_batch(prompt, limits.kv_block_size);
    std::vector<float> logits;
    core::RoutedExpertRecorder rec(c.num_moe_layers(), c.num_experts_per_tok, limits.max_tokens);
    ASSERT_TRUE(model->forward(b, logits, &rec).ok());
    double num = 0, den = 0;
    const auto& ref = cs["prompt_logits"];
    ASSERT_EQ(logits.size(), prompt.size() * static_cast<size_t>(c.vocab_size));
    for (size_t t = 0; t < prompt.size(); ++t)
      for (int64_t v = 0; v < c.vocab_size; ++v) {
        const double r = ref[t][static_cast<size_t>(v)].get<double>();
        const double d = logits[t * static_cast<size_t>(c.vocab_size) + static_cast<size_t>(v)] - r;
        num += d * d;
        den += r * r;
      }
    EXPECT_LT(std::sqrt(num / den), 1e-5) << "prompt logits diverge from the NumPy reference";
    // Router ids of the prompt positions: the first prompt.size() rows of the reference.
    const auto& ids = cs["routed_experts"];
    for (size_t t = 0; t < prompt.size(); ++t)
      for (int64_t l = 0; l < c.num_moe_layers(); ++l)
        for (int64_t k = 0; k < c.num_experts_per_tok; ++k)
          EXPECT_EQ(rec.rows()[(t * static_cast<size_t>(c.num_moe_layers()) + static_cast<size_t>(l)) *
                                   static_cast<size_t>(c.num_experts_per_tok) + static_cast<size_t>(k)],
                    ids[t][static_cast<size_t>(l)][static_cast<size_t>(k)].get<int32_t>())
              << "t=" << t << " layer=" << l << " k=" << k;
  }
}

TEST(EmbeddedModel, GreedyGenerationAndRecordsMatchReference) {
  const auto golden = load_json("tests/reference/tiny_moe_golden.json");
  auto engine = test::embedded_engine(test::small_limits(/*max_tokens=*/3));  // forces chunked prefill
  const auto& c = engine->model_config();
  int i = 0;
  for (const auto& cs : golden["cases"]) {
    core::RequestSpec s;
    s.rid = "r" + std::to_string(i++);
    s.input_ids = cs["prompt"].get<std::vector<int32_t>>();
    s.max_new_tokens = static_cast<uint32_t>(cs["greedy_tokens"].size());
    s.sampling.temperature = 0.0f;
    s.return_routed_experts = true;
    ASSERT_TRUE(engine->submit(s).ok());
  }
  auto events = test::run_to_idle(*engine);
  i = 0;
  for (const auto& cs : golden["cases"]) {
    const std::string rid = "r" + std::to_string(i++);
    std::vector<int32_t> tokens, rows;
    int64_t next_pos = 0;
    int finals = 0;
    for (const auto& e : events) {
      if (e.rid != rid) continue;
      if (e.kind == core::EngineEvent::Kind::kTokens) {
        tokens.insert(tokens.end(), e.token_ids.begin(), e.token_ids.end());
        if (e.routed_num_tokens) {
          EXPECT_EQ(e.routed_start_pos, next_pos) << "records must arrive in position order";
          next_pos += e.routed_num_tokens;
          rows.insert(rows.end(), e.routed_rows.begin(), e.routed_rows.end());
        }
      } else {
        ++finals;
        EXPECT_EQ(e.kind, core::EngineEvent::Kind::kFinished);
        EXPECT_EQ(e.finish_reason, "length");
      }
    }
    EXPECT_EQ(finals, 1);
    EXPECT_EQ(tokens, cs["greedy_tokens"].get<std::vector<int32_t>>()) << rid;
    const auto& ref = cs["routed_experts"];
    ASSERT_EQ(static_cast<size_t>(next_pos), ref.size()) << "one row per forwarded token";
    size_t j = 0;
    for (const auto& t : ref)
      for (const auto& l : t)
        for (const auto& k : l) EXPECT_EQ(rows[j++], k.get<int32_t>());
    (void)c;
  }
}

}  // namespace
}  // namespace rolloutd
