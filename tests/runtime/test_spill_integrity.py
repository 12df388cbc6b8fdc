"""What comes back from spill files is checked, and a forked child leaves the parent's alone
(Notes [Spill files are checked when read back] and [Spill files have no name])."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lms
from tests.conftest import assert_bitwise, open_spill_files, run_step

ALL = {"swapout_threshold": 1, "min_offload_bytes": 1}


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    return model, (torch.randn(32, 64),)


def _forward_then(offload, model, inputs, change):
    """Forward under ``offload``, ``change`` the store's files once written, then backward."""
    with offload:
        loss = model(*inputs).square().mean()
        store = offload._offloader.disk
        store._pool.submit(lambda: None).result()  # every write done
        change(store)
        loss.backward()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda fd, n: os.pwrite(fd, b"\x01\x02\x03\x04", n // 2), id="flipped"),
        pytest.param(lambda fd, n: os.pwrite(fd, bytes(n), 0), id="zeroed"),
    ],
)
def test_changed_spill_file_raises_and_names_the_tensor(spill_dir, change):
    model, inputs = _model()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)

    def corrupt(store):
        key, record = sorted(store._files.items())[-1]
        change(record.fd, record.nbytes)

    with pytest.raises(lms.LMSError, match=r"changed between forward and backward") as info:
        _forward_then(offload, model, inputs, corrupt)
    assert "saved tensor" in str(info.value) and "spill_dir" in str(info.value)
    assert open_spill_files(spill_dir) == []
    # the next step is exact again
    assert_bitwise(run_step(model, inputs), run_step(model, inputs, offload))


def test_swapped_spill_files_raise(spill_dir):
    model, inputs = _model()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)

    def swap(store):
        same = {}
        for record in store._files.values():
            same.setdefault(record.nbytes, []).append(record)
        first, second = next(group for group in same.values() if len(group) > 1)[:2]
        first.fd, second.fd = second.fd, first.fd

    with pytest.raises(lms.LMSError, match="changed between forward and backward"):
        _forward_then(offload, model, inputs, swap)


def test_truncated_spill_file_says_what_to_do(spill_dir):
    model, inputs = _model()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)

    def truncate(store):
        record = sorted(store._files.items())[-1][1]
        os.ftruncate(record.fd, record.nbytes // 2)

    with pytest.raises(lms.LMSError, match="truncated it; keep other processes off the spill_dir"):
        _forward_then(offload, model, inputs, truncate)


def test_backward_after_close_is_a_typed_error(spill_dir):
    model, inputs = _model()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)
    with pytest.raises(lms.LMSError, match="closed"):
        _forward_then(offload, model, inputs, lambda store: store.close())
    assert open_spill_files(spill_dir) == []


FORK = textwrap.dedent(
    """
    import os, sys, torch, lms
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(32, 64)
    model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    offload = lms.LMS(tier="disk", spill_dir=sys.argv[1], swapout_threshold=1, min_offload_bytes=1)
    with offload:
        loss = model(x).square().mean()
        offload._offloader.disk._pool.submit(lambda: None).result()
        child = os.fork()
        if child == 0:
            sys.exit(0)  # Python's normal exit: atexit and finalizers run in the child
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        loss.backward()
    same = all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    print("offloaded", offload.stats.offloaded_tensors, "bitwise", same)
    """
)


def test_a_forked_child_leaves_the_parent_s_spill_files(spill_dir):
    result = subprocess.run(
        [sys.executable, "-c", FORK, spill_dir], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert int(words[1]) > 0 and words[3] == "True", result.stdout
    assert os.listdir(spill_dir) == []


def test_two_threads_entering_one_lms_object_one_is_refused(spill_dir):
    """Note [One step at a time]: of two threads entering one LMS object at once, exactly one
    gets in, every time."""
    import threading

    offload = lms.LMS(tier="disk", spill_dir=spill_dir)
    for _ in range(300):
        start, end = threading.Barrier(2), threading.Barrier(2)
        outcomes = []

        def enter(start=start, end=end, outcomes=outcomes):
            start.wait()
            try:
                with offload:
                    outcomes.append("in")
                    end.wait()
            except lms.LMSError as error:
                assert "running a step already" in str(error)
                outcomes.append("refused")
                end.wait()

        threads = [threading.Thread(target=enter) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["in", "refused"]
    model, inputs = _model()
    assert_bitwise(run_step(model, inputs), run_step(model, inputs, offload))
