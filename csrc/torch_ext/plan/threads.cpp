// The at-fork handlers (one pthread_atfork registration for every ForkAware object) and the
// blocking section.
#include "torch_ext/plan/threads.h"

#include <pthread.h>

#include <mutex>
#include <new>
#include <unordered_set>
#include <utility>

namespace torch_ext::plan {

namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_set<ForkAware*> objects;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: handlers may run during exit
  return *r;
}

void prepare() {
  auto& r = registry();
  r.mutex.lock();  // held across fork: no registration is half done in the child
  for (ForkAware* object : r.objects) object->before_fork();
}

void parent() {
  auto& r = registry();
  for (ForkAware* object : r.objects) object->after_fork_parent();
  r.mutex.unlock();
}

void child() {
  auto& r = registry();
  for (ForkAware* object : r.objects) object->after_fork_child();
  new (&r.mutex) std::mutex();  // made afresh: the parent's thread locked it
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(prepare, parent, child); });
}

}  // namespace

void register_fork_aware(ForkAware* object) {
  install();
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().objects.insert(object);
}

void unregister_fork_aware(ForkAware* object) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().objects.erase(object);
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

}  // namespace torch_ext::plan
