#include "core/model/parameters.hpp"

namespace rolloutd::core {

Status ParameterTable::add(std::string name, TensorView storage) {
  if (index_.count(name))
    return Status(ErrorCode::kInternal, "parameter registered twice", name);
  index_.emplace(name, params_.size());
  params_.push_back(Parameter{std::move(name), storage});
  return Status::Ok();
}

const Parameter* ParameterTable::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &params_[it->second];
}

}  // namespace rolloutd::core
