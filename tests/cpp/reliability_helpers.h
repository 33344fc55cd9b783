#pragma once
// Test helpers: errors, fork safety and stress tests (header-only, tests only).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace torch_ext::testing {

// Expects fn to raise a c10::Error whose message contains every needle.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning " << needles.front();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' not in: " << message;
    }
  }
}

// Runs fn in a forked child and returns its exit code (fn's result; 2 if it threw), 128 + the
// signal if it died of one, or -1 if it was still running after `seconds` (a hang: it is killed).
inline int run_in_child(const std::function<int()>& fn, double seconds = 30) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 2;
    try {
      code = fn();
    } catch (...) {
    }
    ::_exit(code);
  }
  if (pid < 0) return -2;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (true) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// How long each stress test runs: TORCH_EXT_STRESS_SECONDS (`bash .ci/run sanitize` sets 30),
// else a short smoke run.
inline double stress_seconds() {
  const char* value = std::getenv("TORCH_EXT_STRESS_SECONDS");
  return value != nullptr ? std::atof(value) : 1.0;
}

}  // namespace torch_ext::testing
