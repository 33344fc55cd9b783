#pragma once
// Bounded blocking waits, the one helper every capability uses. A thread that blocks on another
// (joins it, waits for its result) may hold a lock that thread needs: the Python interpreter's.
// The Python bindings install a blocking section that releases it around such waits (the other
// thread may be running Python: a compiler, a callback); without one a wait runs as it is.
// Every wait has a deadline. Thread-safe.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>

namespace torch_ext {

using WaitClock = std::chrono::steady_clock;

// `seconds` from now; a huge or infinite limit is clamped to ~30 years (no overflow), a negative one to now.
WaitClock::time_point deadline_after(double seconds);

using BlockingSection = std::function<void(const std::function<void()>&)>;
void set_blocking_section(BlockingSection section);
void blocking_section(const std::function<void()>& wait);

// Inside the blocking section, takes `mutex` and waits on `cv` until `ready()` (called under the
// lock) or `deadline`; returns whether it is ready. The lock is taken inside the section, so a
// thread that holds the interpreter lock never blocks on `mutex` while keeping it.
template <class Ready>
bool wait_until(std::mutex& mutex, std::condition_variable& cv, WaitClock::time_point deadline, Ready ready) {
  bool result = false;
  blocking_section([&] {
    std::unique_lock<std::mutex> lock(mutex);
    result = cv.wait_until(lock, deadline, ready);
  });
  return result;
}

}  // namespace torch_ext
