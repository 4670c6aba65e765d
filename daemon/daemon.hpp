#pragma once
// The process: builds the model and engine, starts the actors (control, engine,
// http) and runs until a drain completes. main() turns the result into an exit
// code; nothing below main exits the process.
#include <atomic>

#include "daemon/config.hpp"

namespace rolloutd::daemon {

// Exit codes (README "Operations"): 0 clean drain; 2 start-up failure (bind, model, device);
// 3 engine fault at run time (the launcher should restart); 64 usage error.
inline constexpr int kExitOk = 0;
inline constexpr int kExitStartupFailure = 2;
inline constexpr int kExitEngineFault = 3;
inline constexpr int kExitUsage = 64;

// Runs the daemon. `drain_signals` counts the SIGTERM/SIGINTs the signal thread took: the first
// starts a drain, a second cuts its deadline to now.
int run_daemon(const DaemonConfig& config, std::atomic<int>& drain_signals);

}  // namespace rolloutd::daemon
