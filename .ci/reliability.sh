#!/usr/bin/env bash
# The reliability checks of `.ci/run` (sourced by it; issue 16), built with clang into their own
# folders (build-fuzz/, build-asan/, build-tsan/), never into build/:
#   run_fuzz             the libFuzzer targets of tests/fuzz, TORCH_EXT_FUZZ_SECONDS (60) each,
#                        under ASan+UBSan: fails on a crash, a sanitizer report, a leak or an input
#                        that runs over 10 s. JUnit report: $results/fuzz.xml.
#   run_sanitize         the GoogleTest suite under ASan+UBSan (stress tests 30 s each), the fuzz
#                        targets over their seed corpus, and the concurrency tests (fork, stress,
#                        concurrent acquires, bounded waits) under TSan. Reports: $results/*.xml.
# Both need clang 14 and its runtime libraries (clang-14, libclang-rt-14-dev).

cmake_clang() {  # cmake_clang BUILD_DIR [cmake options...]
  local dir="$1"; shift
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE="$(command -v "$python")" -DTORCH_EXT_BUILD_PYTHON=OFF -DTORCH_EXT_BUILD_EXAMPLES=OFF "$@" >/dev/null
}

run_fuzz() {
  echo "== fuzzing: each target for ${TORCH_EXT_FUZZ_SECONDS:-60} s under ASan+UBSan (clang)"
  cmake_clang build-fuzz -DTORCH_EXT_BUILD_TESTS=OFF -DTORCH_EXT_BUILD_FUZZERS=ON \
    -DTORCH_EXT_FUZZ_SECONDS="${TORCH_EXT_FUZZ_SECONDS:-60}"
  cmake --build build-fuzz --parallel "$MAX_JOBS" --target fuzz_json_header fuzz_safetensors_source
  rm -rf build-fuzz/fuzz/*/* build-fuzz/fuzz/failure-*
  # The targets fuzz at once, one per core (each is one process for its whole time).
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-fuzz --parallel "$MAX_JOBS" --output-on-failure -R '^fuzz\.[a-z_]+$' \
      --output-junit "$PWD/$results/fuzz.xml"
}

run_sanitize() {
  local stress="${TORCH_EXT_STRESS_SECONDS:-30}" status=0
  local concurrency='*Fork*:*Stress*:*Concurrent*:PagingWaits.*:PagingBudget.Released*'
  echo "== ASan+UBSan: the GoogleTest suite (stress tests ${stress} s each) and the fuzz targets' seeds"
  cmake_clang build-asan -DTORCH_EXT_SANITIZE=address,undefined -DTORCH_EXT_BUILD_TESTS=ON -DTORCH_EXT_BUILD_FUZZERS=ON
  cmake --build build-asan --parallel "$MAX_JOBS" --target torch_ext_tests fuzz_json_header fuzz_safetensors_source
  TORCH_EXT_STRESS_SECONDS="$stress" ASAN_OPTIONS=detect_leaks=1 \
    LSAN_OPTIONS=suppressions="$PWD/.ci/lsan.supp" UBSAN_OPTIONS=print_stacktrace=1 \
    build-asan/torch_ext_tests --gtest_output="xml:$PWD/$results/asan.xml" || status=1
  ctest --test-dir build-asan --output-on-failure -R '\.seeds$' --output-junit "$PWD/$results/asan-seeds.xml" || status=1
  echo "== TSan: the concurrency tests (stress tests ${stress} s each)"
  cmake_clang build-tsan -DTORCH_EXT_SANITIZE=thread -DTORCH_EXT_BUILD_TESTS=ON
  cmake --build build-tsan --parallel "$MAX_JOBS" --target torch_ext_tests
  # die_after_fork=0: a forked child restarts the pager's prefetch thread, which TSan refuses by
  # default after a multi-threaded fork (the fork tests check exactly that path).
  TORCH_EXT_STRESS_SECONDS="$stress" \
    TSAN_OPTIONS="die_after_fork=0:halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/.ci/tsan.supp" \
    build-tsan/torch_ext_tests --gtest_filter="$concurrency" --gtest_output="xml:$PWD/$results/tsan.xml" || status=1
  return $status
}
