"""The node cache under 8 threads for 30 s (issue 16; marker `stress`, deselected by default,
run by `bash .ci/run sanitize`). Asserts invariants, not speeds: never over capacity, never
another node's or a stale value, hits + misses equal to the lookups made."""
import random
import threading
import time

import pytest
import torch

import torch_ext  # noqa: F401  (loads the library)


@pytest.mark.stress
def test_stress_node_cache_eight_threads_thirty_seconds():
    capacity = 64 * 256 * 4
    cache = torch.classes.torch_ext.NodeCache(capacity_bytes=capacity)
    inputs = [torch.arange(256, dtype=torch.float32) + i for i in range(128)]
    barrier = threading.Barrier(8)
    errors, lookups, stop, done = [], [0] * 8, time.monotonic() + 30, [False]

    def work(t):
        rng = random.Random(t)
        while True:
            for _ in range(100):
                i = rng.randrange(len(inputs))
                r = rng.random()
                if r < 0.4:
                    cache.put(i, [inputs[i]], inputs[i] * 3, 1e-6 * rng.randint(1, 100))
                elif r < 0.95:
                    lookups[t] += 1
                    hit, value = cache.lookup(i, [inputs[i]])
                    if hit and not torch.equal(value, inputs[i] * 3):
                        errors.append(f"node {i}: another value")
                elif r < 0.99:
                    cache.invalidate_node(i)
                else:
                    cache.invalidate()
            if barrier.wait(timeout=120) == 0:  # one thread checks while the others wait
                s = cache.stats()
                if s.cached_bytes > capacity or s.hits + s.misses != sum(lookups) or s.entries != cache.cached_count():
                    errors.append(f"counts or capacity broken: {s}")
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
    assert sum(lookups) > 0
