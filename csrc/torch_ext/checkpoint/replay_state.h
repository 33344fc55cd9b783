#pragma once
// The RNG and autocast state a checkpointed forward ran under, put back around its replay so that
// the replay draws the same random numbers (dropout masks) and casts the same way. The CPU
// generator is copied as its Mersenne Twister engine (no tensor to allocate and parse), other
// devices' generators through get_state / set_state. A snapshot is a value: capture it on the
// thread that runs the forward; a Guard may restore it on any thread (the generators' own mutexes
// are taken).
#include <optional>
#include <vector>

#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace torch_ext::checkpoint {

// The default CPU generator's state, copied as its Mersenne Twister engine and its cached normal
// samples (no tensor to allocate and parse). Takes the generator's mutex.
struct CpuRng {
  at::mt19937 engine;
  std::optional<float> next_float_normal;
  std::optional<double> next_double_normal;
  static CpuRng now();
  void apply() const;
  bool operator==(const CpuRng& other) const;
};

class ReplayState {
 public:
  ReplayState() = default;
  // The RNG state of the CPU and of `devices` (when with_rng) and the autocast state of the CPU
  // and of those devices' types.
  static ReplayState capture(const std::vector<c10::Device>& devices, bool with_rng);

  // After the forward: a forward that drew no random number (the CPU generator is where it was and
  // no other device was involved) replays without touching the RNG, which costs about as much as
  // a tiny segment's bookkeeping.
  void forget_rng_if_untouched();

  class Guard;

 private:
  struct DeviceRng {
    c10::Device device{c10::kCPU};
    at::Tensor state;          // devices other than the CPU
    std::optional<CpuRng> cpu;  // the CPU
  };
  struct Autocast {
    c10::DeviceType device_type;
    bool enabled;
    at::ScalarType dtype;
  };
  void apply() const;

  std::vector<c10::Device> devices_;  // what capture() was given
  std::vector<DeviceRng> rng_;
  std::vector<Autocast> autocast_;
  bool autocast_cache_ = true;
};

// Applies a snapshot for the lifetime of the guard and puts the state it found back after.
class ReplayState::Guard {
 public:
  explicit Guard(const ReplayState& state);
  ~Guard();
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

 private:
  ReplayState previous_;
};

}  // namespace torch_ext::checkpoint
