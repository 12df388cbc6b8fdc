"""The public API is typed for its users: `lms.LMS`'s settings are checked by a type checker
before the code runs, and they are `LMSConfig`'s fields, no more and no fewer."""

import dataclasses
import pathlib
import subprocess
import sys
import textwrap
import typing

from lms.core.config import LMSConfig, LMSSettings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_settings_lms_takes_are_the_configs_fields_with_their_types():
    fields = {field.name: field.type for field in dataclasses.fields(LMSConfig) if field.init}
    hints = typing.get_type_hints(LMSSettings)
    config_hints = typing.get_type_hints(LMSConfig)
    assert set(hints) == set(fields)
    assert {name: hints[name] for name in fields} == {name: config_hints[name] for name in fields}


def test_a_users_file_is_checked_strictly_against_the_api(tmp_path):
    good = tmp_path / "good.py"
    good.write_text(
        textwrap.dedent(
            """
            import torch
            import lms
            from lms.core.sync import SyncMode

            offload = lms.LMS(budget="1GiB", tier="disk", free_held=True, swapin_ahead=2)
            lms.LMS(sync_mode=SyncMode.WAIT_OUT)
            lms.LMS(sync_mode=3)
            model = torch.nn.Linear(4, 4)
            with offload:
                model(torch.randn(2, 4)).sum().backward()
            moved: int = offload.stats.offloaded_bytes
            plan: lms.Plan | None = offload.plan
            """
        )
    )
    bad = tmp_path / "bad.py"
    bad.write_text(
        'import lms\n\noffload = lms.LMS(budgt="1GiB", tier="disc")\nlms.LMS(sync_mode=5)\n'
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",  # the user's file, as an installed package is checked
            # lms's own types: PyTorch's, which take the check from 1 s to 14, are left out
            "--no-site-packages",
            "--ignore-missing-imports",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(good),
            str(bad),
        ],
        capture_output=True,
        text=True,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert not [line for line in errors if "good.py" in line], done.stdout
    assert any('Unexpected keyword argument "budgt"' in line for line in errors), done.stdout
    assert any('Argument "tier"' in line and "disc" in line for line in errors), done.stdout
    assert any('Argument "sync_mode"' in line for line in errors), done.stdout
