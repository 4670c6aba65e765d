// rolloutctl: the command-line client of one rolloutd daemon, over the C++ client
// (protocol/client.hpp). Results go to stdout as one JSON object; a typed error goes
// to stderr as {"error": {code, message, field}} with exit status 2; a usage error
// exits 64 (EX_USAGE).
//
// Each subcommand is one add_* function that declares its options and returns the
// action to run once parsing succeeded; a new subcommand is one more entry in main().
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "core/model/family.hpp"
#include "core/model/test_model.hpp"
#include "kernels/status.hpp"
#include "protocol/client.hpp"
#include "protocol/curve.hpp"

namespace {

using json = nlohmann::ordered_json;  // keys in SPEC order, as the daemon sent them
using rolloutd::ErrorCode;
using rolloutd::Result;
using rolloutd::Status;
namespace proto = rolloutd::protocol;

constexpr int kExitOk = 0;
constexpr int kExitError = 2;   // the daemon or the transport reported a typed error
constexpr int kExitUsage = 64;  // EX_USAGE

constexpr const char* kDefaultEndpoint = "tcp://127.0.0.1:7600";

struct GlobalOptions {
  std::string endpoint = kDefaultEndpoint;
  double timeout_s = 30.0;
  // CURVE (a daemon started with --curve-key-file): its public key, and our secret certificate.
  std::string server_key;
  std::string client_key_file;
};

// A parsed subcommand's work; returns the exit status.
using Action = std::function<int(const GlobalOptions&)>;
struct Command {
  CLI::App* app;
  Action run;
};

// ---------------------------------------------------------------- output --
std::string dump(const json& j) {
  // Strings from the daemon are not trusted to be UTF-8; never throw while reporting.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json error_json(const proto::ErrorInfo& e) {
  return {{"code", e.code}, {"message", e.message}, {"field", e.field}};
}

int print_result(const json& j) {
  std::cout << dump(j) << '\n';
  return kExitOk;
}

int print_error(const Status& s) {
  std::cerr << dump({{"error", error_json(proto::to_error_info(s))}}) << '\n';
  return kExitError;
}

json model_json(const proto::ModelInfo& m) {
  return {{"name", m.name},
          {"family", m.family},
          {"vocab_size", m.vocab_size},
          {"num_layers", m.num_layers},
          {"num_moe_layers", m.num_moe_layers},
          {"num_experts", m.num_experts},
          {"top_k", m.top_k},
          {"routed_experts_dtype", m.routed_experts_dtype}};
}

json limits_json(const proto::Limits& l) {
  return {{"max_envelope_bytes", l.max_envelope_bytes},
          {"max_frame_bytes", l.max_frame_bytes},
          {"max_frames", l.max_frames},
          {"max_rid_bytes", l.max_rid_bytes},
          {"max_string_bytes", l.max_string_bytes},
          {"max_input_tokens", l.max_input_tokens},
          {"max_new_tokens", l.max_new_tokens},
          {"max_stop_token_ids", l.max_stop_token_ids},
          {"max_versions", l.max_versions},
          {"max_bucket_entries", l.max_bucket_entries}};
}

// Expert id `i` of raw little-endian rows (the byte order is fixed by the wire, not the host).
int64_t routed_expert_at(const proto::RoutedExperts& r, size_t elem, size_t i) {
  const auto* p = reinterpret_cast<const uint8_t*>(r.data.data()) + i * elem;
  uint32_t v = 0;
  for (size_t b = 0; b < elem; ++b) v |= uint32_t{p[b]} << (8 * b);
  return r.dtype == "int32" ? int64_t{static_cast<int32_t>(v)} : int64_t{v};
}

json routed_experts_json(const proto::RoutedExperts& r) {
  const size_t elem = proto::routed_experts_dtype_size(r.dtype);
  json rows = json::array();
  size_t i = 0;
  for (uint32_t t = 0; t < r.num_tokens; ++t) {
    json layers = json::array();
    for (uint32_t l = 0; l < r.num_layers; ++l) {
      json experts = json::array();
      for (uint32_t k = 0; k < r.top_k; ++k) experts.push_back(routed_expert_at(r, elem, i++));
      layers.push_back(std::move(experts));
    }
    rows.push_back(std::move(layers));
  }
  return {{"dtype", r.dtype},
          {"shape", {r.num_tokens, r.num_layers, r.top_k}},
          {"start_pos", r.start_pos},
          {"ids", std::move(rows)}};
}

// ---------------------------------------------------------------- client --
int to_ms(double seconds) {
  return static_cast<int>(std::clamp(seconds * 1000.0, 1.0, double{std::numeric_limits<int>::max()}));
}

Result<std::unique_ptr<proto::Client>> connect(const GlobalOptions& g) {
  proto::ClientOptions options;
  options.endpoint = g.endpoint;
  options.request_timeout_ms = to_ms(g.timeout_s);
  RD_ASSIGN_OR_RETURN(options.curve, proto::load_curve_client_keys(g.server_key, g.client_key_file));
  return proto::Client::connect(options);
}

// Connects, runs `call` and prints its reply through `to_json`.
template <class Reply>
int run_call(const GlobalOptions& g,
             const std::function<Result<Reply>(proto::Client&)>& call,
             const std::function<json(const Reply&)>& to_json) {
  auto client = connect(g);
  if (!client.ok()) return print_error(client.status());
  auto reply = call(**client);
  if (!reply.ok()) return print_error(reply.status());
  return print_result(to_json(*reply));
}

// ----------------------------------------------------------- subcommands --
Command add_hello(CLI::App& root) {
  auto* app = root.add_subcommand("hello", "Negotiate the protocol; print the daemon, model and limits");
  return {app, [](const GlobalOptions& g) {
            return run_call<proto::HelloReply>(
                g, [](proto::Client& c) { return c.hello("rolloutctl"); },
                [](const proto::HelloReply& r) -> json {
                  return {{"version", r.version},       {"daemon", r.daemon},
                          {"build", r.build},           {"gpu", r.gpu},
                          {"model", model_json(r.model)}, {"weight_version", r.weight_version},
                          {"limits", limits_json(r.limits)}};
                });
          }};
}

Command add_status(CLI::App& root) {
  auto* app = root.add_subcommand("status", "Print readiness, load and counters");
  return {app, [](const GlobalOptions& g) {
            return run_call<proto::StatusReply>(
                g, [](proto::Client& c) { return c.status(); },
                [](const proto::StatusReply& r) -> json {
                  return {{"state", r.state},
                          {"ready", r.ready},
                          {"reason", r.reason},
                          {"weight_version", r.weight_version},
                          {"num_waiting", r.num_waiting},
                          {"num_running", r.num_running},
                          {"num_requests_total", r.num_requests_total},
                          {"num_tokens_generated_total", r.num_tokens_generated_total},
                          {"uptime_s", r.uptime_s},
                          {"build", r.build},
                          {"model", model_json(r.model)},
                          {"paused", r.paused},
                          {"update_session", r.update_session}};
                });
          }};
}

Command add_generate(CLI::App& root) {
  auto* app = root.add_subcommand("generate", "Generate from token ids; print the collected result");
  struct Options {
    proto::GenerateRequest req;
    uint64_t seed = 0;
    bool no_stream = false;
    double wait_s = 120.0;
  };
  auto opts = std::make_shared<Options>();
  auto& r = opts->req;
  app->add_option("--input-ids", r.input_ids, "Prompt token ids, e.g. 1,2,3")
      ->delimiter(',')
      ->required();
  app->add_option("--max-new-tokens", r.max_new_tokens, "Tokens to generate at most")
      ->capture_default_str();
  app->add_option("--temperature", r.temperature, "0 = greedy")->capture_default_str();
  app->add_option("--top-p", r.top_p)->capture_default_str();
  app->add_option("--top-k", r.top_k, "0 = disabled")->capture_default_str();
  app->add_option("--min-p", r.min_p)->capture_default_str();
  auto* seed = app->add_option("--seed", opts->seed, "Sampling seed (default: the daemon picks one)");
  app->add_option("--stop-ids", r.stop_token_ids, "Token ids that end generation, e.g. 2,7")
      ->delimiter(',');
  app->add_flag("--logprobs", r.return_logprob, "Return the log-prob of each sampled token");
  app->add_option("--top-logprobs", r.top_logprobs_num,
                  "Also the N most likely tokens of each sampled token, with their log-probs")
      ->check(CLI::Range(0u, proto::kMaxTopLogprobs));
  app->add_flag("--routed-experts", r.return_routed_experts,
                "Return the routed-expert record [tokens][layers][top_k]");
  app->add_option("--routed-start-len", r.routed_experts_start_len,
                  "First sequence position recorded")
      ->capture_default_str();
  app->add_option("--deadline-s", r.deadline_s,
                  "The daemon ends the request this long after receiving it (finished, abort_reason "
                  "deadline; 0 = none)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, proto::kMaxDeadlineS));
  app->add_flag("--no-stream", opts->no_stream, "Ask the daemon for one event at the end");
  app->add_option("--rid", r.rid, "Request id (default: random)");
  app->add_option("--generate-timeout-s", opts->wait_s, "Bound on the whole generation")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  return {app, [opts, seed](const GlobalOptions& g) {
            proto::GenerateRequest req = opts->req;
            if (seed->count() > 0) req.seed = opts->seed;
            req.stream = !opts->no_stream;
            auto client = connect(g);
            if (!client.ok()) return print_error(client.status());
            auto result = (*client)->generate(req, to_ms(opts->wait_s));
            if (!result.ok()) return print_error(result.status());
            const proto::GenerateResult& res = *result;
            if (res.failed) {
              std::cerr << dump({{"rid", res.rid}, {"error", error_json(res.failed->error)}}) << '\n';
              return kExitError;
            }
            json out = {{"rid", res.rid},
                        {"token_ids", res.token_ids},
                        {"logprobs", res.logprobs},
                        {"weight_versions", res.weight_versions},
                        {"routed_experts", res.routed_experts
                                               ? routed_experts_json(*res.routed_experts)
                                               : json(nullptr)}};
            if (res.top_logprobs_num > 0) {  // per token: [[id, log-prob], ...], most likely first
              const size_t n = res.top_logprobs_num;
              json top = json::array();
              for (size_t j = 0; (j + 1) * n <= std::min(res.top_token_ids.size(), res.top_logprobs.size()); ++j) {
                json row = json::array();
                for (size_t i = j * n; i < (j + 1) * n; ++i) row.push_back({res.top_token_ids[i], res.top_logprobs[i]});
                top.push_back(std::move(row));
              }
              out["top_logprobs"] = std::move(top);
            }
            if (res.finished) {
              out["finish_reason"] = res.finished->reason;
              out["abort_reason"] = res.finished->abort_reason;
              out["prompt_tokens"] = res.finished->prompt_tokens;
              out["completion_tokens"] = res.finished->completion_tokens;
            }
            out["num_retractions"] = res.num_retractions;  // each voided what came before it
            return print_result(out);
          }};
}

Command add_abort(CLI::App& root) {
  auto* app = root.add_subcommand("abort", "Abort one request (--rid) or every request (--all)");
  struct Options {
    std::string rid;
    bool all = false;
  };
  auto opts = std::make_shared<Options>();
  auto* rid = app->add_option("--rid", opts->rid, "Request id to abort");
  rid->excludes(app->add_flag("--all", opts->all, "Abort every request in flight"));
  app->require_option(1);
  return {app, [opts](const GlobalOptions& g) {
            return run_call<proto::AbortReply>(
                g, [&](proto::Client& c) { return opts->all ? c.abort_all() : c.abort(opts->rid); },
                [](const proto::AbortReply& r) -> json { return {{"num_aborted", r.num_aborted}}; });
          }};
}

Command add_shutdown(CLI::App& root) {
  auto* app = root.add_subcommand("shutdown", "Stop the daemon, draining in-flight requests");
  struct Options {
    bool no_drain = false;
    double deadline_s = 30.0;
  };
  auto opts = std::make_shared<Options>();
  app->add_flag("--no-drain", opts->no_drain, "Abort in-flight requests instead of finishing them");
  app->add_option("--deadline-s", opts->deadline_s, "Bound on the drain")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  return {app, [opts](const GlobalOptions& g) {
            return run_call<proto::ShutdownReply>(
                g, [&](proto::Client& c) { return c.shutdown(!opts->no_drain, opts->deadline_s); },
                [](const proto::ShutdownReply& r) -> json { return {{"accepted", r.accepted}}; });
          }};
}

// ---- weights and generation control (SPEC §11) ----
Command add_weights_checksum(CLI::App& root) {
  auto* app = root.add_subcommand(
      "weights-checksum", "Print per-parameter and whole-model CRC-32s of the serving weights");
  auto names = std::make_shared<std::vector<std::string>>();
  auto* opt = app->add_option("--names", *names, "Parameter names, e.g. a,b (default: every one)")
                  ->delimiter(',');
  return {app, [names, opt](const GlobalOptions& g) {
            std::optional<std::vector<std::string>> selected;
            if (opt->count() > 0) selected = *names;
            return run_call<proto::WeightsChecksumReply>(
                g, [&](proto::Client& c) { return c.weights_checksum(selected); },
                [](const proto::WeightsChecksumReply& r) -> json {
                  json params = json::array();
                  for (const auto& p : r.parameters)
                    params.push_back({{"name", p.name},
                                      {"dtype", p.dtype},
                                      {"shape", p.shape},
                                      {"checksum", p.checksum}});
                  return {{"algo", r.algo},
                          {"weight_version", r.weight_version},
                          {"model_checksum", r.model_checksum},
                          {"parameters", std::move(params)}};
                });
          }};
}

Command add_get_weights(CLI::App& root) {
  auto* app = root.add_subcommand(
      "get-weights", "Print the first values of one parameter (checkpoint layout, flattened)");
  struct Options {
    std::string name;
    uint32_t truncate = 100;
  };
  auto opts = std::make_shared<Options>();
  app->add_option("--name", opts->name, "Parameter name")->required();
  app->add_option("--truncate", opts->truncate, "How many values")
      ->capture_default_str()
      ->check(CLI::Range(uint32_t{0}, proto::kMaxGetWeightsTruncate));
  return {app, [opts](const GlobalOptions& g) {
            return run_call<proto::GetWeightsByNameReply>(
                g, [&](proto::Client& c) { return c.get_weights_by_name(opts->name, opts->truncate); },
                [](const proto::GetWeightsByNameReply& r) -> json {
                  // NaN and infinities have no JSON number: nlohmann writes them as null.
                  return {{"name", r.name}, {"dtype", r.dtype}, {"shape", r.shape}, {"values", r.values}};
                });
          }};
}

Command add_pause(CLI::App& root) {
  auto* app = root.add_subcommand("pause", "Stop forward steps (before a weight update)");
  auto mode = std::make_shared<std::string>();
  app->add_option("--mode", *mode,
                  "abort: end in-flight requests; retract: restart them from their prompt later; "
                  "in_place: hold them until continue")
      ->required()
      ->check(CLI::IsMember({"abort", "retract", "in_place"}));
  return {app, [mode](const GlobalOptions& g) {
            return run_call<proto::PauseGenerationReply>(
                g,
                [&](proto::Client& c) { return c.pause_generation(*proto::pause_mode_from_name(*mode)); },
                [](const proto::PauseGenerationReply& r) -> json {
                  return {{"num_aborted", r.num_aborted},
                          {"num_retracted", r.num_retracted},
                          {"num_paused", r.num_paused}};
                });
          }};
}

// Needs no daemon: writes <out>.key (public, for daemons' --curve-allow or clients'
// --server-key) and <out>.key_secret (mode 0600, for its owner's --curve-key-file or
// --client-key-file).
Command add_keygen(CLI::App& root) {
  auto* app = root.add_subcommand(
      "keygen", "Write a new CURVE key pair: <out>.key (public) and <out>.key_secret (secret, mode 0600)");
  struct Options {
    std::string out;
    bool force = false;
  };
  auto opts = std::make_shared<Options>();
  app->add_option("--out", opts->out, "Path and base name of the two files, e.g. /etc/rolloutd/daemon")
      ->required();
  app->add_flag("--force", opts->force, "Replace existing files");
  return {app, [opts](const GlobalOptions&) {
            auto keys = proto::generate_curve_keypair();
            if (!keys.ok()) return print_error(keys.status());
            auto files = proto::write_curve_keypair_files(opts->out, *keys, opts->force);
            if (!files.ok()) return print_error(files.status());
            return print_result({{"public_key", keys->public_key},
                                 {"public_file", files->public_path},
                                 {"secret_file", files->secret_path}});
          }};
}

// Needs no daemon: a small random checkpoint in the Hugging Face format (core/model/test_model.hpp).
Command add_make_test_model(CLI::App& root) {
  auto* app = root.add_subcommand(
      "make-test-model",
      "Write a small random Hugging Face checkpoint (config.json + model.safetensors), deterministic for a seed");
  auto spec = std::make_shared<rolloutd::core::TestModelSpec>();
  auto out = std::make_shared<std::string>();
  app->add_option("--family", spec->family, "Model family")
      ->capture_default_str()
      ->check(CLI::IsMember(rolloutd::core::model_family_names()));
  app->add_option("--layers", spec->layers, "Decoder layers")->capture_default_str()->check(CLI::Range(1, 256));
  app->add_option("--hidden", spec->hidden, "Hidden size")->capture_default_str()->check(CLI::Range(1, 16384));
  app->add_option("--experts", spec->experts, "Routed experts per layer")->capture_default_str()->check(CLI::Range(1, 1024));
  app->add_option("--top-k", spec->top_k, "Experts per token")->capture_default_str()->check(CLI::Range(1, 1024));
  app->add_option("--heads", spec->heads, "Query heads")->capture_default_str()->check(CLI::Range(1, 256));
  app->add_option("--kv-heads", spec->kv_heads, "Key/value heads")->capture_default_str()->check(CLI::Range(1, 256));
  app->add_option("--head-dim", spec->head_dim, "Head dimension")->capture_default_str()->check(CLI::Range(2, 512));
  app->add_option("--intermediate", spec->intermediate, "Expert intermediate size")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  app->add_option("--vocab", spec->vocab, "Vocabulary size")->capture_default_str()->check(CLI::Range(2, 1 << 20));
  app->add_option("--dtype", spec->dtype, "Checkpoint dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"bfloat16", "float32"}));
  app->add_option("--mlp-only-layers", spec->mlp_only_layers, "qwen3_moe: dense layers, e.g. 0,3")->delimiter(',');
  app->add_option("--decoder-sparse-step", spec->decoder_sparse_step, "qwen3_moe: every n-th layer is MoE")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app->add_flag("--experts-mxfp4", spec->experts_mxfp4, "gpt_oss: experts as MXFP4 *_blocks/*_scales (as published)");
  app->add_option("--sliding-window", spec->sliding_window, "gpt_oss: window of the sliding-attention layers")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--seed", spec->seed, "Seed of the weights")->capture_default_str();
  app->add_option("--out", *out, "Directory to write (created if missing)")->required();
  return {app, [spec, out](const GlobalOptions&) {
            if (Status s = rolloutd::core::write_test_model(*spec, *out); !s.ok()) return print_error(s);
            return print_result({{"out", *out},
                                 {"family", spec->family},
                                 {"config", *out + "/config.json"},
                                 {"weights", *out + "/model.safetensors"},
                                 {"seed", spec->seed}});
          }};
}

Command add_continue(CLI::App& root) {
  auto* app = root.add_subcommand("continue", "Resume forward steps after pause");
  return {app, [](const GlobalOptions& g) {
            return run_call<proto::ContinueGenerationReply>(
                g, [](proto::Client& c) { return c.continue_generation(); },
                [](const proto::ContinueGenerationReply& r) -> json {
                  return {{"num_resumed", r.num_resumed}};
                });
          }};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"rolloutctl: command-line client of a rolloutd daemon"};
  app.set_version_flag("--version", rolloutd::build::kVersion);
  app.require_subcommand(1);

  GlobalOptions global;
  app.add_option("--endpoint", global.endpoint, "Daemon control socket")
      ->envname("ROLLOUTD_ENDPOINT")
      ->capture_default_str();
  app.add_option("--timeout-s", global.timeout_s, "Bound on each reply")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--server-key", global.server_key,
                 "The daemon's CURVE public key: Z85 text, or its certificate file (<name>.key)")
      ->envname("ROLLOUTD_CURVE_SERVER_KEY");
  app.add_option("--client-key-file", global.client_key_file,
                 "This client's CURVE secret certificate (<name>.key_secret), whose public key the daemon allows")
      ->envname("ROLLOUTD_CURVE_CLIENT_KEY_FILE");

  const std::vector<Command> commands = {
      add_hello(app),         add_status(app),        add_generate(app),
      add_abort(app),         add_shutdown(app),      add_weights_checksum(app),
      add_get_weights(app),   add_pause(app),         add_continue(app),
      add_keygen(app),        add_make_test_model(app),
  };

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0.
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  for (const auto& command : commands)
    if (command.app->parsed()) return command.run(global);
  return kExitUsage;  // unreachable: require_subcommand(1)
}
