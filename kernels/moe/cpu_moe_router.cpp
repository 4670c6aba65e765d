// CPU reference of the routers (moe_ops.hpp has the semantics and the tie policy). One token
// at a time, experts picked by repeated arg-max in (value desc, id asc) order.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/moe/moe_math.hpp"
#include "kernels/moe/moe_plan.hpp"

namespace rolloutd::moe::detail {
namespace {

// The best expert by `rank` among those not taken and allowed; -1 when none is left.
int pick(const std::vector<float>& rank, std::vector<char>& taken, const std::vector<char>& allowed) {
  int best = -1;
  for (int e = 0; e < static_cast<int>(rank.size()); ++e) {
    if (taken[static_cast<size_t>(e)] || !allowed[static_cast<size_t>(e)]) continue;
    if (best < 0 || math::ranks_before(rank[static_cast<size_t>(e)], e,
                                       rank[static_cast<size_t>(best)], best))
      best = e;
  }
  if (best >= 0) taken[static_cast<size_t>(best)] = 1;
  return best;
}

float score(ScoreFunc f, float v) {
  return f == ScoreFunc::kSigmoid ? math::sigmoid(v) : math::sqrt_softplus(v);
}

}  // namespace

Status cpu_route(const RouterPlan& p) {
  const int64_t num_experts = p.num_experts;
  const int k = p.top_k;
  const RouterParams& prm = p.params;
  const auto ne = static_cast<size_t>(num_experts);

  // Index values first: a bad token id or table entry leaves the outputs untouched.
  if (prm.kind == RouterKind::kHash) {
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      const int32_t tok = p.token_ids[t];
      if (tok < 0 || tok >= p.vocab)
        return Status(ErrorCode::kOutOfRange,
                      "token id " + std::to_string(tok) + " at row " + std::to_string(t) +
                          " outside the hash table's [0, " + std::to_string(p.vocab) + ")",
                      "token_ids");
      for (int j = 0; j < k; ++j) {
        const int32_t id = p.tid2eid[static_cast<int64_t>(tok) * k + j];
        if (id < 0 || id >= num_experts)
          return Status(ErrorCode::kOutOfRange,
                        "tid2eid[" + std::to_string(tok) + ", " + std::to_string(j) + "] = " +
                            std::to_string(id) + " outside [0, " + std::to_string(num_experts) + ")",
                        "tid2eid");
      }
    }
  }

  std::vector<float> v(ne), s(ne), rank(ne);
  std::vector<char> taken(ne), allowed(ne, 1);
  const int64_t group_size = num_experts / (prm.n_group > 0 ? prm.n_group : 1);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* l = p.logits + t * num_experts;
    int32_t* ids = p.ids + t * k;
    float* w = p.weights + t * k;
    for (size_t e = 0; e < ne; ++e) v[e] = p.logit_bias ? math::add(l[e], p.logit_bias[e]) : l[e];
    std::fill(taken.begin(), taken.end(), 0);
    std::fill(allowed.begin(), allowed.end(), 1);

    switch (prm.kind) {
      case RouterKind::kSoftmaxTopK:
      case RouterKind::kTopKSoftmax: {
        for (size_t e = 0; e < ne; ++e) rank[e] = math::rank_value(v[e]);
        for (int j = 0; j < k; ++j) ids[j] = pick(rank, taken, allowed);
        if (prm.kind == RouterKind::kTopKSoftmax) {
          // softmax over the k picked logits; the first pick is their maximum.
          const float m = v[static_cast<size_t>(ids[0])];
          float sum = 0.0f;
          for (int j = 0; j < k; ++j) {
            w[j] = math::exp(math::sub(v[static_cast<size_t>(ids[j])], m));
            sum = math::add(sum, w[j]);
          }
          for (int j = 0; j < k; ++j) w[j] = math::div(w[j], sum);
          break;
        }
        float m = -INFINITY;
        for (size_t e = 0; e < ne; ++e)
          if (v[e] > m) m = v[e];
        float sum = 0.0f;
        for (size_t e = 0; e < ne; ++e) sum = math::add(sum, math::exp(math::sub(v[e], m)));
        float picked = 0.0f;
        for (int j = 0; j < k; ++j) {
          w[j] = math::div(math::exp(math::sub(v[static_cast<size_t>(ids[j])], m)), sum);
          picked = math::add(picked, w[j]);
        }
        if (prm.renormalize)
          for (int j = 0; j < k; ++j) w[j] = math::div(w[j], picked);
        break;
      }
      case RouterKind::kSigmoidGroupedTopK:
      case RouterKind::kSqrtSoftplusTopK: {
        const ScoreFunc f = prm.kind == RouterKind::kSigmoidGroupedTopK ? ScoreFunc::kSigmoid
                                                                         : ScoreFunc::kSqrtSoftplus;
        for (size_t e = 0; e < ne; ++e) {
          s[e] = score(f, v[e]);
          rank[e] = math::rank_value(p.correction_bias ? math::add(s[e], p.correction_bias[e]) : s[e]);
        }
        if (prm.n_group > 1) {
          // Group score: the sum of its two best biased scores (one when a group has one expert).
          const int ng = prm.n_group;
          std::vector<float> gs(static_cast<size_t>(ng));
          for (int g = 0; g < ng; ++g) {
            float r1 = -INFINITY, r2 = -INFINITY;
            for (int64_t i = 0; i < group_size; ++i) {
              const float r = rank[static_cast<size_t>(g * group_size + i)];
              if (r > r1) {
                r2 = r1;
                r1 = r;
              } else if (r > r2) {
                r2 = r;
              }
            }
            gs[static_cast<size_t>(g)] = math::rank_value(group_size >= 2 ? math::add(r1, r2) : r1);
          }
          std::vector<char> gtaken(static_cast<size_t>(ng), 0), gall(static_cast<size_t>(ng), 1);
          std::fill(allowed.begin(), allowed.end(), 0);
          for (int j = 0; j < prm.topk_group; ++j) {
            const int g = pick(gs, gtaken, gall);
            for (int64_t i = 0; i < group_size; ++i) allowed[static_cast<size_t>(g * group_size + i)] = 1;
          }
        }
        for (int j = 0; j < k; ++j) {
          ids[j] = pick(rank, taken, allowed);
          w[j] = s[static_cast<size_t>(ids[j])];
        }
        math::normalize_and_scale(w, k, prm.renormalize, prm.routed_scaling_factor);
        break;
      }
      case RouterKind::kHash: {
        const int32_t* row = p.tid2eid + static_cast<int64_t>(p.token_ids[t]) * k;
        float m = -INFINITY, sum = 0.0f;
        if (prm.hash_score == ScoreFunc::kSoftmax) {
          for (size_t e = 0; e < ne; ++e)
            if (v[e] > m) m = v[e];
          for (size_t e = 0; e < ne; ++e) sum = math::add(sum, math::exp(math::sub(v[e], m)));
        }
        for (int j = 0; j < k; ++j) {
          ids[j] = row[j];
          const float x = v[static_cast<size_t>(row[j])];
          w[j] = prm.hash_score == ScoreFunc::kSoftmax ? math::div(math::exp(math::sub(x, m)), sum)
                                                        : score(prm.hash_score, x);
        }
        math::normalize_and_scale(w, k, prm.renormalize, prm.routed_scaling_factor);
        break;
      }
    }
  }
  return Status::Ok();
}

}  // namespace rolloutd::moe::detail
