"""The benchmark harness every bench_<capability>.py uses: timing (warm-up, repeats, median
and spread), memory through torch_ext.memory, the machine's description, and reports written
as a markdown table and as JSON under benchmarks/results/."""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import sys

import torch

# Measure the checkout this file is in, not whichever torch_ext the environment has installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch_ext  # noqa: E402
from torch_ext import memory  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_ext": torch_ext.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


@dataclass
class Timing:
    """Seconds per call over `repeat` calls after `warmup` calls."""

    median_seconds: float
    min_seconds: float
    max_seconds: float
    p10_seconds: float
    p90_seconds: float
    repeat: int
    samples: list = field(default_factory=list)  # in the order they were taken (rounds, when interleaved)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative spread of the repeats."""
        return (self.p90_seconds - self.p10_seconds) / self.median_seconds if self.median_seconds else 0.0


def timing_of(samples: Sequence[float]) -> Timing:
    if not samples:
        raise ValueError("timing_of: no samples")
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return Timing(statistics.median(ordered), ordered[0], ordered[-1], quantile(0.1), quantile(0.9), len(ordered),
                  list(samples))


def paired_difference(first: Timing, second: Timing, coverage: float = 0.95) -> tuple[float, float, float, int]:
    """(median, low, high, first_faster) of the per-round differences first - second of two
    interleaved timings: [low, high] holds the true median difference with at least `coverage`
    (the sign test's order statistics, no assumption about the noise's distribution; below 6
    rounds, 95% needs more rounds than there are and the interval is the whole range);
    first_faster counts the rounds where first took less time."""
    differences = [f - s for f, s in zip(first.samples, second.samples)]
    return (*_median_interval(differences, coverage), sum(d < 0 for d in differences))


def paired_ratio(first: Timing, second: Timing, coverage: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high) of the per-round ratios first / second of two interleaved timings, with
    paired_difference's interval."""
    return _median_interval([f / s for f, s in zip(first.samples, second.samples)], coverage)


def _median_interval(values: list[float], coverage: float) -> tuple[float, float, float]:
    values = sorted(values)
    n = len(values)
    if n == 0:
        raise ValueError("paired rounds: none were timed")
    # The k-th smallest and k-th largest value bound the median with probability
    # 1 - 2 P(Binomial(n, 1/2) <= k - 1): take the largest k that keeps that at least `coverage`.
    def coverage_of(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k < (n + 1) // 2 and coverage_of(k + 1) >= coverage:
        k += 1
    return statistics.median(values), values[k - 1], values[n - k]


def peak_and_time_check(label: str, pair: dict, peaks: dict, ours: str, reference: str,
                        short: tuple[str, str]) -> tuple[str, bool]:
    """(text, met) of the check that variant `ours` holds at most `reference`'s step peak (2% slack)
    with a step no slower in the paired rounds of `pair` (the 95% interval of the per-round
    difference reaches 0 or below); short: the two variants' names in the text."""
    a, b = short
    rounds = len(pair[ours].samples)
    paired, low, high, faster = paired_difference(pair[ours], pair[reference])
    verdict = "faster" if high < 0 else ("slower" if low > 0 else "a tie within this run's noise")
    text = (f"{label}: {a} at {b}'s step peak memory ({format_bytes(peaks[ours])} vs {format_bytes(peaks[reference])}) "
            f"and no slower: in {rounds} paired rounds {format_seconds(pair[ours].median_seconds)} vs "
            f"{format_seconds(pair[reference].median_seconds)}, per round {a} - {b} median {paired * 1e3:+.1f} ms, 95% "
            f"interval [{low * 1e3:+.1f}, {high * 1e3:+.1f}] ms (sign test), {a} faster in {faster} of {rounds}: "
            f"{verdict}")
    return text, peaks[ours] <= peaks[reference] * 1.02 and low <= 0


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 10) -> Timing:
    """Time fn: `warmup` untimed calls, then `repeat` timed ones (CUDA work is synchronised)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        samples.append(time.perf_counter() - start)
    return timing_of(samples)


def measure_interleaved(variants: dict[str, Callable[[], Any]], *, warmup: int = 2, repeat: int = 10,
                        before_each: dict[str, Callable[[], Any]] | None = None,
                        clock: Callable[[], float] = time.perf_counter, alternate: bool = False) -> dict[str, Timing]:
    """Time several variants in rounds (A B C, A B C, ...), so drift on a shared machine hits
    each alike; before_each[name] runs untimed before each of that variant's calls.
    clock=time.thread_time measures single-threaded work without the time spent waiting for a
    core on a busy machine. alternate=True reverses every other round (A B, B A, ...), so that
    what a variant leaves behind (memory, caches) does not always fall on the same one."""
    before_each = before_each or {}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(warmup + repeat):
        order = list(variants.items())
        if alternate and round_index % 2:
            order.reverse()
        for name, fn in order:
            if name in before_each:
                before_each[name]()
            _synchronize()
            start = clock()
            fn()
            _synchronize()
            if round_index >= warmup:
                samples[name].append(clock() - start)
    return {name: timing_of(values) for name, values in samples.items()}


def run_threads(target: Callable[[int], Any], count: int) -> float:
    """target(k) for k in range(count), each on its own thread, all at once; the wall seconds from
    the moment every thread is ready (a barrier: a server's handler threads exist before its
    requests come, and starting 8 threads takes about 0.75 ms here, 4% of a batcher round) to the
    last target's return. Raises the first error a target raised."""
    import threading

    start, ends, errors = [], [0.0] * count, []
    ready = threading.Barrier(count, action=lambda: start.append(time.perf_counter()))

    def body(k: int) -> None:
        ready.wait()
        try:
            target(k)
        except BaseException as error:  # re-raised below: a failed client must not be timed as done
            errors.append(error)
        ends[k] = time.perf_counter()

    threads = [threading.Thread(target=body, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(ends) - start[0]


class Child:
    """A variant in a process of its own, driven a line at a time: `command` starts it (it says
    "ready" once set up, alone), ask(line) returns its one-line answer, finish() asks it to write
    its results to `out` and exit, and returns them."""

    def __init__(self, name: str, command: list[str], env: dict, out: Path) -> None:
        self.name, self.out = name, Path(out)
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read("ready")

    def _read(self, expected: str | None = None) -> str:
        reply = self.process.stdout.readline().strip()
        if not reply or (expected is not None and reply != expected):
            raise RuntimeError(f"variant {self.name!r} said {reply!r} (exit code {self.process.poll()})")
        return reply

    def ask(self, line: str) -> str:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self._read()

    def finish(self) -> dict:
        self.process.stdin.write("finish\n")
        self.process.stdin.flush()
        if self.process.wait(timeout=600) != 0:
            raise RuntimeError(f"variant {self.name!r} failed")
        return json.loads(self.out.read_text())


def run_children(make: Sequence[Callable[[], Child]], rounds: Sequence[str]) -> list[tuple[dict, list[str]]]:
    """Each child made in turn (its set-up alone), then every line of `rounds` asked of all of them,
    in order, every other round in reverse, so drift on a shared machine hits every variant alike;
    then each child's results (finish()) with its answers, in round order. A child left running by
    an error is killed."""
    children: list[Child] = []
    try:
        for new in make:
            children.append(new())
        answers: dict[int, list[str]] = {id(c): [] for c in children}
        for index, line in enumerate(rounds):
            for c in children if index % 2 == 0 else children[::-1]:
                answers[id(c)].append(c.ask(line))
        return [(c.finish(), answers[id(c)]) for c in children]
    finally:
        for c in children:
            if c.process.poll() is None:
                c.process.kill()


def peak_memory(fn: Callable[[], Any], device=None) -> int:
    """Peak bytes of live tensor memory above the start while fn runs (torch_ext.memory; no
    saved-tensor hooks, which would change what torch.compile traces). Unreachable cycles are
    collected first: one collected while fn runs (an earlier variant's graph) would free memory
    counted in the start, and lower the peak by it (a Llama row once read 10.0 MiB for 50.8)."""
    gc.collect()
    memory.reset_peak(device)
    start = memory.stats(device).current_bytes
    fn()
    return memory.stats(device).peak_bytes - start


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} µs"


def progress(label: str) -> Callable[[str], None]:
    """A printer for long runs: progress(label)(what) writes "label: what (N s)" to stderr, N the
    seconds since progress(label) was called."""
    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"{label}: {what} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    return say


class Report:
    """Rows of one benchmark, printed as a markdown table and saved as results/<name>.{md,json}."""

    def __init__(self, name: str, title: str, columns: Sequence[str], command: str) -> None:
        self.name, self.title, self.columns, self.command = name, title, list(columns), command
        self.rows: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {}
        self.notes: list[str] = []

    def add_row(self, cells: dict[str, Any], **raw: Any) -> None:
        """cells: the table's formatted cells by column; raw: the unformatted numbers for the JSON."""
        unknown = set(cells) - set(self.columns)
        if unknown:
            raise KeyError(f"Report {self.name}: unknown columns {sorted(unknown)}")
        self.rows.append({"cells": cells, "raw": raw})

    def add_checks(self, checks: Sequence[tuple[str, bool]]) -> None:
        """Targets and whether this run met them: a list in the notes and data["checks"]."""
        self.notes.append("")
        self.notes.extend(f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in checks)
        self.data["checks"] = [{"target": text, "met": ok} for text, ok in checks]

    def markdown(self) -> str:
        lines = [f"| {' | '.join(self.columns)} |", f"|{'|'.join('---' for _ in self.columns)}|"]
        for row in self.rows:
            lines.append(f"| {' | '.join(str(row['cells'].get(c, '')) for c in self.columns)} |")
        m = machine()
        lines.append("")
        lines.append(f"Measured with `{self.command}` on {m['cpu']}, {m['cores']} cores, "
                     f"torch {m['torch']}{', ' + m['gpu'] if 'gpu' in m else ''}.")
        lines.extend(self.notes)
        return "\n".join(lines)

    def write(self) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        text = f"### {self.title}\n\n{self.markdown()}\n"
        print(text)
        (RESULTS / f"{self.name}.md").write_text(text)
        payload = {"title": self.title, "command": self.command, "machine": machine(),
                   "rows": [{**row["cells"], **{f"raw_{k}": v for k, v in row["raw"].items()}} for row in self.rows],
                   "data": self.data, "notes": self.notes}
        path = RESULTS / f"{self.name}.json"
        path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
        return path
