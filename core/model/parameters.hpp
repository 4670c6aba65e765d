#pragma once
// Named parameters: every weight is registered once, at model build, under its
// Hugging Face checkpoint name with its storage in a stable arena. The weight
// hot-reload registry (sessions, quant methods) builds on this table.
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd::core {

struct Parameter {
  std::string name;
  TensorView storage;  // dtype/shape as stored; address fixed for the model's lifetime
};

class ParameterTable {
 public:
  Status add(std::string name, TensorView storage);
  const Parameter* find(std::string_view name) const;
  const std::vector<Parameter>& all() const { return params_; }
  size_t size() const { return params_.size(); }

 private:
  std::vector<Parameter> params_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace rolloutd::core
