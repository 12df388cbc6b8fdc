"""The write log keeps forward's histories only as long as a recipe may still need them (Note [The
log lets go of what the step freed])."""

import gc
import weakref

import torch

from lms.runtime.writelog import WriteLog


def _log() -> WriteLog:
    # Every argument smaller than 1 MiB is held as it is, as the runtime holds those too small
    # to offload.
    return WriteLog(set(), lambda storage: None, small_bytes=2**20)


def test_a_history_goes_with_its_storage_and_lets_go_of_what_it_held():
    weight = torch.randn(256, requires_grad=True)
    with _log() as log:
        scaled = weight * 2  # its history holds `weight`, a fixed argument
        doubled = scaled.sigmoid()  # its history holds `scaled`, too small to offload
        held = weakref.ref(scaled)
        del scaled
        gc.collect()
        alive_while_read = held() is not None  # the history of `doubled` holds it
        histories = len(log.histories)
        del doubled
        torch.empty(1)  # the next call, of no recipe, drops the histories whose storages died
        gc.collect()
        assert alive_while_read
        assert histories == 2
        assert held() is None
        assert not log.histories


def test_backward_drops_forwards_histories():
    weight = torch.randn(256, requires_grad=True)
    with _log() as log:
        loss = (weight * 2).sigmoid().sum()
        assert log.histories
        loss.backward()
        assert not log.histories
        assert not log.unsaved
        (weight * 3).sigmoid()  # a forward run again starts histories afresh
        assert log.histories
