#!/usr/bin/env bash
# torch_ext on a machine with an NVIDIA GPU and a CUDA build of torch (nvcc on PATH). Steps, in the
# order given (default: all of them):
#   build       build against the installed torch with the C++ tests (TORCH_EXT_BUILD_TESTS=0: without
#               them), into the source tree (no pip: GPU machines may have no package index to reach)
#   test        the whole GoogleTest suite where it was built (its CUDA tests run here) and every
#               CUDA test in pytest
#   plan checkpoint paging
#               bench_<name>.py --device cuda (results: benchmarks/results/<name>_cuda*.{md,json})
#   selective   bench_checkpoint.py --part selective --device cuda --eager-only (96 s on an H200;
#               the compiled rows, 20 Inductor compiles, are left out)
#
#   bash benchmarks/run_gpu.sh                 # build, test, plan, checkpoint (every part), paging
#   QUICK=1 bash benchmarks/run_gpu.sh test plan
# GoogleTest must be findable by CMake (CMAKE_PREFIX_PATH=<prefix> where it is not installed), and
# so must xxhash.h (CMAKE_INCLUDE_PATH=<folder holding it>: the lent H200s have none; carry
# Debian's /usr/include/xxhash.h, header-only). Those machines' transformers (5.17) is older than
# the tests' pin: carry the pinned wheel. There (16 cores) the build without C++ tests took 89 s,
# the CUDA tests in pytest 35 s.
# Each step's output also goes to $LOGS/<step>.log (default build/gpu-logs). Exits non-zero if
# any step failed, after running the others.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
logs=${LOGS:-build/gpu-logs}
mkdir -p "$logs"
quick=${QUICK:+--quick}
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build test plan checkpoint paging)
failed=()

run() {  # run NAME COMMAND...: the command's output on stdout and in $logs/NAME.log
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$logs/$name.log"
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status after $((SECONDS - start)) s"
  [ "$status" = 0 ] || failed+=("$name")
}

"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("torch", torch.__version__, torch.cuda.get_device_name())' \
  || exit 1
export PYTHONUNBUFFERED=1
for step in "${steps[@]}"; do
  case "$step" in
    build)
      # A compiler without a shared libstdc++ links a private copy of it into libtorch_ext.so,
      # which exports it: number formatting then crashes in every binary that loads the library
      # (seen with /opt/gcc on the lent GPU machines). Use the system compiler there.
      compiler=${CXX:-$(command -v c++)}
      if [ "$("$compiler" -print-file-name=libstdc++.so)" = libstdc++.so ] && [ -x /usr/bin/g++ ]; then
        echo "== build: $compiler has no shared libstdc++; building with /usr/bin/g++"
        export CXX=/usr/bin/g++
        rm -rf build
      fi
      export TORCH_EXT_BUILD_TESTS="${TORCH_EXT_BUILD_TESTS:-1}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
      run build "$python" setup.py -q build_ext --inplace
      ;;
    test)
      # The GoogleTest binary itself: CTest's discovery can choke on what a CUDA torch prints.
      if [ -x build/torch_ext_tests ]; then
        run gtest build/torch_ext_tests --gtest_brief=1 "--gtest_filter=${GTEST_FILTER:-*}"
      else
        echo "== gtest: not built (TORCH_EXT_BUILD_TESTS=0)"
      fi
      run pytest "$python" -m pytest -c tests/pytest.ini --rootdir tests tests/python -k cuda -p no:cacheprovider
      ;;
    selective)
      run bench_selective "$python" benchmarks/bench_checkpoint.py --part selective --device cuda --eager-only
      ;;
    plan | checkpoint | paging)
      # shellcheck disable=SC2086  # $quick is empty or one flag
      run "bench_$step" "$python" "benchmarks/bench_$step.py" --device cuda $quick
      ;;
    *)
      echo "unknown step '$step'; expected build, test, plan, checkpoint, paging or selective" >&2
      exit 2
      ;;
  esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
echo "all steps passed: ${steps[*]}"
