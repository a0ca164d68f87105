"""The GPU check runs as a process on a CPU at toy sizes (`--device cpu --quick`): every check that applies
passes and prints its JSON line, so the script stays runnable where no GPU is."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_gpu_check_runs_on_a_cpu_at_toy_sizes(tmp_path):
    out = tmp_path / "check.jsonl"
    proc = subprocess.run([sys.executable, "-m", "tandem.gpu_check", "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    by_name = {line["check"]: line for line in lines}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(by_name) == ["probe", "hbm_bandwidth", "pcie", "parity", "backends", "kv_handoff",
                             "kv_export_import", "decode_hbm", "tandem_up"]
    assert by_name["pcie"]["ok"] is None and "cuda" in by_name["pcie"]["skipped"]  # does not apply here
    assert all(line["ok"] is True for name, line in by_name.items() if name != "pcie"), lines
    assert all(f is None for firsts in by_name["parity"]["first_difference_by_prompt"].values() for f in firsts)
    assert by_name["tandem_up"]["tokens"] and len(by_name["tandem_up"]["tokens"]) == 8
