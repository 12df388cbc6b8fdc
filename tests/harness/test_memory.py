"""Measuring a CPU step: the C heap in use counts what the block allocates, however much of it
glibc already held resident (Note [The C heap in use, not the resident set, measures a CPU
step])."""

import json
import mmap
import platform
import subprocess
import sys
import textwrap

import pytest

from lms.harness.memory import (
    PeakMemory,
    SampledSteps,
    heap_in_use_bytes,
    sampled_steps,
    steady_times,
)

pytestmark = pytest.mark.serial  # measured alone (pyproject.toml's markers)

GLIBC = platform.libc_ver()[0] == "glibc" and tuple(
    int(part) for part in platform.libc_ver()[1].split(".")[:2]
) >= (2, 33)

# 256 chunks of 1 MiB, allocated, freed, then allocated again inside the block: glibc mostly
# serves the second round from the heap the first left resident (an 8 MiB block freed first raises
# its mmap threshold above 1 MiB; a small tensor allocated after the chunks may keep the heap from
# shrinking), so the resident set grows by anything from nothing to the whole 256 MiB.
SCRIPT = textwrap.dedent(
    """
    import json, torch
    from lms.harness.memory import PeakMemory
    torch.empty(2**21)  # 8 MiB, freed at once
    chunks = [torch.ones(2**18) for _ in range(256)]
    top = torch.ones(2**12)
    del chunks
    with PeakMemory() as memory:
        again = [torch.ones(2**18) for _ in range(256)]
    del again
    with PeakMemory() as idle:
        pass
    print(json.dumps({"heap": memory.heap_growth_bytes, "rss": memory.rss_growth_bytes,
                      "idle": idle.growth_bytes}))
    """
)


@pytest.mark.skipif(not GLIBC, reason="counts the heap through glibc's mallinfo2 (2.33 and later)")
def test_the_heap_counts_what_the_block_allocates_from_memory_already_resident():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    mib = 2**20
    assert 256 * mib <= result["heap"] <= 260 * mib, result
    assert abs(result["idle"]) < mib, result


def test_without_the_heap_count_growth_is_the_resident_sets(monkeypatch):
    import lms.runtime.heap as heap

    monkeypatch.setattr(heap, "_MALLINFO2", None)
    assert heap_in_use_bytes() is None
    size = 64 * 2**20
    with PeakMemory() as peak:
        # fresh pages, each touched: resident whatever the heap kept from earlier tests
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
    block.close()
    assert peak.heap_growth_bytes is None
    assert peak.growth_bytes == peak.rss_growth_bytes >= 60 * 2**20


@pytest.mark.parametrize(
    ("steps", "cuda", "sampled", "timed"),
    [
        (1, False, {0}, [1.0]),
        (2, False, {0, 1}, [2.0]),
        (3, False, {1}, [3.0]),
        (5, False, {1}, [3.0, 4.0, 5.0]),
        (3, True, set(), [2.0, 3.0]),
    ],
)
def test_steps_are_timed_apart_from_the_ones_whose_memory_is_sampled(steps, cuda, sampled, timed):
    """Note [Steps timed without the sampler]: from three steps on a CPU, the second's memory
    is sampled and the steps after it timed; a CUDA run samples none."""
    chosen = sampled_steps(steps, cuda)
    assert chosen == sampled
    assert steady_times([float(i + 1) for i in range(steps)], chosen) == timed


@pytest.mark.parametrize(
    ("steps", "cuda", "said"),
    [(1, False, "first step"), (2, False, "sampler"), (3, False, ""), (1, True, "first step")]
    + [(2, True, ""), (5, False, "")],
)
def test_a_run_says_what_its_timed_steps_carry_beside_the_step(steps, cuda, said):
    """Set against a prediction, a time from the first step or from a sampled one says so."""
    caveat = SampledSteps(steps, cuda).timing_caveat(steps)
    assert (said in caveat) if said else caveat == ""


def test_a_cpu_run_samples_one_step_of_three_and_times_the_last(monkeypatch):
    import lms.harness.memory
    import lms.harness.train

    started = []

    class Counted(PeakMemory):
        def __enter__(self):
            started.append(self)
            return super().__enter__()

    monkeypatch.setattr(lms.harness.memory, "PeakMemory", Counted)
    result = lms.harness.train.train(
        "resnet50", size=64, steps=3, method="none", progress=False, device="cpu"
    )
    assert len(started) == 1
    assert result.peak_bytes == result.start_bytes + started[0].growth_bytes
