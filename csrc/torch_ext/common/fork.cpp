#include "torch_ext/common/fork.h"

#include <pthread.h>

#include <mutex>
#include <new>
#include <vector>

#include <c10/util/Exception.h>

namespace torch_ext {

namespace {

// Leaked on purpose: objects may unregister during static destruction.
struct Registry {
  std::mutex mutex;
  std::vector<ForkParticipant*> participants;  // in registration order
};

Registry& registry() {
  static Registry* instance = new Registry();
  return *instance;
}

// Locks are taken in registration order and released in reverse; no participant takes another
// participant's lock while holding its own, so the order cannot deadlock.
void prepare() {
  Registry& r = registry();
  r.mutex.lock();
  for (ForkParticipant* p : r.participants) p->fork_prepare();
}

void parent() {
  Registry& r = registry();
  for (auto it = r.participants.rbegin(); it != r.participants.rend(); ++it) (*it)->fork_parent();
  r.mutex.unlock();
}

void child() {
  Registry& r = registry();
  for (auto it = r.participants.rbegin(); it != r.participants.rend(); ++it) (*it)->fork_child();
  new (&r.mutex) std::mutex();  // locked by prepare() in the parent's thread: start afresh
}

}  // namespace

void register_fork_participant(ForkParticipant* participant) {
  static const int installed = ::pthread_atfork(&prepare, &parent, &child);
  TORCH_CHECK(installed == 0, "torch_ext: pthread_atfork failed with error ", installed);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.participants.push_back(participant);
}

void unregister_fork_participant(ForkParticipant* participant) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::erase(r.participants, participant);
}

}  // namespace torch_ext
