"""Smoke run of scripts/checks/fuzz_gguf.py: a thousand seeded mutations of a small synthetic file
(header bytes, odd bytes in strings, boundary values, truncations, swapped dimensions), each opened as `edgellm info`
opens a file, in a memory-capped worker with a timeout. Every outcome must be a clean error or a
success: no traceback, signal, hang or memory blow-up."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgellm.synthetic import write_synthetic_gguf

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "checks" / "fuzz_gguf.py"


def test_fuzz_smoke(tmp_path):
    base = write_synthetic_gguf(tmp_path / "base.gguf", arch="gemma3", n_layer=2, n_embd=64, n_head=4,
                                n_head_kv=2, n_ff=128, n_vocab=300, ggml_type=8)  # Q8_0 matrices
    r = subprocess.run([sys.executable, str(SCRIPT), str(base), "--cases", "1000", "--seed", "1", "--json",
                        "--timeout", "20"], capture_output=True, text=True, timeout=300)
    result = json.loads(r.stdout)
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == 1000
    assert all(outcomes[k] == 0 for k in ("traceback", "signal", "hang", "blowup")), result["bad"]
    assert outcomes["clean"] > 300 and outcomes["success"] > 100, outcomes  # both paths exercised
    assert r.returncode == 0
