"""The core-sharing probe: its arguments, and one real case of two engine processes."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import core_sharing_probe as probe


@pytest.mark.parametrize("cases", ["", "prefill", "prefill:0", "decode:1:spin", "prefill:1 other:1", "prefill:1;"])
def test_bad_cases_exit_2_with_a_message(cases, capsys):
    with pytest.raises(SystemExit) as exited:
        probe.main(["--cases", cases])
    assert exited.value.code == 2
    assert "--cases" in capsys.readouterr().err


def test_bad_seconds_exit_2():
    with pytest.raises(SystemExit) as exited:
        probe.main(["--seconds", "0"])
    assert exited.value.code == 2


@pytest.mark.e2e
def test_one_case_runs_both_processes_on_the_real_model(capsys):
    assert probe.main(["--seconds", "1", "--cases", "prefill:1:passive decode:1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["process"] for r in lines] == ["prefill:1:passive", "decode:1"]
    assert all(r["n"] >= 1 and r["median_ms"] > 0 for r in lines)
