"""`edgellm quality`: one table over several types on a small synthetic model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import quant_cases
from edgellm.errors import InvalidArgumentError
from edgellm.quality import report


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return quant_cases.write_model("gemma3_f16", tmp_path_factory.mktemp("quality"))


def test_quality_report(base):
    rep = report.quality(base, ["Q2_K", "Q8_0", "Q4_K_M"], n_ctx=128, n_chunks=2, max_kl=1e-7)
    assert [r.type for r in rep.rows] == ["Q2_K", "Q4_K_M", "Q8_0", "F16 (base)"]  # by size, base last
    q2, q4, q8, b = rep.rows
    assert q2.file_bytes < q4.file_bytes < q8.file_bytes < b.file_bytes
    assert q2.bits_per_weight < q4.bits_per_weight < q8.bits_per_weight < b.bits_per_weight
    assert q8.kl_mean < q4.kl_mean < q2.kl_mean  # fewer bits, further from the base
    assert b.kl_mean == 0 and b.same_top == 1.0
    assert rep.knee == "Q8_0"  # the only one within the (tiny) budget
    assert all(r.pp_tps > 0 and r.tg_tps > 0 and r.ttft_s > 0 and r.memory_bytes > 0 for r in rep.rows)
    text = report.table(rep)
    assert "<- knee" in text.splitlines()[4] and "Q8_0" in text.splitlines()[4]
    assert [ln.split()[0] for ln in report.chart(rep).splitlines()[1:]] == ["Q2_K", "Q4_K_M", "Q8_0"]


def test_quality_cli_errors(base, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "edgellm.cli", "quality", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True)
    bad = run(base, "--types", "Q8_0,Q7_K")
    assert bad.returncode == 1 and "unknown TYPE 'Q7_K'" in bad.stderr and bad.stderr.count("\n") == 1
    bad = run(base, "-c", "64")
    assert bad.returncode == 1 and "at least 128" in bad.stderr


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without it looks like
    with pytest.raises(InvalidArgumentError, match="pip install matplotlib"):
        report.plot(report.QualityReport("b.gguf", "F16", 128, 1, 0.01), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_quality_json(base):
    out = subprocess.run([sys.executable, "-m", "edgellm.cli", "quality", str(base), "--types", "Q6_K", "-c", "128",
                          "--chunks", "1", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert [r["type"] for r in d["rows"]] == ["Q6_K", "F16 (base)"] and d["n_chunks"] == 1
