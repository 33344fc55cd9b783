"""Weight paging as a long-running server and a DataLoader use it (issue 16): budgets that hold,
byte budgets in the ecosystem's spelling, fork safety, and (marker `stress`) 8 threads for 30 s."""
import copy
import os
import signal
import threading
import time
import warnings

import pytest
import torch
from safetensors.torch import save_file

import torch_ext
from torch_ext.demos import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=128, block_size=16)


def layers(tmp_path, n=8, floats=256, name="layers.safetensors"):
    path = tmp_path / name
    save_file({f"t{i}": torch.full((floats,), float(i)) for i in range(n)}, path)
    return path


def in_child(fn, timeout=60):
    """Runs fn in a forked child; returns its exit code, or None if it hung (then it is killed)."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = fn()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


# ---------------------------------------------------------------- budgets


@pytest.mark.parametrize("budget, expected", [(4096, 4096), (4096.0, 4096), ("4KiB", 4096), ("4 kb", 4000),
                                              ("25%", 2048), ("1GB", 10**9)])
def test_budgets_in_the_ecosystems_spelling(tmp_path, budget, expected):
    pager = torch_ext.LayerPager(layers(tmp_path), budget_bytes=budget)  # 8 x 1 KiB
    assert pager.budget_bytes == expected


def test_a_budget_beyond_64_bits_is_a_value_error_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"budget_bytes=\"?9223372036854775808\"? is not a byte budget"):
        torch_ext.LayerPager(layers(tmp_path), budget_bytes=2**63)


def test_a_budget_below_the_largest_tensor_warns_once_and_says_so_in_stats(tmp_path):
    with pytest.warns(UserWarning, match=r"budget_bytes=512 is smaller than the largest tensor"):
        pager = torch_ext.LayerPager(layers(tmp_path), budget_bytes=512)
    assert pager.stats().budget_below_largest_tensor and pager.stats().largest_tensor_bytes == 1024
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(8):
            pager.acquire(f"t{i}")
        assert not torch_ext.LayerPager(layers(tmp_path), budget_bytes=1024).stats().budget_below_largest_tensor


def test_a_tensor_larger_than_the_budget_evicts_the_others_first_and_goes_on_release(tmp_path):
    # Keeping the others would put its bytes on top of the budget: resident stays within
    # max(budget, largest tensor), not budget + largest tensor.
    path = tmp_path / "big.safetensors"
    save_file({"a": torch.ones(256), "b": torch.ones(256), "big": torch.ones(2048)}, path)
    with pytest.warns(UserWarning, match="smaller than the largest tensor"):
        pager = torch_ext.LayerPager(path, budget_bytes=4096, prefetch=0)
    pager.acquire("a"), pager.acquire("b")
    big = pager.acquire("big")
    assert not pager.is_resident("a") and not pager.is_resident("b")
    assert pager.resident_bytes() == 8192 and pager.stats().over_budget_loads == 1
    del big
    assert pager.resident_bytes() == 0 and pager.stats().release_evictions == 1


def test_released_tensors_bring_the_pager_back_within_its_budget(tmp_path):
    # The case: 8 threads held tensors past a 512 KiB budget; the pager then stayed at
    # 8 MiB through 32,000 hits with no eviction, since it evicted only on a miss.
    path = layers(tmp_path, n=8, floats=256 << 10)
    with pytest.warns(UserWarning, match="smaller than the largest tensor"):
        pager = torch_ext.LayerPager(path, budget_bytes=512 << 10, prefetch=0)
    held = [None] * 8
    threads = [threading.Thread(target=lambda i=i: held.__setitem__(i, pager.acquire(f"t{i}"))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pager.resident_bytes() == 8 << 20
    del held, threads, t
    assert pager.resident_bytes() <= 512 << 10
    for _ in range(2000):
        pager.acquire("t0")
    assert pager.resident_bytes() <= 512 << 10 and pager.stats().release_evictions >= 7


def test_the_copy_path_gives_evicted_memory_back_to_the_system(tmp_path):
    # 24 tensors of 8 MiB through a 16 MiB budget: with c10's allocator glibc keeps the freed
    # blocks (they are under its dynamic mmap threshold); the pager's own pages go back at once.
    path = layers(tmp_path, n=24, floats=2 << 20)
    code = f"""
import resource, torch_ext
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
def peak_above(**options):
    pager = torch_ext.LayerPager({str(path)!r}, budget_bytes=16 << 20, prefetch=0, zero_copy=False, **options)
    start, peak = rss(), 0
    for _ in range(2):
        for i in range(24):
            pager.acquire(f"t{{i}}")
            peak = max(peak, rss() - start)
    del pager
    return peak
own = peak_above()
print("own buffers", own >> 20, "MiB; c10 allocator", peak_above(own_buffers=False) >> 20, "MiB")
assert own <= (16 << 20) + (8 << 20) + (4 << 20), own  # budget + largest tensor + 4 MiB
"""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- fork


def test_a_child_deletes_an_inherited_pager_without_hanging(tmp_path):
    pager = torch_ext.LayerPager(layers(tmp_path), budget_bytes=1 << 20, prefetch=2)
    pager.set_order([f"t{i}" for i in range(8)])
    pager.acquire("t0")

    def child():
        nonlocal pager
        ok = torch.equal(pager.acquire("t5"), torch.full((256,), 5.0))
        del pager
        return 0 if ok else 3

    assert in_child(child) == 0
    assert torch.equal(pager.acquire("t7"), torch.full((256,), 7.0))


def test_a_child_acquires_a_tensor_that_was_loading_at_fork(tmp_path):
    # A 256 MiB tensor takes long enough to load that the fork lands in the load (the C++ test
    # PagingFork.AChildReloadsATensorThatWasLoadingAtFork makes this deterministic).
    path = tmp_path / "big.safetensors"
    big = torch.arange(64 << 20, dtype=torch.float32)
    last = big[-1].item()
    save_file({"big": big}, path)
    del big
    pager = torch_ext.LayerPager(path, budget_bytes=1 << 30, prefetch=0)
    loader = threading.Thread(target=pager.acquire, args=("big",))
    loader.start()
    time.sleep(0.02)
    loading_at_fork = not pager.is_resident("big")
    code = in_child(lambda: 0 if pager.acquire("big")[-1].item() == last else 3)
    loader.join()
    assert code == 0, f"child exit {code} (None: it hung); the load was under way at fork: {loading_at_fork}"


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, model):
        self.model = model

    def __len__(self):
        return 8

    def __getitem__(self, i):
        tokens = torch.full((1, CONFIG.block_size), i % CONFIG.vocab_size)
        with torch.no_grad():
            return self.model(tokens)[0, -1]  # the workers run the paged model


def test_a_dataloader_with_forked_workers_uses_a_paged_model(tmp_path):
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    path = tmp_path / "gpt.safetensors"
    torch_ext.save_pageable(model, path)
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, "50%", prefetch=2)
    with torch.no_grad():
        paged(torch.zeros(1, CONFIG.block_size, dtype=torch.long))  # the prefetcher is running at fork
    loader = torch.utils.data.DataLoader(_Tokens(paged), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", timeout=120)
    got = torch.cat([batch for batch in loader])
    expected = torch.stack([_Tokens(model)[i] for i in range(8)])
    assert torch.equal(got, expected)
    assert pager.budget_bytes == torch_ext.SafetensorsSource(path).total_bytes() // 2


# ---------------------------------------------------------------- stress (pytest -m stress)


@pytest.mark.stress
def test_stress_pager_eight_threads_thirty_seconds(tmp_path):
    path = tmp_path / "s.safetensors"
    sizes = [256 + (i * 2654435761) % 8192 for i in range(32)]
    save_file({f"t{i}": torch.full((n,), float(i)) for i, n in enumerate(sizes)}, path)
    budget = sum(sizes) * 4 // 4
    pager = torch_ext.LayerPager(path, budget_bytes=budget, prefetch=3)
    barrier = threading.Barrier(8)
    errors, acquires, stop, done = [], [0] * 8, time.monotonic() + 30, [False]

    def work(t):
        import random
        rng = random.Random(t)
        while True:
            for _ in range(50):
                i = rng.randrange(32)
                if rng.random() < 0.03:
                    pager.begin_pass()
                    continue
                got = pager.acquire_many([f"t{i}", f"t{(i + 1) % 32}"])
                acquires[t] += 2
                if not (torch.equal(got[0], torch.full((sizes[i],), float(i)))
                        and got[1][0].item() == float((i + 1) % 32)):
                    errors.append(f"wrong data for t{i}")
                del got
            if barrier.wait(timeout=120) == 0:  # one thread checks while nobody holds a tensor
                s = pager.stats()
                if pager.resident_bytes() > budget or s.hits + s.misses != sum(acquires):
                    errors.append(f"resident {pager.resident_bytes()} > {budget} or counts {s}")
                done[0] = time.monotonic() > stop
            barrier.wait(timeout=120)
            if done[0]:
                return

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert sum(acquires) > 0
