#pragma once
// Logical -> physical expert map. The router speaks logical ids (what the
// trainer's checkpoint calls expert e); compute runs on physical slots, which
// may hold redundant replicas (as EPLB produces). Records are always logical.
#include <cstdint>
#include <vector>

#include "kernels/status.hpp"

namespace rolloutd::core {

class ExpertMap {
 public:
  // Identity map over `num_experts` slots.
  static ExpertMap identity(int64_t num_experts);
  // `logical_to_physical[e]` is the slot computing logical expert e; each slot must be
  // < num_physical and every slot must hold exactly one logical expert's weights.
  static Result<ExpertMap> create(std::vector<int32_t> logical_to_physical, int64_t num_physical);

  int64_t num_logical() const { return static_cast<int64_t>(l2p_.size()); }
  int64_t num_physical() const { return num_physical_; }
  int32_t logical_to_physical(int32_t logical) const { return l2p_[static_cast<size_t>(logical)]; }
  const std::vector<int32_t>& table() const { return l2p_; }

 private:
  std::vector<int32_t> l2p_;
  int64_t num_physical_ = 0;
};

}  // namespace rolloutd::core
