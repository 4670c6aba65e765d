#include "core/moe/expert_map.hpp"

#include <string>

namespace rolloutd::core {

ExpertMap ExpertMap::identity(int64_t num_experts) {
  ExpertMap m;
  m.l2p_.resize(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) m.l2p_[static_cast<size_t>(e)] = static_cast<int32_t>(e);
  m.num_physical_ = num_experts;
  return m;
}

Result<ExpertMap> ExpertMap::create(std::vector<int32_t> logical_to_physical, int64_t num_physical) {
  if (logical_to_physical.empty())
    return Status(ErrorCode::kInvalidArgument, "empty expert map", "logical_to_physical");
  if (num_physical < static_cast<int64_t>(logical_to_physical.size()))
    return Status(ErrorCode::kInvalidArgument, "fewer physical slots than logical experts",
                  "num_physical");
  for (size_t e = 0; e < logical_to_physical.size(); ++e) {
    const int32_t p = logical_to_physical[e];
    if (p < 0 || p >= num_physical)
      return Status(ErrorCode::kOutOfRange, "physical slot out of range",
                    "logical_to_physical[" + std::to_string(e) + "]");
  }
  ExpertMap m;
  m.l2p_ = std::move(logical_to_physical);
  m.num_physical_ = num_physical;
  return m;
}

}  // namespace rolloutd::core
