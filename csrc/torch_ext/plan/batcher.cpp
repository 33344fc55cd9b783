// The dynamic batcher: a bounded queue of single requests; batches (max_batch_size rows, run by
// the client that filled them, or max_delay_ms, run by the batcher's thread) through the plan
// cache, every caller handed its rows; deadlines; and what fork() does to it.
#include "torch_ext/plan/batcher.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/equal.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "torch_ext/common/thread_name.h"
#include "torch_ext/common/wait.h"
#include "torch_ext/plan/layout.h"

namespace torch_ext::plan {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

}  // namespace

void BatcherOptions::validate() const {
  TORCH_CHECK_VALUE(max_batch_size >= 0, "Batcher: max_batch_size must be >= 0, got ", max_batch_size);
  TORCH_CHECK_VALUE(max_delay_ms >= 0, "Batcher: max_delay_ms must be >= 0, got ", max_delay_ms);
  TORCH_CHECK_VALUE(max_queue >= 1, "Batcher: max_queue must be >= 1, got ", max_queue);
  TORCH_CHECK_VALUE(timeout_seconds > 0, "Batcher: timeout_seconds must be > 0, got ", timeout_seconds);
  TORCH_CHECK_VALUE(max_running_batches >= 0, "Batcher: max_running_batches must be >= 0 (0: one per core), got ",
                    max_running_batches);
}

Batcher::Batcher(c10::intrusive_ptr<PlanCache> cache, BatcherOptions options)
    : cache_(std::move(cache)), options_(options) {
  TORCH_CHECK_VALUE(cache_, "Batcher: no plan cache given");
  options_.validate();
  max_rows_ = options_.max_batch_size > 0 ? options_.max_batch_size : cache_->layout().max_size(0);
  TORCH_CHECK_VALUE(max_rows_ > 0, "Batcher: set max_batch_size (the cache has no max_batch_size to take it from)");
  // More batches at once than cores only makes them take turns, and a Python client that holds
  // the GIL then waits for a core as well, stalling every other client.
  // The default is resolved here, so the option reads the number chosen.
  if (options_.max_running_batches == 0) {
    const int64_t cores = std::thread::hardware_concurrency();
    options_.max_running_batches = std::max<int64_t>(1, cores / std::max(1, at::get_num_threads()));
  }
  register_fork_participant(this);
  thread_ = std::make_unique<std::thread>([this] { loop(); });
}

Batcher::~Batcher() {
  unregister_fork_participant(this);
  close();
}

void Batcher::close() {
  if (forked_.load(std::memory_order_relaxed)) {
    // A forked child: the thread is the parent's, absent here. Its handle is dropped, never joined,
    // and the parent's queued requests are not this process's to answer.
    (void)thread_.release();
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.clear();
    closing_ = true;
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  cv_.notify_all();
  // The thread runs what is queued, then returns: each batch is one run of the cache.
  if (thread_ && thread_->joinable()) blocking_section([this] { thread_->join(); });
}

c10::intrusive_ptr<PlanCache> Batcher::cache() const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  return cache_;
}

void Batcher::follow(c10::intrusive_ptr<PlanCache> cache) {
  TORCH_CHECK_VALUE(cache, "Batcher.follow: no plan cache given");
  const Layout& now = this->cache()->layout();
  const Layout& next = cache->layout();
  TORCH_CHECK_VALUE(next.rank() == now.rank(), "Batcher.follow: the new cache has ", next.rank(),
                    " dynamic dimension(s), this batcher's ", now.rank());
  TORCH_CHECK_VALUE(next.max_size(0) == 0 || next.max_size(0) >= max_rows_, "Batcher.follow: the new cache takes ",
                    "batches of at most ", next.max_size(0), " rows, below this batcher's max_batch_size ", max_rows_);
  c10::intrusive_ptr<PlanCache> old;  // may be the last reference: let it go after the lock
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    old = std::exchange(cache_, std::move(cache));
  }
}

void Batcher::submit(std::vector<c10::IValue> inputs, Callback callback, double deadline_ms) {
  TORCH_CHECK_VALUE(callback, "Batcher.submit: no callback given");
  enqueue(std::move(inputs), c10::make_intrusive<BatchResult>(std::move(callback)), deadline_ms,
          options_.submit_runs_batch);
}

void Batcher::enqueue(std::vector<c10::IValue> inputs, c10::intrusive_ptr<BatchResult> result, double deadline_ms,
                      bool run_if_full) {
  TORCH_CHECK(!forked_.load(std::memory_order_relaxed), "Batcher.submit: this process was forked from the one that "
              "made the batcher, whose thread a forked child does not have; make a new Batcher in the child");
  TORCH_CHECK_VALUE(!std::isnan(deadline_ms), "Batcher.submit: deadline_ms is NaN");
  const auto cache = this->cache();
  const Bucket sizes = cache->check_request(inputs);
  TORCH_CHECK(sizes[0] <= max_rows_, "Batcher: a request of batch size ", sizes[0], " is above max_batch_size ",
              max_rows_);
  const auto now = Clock::now();
  const bool has_deadline = deadline_ms >= 0;
  const auto deadline = has_deadline ? deadline_after(deadline_ms / 1000) : Clock::time_point::max();
  Batch batch;
  std::vector<Request> expired;
  bool was_empty = false;
  bool full = false;
  Waiting batcher_waits = Waiting::kNothing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!closing_, "Batcher.submit: the batcher is closed");
    if (has_deadline && (deadline_ms == 0 || deadline_ms < fastest_batch_seconds_ * 1000)) {
      ++stats_.expired;
      TORCH_CHECK(false, "Batcher: this request's deadline of ", deadline_ms, " ms cannot be met: ",
                  deadline_ms == 0 ? std::string("it has already passed")
                                   : "no batch has run in under " + std::to_string(fastest_batch_seconds_ * 1000) +
                                         " ms (the fastest so far)",
                  "; it was not queued");
    }
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queue) {
      ++stats_.rejected;
      TORCH_CHECK(false, "Batcher: the queue is full (", queue_.size(), " requests waiting, max_queue=",
                  options_.max_queue, "); retry later, or raise max_queue");
    }
    was_empty = queue_.empty();
    batcher_waits = waiting_;
    queue_.push_back(
        Request{std::move(inputs), sizes, std::move(result), now, deadline, deadline_ms});
    queued_rows_ += sizes[0];
    ++stats_.requests;
    stats_.max_queued = std::max(stats_.max_queued, static_cast<int64_t>(queue_.size()));
    // The caller runs the batch its request fills: no hand-off to the batcher's thread (a submit()
    // with submit_runs_batch false leaves it to that thread, one wake-up per batch). When every
    // slot is taken, the batch waits for the first of their runners to finish, which runs it next.
    full = queued_rows_ >= max_rows_;
    if (run_if_full && full && running_ < options_.max_running_batches) {
      batch = take_batch_locked(expired);
      if (!batch.requests.empty()) {
        ++running_;
        ++stats_.client_batches;
      }
    }
  }
  // The batcher's thread is woken only where it waits for what this request brings: a first request
  // (to start its max_delay_ms), or a full batch to run. A thread waiting for an earlier request's
  // due time wakes by itself no later than this one's; one waiting for a slot, when a runner frees it.
  if (batch.requests.empty() && ((was_empty && batcher_waits == Waiting::kRequest) ||
                                 (full && !run_if_full && batcher_waits != Waiting::kSlot))) {
    cv_.notify_one();
  }
  fail_expired(expired);
  if (batch.requests.empty()) return;
  // A client's thread computes with torch's intra-op thread count, as the batcher's does (a thread
  // torch did not start would use OpenMP's default: every core).
  thread_local bool threads_set = false;
  if (!threads_set) {
    at::init_num_threads();
    threads_set = true;
  }
  blocking_section([&] { run_batches(std::move(batch), /*on_client=*/true); });
}

void Batcher::run_batches(Batch batch, bool on_client) {
  while (!batch.requests.empty()) {
    run_batch(batch);
    batch = Batch{};  // its requests go unlocked: dropping a tensor Python made may take the GIL
    std::vector<Request> expired;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (queued_rows_ >= max_rows_) batch = take_batch_locked(expired);
      if (batch.requests.empty()) {
        --running_;
        if (waiting_ == Waiting::kSlot) cv_.notify_one();  // for a batch that is due
      } else if (on_client) {
        ++stats_.client_batches;
      }
    }
    fail_expired(expired);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> BatchResult::store(c10::IValue value, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mutex_);
  done_ = true;
  value_ = std::move(value);
  error_ = error;
  return future_;  // one made from now on is completed as it is made
}

void BatchResult::announce(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  cv_.notify_all();
  // value_ and error_ are not written again once stored
  if (future) {
    if (error_) {
      future->setError(error_);
    } else {
      future->markCompleted(value_);
    }
  }
  if (callback_) {
    try {
      callback_(value_, error_);
    } catch (...) {  // a caller's callback must not stop the batcher; its caller has its result
    }
  }
}

bool BatchResult::wait(double timeout_seconds) {
  return wait_until(mutex_, cv_, deadline_after(timeout_seconds), [this] { return done_; });
}

c10::IValue BatchResult::result(double timeout_seconds) {
  TORCH_CHECK(wait(timeout_seconds), "Batcher: no result after ", timeout_seconds,
              " s: the request still waits in the queue (a batch runs when it fills or after max_delay_ms) or its "
              "batch still runs; wait longer, or lower max_delay_ms");
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  return value_;
}

bool BatchResult::done() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

bool BatchResult::running() {
  std::lock_guard<std::mutex> lock(mutex_);
  return taken_.load(std::memory_order_relaxed) && !done_;
}

bool BatchResult::cancelled() {
  std::lock_guard<std::mutex> lock(mutex_);
  return cancelled_;
}

c10::intrusive_ptr<c10::ivalue::Future> BatchResult::future() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    if (done_ && error_) future_->setError(error_);
    if (done_ && !error_) future_->markCompleted(value_);
  }
  return future_;
}

Completions::Completions(int fd) : state_(std::make_shared<State>()) {
  TORCH_CHECK_VALUE(fd >= 0, "Completions: expected a file descriptor, got ", fd);
  state_->fd = fd;
}

void Completions::watch(BatchResult& result, int64_t key) {
  result.future()->addCallback(
      [state = state_, key](c10::ivalue::Future&) {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (state->closed) return;
        state->done.push_back(key);
        if (state->done.size() == 1) {
          const char byte = 0;
          (void)!::write(state->fd, &byte, 1);  // full (EAGAIN): the loop is already due to wake
        }
      },
      /*uses_future=*/false);
}

std::vector<int64_t> Completions::take() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return std::exchange(state_->done, {});
}

void Completions::close() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->closed = true;
  state_->done.clear();
}

c10::intrusive_ptr<BatchResult> Batcher::submit(std::vector<c10::IValue> inputs, double deadline_ms) {
  auto result = c10::make_intrusive<BatchResult>();
  enqueue(std::move(inputs), result, deadline_ms, options_.submit_runs_batch);
  return result;
}

c10::IValue Batcher::infer(std::vector<c10::IValue> inputs, double timeout_seconds, double deadline_ms) {
  auto result = c10::make_intrusive<BatchResult>();
  enqueue(std::move(inputs), result, deadline_ms, /*run_if_full=*/true);
  const double wait = timeout_seconds < 0 ? options_.timeout_seconds : timeout_seconds;
  if (!result->wait(wait)) {
    // Nobody can collect a result this call gives up on: a request still queued is taken out.
    TORCH_CHECK(!cancel(result), "Batcher: no result after ", wait, " s: the request still waited in the queue (a "
                "batch runs when it fills or after max_delay_ms) and was taken out of it, not run; wait longer, or "
                "lower max_delay_ms");
    TORCH_CHECK(result->done(), "Batcher: no result after ", wait, " s: its batch still runs; wait longer");
  }
  return result->result(0);
}

bool Batcher::cancel(const c10::intrusive_ptr<BatchResult>& result) {
  TORCH_CHECK_VALUE(result, "Batcher.cancel: no request given");
  Request request;  // dropped unlocked, as a batch's requests are
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Request& r) { return r.result == result; });
    if (it == queue_.end()) return false;
    queued_rows_ -= it->sizes[0];
    ++stats_.cancelled;
    request = std::move(*it);
    queue_.erase(it);
    std::lock_guard<std::mutex> result_lock(result->mutex_);
    result->cancelled_ = true;  // before it is done: whoever sees it done sees it cancelled
  }
  // A batcher's thread waiting for this request's due time wakes then and looks at the queue again.
  result->complete(c10::IValue(), std::make_exception_ptr(c10::Error(
                                      "Batcher: the request was cancelled before a batch took it; it was not run")));
  return true;
}

bool Batcher::joins(const Layout& layout, const Request& first, const Bucket& first_bucket, const Request& other) const {
  for (int k = 1; k < first.sizes.rank; ++k) {
    if (first.sizes[k] != other.sizes[k] && !layout.pads(k)) return false;  // only equal sizes join
  }
  if (options_.group_by_bucket) {
    const Bucket bucket = layout.bucket_of(other.sizes);
    for (int k = 1; k < bucket.rank; ++k) {
      if (bucket[k] != first_bucket[k]) return false;
    }
  }
  for (size_t i = 0; i < first.inputs.size(); ++i) {
    const bool batched = first.inputs[i].isTensor() && layout.input_dim(i, 0) >= 0;
    if (batched) continue;
    // Unbatched inputs are the batch's: requests join only where they agree on them.
    const auto& a = first.inputs[i];
    const auto& b = other.inputs[i];
    if (a.isTensor() != b.isTensor()) return false;
    if (a.isTensor() ? !(a.toTensor().is_same(b.toTensor()) || at::equal(a.toTensor(), b.toTensor())) : !(a == b)) {
      return false;
    }
  }
  return true;
}

Batcher::Batch Batcher::take_batch_locked(std::vector<Request>& expired) {
  Batch batch{cache(), {}};
  // The buckets of the cache that runs the batch: a follow() since the requests came may have changed them.
  const Layout& layout = batch.cache->layout();
  Bucket first_bucket;
  int64_t rows = 0;
  const auto now = Clock::now();
  for (auto it = queue_.begin(); it != queue_.end() && rows < max_rows_;) {
    if (it->deadline <= now) {
      queued_rows_ -= it->sizes[0];
      ++stats_.expired;
      expired.push_back(std::move(*it));
      it = queue_.erase(it);
    } else if (batch.requests.empty() ||
               (rows + it->sizes[0] <= max_rows_ && joins(layout, batch.requests.front(), first_bucket, *it))) {
      if (batch.requests.empty() && options_.group_by_bucket) first_bucket = layout.bucket_of(it->sizes);
      rows += it->sizes[0];
      queued_rows_ -= it->sizes[0];
      it->result->taken_.store(true, std::memory_order_relaxed);
      batch.requests.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return batch;
}

void Batcher::fail_expired(std::vector<Request>& expired) {
  const auto now = Clock::now();
  for (auto& request : expired) {
    const auto error = std::make_exception_ptr(
        c10::Error("Batcher: this request's deadline of " + std::to_string(request.deadline_ms) + " ms passed after " +
                   std::to_string(ms_between(request.arrived, now)) + " ms in the queue; it was not run"));
    request.result->complete(c10::IValue(), error);
  }
}

void Batcher::loop() {
  name_this_thread("torch_ext batch");
  at::init_num_threads();  // this thread computes with torch's intra-op thread count, as callers' do
  const auto delay = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(options_.max_delay_ms));
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // Predicate waits: a request queued into an empty queue before the wait is seen, one after it
    // notifies (waiting_ says what this thread waits for, so that only that wakes it). The idle
    // wait runs in 1 s slices.
    waiting_ = Waiting::kRequest;
    while (!cv_.wait_for(lock, std::chrono::seconds(1), [this] { return closing_ || !queue_.empty(); })) {
    }
    waiting_ = Waiting::kNothing;
    if (queue_.empty()) break;  // closing, nothing left to run
    // The oldest request's batch is due when full, or max_delay_ms after it arrived; a client may
    // fill and run it first, so the front is looked at again after the wait.
    const auto due = queue_.front().arrived + delay;
    if (!closing_ && queued_rows_ < max_rows_ && Clock::now() < due) {
      waiting_ = Waiting::kDue;
      cv_.wait_until(lock, due, [this] { return closing_ || queued_rows_ >= max_rows_; });
      waiting_ = Waiting::kNothing;
      continue;
    }
    // Every slot taken: the first runner to finish takes a full batch itself, or wakes this thread.
    if (running_ >= options_.max_running_batches) {
      waiting_ = Waiting::kSlot;
      cv_.wait(lock, [this] { return running_ < options_.max_running_batches; });
      waiting_ = Waiting::kNothing;
      continue;
    }
    {
      std::vector<Request> expired;
      Batch batch = take_batch_locked(expired);
      if (!batch.requests.empty()) ++running_;
      lock.unlock();
      fail_expired(expired);
      run_batches(std::move(batch), /*on_client=*/false);
      // The requests go here, unlocked: dropping a tensor Python made may take the GIL, which a
      // submit() holds while it waits for the lock.
    }
    lock.lock();
  }
}

void Batcher::run_batch(Batch& batch) {
  const Layout& layout = batch.cache->layout();
  const auto start = Clock::now();
  Bucket padded = batch.requests.front().sizes;  // the longest of each other dimension; the batch's rows
  padded[0] = 0;
  double waited = 0;
  for (const auto& request : batch.requests) {
    padded[0] += request.sizes[0];
    for (int k = 1; k < padded.rank; ++k) padded[k] = std::max(padded[k], request.sizes[k]);
    waited += std::chrono::duration<double>(start - request.arrived).count();
  }
  c10::IValue output;
  std::exception_ptr error;
  try {
    // Each request's grad mode was checked as it came (PlanCache::check_request); the batch runs on
    // whichever thread fills it, whose own grad mode is not the requests'.
    c10::AutoGradMode no_grad(false);
    std::vector<std::vector<c10::IValue>> inputs;
    for (const auto& request : batch.requests) {
      Bucket target = padded;
      target[0] = request.sizes[0];
      inputs.push_back(target == request.sizes ? request.inputs : layout.pad(request.inputs, request.sizes, target));
    }
    output = batch.cache->infer_batch(layout.concat_inputs(inputs));
  } catch (...) {
    error = std::current_exception();
  }
  {
    // Counted before any caller hears back: a caller that reads stats() after its result sees its batch.
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.batches;
    stats_.rows += padded[0];
    stats_.max_batch_rows = std::max(stats_.max_batch_rows, padded[0]);
    stats_.failed += error ? static_cast<int64_t>(batch.requests.size()) : 0;
    stats_.queue_seconds += waited;
    const double seconds = seconds_since(start);
    stats_.batch_seconds += seconds;
    if (!error && (fastest_batch_seconds_ == 0 || seconds < fastest_batch_seconds_)) fastest_batch_seconds_ = seconds;
  }
  // Every result is stored before any waiter is woken or callback called (BatchResult::store).
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  futures.reserve(batch.requests.size());
  int64_t offset = 0;
  for (auto& request : batch.requests) {
    c10::IValue rows;
    std::exception_ptr failure = error;
    if (!failure) {
      try {
        Bucket target = padded;
        target[0] = request.sizes[0];
        rows = layout.slice_output(layout.output_rows(output, offset, request.sizes[0]), request.sizes, target);
      } catch (...) {
        failure = std::current_exception();
        std::lock_guard<std::mutex> lock(mutex_);
        ++stats_.failed;
      }
    }
    offset += request.sizes[0];
    futures.push_back(request.result->store(std::move(rows), failure));
  }
  for (size_t i = 0; i < futures.size(); ++i) batch.requests[i].result->announce(futures[i]);
}

BatcherStats Batcher::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  BatcherStats out = stats_;
  out.queued = static_cast<int64_t>(queue_.size());
  return out;
}

void Batcher::fork_prepare() { mutex_.lock(); }

void Batcher::fork_parent() { mutex_.unlock(); }

void Batcher::fork_child() {
  new (&mutex_) std::mutex();  // made afresh: the parent's thread took it
  new (&cv_) std::condition_variable();
  forked_.store(true, std::memory_order_relaxed);
}

}  // namespace torch_ext::plan
