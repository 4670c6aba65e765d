// rolloutd: one process per GPU. Signals are taken by one thread with sigwait,
// so no actor is interrupted mid-step; SIGTERM/SIGINT start a drain, a second
// one shortens the drain deadline to zero.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <thread>

#include "daemon/daemon.hpp"
#include "daemon/obs/log.hpp"

int main(int argc, char** argv) {
  using namespace rolloutd;
  // Block the signals before any thread exists (the logger starts a flush thread): every
  // thread inherits the mask, and only the signal thread below receives them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  daemon::ParseOutcome parsed = daemon::parse_config(argc, argv);
  if (parsed.exit_now) return parsed.exit_code;
  const auto level = obs::parse_log_level(parsed.config.log_level).value_or(obs::LogLevel::kInfo);
  obs::init_logging(level, parsed.config.device == "cuda" ? parsed.config.gpu : -1);

  // A vanished peer must surface as an error on the socket, not kill the process.
  signal(SIGPIPE, SIG_IGN);

  std::atomic<bool> drain_requested{false};
  std::atomic<bool> done{false};
  std::thread signals([&] {
    while (!done.load()) {
      timespec timeout{0, 100 * 1000 * 1000};
      const int sig = sigtimedwait(&set, nullptr, &timeout);
      if (sig == SIGTERM || sig == SIGINT) {
        obs::log_info("daemon", "signal received; draining", {{"signal", sig == SIGTERM ? "SIGTERM" : "SIGINT"}});
        drain_requested.store(true);
      }
    }
  });
  const int rc = daemon::run_daemon(parsed.config, drain_requested);
  done.store(true);
  signals.join();
  return rc;
}
