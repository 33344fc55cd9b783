#pragma once
// Names the calling thread as top, perf, gdb and /proc/<pid>/task/*/comm show it, so the threads
// torch_ext starts (a batcher's, a plan cache's build worker, a pager's prefetcher) can be told
// from the interpreter's. Linux keeps 15 characters; elsewhere it does nothing.
#if defined(__linux__)
#include <pthread.h>
#endif

namespace torch_ext {

inline void name_this_thread(const char* name) {
#if defined(__linux__)
  (void)pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace torch_ext
