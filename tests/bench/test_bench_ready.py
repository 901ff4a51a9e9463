"""The time-to-ready benchmark runs end to end on a tiny model (no timing asserted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.experiments import ready


def test_the_ready_benchmark_starts_sluice_twice_a_round_and_reports_medians(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    assert ready.main(["--sluice-model", str(tiny_llama_dir), "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    starts = re.findall(r"^(sluice, \w+ start): ready ([\d.]+) s, first request ([\d.]+) s$", printed, re.MULTILINE)
    assert [kind for kind, *_ in starts] == ["sluice, first start", "sluice, later start"]
    assert all(float(t) > 0 for _, *times in starts for t in times)
    assert "medians of 1 rounds" in printed
    imports = re.findall(r"^sluice's imports alone: ([\d.]+) s$", printed, re.MULTILINE)
    assert len(imports) == 1 and float(imports[0]) > 0  # (no order of times asserted: a busy machine reorders them)


def test_llama_server_needs_a_gguf() -> None:
    with pytest.raises(SystemExit):
        ready.main(["--llama-server", "/bin/true", "--sluice-model", "folder"])
