"""Cost of torch_ext's counting CPU allocator: an allocation-heavy loop with and without it.

    python benchmarks/bench_memory.py [--quick]

Both variants run in one process, in interleaved rounds (with, without, with, ...), on the
same loop; the counting wrapper is uninstalled and reinstalled between them. The loop runs on
one thread and is timed in that thread's CPU time.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from harness import Report, format_bytes, format_seconds, measure_interleaved
import torch_ext  # noqa: E402  (after harness, which puts this checkout first on sys.path)

SMALL_SIZES = [16, 64, 256, 1024, 4096]          # floats: 64 B to 16 KiB
LARGE_SIZES = [1 << 18, 1 << 20, 1 << 22]        # floats: 1 MiB to 16 MiB


def allocation_loop(small_count: int, large_count: int) -> None:
    """Many small and some large CPU tensors, created and freed: allocation-bound work."""
    for i in range(small_count):
        x = torch.empty(SMALL_SIZES[i % len(SMALL_SIZES)])
        y = x.fill_(1.0) + 1.0
        del x, y
    for i in range(large_count):
        x = torch.empty(LARGE_SIZES[i % len(LARGE_SIZES)])
        x.fill_(1.0)
        del x


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args(argv)
    small_count, large_count = 20_000, 60
    rounds = 7 if args.quick else 25
    torch.set_num_threads(1)  # the loop is allocation-bound; one thread keeps the rounds comparable

    def loop() -> None:
        allocation_loop(small_count, large_count)

    memory_ops = torch.ops.torch_ext
    timings = measure_interleaved(
        {"counting allocator": loop, "c10 default allocator": loop},
        before_each={"counting allocator": memory_ops.install_counting_allocator,
                     "c10 default allocator": memory_ops.uninstall_counting_allocator},
        warmup=2, repeat=rounds, clock=time.thread_time)
    memory_ops.install_counting_allocator()

    before = torch_ext.memory.stats()
    torch_ext.memory.reset_peak()
    loop()
    after = torch_ext.memory.stats()
    allocations = after.allocations - before.allocations

    base = timings["c10 default allocator"].median_seconds
    report = Report("memory" + ("_quick" if args.quick else ""), "CPU counting allocator overhead",
                    ["allocator", "loop time (median)", "p10-p90", "per allocation", "vs default"],
                    command="python benchmarks/bench_memory.py")
    for name, timing in timings.items():
        report.add_row({
            "allocator": name,
            "loop time (median)": format_seconds(timing.median_seconds),
            "p10-p90": f"{format_seconds(timing.p10_seconds)} - {format_seconds(timing.p90_seconds)}",
            "per allocation": format_seconds(timing.median_seconds / allocations),
            "vs default": f"{timing.median_seconds / base:.3f}x",
        }, timing=timing)
    overhead = timings["counting allocator"].median_seconds / base - 1
    report.data.update(overhead=overhead, allocations_per_loop=allocations, rounds=rounds,
                       loop_peak_bytes=after.peak_bytes - before.current_bytes)
    report.notes.append(
        f"\nOne loop: {small_count} small tensors (64 B-16 KiB, each filled and added to: "
        f"{allocations} allocations in all) and {large_count} large ones (1-16 MiB, filled); "
        f"peak {format_bytes(after.peak_bytes - before.current_bytes)} as counted. "
        f"{rounds} interleaved rounds after 2 warm-up rounds, one torch thread, timed in thread CPU "
        f"time (time.thread_time) so other processes on the machine do not count. "
        f"Overhead of counting: {overhead * 100:+.1f}% (target: at most +2%).")
    report.write()


if __name__ == "__main__":
    sys.exit(main())
