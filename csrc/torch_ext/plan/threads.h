#pragma once
// What objects that own a thread (the plan cache's build worker, the batcher) need to stay safe.
//
// Fork: such objects register to survive fork(): before a fork their locks are taken, so the
// child never inherits one held by a thread it does not have; after it the parent releases them,
// and the child makes them afresh and learns its threads are gone (after_fork_child: no locks,
// no allocation). Registration is thread-safe; handlers run in the forking thread.
#include <functional>

namespace torch_ext::plan {

class ForkAware {
 public:
  virtual ~ForkAware() = default;
  virtual void before_fork() = 0;       // take the locks a child must not inherit held
  virtual void after_fork_parent() = 0;  // release them
  virtual void after_fork_child() = 0;   // make them afresh; the object's threads do not exist here
};

// Adds or removes an object from the set the at-fork handlers visit (installed on first use).
void register_fork_aware(ForkAware* object);
void unregister_fork_aware(ForkAware* object);

// Blocking on another thread (joining it, waiting for its result) while holding a lock that
// thread may need: the Python bindings install a section that releases the interpreter lock
// around such waits, since the other thread may be running Python (a compiler, a callback).
// The default runs the wait as it is.
using BlockingSection = std::function<void(const std::function<void()>&)>;
void set_blocking_section(BlockingSection section);
void blocking_section(const std::function<void()>& wait);

}  // namespace torch_ext::plan
