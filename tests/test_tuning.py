"""The local device's spec: measured once a process for each GPU and TF32 setting."""

import types

import torch

from lms import tuning


def test_local_spec_measures_each_gpu_once_per_tf32_setting(monkeypatch):
    calls = {"link": 0, "compute": 0}

    def link(device):
        calls["link"] += 1
        return 50.0 + calls["link"], 51.0

    def compute(device):
        calls["compute"] += 1
        return tuning.ComputeRates(70e12 + calls["compute"], 100e12, 2000.0)

    monkeypatch.setattr(tuning, "_MEASURED", {})
    monkeypatch.setattr(tuning, "measure_link_gbps", link)
    monkeypatch.setattr(tuning, "measure_compute", compute)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(total_memory=80 * 2**30),
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    first = tuning.local_device_spec(torch.device("cuda"))
    again = tuning.local_device_spec(torch.device("cuda", 0))
    assert first == again and calls == {"link": 1, "compute": 1}
    assert first.d2h_gbps == 51.0 and first.peak_flops == 70e12 + 1
    tuning.local_device_spec(torch.device("cuda", 1))  # another GPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # other convolution rates
    tuning.local_device_spec(torch.device("cuda", 0))
    assert calls == {"link": 3, "compute": 3}
