#include "core/model/hf_checkpoint.hpp"

#include <cstdint>
#include <vector>

#include "core/model/hf_config.hpp"

namespace rolloutd::core {
namespace {

bool is_synthetic(const std::string& name) { return name.rfind("synthetic", 0) == 0; }

// The checkpoint tensor that would write row `row` of expert `e` of parameter `param` (for
// the "missing" message): a per-expert tensor when one maps there, else the parameter itself.
std::string expected_name(const WeightRegistry& reg, size_t param, int64_t e, int64_t row) {
  const std::string& name = reg.parameters()[param].name;
  const std::string& out = name;
  auto ends = [](const std::string& s, const std::string& x) {
    return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  // MXFP4 experts: the stored `<name>_blocks` / `<name>_scales` take the same tensors as `<name>`.
  std::string base = name;
  for (const char* sfx : {"_blocks", "_scales"})
    if (ends(base, sfx)) base.resize(base.size() - std::string(sfx).size());
  const std::string fused = "mlp.experts.gate_up_proj", down = "mlp.experts.down_proj";
  std::string prefix;
  if (ends(base, fused)) prefix = base.substr(0, base.size() - fused.size());
  if (ends(base, down)) prefix = base.substr(0, base.size() - down.size());
  if (prefix.empty()) return out;
  for (const char* part : {"gate_proj", "up_proj", "down_proj"}) {
    const std::string cand = prefix + "mlp.experts." + std::to_string(e) + "." + part + ".weight";
    const CheckpointTensor* t = reg.resolve(cand);
    if (!t) continue;
    for (const RowCopy& c : reg.rows_written(*t, DType::kBF16))
      if (c.param == param && c.expert == e && row >= c.dst_start &&
          (row - c.dst_start) % c.dst_stride == 0 && (row - c.dst_start) / c.dst_stride < c.count)
        return cand;
  }
  return base != name && reg.resolve(base) ? base : out;
}

}  // namespace

Result<HfModel> open_hf_model(const std::string& dir, ExpertQuantization quantize_experts) {
  HfModel m;
  m.dir = dir;
  RD_ASSIGN_OR_RETURN(m.config, load_hf_config(dir + "/config.json"));
  RD_RETURN_IF_ERROR(check_decoder_supports(m.config));
  RD_ASSIGN_OR_RETURN(m.checkpoint, SafetensorsCheckpoint::open(dir));
  // Input-major experts as published (gpt-oss): MXFP4, served as they are.
  if (m.config.moe_layout == MoeLayout::kInputMajorBiased && m.checkpoint->find("model.layers.0.mlp.experts.gate_up_proj_blocks"))
    m.config.experts_mxfp4 = true;
  // BF16 dense projections on CUDA when every one the checkpoint holds is BF16 (config.json may
  // omit its dtype, so the tensors decide): storing them in BF16 then loses nothing. One FP32
  // projection (an FP32 LM head, say) keeps them all FP32.
  {
    bool all_bf16 = true, any = false;
    for (const auto& [name, t] : m.checkpoint->tensors()) {
      const bool dense = name == "lm_head.weight" ||
                         (name.find(".self_attn.") != std::string::npos && name.size() > 7 &&
                          name.compare(name.size() - 7, 7, ".weight") == 0 &&
                          (name.find("_proj.weight") != std::string::npos));
      if (!dense) continue;
      any = true;
      all_bf16 = all_bf16 && t.entry->dtype == DType::kBF16;
    }
    m.config.dense_bf16 = any && all_bf16;
  }
  RD_RETURN_IF_ERROR(apply_expert_quantization(m.config, quantize_experts));
  return m;
}

Status load_checkpoint(MoeDecoder& model, const SafetensorsCheckpoint& ckpt) {
  WeightRegistry& reg = model.weights();
  const auto& params = reg.parameters();
  // Which checkpoint tensor writes each row of each parameter (-1: none yet).
  std::vector<std::vector<int32_t>> writer(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const RowGeometry g = row_geometry(params[i].storage);
    writer[i].assign(static_cast<size_t>(g.experts * g.rows), -1);
  }
  std::vector<std::pair<const CheckpointTensor*, const SafetensorsCheckpoint::Tensor*>> plan;
  std::vector<std::string> names;
  for (const auto& [name, t] : ckpt.tensors()) {
    const CheckpointTensor* ct = reg.resolve(name);
    // (A lambda may not capture the structured binding `name` before C++20 as clang 14 reads it.)
    const std::string& tensor_name = name;
    const auto ends_with = [&tensor_name](const char* sfx) {
      const std::string x(sfx);
      return tensor_name.size() >= x.size() &&
             tensor_name.compare(tensor_name.size() - x.size(), x.size(), x) == 0;
    };
    if (!ct && (ends_with("_blocks") || ends_with("_scales")))
      return Status(ErrorCode::kUnimplemented,
                    "checkpoint tensor '" + name + "' is MXFP4 (blocks/scales): served for input-major experts as published (gpt_oss) only; this " +
                        model.config().family + " model takes BF16/FP32 tensors (save a dequantized copy with "
                        "transformers)",
                    name);
    if (!ct)
      return Status(ErrorCode::kNotFound,
                    "checkpoint tensor '" + name + "' is not a parameter of this " + model.config().family +
                        " model (extra tensor, or config.json describes another architecture)",
                    name);
    const SafetensorsEntry& e = *t.entry;
    if (Status s = reg.check_load(*ct, e.dtype, e.shape, e.nbytes()); !s.ok()) {
      std::string shape;
      for (int64_t d : ct->shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
      return Status(s.code(),
                    "checkpoint tensor '" + name + "' (" + std::string(dtype_name(e.dtype)) + ") does not fit: " +
                        s.message() + " (expected shape [" + shape + "])",
                    name);
    }
    // Quantized parameters (MXFP4 experts) are written by quantizing on arrival, as in a weight
    // update: the rows they write are those of the quantized outputs.
    const int32_t me = static_cast<int32_t>(names.size());
    for (const RowCopy& c : reg.rows_written(*ct, e.dtype)) {
      const RowGeometry g = row_geometry(params[c.param].storage);
      const int64_t base = (c.expert < 0 ? 0 : c.expert) * g.rows;
      for (int64_t i = 0; i < c.count; ++i) {
        int32_t& w = writer[c.param][static_cast<size_t>(base + c.dst_start + i * c.dst_stride)];
        if (w >= 0)
          return Status(ErrorCode::kInvalidArgument,
                        "checkpoint tensors '" + names[static_cast<size_t>(w)] + "' and '" + name +
                            "' both write parameter " + params[c.param].name + " (a fused and a split copy?)",
                        name);
        w = me;
      }
    }
    names.push_back(name);
    plan.emplace_back(ct, &t);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (is_synthetic(params[i].name)) continue;
    const RowGeometry g = row_geometry(params[i].storage);
    for (size_t r = 0; r < writer[i].size(); ++r)
      if (writer[i][r] < 0) {
        const int64_t e = params[i].storage.rank() >= 3 ? static_cast<int64_t>(r) / g.rows : -1;
        const std::string want = expected_name(reg, i, e, static_cast<int64_t>(r) % g.rows);
        return Status(ErrorCode::kNotFound,
                      "checkpoint lacks tensor '" + want + "'" +
                          (want != params[i].name ? " (rows of parameter " + params[i].name + ")" : std::string()),
                      want);
      }
  }
  for (const auto& [ct, t] : plan) {
    const SafetensorsEntry& e = *t->entry;
    if (Status s = reg.load(*ct, e.dtype, e.shape, ckpt.data(*t)); !s.ok())
      return Status(s.code(), "loading checkpoint tensor '" + e.name + "': " + s.message(), e.name);
  }
  RD_RETURN_IF_ERROR(model.backend().synchronize(model.context()));
  return reg.postprocess_all();
}

}  // namespace rolloutd::core
