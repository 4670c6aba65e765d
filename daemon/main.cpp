// rolloutd: one process per GPU. Signals are taken by one thread with sigwait,
// so no actor is interrupted mid-step; SIGTERM/SIGINT start a drain, a second
// one (at least 1 s after the first) shortens the drain deadline to zero.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
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
    // One stop often arrives as two signals at once: a Ctrl-C reaches every process of the
    // terminal's group (the daemon and a launcher that forwards a SIGTERM), as does a signal to
    // a process group. Only a signal at least this long after the first counts as a second.
    constexpr auto kSecondSignalAfter = std::chrono::seconds(1);
    std::chrono::steady_clock::time_point first{};
    while (!done.load()) {
      timespec timeout{0, 100 * 1000 * 1000};
      const int sig = sigtimedwait(&set, nullptr, &timeout);
      if (sig != SIGTERM && sig != SIGINT) continue;
      const char* name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
      const auto now = std::chrono::steady_clock::now();
      if (drain_signals.load() == 0) {
        first = now;
        drain_signals.store(1);
        obs::log_info("daemon", "signal received; draining", {{"signal", name}});
      } else if (now - first < kSecondSignalAfter) {
        obs::log_info("daemon", "signal received again within 1 s of the first; taken as the same stop",
                      {{"signal", name}});
      } else {
        const int n = drain_signals.fetch_add(1) + 1;
        obs::log_info("daemon", "signal received again; cutting the drain short", {{"signal", name}, {"count", n}});
      }
    }
  });
  const int rc = daemon::run_daemon(parsed.config, drain_signals);
  done.store(true);
  signals.join();
  return rc;
}
