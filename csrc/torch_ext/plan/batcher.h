#pragma once
// Batcher: a dynamic batcher in front of a PlanCache. Callers submit single requests, which
// queue; a batch takes them oldest first (padded to the longest along the other dynamic
// dimensions where the cache pads them; with group_by_bucket only requests of one bucket join),
// runs as one call of the cache, and each caller gets its own rows. The call whose request
// brings max_batch_size rows runs that batch itself, on its own thread (no hand-off): an infer()
// always, a submit() unless submit_runs_batch is false (then the batcher's thread runs it at once,
// while the caller goes on). A batch that does not fill runs on the batcher's thread max_delay_ms
// after its oldest request arrived. At most max_running_batches batches run at once (by default
// one per core for torch's intra-op threads): a batch filled while that many run waits, and the
// first of them to finish runs it next, on its thread, before it returns.
// A request may carry a deadline (deadline_ms after submit): one that cannot be met (not
// positive, or shorter than the fastest batch this batcher has run) is refused at once, and
// one whose deadline passes while it waits fails without running; the errors say so.
//
// Thread safety: submit() and infer() may be called from any number of threads. Callbacks run on
// the thread that ran the batch (a client's, or the batcher's), outside its locks but holding its
// place among the max_running_batches (one that waits on this batcher can wait for itself). The queue is
// bounded: submit() raises at once when max_queue requests wait. Every wait is bounded (infer()
// by timeout_seconds). A forked child gets an error from submit() (the batcher's thread is not in
// it) and may destroy the batcher.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/core/ivalue.h>

#include "torch_ext/common/fork.h"
#include "torch_ext/fields.h"
#include "torch_ext/plan/plan_cache.h"

namespace torch_ext::plan {

struct BatcherOptions {
  int64_t max_batch_size = 0;
  double max_delay_ms = 2.0;
  int64_t max_queue = 1024;
  double timeout_seconds = 60;
  bool group_by_bucket = true;
  bool submit_runs_batch = true;
  int64_t max_running_batches = 0;

  static constexpr auto fields() {
    return std::make_tuple(
        field("max_batch_size", &BatcherOptions::max_batch_size,
              "most rows one batch takes; 0: the cache's max_batch_size"),
        field("max_delay_ms", &BatcherOptions::max_delay_ms,
              "longest the oldest waiting request waits for others to join its batch"),
        field("max_queue", &BatcherOptions::max_queue,
              "most requests waiting; submit() raises when that many are queued (backpressure)"),
        field("timeout_seconds", &BatcherOptions::timeout_seconds,
              "longest infer() waits for its result before raising"),
        field("group_by_bucket", &BatcherOptions::group_by_bucket,
              "requests join a batch only when they fall in the same bucket of the cache along the dynamic "
              "dimensions after the batch, so none is padded past its bucket's bound (a short sequence is not "
              "padded to a long one's length); False: any requests the cache can pad join, padded to the longest"),
        field("submit_runs_batch", &BatcherOptions::submit_runs_batch,
              "a submit() whose request fills a batch runs it before returning, on the caller's thread (no "
              "hand-off; batches filled by different callers run at once); False: submit() returns at once and the "
              "batch runs on the batcher's thread (for a caller that must not block, such as an event loop)"),
        field("max_running_batches", &BatcherOptions::max_running_batches,
              "most batches running at once, on clients' threads and the batcher's; a batch filled while that many "
              "run waits, and the first of them to finish runs it next (no hand-off); 0: one per core for torch's "
              "intra-op threads (the machine's hardware threads / torch.get_num_threads() when the batcher is made, "
              "at least 1), which the option then reads"));
  }
  void validate() const;
};

struct BatcherStats {
  int64_t requests = 0;
  int64_t rejected = 0;
  int64_t failed = 0;
  int64_t batches = 0;
  int64_t rows = 0;
  int64_t max_batch_rows = 0;
  int64_t queued = 0;
  int64_t max_queued = 0;
  double queue_seconds = 0;
  double batch_seconds = 0;
  int64_t client_batches = 0;
  int64_t expired = 0;
  int64_t cancelled = 0;

  static constexpr auto fields() {
    return std::make_tuple(
        field("requests", &BatcherStats::requests, "requests accepted"),
        field("rejected", &BatcherStats::rejected, "requests refused because the queue was full"),
        field("failed", &BatcherStats::failed, "requests whose batch raised"),
        field("batches", &BatcherStats::batches, "batches run"),
        field("rows", &BatcherStats::rows, "rows run, over all batches"),
        field("max_batch_rows", &BatcherStats::max_batch_rows, "the largest batch's rows"),
        field("queued", &BatcherStats::queued, "requests waiting now"),
        field("max_queued", &BatcherStats::max_queued, "the most requests that waited at once"),
        field("queue_seconds", &BatcherStats::queue_seconds, "time requests waited for their batch, summed"),
        field("batch_seconds", &BatcherStats::batch_seconds, "time batches took to run, summed"),
        field("client_batches", &BatcherStats::client_batches,
              "batches run by the client whose request filled them (the rest ran on the batcher's thread)"),
        field("expired", &BatcherStats::expired,
              "requests failed for their deadline: refused at submit (it could not be met) or passed in the queue"),
        field("cancelled", &BatcherStats::cancelled, "requests taken out of the queue by cancel() before they ran"));
  }
};

// One request's result: filled once by the thread that ran its batch, waited for with a timeout
// by any number of threads. future() is a torch Future completed with it (made on first use: for
// TorchScript's wait and for callbacks). One made with a callback hands it the result as well.
class BatchResult : public torch::CustomClassHolder {
 public:
  // Called with the request's output, or the error its batch raised, on the thread that ran the
  // batch, outside the batcher's locks; what it raises is dropped (its caller has the result).
  using Callback = std::function<void(c10::IValue output, std::exception_ptr error)>;

  BatchResult() = default;
  explicit BatchResult(Callback callback) : callback_(std::move(callback)) {}

  void complete(c10::IValue value, std::exception_ptr error) { announce(store(std::move(value), error)); }
  // complete() in two steps, so that a batch stores every result before it wakes any waiter: a
  // waiter woken early may take the batcher's core (Linux often runs a woken thread on its
  // waker's core when the other is busy) and wait again for its next result, one such round trip
  // per request. store() returns the torch Future (if one was made) for announce() to complete;
  // announce() also calls the callback.
  c10::intrusive_ptr<c10::ivalue::Future> store(c10::IValue value, std::exception_ptr error);
  void announce(const c10::intrusive_ptr<c10::ivalue::Future>& future);
  // Whether the result is in after waiting at most timeout_seconds.
  bool wait(double timeout_seconds);
  // The output, or the error of the request's batch; raises if it is not in after timeout_seconds.
  c10::IValue result(double timeout_seconds);
  bool done();
  // Whether a batch has taken the request and not yet handed its result back (false while queued).
  bool running();
  // Whether Batcher::cancel() took it out of the queue (result() then raises saying so).
  bool cancelled();
  c10::intrusive_ptr<c10::ivalue::Future> future();

 private:
  friend class Batcher;
  std::atomic<bool> taken_{false};  // set by the batch that takes the request
  bool cancelled_ = false;          // guarded by mutex_
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  c10::IValue value_;
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  const Callback callback_;
};

// Tells an event loop (asyncio's, or a C++ server's poll) which of the requests it awaits are
// done, waking it once for all that complete before it looks: watch(result, key) lists the key
// when the result is in, and writes one byte to fd when the list was empty; the loop, woken by
// fd, reads it and take()s the list. The thread that completes a result only appends to the list
// (no GIL, no call into the loop); a batch completes its results one after another at once, so
// its n awaited requests wake the loop once, not n times (unless the loop takes the list between).
class Completions {
 public:
  explicit Completions(int fd);  // the write end of a non-blocking pipe; the caller owns it
  void watch(BatchResult& result, int64_t key);
  std::vector<int64_t> take();
  // Nothing is written to fd once this returns (the caller may close it).
  void close();

 private:
  struct State {
    std::mutex mutex;
    std::vector<int64_t> done;
    int fd = -1;
    bool closed = false;
  };
  std::shared_ptr<State> state_;  // shared with the watches' callbacks, which may outlive this
};

class Batcher : public torch::CustomClassHolder, private ForkParticipant {
 public:
  using Callback = BatchResult::Callback;

  Batcher(c10::intrusive_ptr<PlanCache> cache, BatcherOptions options = {});
  ~Batcher() override;
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Queues one request: inputs as PlanCache::infer takes them, any batch size up to
  // max_batch_size. Checked here (a bad request never joins a batch); raises when the queue is
  // full or the deadline (deadline_ms after now; < 0: none) cannot be met. A batch the request
  // fills runs here before it returns (submit_runs_batch) or on the batcher's thread; when
  // max_running_batches run, it waits for the first of them to finish.
  void submit(std::vector<c10::IValue> inputs, Callback callback, double deadline_ms = -1);
  c10::intrusive_ptr<BatchResult> submit(std::vector<c10::IValue> inputs, double deadline_ms = -1);
  // submit() and wait for the result, at most timeout_seconds (< 0: the option's); a request still
  // queued then is taken out of the queue as the call raises. A batch the request fills runs on
  // this thread (it would wait anyway): no hand-off. Either call, once it
  // runs a batch, goes on to run those that filled meanwhile (see max_running_batches).
  c10::IValue infer(std::vector<c10::IValue> inputs, double timeout_seconds = -1, double deadline_ms = -1);
  // Takes a request submit() queued out of the queue, if no batch has taken it yet: its result is
  // then done and cancelled (result() raises, callbacks run here) and true is returned. False when
  // it runs or has run, or is not this batcher's.
  bool cancel(const c10::intrusive_ptr<BatchResult>& result);

  BatcherStats stats() const;
  const BatcherOptions& options() const { return options_; }
  c10::intrusive_ptr<PlanCache> cache() const;
  // Batches from now on run on `cache`, the re-plan of this one's (torch_ext.PlanCache's re-plans
  // swap in a new cache and call it): queued requests included; a batch under way ends on the old
  // one. Raises unless `cache` takes the same dynamic dimensions and this batcher's batch size.
  void follow(c10::intrusive_ptr<PlanCache> cache);
  // Stops taking requests, runs those queued, and joins the thread (the destructor calls it).
  void close();

 private:
  struct Request {
    std::vector<c10::IValue> inputs;
    Bucket sizes;
    c10::intrusive_ptr<BatchResult> result;  // where the output goes
    std::chrono::steady_clock::time_point arrived;
    std::chrono::steady_clock::time_point deadline;  // time_point::max(): none
    double deadline_ms = -1;
  };

  // A batch's requests and the cache they were grouped for, which runs them (a follow() after the
  // grouping applies to the next batch).
  struct Batch {
    c10::intrusive_ptr<PlanCache> cache;
    std::vector<Request> requests;
  };

  // submit() and infer(): the output goes to result; run_if_full, the caller runs the batch its
  // request fills; else the batcher's thread does.
  void enqueue(std::vector<c10::IValue> inputs, c10::intrusive_ptr<BatchResult> result, double deadline_ms,
               bool run_if_full);
  void loop();
  // The requests of the next batch, oldest first; those whose deadline has passed move to `expired`
  // (called with the lock held).
  Batch take_batch_locked(std::vector<Request>& expired);
  void fail_expired(std::vector<Request>& expired);
  // Whether `other` may run in one batch with `first` (whose bucket in `layout` is first_bucket).
  bool joins(const Layout& layout, const Request& first, const Bucket& first_bucket, const Request& other) const;
  void run_batch(Batch& batch);
  // Runs `batch`, which holds one of the max_running_batches slots, then with the same slot each
  // batch that filled meanwhile; gives the slot back when none has (called unlocked).
  void run_batches(Batch batch, bool on_client);
  void fork_prepare() override;
  void fork_parent() override;
  void fork_child() override;

  mutable std::mutex cache_mutex_;  // held only to read or swap cache_
  c10::intrusive_ptr<PlanCache> cache_;
  BatcherOptions options_;
  int64_t max_rows_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Request> queue_;
  int64_t queued_rows_ = 0;
  int64_t running_ = 0;  // batches running now (guarded by mutex_)
  // What the batcher's thread waits for (guarded by mutex_): a request into the empty queue, the
  // oldest request's due time (or its batch to fill), a free slot; kNothing: it is running.
  enum class Waiting { kNothing, kRequest, kDue, kSlot };
  Waiting waiting_ = Waiting::kNothing;
  bool closing_ = false;
  BatcherStats stats_;  // guarded by mutex_
  double fastest_batch_seconds_ = 0;  // guarded by mutex_; 0: no batch has run
  std::unique_ptr<std::thread> thread_;
  std::atomic<bool> forked_{false};
};

}  // namespace torch_ext::plan
