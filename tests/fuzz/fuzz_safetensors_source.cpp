// libFuzzer target: SafetensorsSource opened on arbitrary bytes (a memfd named by its
// /proc/self/fd path), then every tensor loaded, read, viewed, populated and released. Any input
// must open or raise c10::Error; a crash, a sanitizer report, a leak or a hang is a bug.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "torch_ext/paging/source.h"

namespace {

int memory_file() {
  static const int fd = ::memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memory_file();
  if (fd < 0 || ::ftruncate(fd, 0) != 0) return 0;
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::pwrite(fd, data + written, size - written, static_cast<off_t>(written));
    if (n <= 0) return 0;
    written += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const auto source = c10::make_intrusive<torch_ext::paging::SafetensorsSource>(path);
    for (const auto& name : source->names()) {
      const auto& info = source->info(name);
      at::Tensor loaded = source->load(name);
      at::Tensor view = source->view(name);
      source->populate(name);
      std::vector<char> buffer(static_cast<size_t>(info.nbytes));
      source->read_into(name, buffer.data());
      if (info.nbytes > 0 && (loaded.nbytes() != static_cast<size_t>(info.nbytes) ||
                              std::memcmp(loaded.data_ptr(), buffer.data(), buffer.size()) != 0 ||
                              std::memcmp(view.data_ptr(), buffer.data(), buffer.size()) != 0)) {
        __builtin_trap();  // the three read paths must agree
      }
      source->release_pages(name);
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
