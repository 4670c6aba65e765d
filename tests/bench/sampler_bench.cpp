// Host sampling cost per token at a real vocabulary (Qwen3: 151,936) for the settings RL uses:
// greedy, temperature 1 with no filter, top-p 0.9 / top-k 50, against the full sort of the
// vocabulary the sampler did per token before it ordered only the prefix it needs. Reports
// numbers (tests/bench/NOTES.md, "Host sampling"); runs on any machine.
//
//   sampler_bench [VOCAB] [TOKENS]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "core/sampling/sampler.hpp"

int main(int argc, char** argv) {
  using namespace rolloutd::core;
  const size_t vocab = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 151936;
  const int tokens = argc > 2 ? std::atoi(argv[2]) : 200;
  // LLM-like logits: a few strong candidates over a long tail (normal-ish via a sum of uniforms).
  std::vector<float> logits(vocab);
  uint64_t x = 7;
  auto uni = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(x >> 40) / 16777216.0f;
  };
  for (auto& l : logits) l = 2.0f * (uni() + uni() + uni() + uni() - 2.0f);
  for (int i = 0; i < 20; ++i) logits[static_cast<size_t>(uni() * static_cast<float>(vocab))] += 12.0f;
  struct Case {
    const char* name;
    SamplingParams p;
  };
  const Case cases[] = {{"greedy", {0.0f, 1.0f, 0, 0.0f, 1}},
                        {"temperature 1, no filter", {1.0f, 1.0f, 0, 0.0f, 1}},
                        {"temperature 1, top_p 0.9", {1.0f, 0.9f, 0, 0.0f, 1}},
                        {"temperature 0.7, top_k 50", {0.7f, 1.0f, 50, 0.0f, 1}},
                        {"temperature 1, min_p 0.05", {1.0f, 1.0f, 0, 0.05f, 1}}};
  Sampler s;
  std::printf("vocab %zu, %d tokens per case\n", vocab, tokens);
  for (const Case& c : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t sink = 0;
    for (int i = 0; i < tokens; ++i) sink += static_cast<uint64_t>(s.sample(logits, c.p, static_cast<uint64_t>(i)).token);
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / tokens;
    std::printf("%-28s %9.1f us/token (checksum %llu)\n", c.name, us, static_cast<unsigned long long>(sink));
  }
  // What ordering the whole vocabulary costs (the sampler's old per-token step).
  std::vector<int32_t> order(vocab);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return logits[static_cast<size_t>(a)] != logits[static_cast<size_t>(b)]
                 ? logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]
                 : a < b;
    });
  }
  std::printf("%-28s %9.1f us/token\n", "full sort of the vocabulary",
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 20);
  return 0;
}
