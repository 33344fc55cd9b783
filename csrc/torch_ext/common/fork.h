#pragma once
// The one at-fork registry of the tree, for objects that own locks or threads (LayerPager,
// NodeCache, PlanCache, Batcher). Each registers itself for its lifetime; pthread_atfork handlers
// (installed on the first registration, in the core library, so C++ programs are covered too)
// call fork_prepare() on every registered object before fork() (take its locks, so no state is
// mid-change when the process is copied), fork_parent() after it in the parent (release them),
// and fork_child() in the child, where only the forking thread exists (make the locks new, forget
// threads and work of other threads; no locks, no allocation). The registry is thread-safe.
namespace torch_ext {

class ForkParticipant {
 public:
  virtual void fork_prepare() = 0;
  virtual void fork_parent() = 0;
  virtual void fork_child() = 0;

 protected:
  ForkParticipant() = default;
  ~ForkParticipant() = default;
};

void register_fork_participant(ForkParticipant* participant);
void unregister_fork_participant(ForkParticipant* participant);

}  // namespace torch_ext
