#pragma once
// Objects that own a thread (the plan cache's build worker, the batcher) register here to survive
// fork(): before a fork their locks are taken, so the child never inherits one held by a thread
// it does not have; after it the parent releases them, and the child releases them and learns its
// threads are gone (after_fork_child, which must only flip flags: no locks, no allocation).
// Registration is thread-safe; handlers run in the forking thread.

namespace torch_ext::plan {

class ForkAware {
 public:
  virtual ~ForkAware() = default;
  virtual void before_fork() = 0;       // take the locks a child must not inherit held
  virtual void after_fork_parent() = 0;  // release them
  virtual void after_fork_child() = 0;   // release them; the object's threads do not exist here
};

// Adds or removes an object from the set the at-fork handlers visit (installed on first use).
void register_fork_aware(ForkAware* object);
void unregister_fork_aware(ForkAware* object);

}  // namespace torch_ext::plan
