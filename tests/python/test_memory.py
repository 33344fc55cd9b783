import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import torch_ext
from torch_ext import memory

MiB = 1 << 20


def test_allocate_and_free_move_current_and_peak_exactly():
    memory.reset_peak()
    base = memory.stats()
    assert base.peak_bytes == base.current_bytes
    big = torch.empty(3 * MiB, dtype=torch.uint8)
    during = memory.stats()
    assert during.current_bytes - base.current_bytes == 3 * MiB
    assert during.allocations - base.allocations == 1
    del big
    small = torch.empty(MiB, dtype=torch.uint8)
    after = memory.stats()
    assert after.current_bytes - base.current_bytes == MiB
    assert after.peak_bytes - base.current_bytes == 3 * MiB
    del small
    assert memory.stats().current_bytes == base.current_bytes


def test_threads_allocating_at_once_keep_counts_exact():
    threads, iterations = 4, 500
    kept = [[] for _ in range(threads)]
    start = threading.Barrier(threads)
    before = memory.stats()

    def work(t):
        start.wait()
        for i in range(iterations):
            x = torch.empty(1 + (i * 31 + t) % 8192, dtype=torch.uint8)
            if i % 5 == 0:
                kept[t].append(x)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    after = memory.stats()
    assert after.current_bytes - before.current_bytes == sum(x.nbytes for xs in kept for x in xs)
    assert after.allocations - before.allocations == threads * iterations


class SinExp(torch.nn.Module):
    """sin saves its input; exp saves its output; x * x saves x twice (one storage)."""

    def forward(self, x):
        return (x.sin().exp() + x * x).sum()


def test_saved_for_backward_matches_hand_count():
    x = torch.randn(64, 128, requires_grad=True)
    with memory.track() as tracked:
        loss = SinExp()(x)
    # Saved: x (by sin and twice by mul: one storage) and exp's output.
    assert tracked.saved_bytes == 2 * x.nbytes
    loss.backward()
    torch.testing.assert_close(x.grad, x.cos() * x.sin().exp() + 2 * x)


def test_saved_for_backward_of_a_linear_layer():
    layer = torch.nn.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with memory.track() as tracked:
        layer(x)
    # addmm saves its input and the weight for the two matrix products of backward.
    assert tracked.saved_bytes == x.nbytes + layer.weight.nbytes


def test_track_reports_block_peak_and_nests():
    with memory.track() as outer:
        first = torch.empty(4 * MiB, dtype=torch.uint8)
        del first
        with memory.track() as inner:
            second = torch.empty(MiB, dtype=torch.uint8)
            del second
    assert inner.peak_delta_bytes == MiB
    assert outer.peak_delta_bytes == 4 * MiB
    assert outer.saved_bytes == 0


def test_reset_peak_inside_a_track_leaves_its_peak_alone():
    with memory.track() as tracked:
        first = torch.empty(4 * MiB, dtype=torch.uint8)
        del first
        memory.reset_peak()  # the peak from here on is its caller's; the block keeps what it saw
        second = torch.empty(MiB, dtype=torch.uint8)
        del second
    assert tracked.peak_delta_bytes == 4 * MiB


def test_nothing_saved_under_no_grad():
    x = torch.randn(100, requires_grad=True)
    with torch.no_grad(), memory.track() as tracked:
        x.sin().exp()
    assert tracked.saved_bytes == 0


def test_unknown_device_is_rejected_with_its_name():
    with pytest.raises(ValueError, match="device meta is not supported"):
        memory.stats("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_figures_come_from_torch_cuda():
    memory.reset_peak("cuda")
    before = memory.stats("cuda")
    x = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    assert memory.stats("cuda").current_bytes - before.current_bytes == MiB
    assert memory.stats("cuda").peak_bytes == torch.cuda.max_memory_allocated()
    del x


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_code_measures_where_it_calls_the_ops(backend):
    torch._dynamo.reset()

    @torch.compile(backend=backend)
    def measured_double(x):
        torch.ops.torch_ext.reset_peak_memory()
        before = torch.ops.torch_ext.memory_stats()
        y = x * 2
        return y, before

    x = torch.ones(1024)
    first = measured_double(x)[1]
    held = torch.empty(MiB, dtype=torch.uint8)
    second = measured_double(x)[1]
    # Traced, the second call would return the figures of the first.
    assert second[0] - first[0] > MiB // 2  # current_bytes: the held MiB, give or take small buffers
    del held
    big = torch.empty(4 * MiB, dtype=torch.uint8)
    del big
    measured_double(x)
    # Inductor would drop a traced reset_peak_memory() as dead code.
    assert memory.stats().peak_bytes < memory.stats().current_bytes + 4 * MiB


def test_fullgraph_compile_refuses_a_memory_op_naming_it():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def measured(x):
        return x * 2, torch.ops.torch_ext.memory_stats()

    with pytest.raises(Exception, match="memory_stats"):
        measured(torch.ones(4))


def test_scripted_code_sees_each_call():
    @torch.jit.script
    def measured_double(x: torch.Tensor):
        before = torch.ops.torch_ext.memory_stats()
        y = x * 2
        after = torch.ops.torch_ext.memory_stats()
        return y, after[0] - before[0]

    y, delta = measured_double(torch.ones(1024))
    assert delta == y.nbytes


def test_fresh_process_loads_the_library_without_the_package(tmp_path):
    script = tmp_path / "load_library.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        torch.ops.load_library({torch_ext.library_path()!r})
        assert "torch_ext" not in sys.modules
        current, peak, allocations = torch.ops.torch_ext.memory_stats()
        x = torch.empty(1 << 20, dtype=torch.uint8)
        assert torch.ops.torch_ext.memory_stats()[0] - current == 1 << 20

        @torch.jit.script
        def scripted() -> int:
            return torch.ops.torch_ext.memory_stats()[2]

        assert scripted() >= allocations + 1
        print("ok")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
