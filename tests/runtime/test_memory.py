"""Memory measured in a fresh process: a tuned plan stays within its budget on the CPU, and the
simulator predicts the growth of resident memory within 10%."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, lms
    from lms.bench.rss import PeakRSS
    from lms.analysis import simulate, trace_step
    from lms.tuning import local_device_spec
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU()]
    for _ in range(7):
        layers += [torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU()]
    fmt = torch.channels_last
    model = torch.nn.Sequential(*layers).to(memory_format=fmt)
    x = torch.randn(1, 3, 512, 512).contiguous(memory_format=fmt)

    def step(m, batch):
        loss = m(*batch).square().mean()
        loss.backward()
        return loss

    budget = int(sys.argv[1]) * 2**20
    offload = lms.LMS(budget=budget, tier="disk", spill_dir=sys.argv[2])
    plan = offload.tune(model, [x], step, cache_dir=sys.argv[2] + "/plans")
    trace = trace_step(model, [x], step, device="cpu")
    sim = simulate(trace, plan, local_device_spec(torch.device("cpu")))
    before = trace.param_bytes + trace.buffer_bytes + trace.input_bytes
    peaks = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with PeakRSS() as rss:
            with offload:
                step(model, [x])
        peaks.append(rss.growth_bytes)
    print(json.dumps({"measured": max(peaks[1:]), "simulated": sim.peak_tensor_bytes - before,
                      "offloaded": len(plan.offload), "budget": budget}))
    """
)


def test_tuned_plan_keeps_rss_growth_within_budget_and_prediction(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "200", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["offloaded"] > 0
    assert result["measured"] <= result["budget"], result
    assert abs(result["measured"] / result["simulated"] - 1) <= 0.10, result
