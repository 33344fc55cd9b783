"""PlanCache's reliability (issue 16): a saved folder is checked before it is trusted, a forked
child never hangs on the parent's threads, and every wait is bounded."""
import gc
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.export import Dim

import torch_ext
from torch_ext import PlanCache


class RowWise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.scale + 0.5) * 2.0


def x(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


@pytest.fixture
def rowwise():
    torch.manual_seed(0)
    return torch.jit.script(RowWise().eval())


@pytest.fixture
def saved(rowwise, tmp_path):
    cache = PlanCache(rowwise, warmup_calls=1)
    cache.preload([2, 6], example_inputs=(x(1),), progress=False)
    cache.save(tmp_path / "plans")
    return tmp_path / "plans"


def edit_manifest(folder, old: str, new: str) -> None:
    path = folder / "manifest.txt"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize("line, error", [
    ("plan 0 lower 0 static", "sizes must satisfy 1 <= lower <= upper"),
    ("plan 4000000000 lower 4000000000 static", "batch 4000000000 is above 65536, the most a cache without a limit"),
    ("plan 6 lower 6 static junk", "needs its SHA-256"),
    ("plan 6x lower 6 static", "'6x' is not an integer"),
    ("plan 6 lower 6", "expected 'static', 'dynamic' or 'script' after the lower sizes"),
    ("plan 6 lower 6 script", "a TorchScript module's cache holds static plans only; this line has a script one"),
    ("plan 6 lower 6 static\nsizes 2 6", "unknown line"),
    ("plan 6 lower 6 static\nplan 6 lower 6 static", "bucket 6 is listed twice"),
    ("plan 6 lower 6 static\ntraffic 6 0", r"line \d+: the count of 6 must be > 0, got 0"),
    ("plan 6 lower 6 static\ntraffic 6 8 1", r"line \d+: each row is a size per dynamic dimension \(batch\) then a count"),
    ("plan 6 lower 6 static\ntraffic 6 x", "'x' is not an integer"),
])
def test_a_manifest_is_parsed_strictly_and_its_sizes_checked_before_anything_is_built(rowwise, saved, line, error):
    edit_manifest(saved, "plan 6 lower 6 static", line)
    cache = PlanCache(rowwise, warmup_calls=1)
    with pytest.raises((RuntimeError, ValueError), match=error):
        cache.load(saved)
    assert cache.stats().builds == 0 and cache.cached_sizes() == [] and cache.traffic() == {}


def sha256_of(path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_pinned_manifest_digest_loads_that_folder_and_refuses_any_other_before_opening_its_files(rowwise, saved,
                                                                                                 tmp_path):
    trusted = sha256_of(saved / "manifest.txt")
    pinned = PlanCache(rowwise, warmup_calls=1, manifest_sha256=trusted)
    assert pinned.manifest_sha256 == trusted
    assert pinned.load(saved) == 2 and pinned.cached_sizes() == [2, 6]
    # An attacker rewrites a file and the manifest with it: the SHA-256 lines agree, the digest does not.
    edit_manifest(saved, "value method forward", "value method forward ")
    with pytest.raises(RuntimeError, match=f"refusing {saved}: the SHA-256 of its manifest .* is "
                       f"{sha256_of(saved / 'manifest.txt')}, not the manifest_sha256 this cache trusts "
                       f"\\({trusted}\\); nothing in the folder was loaded"):
        PlanCache(rowwise, warmup_calls=1, manifest_sha256=trusted).load(saved)
    # Refused before any file it lists is opened: with them gone the error is still the pin's.
    for path in saved.iterdir():
        if path.name != "manifest.txt":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    cache = PlanCache(rowwise, warmup_calls=1, manifest_sha256=trusted)
    with pytest.raises(RuntimeError, match="nothing in the folder was loaded"):
        cache.load(saved)
    assert cache.stats().builds == 0 and cache.cached_sizes() == []


@pytest.mark.parametrize("bad", ["abc", "0" * 63, "G" * 64, "A" * 64])
def test_manifest_sha256_must_be_a_lowercase_sha256(rowwise, bad):
    with pytest.raises(ValueError, match="manifest_sha256 must be 64 lowercase hex digits"):
        PlanCache(rowwise, manifest_sha256=bad)


def test_manifest_sizes_above_max_batch_size_are_refused(rowwise, saved):
    edit_manifest(saved, "plan 6 lower 6 static", "plan 9 lower 9 static")
    with pytest.raises(RuntimeError, match="line .*: batch 9 is outside 1..8"):
        PlanCache(rowwise, max_batch_size=8, warmup_calls=1).load(saved)


def test_a_swapped_module_file_is_refused_naming_it(rowwise, saved, tmp_path):
    torch.manual_seed(1)
    other = PlanCache(torch.jit.script(RowWise().eval()), warmup_calls=1)
    other.preload([2], example_inputs=(x(1),), progress=False)
    other.save(tmp_path / "other")
    (saved / "module.pt").write_bytes((tmp_path / "other" / "module.pt").read_bytes())
    with pytest.raises(RuntimeError, match=f"{saved / 'module.pt'} is not the file that was saved"):
        PlanCache(rowwise, warmup_calls=1).load(saved)


def test_a_changed_forward_with_the_same_class_and_weights_is_refused(rowwise, saved):
    class RowWise(torch.nn.Module):  # same name, same parameters, another forward
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x * self.scale + 0.25) * 2.0

    changed = RowWise().eval()
    changed.load_state_dict(dict(rowwise.named_parameters()))
    changed = torch.jit.script(changed)
    cache = PlanCache(changed, warmup_calls=1)
    with pytest.raises(RuntimeError, match="the code of this cache's module .* differs"):
        cache.load(saved)
    assert cache.cached_sizes() == []
    # Without the check the old frozen module would have served: a silently wrong result.
    ones = torch.ones(2, 8)
    assert not torch.equal(changed(ones), rowwise(ones))


def test_changed_weights_are_refused(rowwise, saved):
    with torch.no_grad():
        rowwise.scale.add_(1.0)
    with pytest.raises(RuntimeError, match="weights .* differ"):
        PlanCache(rowwise, warmup_calls=1).load(saved)


def test_the_hashes_are_stable_across_processes(rowwise, tmp_path):
    """A folder saved by another process loads here: SHA-256s, not a per-run std::hash."""
    rowwise.save(str(tmp_path / "module.pt"))
    code = f"""
import torch, torch_ext
module = torch.jit.load({str(tmp_path / 'module.pt')!r})
cache = torch_ext.PlanCache(module, warmup_calls=1)
cache.preload([3], example_inputs=(torch.randn(1, 8),), progress=False)
cache.save({str(tmp_path / 'plans')!r})
"""
    root = os.path.dirname(os.path.dirname(torch_ext.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    cache = PlanCache(torch.jit.load(str(tmp_path / "module.pt")), warmup_calls=1)
    assert cache.load(tmp_path / "plans") == 1
    inputs = x(3)
    assert torch.equal(cache(inputs), rowwise(inputs)) and cache.stats().misses == 0


def run_child(body, timeout: float = 120.0) -> int:
    """Forks; the child runs body() and exits 0 when it returns True. Returns the child's exit
    status; a child still running after `timeout` (a hang) is killed and reported as -1."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            status = 0 if body() else 1
        except BaseException:  # noqa: BLE001 - reported by the exit status
            import traceback
            traceback.print_exc()
        os._exit(status)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -1


class BlockingCompiler:
    """A compiler that blocks until released, then fails: a build in progress as long as a test
    needs one (through torch_ext._C.plan, the hook the Python face installs its compiler with)."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, upper, lower, dynamic, example, package_path, background, cancelled) -> None:
        self.started.set()
        while not self.release.wait(0.05):
            if cancelled():
                break
        raise RuntimeError("released without a package")


@pytest.fixture
def program():
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4).eval()
    return torch.export.export(module, (x(2),), dynamic_shapes=({0: Dim("batch", max=16)},))


def blocked_cache(program, **options):
    cache = PlanCache(program, warmup_calls=1, **options)
    compiler = BlockingCompiler()
    torch_ext._C.plan.set_compiler(cache.script_object, compiler)
    return cache, compiler


def test_a_forked_child_gets_an_error_not_a_hang_and_can_destroy_the_cache(program):
    cache, compiler = blocked_cache(program, miss_mode="pad", background_builds=True)
    holder = [cache]  # the child drops the last reference: the frame's own goes first
    del cache
    holder[0](x(3))  # served by the source; the build of bucket 3 blocks in the worker
    assert compiler.started.wait(60)

    def child():
        with pytest.raises(RuntimeError, match="forked .* worker thread"):
            holder[0].wait_for_builds()  # used to wait for the parent's thread forever
        with pytest.raises(RuntimeError, match="forked"):
            holder[0](x(5))  # a miss would queue a background build, which has no thread here
        holder.clear()
        gc.collect()  # the destructor must not join the parent's thread
        return True

    try:
        assert run_child(child) == 0
    finally:
        compiler.release.set()
    holder[0].wait_for_builds()
    assert holder[0].stats().build_failures == 1


def test_a_forked_child_serves_cached_plans_and_destroys_the_cache_without_joining(rowwise):
    holder = [PlanCache(rowwise, miss_mode="pad", background_builds=True, warmup_calls=1)]
    holder[0].preload([4], example_inputs=(x(1),), progress=False)

    def child():
        inputs = x(4)
        ok = torch.equal(holder[0](inputs), rowwise(inputs))
        holder.clear()
        gc.collect()
        return ok

    assert run_child(child) == 0
    inputs = x(4)
    assert torch.equal(holder[0](inputs), rowwise(inputs))


def test_a_forked_child_that_drops_the_cache_leaves_the_parents_program_file(program):
    holder = [PlanCache(program, warmup_calls=1)]
    path = holder[0]._program.path  # what background builds compile from and save() copies
    assert os.path.isfile(path)

    def child():
        holder.clear()
        gc.collect()  # the child's copy of the folder's owner goes, as at a worker's normal exit
        return True

    assert run_child(child) == 0
    assert os.path.isfile(path)


def test_wait_for_builds_is_bounded(program):
    cache, compiler = blocked_cache(program, miss_mode="pad", background_builds=True)
    cache(x(3))
    assert compiler.started.wait(60)
    with pytest.raises(RuntimeError, match="builds still running after 0.3 s"):
        cache.wait_for_builds(0.3)
    compiler.release.set()
    cache.wait_for_builds()
    assert cache.stats().build_failures == 1


def test_a_request_waiting_for_another_threads_build_is_bounded_by_timeout_seconds(program):
    cache, compiler = blocked_cache(program, timeout_seconds=0.3)
    first = threading.Thread(target=lambda: pytest.raises(RuntimeError, cache, x(3)))
    first.start()
    assert compiler.started.wait(60)
    with pytest.raises(RuntimeError, match="waited timeout_seconds=0.3 s for another thread's build of the plan for "
                                           "batch size 3"):
        cache(x(3))
    compiler.release.set()
    first.join()
    assert cache.stats().build_failures == 1


@pytest.mark.stress
def test_stress_eight_threads_for_thirty_seconds_every_mode(rowwise):
    """Invariants under load: every output equals the module's, counts add up, bounds hold."""
    caches = {mode: PlanCache(rowwise, miss_mode=mode, background_builds=mode != "exact", max_plans=4,
                              warmup_calls=1) for mode in ("exact", "pad", "split", "auto")}
    for cache in caches.values():
        cache.preload([8], example_inputs=(x(8),), progress=False)
    errors, counts = [], {mode: 0 for mode in caches}
    lock = threading.Lock()
    stop = time.monotonic() + 30

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                mode = rng.choice(list(caches))
                inputs = x(rng.randint(1, 12))
                if not torch.equal(caches[mode](inputs), rowwise(inputs)):
                    errors.append(f"{mode}: wrong output at batch size {inputs.shape[0]}")
                with lock:
                    counts[mode] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    for mode, cache in caches.items():
        cache.wait_for_builds()
        s = cache.stats()
        assert s.calls == counts[mode] and s.hits + s.misses == s.calls, mode
        assert sum(z.calls for z in s.sizes) == s.calls and s.plans <= 4 and s.build_failures == 0, mode
        assert s.hits + s.padded_calls + s.split_calls + s.fallback_calls <= s.calls, mode


class FixedRows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(3, 2)  # 3 rows whatever the batch: not what output_batch_dims says


def test_a_plan_whose_output_lacks_the_request_s_rows_raises_instead_of_answering():
    cache = PlanCache(torch.jit.script(FixedRows().eval()))
    cache(x(3))  # the sizes agree
    with pytest.raises(RuntimeError, match=r"the plan for batch size 5 ran batch size 5 and its output 0 has shape "
                                           r"\[3, 2\]: its batch dimension 0 should have size 5"):
        cache(x(5))
