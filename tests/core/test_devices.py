"""Device specs named, and read from a file (Note [A device spec from a file])."""

import json

import pytest

import lms
from lms.cli import main
from lms.core.devices import DEVICES, DeviceSpec


def test_a_spec_file_with_a_base_replaces_only_the_fields_it_gives(tmp_path):
    path = tmp_path / "slow.json"
    path.write_text(json.dumps({"base": "h100", "name": "h100-slow", "d2h_gbps": 20}))
    spec = lms.device_spec(str(path), memory="16GiB")
    base = lms.device_spec("h100")
    assert (spec.name, spec.d2h_gbps, spec.memory_bytes) == ("h100-slow", 20, 16 * 2**30)
    assert spec.h2d_gbps == base.h2d_gbps and spec.peak_flops == base.peak_flops
    assert spec.workspace_bytes == base.workspace_bytes


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_named_spec_comes_back_from_its_fields(name, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(DEVICES[name].to_dict()))
    assert lms.device_spec(str(path)) == DEVICES[name]


def test_the_spec_analyze_wrote_plans_the_same_step_again(tmp_path, capsys):
    """A card planned for once is planned for from the JSON of that analysis: its "spec" is
    the spec simulated, and the same analysis from it predicts the same step."""
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    common = ["analyze", "-q", "--model", "tinylm", "--seq-len", "64", "--gpu-memory", "4GiB"]
    assert main([*common, "--device-spec", "l4", "--json", str(first)]) == 0
    assert main([*common, "--device-spec", str(first), "--json", str(again)]) == 0
    written, read = json.loads(first.read_text()), json.loads(again.read_text())
    assert written["spec"] == lms.device_spec("l4").to_dict()
    assert read["spec"] == written["spec"] and read["device_spec"] == "l4-24gb"
    assert read["predicted_step_s"] == written["predicted_step_s"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ({"base": "h100", "d2h": 20}, "has no field 'd2h'"),
        ({"base": "h100", "d2h_gbps": "fast"}, "d2h_gbps='fast' is not a float"),
        ({"base": "h100", "memory_bytes": 1.5}, "memory_bytes=1.5 is not a int (bytes"),
        ({"name": "mine"}, "lacks 'memory_bytes', 'peak_flops'"),
        ([1, 2], "holds list, not an object of fields"),
        ({"base": "rtx9999"}, "device_spec='rtx9999' is unknown"),
    ],
)
def test_a_spec_file_that_is_not_a_spec_is_refused_naming_what_is_wrong(content, words, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        lms.device_spec(str(path))


def test_a_spec_file_missing_or_not_json_is_refused_before_the_analysis(
    tmp_path, monkeypatch, capsys
):
    import lms.orchestration.analyze as analyze

    traced = []
    monkeypatch.setattr(analyze, "trace_step", lambda *a, **k: traced.append(1))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for path, words in ((tmp_path / "none.json", "no such file"), (broken, "cannot be read")):
        assert main(["analyze", "--model", "tinylm", "--device-spec", str(path)]) == 2
        assert words in capsys.readouterr().err and not traced


def test_a_spec_read_back_keeps_its_op_times_only_in_a_step_record():
    """A record's spec carries the op times it was priced on (`DeviceSpec.from_dict`); a file
    given as a spec drops them, since they belong to another trace."""
    from lms.core.devices import OpTimings

    timed = DEVICES["h100-80gb"].with_op_timings(OpTimings("abc", (0.5, None), (1, None)))
    back = DeviceSpec.from_dict(timed.to_dict())
    assert back.op_timings is not None and back.op_timings.seconds == (0.5, None)
    assert back.op_timings.scratch == (1, None) and back.op_timings.fingerprint == "abc"
