#include "torch_ext/common/wait.h"

#include <algorithm>
#include <utility>

namespace torch_ext {

WaitClock::time_point deadline_after(double seconds) {
  constexpr double kFar = 1e9;  // seconds (~30 years)
  const double limit = std::clamp(seconds, 0.0, kFar);  // NaN compares false: treated as now below
  if (!(limit > 0)) return WaitClock::now();
  return WaitClock::now() + std::chrono::duration_cast<WaitClock::duration>(std::chrono::duration<double>(limit));
}

namespace {

std::mutex section_mutex;
BlockingSection section;  // guarded by section_mutex

}  // namespace

void set_blocking_section(BlockingSection fn) {
  std::lock_guard<std::mutex> lock(section_mutex);
  section = std::move(fn);
}

void blocking_section(const std::function<void()>& wait) {
  BlockingSection fn;
  {
    std::lock_guard<std::mutex> lock(section_mutex);
    fn = section;
  }
  if (fn) {
    fn(wait);
  } else {
    wait();
  }
}

}  // namespace torch_ext
