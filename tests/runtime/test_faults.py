"""Bad input fails before training; faults lose nothing and leave nothing behind."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import lms
from lms.runtime import disk
from tests.conftest import assert_bitwise, hooks_are_gone, run_step, spill_files

ALL = dict(swapout_threshold=1, min_offload_bytes=0)


def model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh())
    return model, (torch.randn(64, 128),)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("budget", "ten"),
        ("budget", -5),
        ("tier", "gpu"),
        ("swapout_threshold", 0),
        ("swapin_ahead", 0),
        ("swapin_groupby", -3),
        ("sync_mode", 4),
        ("min_offload_bytes", -2),
        ("host_budget", "1 parsec"),
    ],
)
def test_invalid_settings_name_field_and_value(field, value):
    with pytest.raises(ValueError) as info:
        lms.LMS(**{field: value})
    assert field in str(info.value)
    assert repr(value) in str(info.value)


def test_unwritable_spill_dir_fails_before_training(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with pytest.raises(lms.SpillError, match="not a folder"):
        lms.LMS(tier="disk", spill_dir=str(not_a_folder))
    # /proc takes no new folders, even from root
    with pytest.raises(lms.SpillError, match="not writable"):
        lms.LMS(tier="disk", spill_dir="/proc")


def test_disk_full_before_write_raises_and_cleans(spill_dir, monkeypatch):
    model, inputs = model_and_input()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)
    usage = shutil.disk_usage(spill_dir)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage._replace(free=1024 * 1024))
    with pytest.raises(lms.SpillError, match="free, too little") as info:
        run_step(model, inputs, offload)
    assert "spill_dir" in str(info.value)
    assert spill_files(spill_dir) == []
    assert hooks_are_gone()


def test_disk_full_during_write_loses_nothing(spill_dir, monkeypatch):
    """The write fails on the I/O thread: the data stays resident and the step says so."""
    model, inputs = model_and_input()
    ref = run_step(model, inputs)
    real_write = disk.SpillStore._write
    calls = []

    def failing_write(self, path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, path, data)

    def enospc(self, path, data):
        try:
            failing_write(self, path, data)
        except OSError as exc:
            raise lms.SpillError(f"lms: the disk filled up: {exc}") from exc

    monkeypatch.setattr(disk.SpillStore, "_write", enospc)
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, sync_mode=1, **ALL)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with pytest.raises(lms.SpillError, match="filled up"), offload:
        model(*inputs).float().square().mean()
    assert spill_files(spill_dir) == []
    assert hooks_are_gone()
    # the failed step is not taken as the record, and the next step is exact
    monkeypatch.setattr(disk.SpillStore, "_write", real_write)
    assert_bitwise(ref, run_step(model, inputs, offload))
    assert offload._record is None or len(offload._record.nbytes) == 4


def test_real_write_error_is_typed(spill_dir, monkeypatch):
    store = disk.SpillStore(spill_dir)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    future = store.write(0, torch.zeros(1024, dtype=torch.uint8))
    with pytest.raises(lms.SpillError, match="filled up"):
        future.result()
    monkeypatch.undo()
    store.close()
    assert spill_files(spill_dir) == []


def test_host_memory_running_out(spill_dir):
    model, inputs = model_and_input()
    offload = lms.LMS(tier="host", host_budget="64KiB", **ALL)
    with pytest.raises(lms.HostMemoryError, match="host_budget") as info:
        run_step(model, inputs, offload)
    assert "KiB" in str(info.value)
    assert hooks_are_gone()
    assert offload._offloader.host_bytes == 0


def test_host_overflow_goes_to_disk_with_auto_tier(spill_dir):
    model, inputs = model_and_input()
    ref = run_step(model, inputs)
    offload = lms.LMS(tier="host", host_budget="64KiB", spill_dir=spill_dir, **ALL)
    offload._offloader.tier = "auto-host"  # a CUDA-like auto tier on the CPU: host, then disk
    got = run_step(model, inputs, offload)
    assert_bitwise(ref, got)
    assert 0 < offload.stats.spilled_bytes < offload.stats.offloaded_bytes


@pytest.mark.parametrize("tier", ["auto-host", "host"])
def test_pinning_that_fails_below_the_host_budget_is_a_full_budget(
    spill_dir, monkeypatch, caplog, tier
):
    # Note [Pinning can fail below the budget]: a CUDA error from pinning, which ended a step
    # on an H100 whose host had room left in its budget, sends the data to disk or is typed.
    from lms.runtime import pool, store
    from tests.runtime.test_pool import PinnedPool

    pinned = []

    def pin_up_to_64kib(nbytes, pin):
        assert pin
        if sum(pinned) + nbytes > 64 * 1024:
            raise RuntimeError("CUDA error: out of memory")
        pinned.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pool, "_empty", pin_up_to_64kib)
    monkeypatch.setattr(store, "HostPool", PinnedPool)
    model, inputs = model_and_input()
    ref = run_step(model, inputs)
    offload = lms.LMS(tier="host", host_budget="1GiB", spill_dir=spill_dir, **ALL)
    offload._offloader.tier = tier  # "auto-host": a CUDA-like auto tier, host then disk
    with caplog.at_level("WARNING", logger="lms"):
        if tier == "host":
            with pytest.raises(lms.HostMemoryError):
                run_step(model, inputs, offload)
        else:
            assert_bitwise(ref, run_step(model, inputs, offload))
            assert 0 < offload.stats.spilled_bytes < offload.stats.offloaded_bytes
    assert "pinning" in caplog.text and 0 < sum(pinned) <= 64 * 1024
    assert offload._offloader._pool.limit_bytes == sum(pinned)  # tried once, not per tensor
    offload.close()
    assert hooks_are_gone() and not spill_files(spill_dir)


def test_exception_mid_step_discards_everything(spill_dir):
    model, inputs = model_and_input()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)
    with pytest.raises(ZeroDivisionError), offload:
        loss = model(*inputs).square().mean()
        assert offload.stats.offloaded_tensors > 0
        offload._offloader.disk._pool.submit(lambda: None).result()  # the writes done
        assert spill_files(spill_dir)
        raise ZeroDivisionError("mid-step")
    assert spill_files(spill_dir) == []
    assert hooks_are_gone()
    with pytest.raises(lms.StepAbortedError, match="run forward again"):
        loss.backward()


def test_files_removed_after_successful_step(spill_dir):
    model, inputs = model_and_input()
    offload = lms.LMS(tier="disk", spill_dir=spill_dir, **ALL)
    run_step(model, inputs, offload)
    assert offload.stats.spilled_bytes > 0
    assert spill_files(spill_dir) == []
    assert hooks_are_gone()


def test_ctrl_c_leaves_no_spill_files(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time, torch, lms
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(64)])
        x = torch.randn(512, 512)
        offload = lms.LMS(tier="disk", spill_dir={str(spill)!r}, swapout_threshold=1)
        calls = 0

        def interrupt(module, args):
            global calls
            calls += 1
            if calls == 40:
                held = []
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        held.append(os.readlink(f"/proc/self/fd/{{fd}}"))
                    except OSError:
                        pass
                print("files", sum({str(spill)!r} in link for link in held), flush=True)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises KeyboardInterrupt here, in Python code

        for layer in model:
            layer.register_forward_pre_hook(interrupt)
        try:
            with offload:
                model(x).sum().backward()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "interrupted" in result.stdout, result.stderr
    held = int(result.stdout.split()[1])
    assert held > 0  # spill files were open when the interrupt came
    assert list(spill.iterdir()) == []
    assert signal.SIGINT  # the test sent a real SIGINT, handled as KeyboardInterrupt


KILLER = textwrap.dedent(
    """
    import os, signal, sys, time, torch, lms
    spill, how, where = sys.argv[1], getattr(signal, sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    offload = lms.LMS(tier="disk", spill_dir=spill, swapout_threshold=1)

    def held():
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return sum(link.startswith(os.path.realpath(spill)) for link in links)

    def kill(*args):
        # the I/O thread opens the spill files: on a loaded machine it may not have yet
        deadline = time.monotonic() + 30
        while not held() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("files", held(), flush=True)
        os.kill(os.getpid(), how)

    if where == "forward":
        model[-1].register_forward_pre_hook(kill)
    else:
        model[2].register_full_backward_pre_hook(kill)
    with offload:
        model(torch.randn(256, 256)).sum().backward()
    """
)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_killed_step_leaves_nothing_on_disk(tmp_path, how, where):
    """Note [Spill files have no name]: killed in forward or backward, by a signal Python
    handles (SIGTERM's default ends the process) or one it cannot, the process leaves nothing
    under the spill folder, though spill files were open when it died."""
    spill = tmp_path / "spill"
    spill.mkdir()
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(spill), how, where], capture_output=True, text=True
    )
    assert killed.returncode == -getattr(signal, how), killed.stderr
    assert int(killed.stdout.split()[1]) > 0  # spill files were open when it was killed
    assert list(spill.iterdir()) == []


def test_folders_left_by_killed_processes_of_older_releases_are_removed(tmp_path):
    """Note [Spill folders of processes that were killed]."""
    spill = tmp_path / "spill"
    spill.mkdir()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    left = spill / f"lms-spill-{gone.stdout.strip()}@{disk._this_host()}-abc"
    left.mkdir()
    (left / "0.bin").write_bytes(b"x" * 4096)
    # a folder of a live process (this one), of another host, and of an older release stay
    alive = spill / f"lms-spill-{os.getpid()}@{disk._this_host()}-live"
    other = spill / "lms-spill-1@elsewhere.1-abc"
    older = spill / "lms-spill-k2j4_x9a"
    for folder in (alive, other, older):
        folder.mkdir()
    model, inputs = model_and_input()
    offload = lms.LMS(tier="disk", spill_dir=str(spill), **ALL)
    run_step(model, inputs, offload)
    assert not left.exists()
    assert all(folder.exists() for folder in (alive, other, older))
    assert disk.remove_stale_folders(str(spill)) == 0


def test_the_runtime_is_freed_without_the_cyclic_collector(spill_dir):
    """Note [No reference cycles through the runtime]: left to the cyclic collector, a failed
    step's handles could be released on an I/O thread while the main thread holds the lock."""
    import gc
    import weakref

    gc.disable()
    try:
        offload = lms.LMS(tier="disk", spill_dir=spill_dir)
        alive = weakref.ref(offload)
        del offload
        assert alive() is None
    finally:
        gc.enable()
