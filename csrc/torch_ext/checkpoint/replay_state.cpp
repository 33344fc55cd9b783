#include "torch_ext/checkpoint/replay_state.h"

#include <algorithm>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>

namespace torch_ext::checkpoint {
CpuRng CpuRng::now() {
  auto generator = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto* cpu = generator.get<at::CPUGeneratorImpl>();
  return {cpu->engine(), cpu->next_float_normal_sample(), cpu->next_double_normal_sample()};
}

void CpuRng::apply() const {
  auto generator = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(generator.mutex());
  auto* cpu = generator.get<at::CPUGeneratorImpl>();
  cpu->set_engine(engine);
  cpu->set_next_float_normal_sample(next_float_normal);
  cpu->set_next_double_normal_sample(next_double_normal);
}

bool CpuRng::operator==(const CpuRng& other) const {
  const auto x = engine.data();
  const auto y = other.engine.data();
  return x.seed_ == y.seed_ && x.left_ == y.left_ && x.seeded_ == y.seeded_ && x.next_ == y.next_ &&
         x.state_ == y.state_ && next_float_normal == other.next_float_normal &&
         next_double_normal == other.next_double_normal;
}

ReplayState ReplayState::capture(const std::vector<c10::Device>& devices, bool with_rng) {
  ReplayState s;
  s.devices_ = devices;
  std::vector<c10::Device> all{c10::Device(c10::kCPU)};
  std::vector<c10::DeviceType> types{c10::kCPU};
  for (const auto& d : devices) {
    if (std::find(all.begin(), all.end(), d) == all.end()) all.push_back(d);
    if (std::find(types.begin(), types.end(), d.type()) == types.end()) types.push_back(d.type());
  }
  if (with_rng) {
    for (const auto& device : all) {
      DeviceRng rng;
      rng.device = device;
      if (device.is_cpu()) {
        rng.cpu = CpuRng::now();
      } else {
        auto generator = at::globalContext().defaultGenerator(device);
        std::lock_guard<std::mutex> lock(generator.mutex());
        rng.state = generator.get_state();
      }
      s.rng_.push_back(std::move(rng));
    }
  }
  for (auto type : types) {
    if (at::autocast::is_autocast_available(type)) {
      s.autocast_.push_back({type, at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)});
    }
  }
  s.autocast_cache_ = at::autocast::is_autocast_cache_enabled();
  return s;
}

void ReplayState::forget_rng_if_untouched() {
  for (const auto& s : rng_) {
    if (!s.cpu) return;  // another device: its generator cannot be compared cheaply
    if (CpuRng::now() != *s.cpu) return;
  }
  rng_.clear();
}

void ReplayState::apply() const {
  for (const auto& s : rng_) {
    if (s.cpu) {
      s.cpu->apply();
    } else {
      auto generator = at::globalContext().defaultGenerator(s.device);
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(s.state);
    }
  }
  for (const auto& s : autocast_) {
    at::autocast::set_autocast_enabled(s.device_type, s.enabled);
    at::autocast::set_autocast_dtype(s.device_type, s.dtype);
  }
  at::autocast::set_autocast_cache_enabled(autocast_cache_);
}

ReplayState::Guard::Guard(const ReplayState& state) : previous_(capture(state.devices_, !state.rng_.empty())) {
  state.apply();
}

ReplayState::Guard::~Guard() { previous_.apply(); }

}  // namespace torch_ext::checkpoint
