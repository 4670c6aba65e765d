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

  std::atomic<int> drain_signals{0};
  std::atomic<bool> done{false};
  std::thread signals([&] {
    while (!done.load()) {
      timespec timeout{0, 100 * 1000 * 1000};
      const int sig = sigtimedwait(&set, nullptr, &timeout);
      if (sig == SIGTERM || sig == SIGINT) {
        const int n = drain_signals.fetch_add(1) + 1;
        obs::log_info("daemon", n == 1 ? "signal received; draining" : "signal received again; cutting the drain short",
                      {{"signal", sig == SIGTERM ? "SIGTERM" : "SIGINT"}, {"count", n}});
      }
    }
  });
  const int rc = daemon::run_daemon(parsed.config, drain_signals);
  done.store(true);
  signals.join();
  return rc;
}
