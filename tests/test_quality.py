"""`edgellm quality`: one table over several types on a small synthetic model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import quant_cases
from edgellm.errors import InvalidArgumentError
from edgellm.quality import report


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return quant_cases.write_model("gemma3_f16", tmp_path_factory.mktemp("quality"))


def test_quality_report(base, monkeypatch):
    from edgellm.quality import perplexity as px

    runs = []
    scored = px.scored_logits
    monkeypatch.setattr(px, "scored_logits", lambda model, chunk: runs.append(1) or scored(model, chunk))
    rep = report.quality(base, ["Q2_K", "Q8_0", "Q4_K_M"], n_ctx=128, n_chunks=2, max_kl=1e-7)
    assert len(runs) == 4 * 2  # each chunk through each model once: the base's KL data from its own PPL run
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


def test_quality_json_is_kept_and_plan_advises_from_it(base, tmp_path):
    """`quality --json` prints the report and keeps it in the user cache; `plan` on the base or on
    any quantization of it names the measured type that fits, with its KL."""
    import edgellm
    from edgellm.config import ModelConfig
    from edgellm.gguf_file import GGUFFile
    from edgellm.memory import Budgets
    from edgellm.planner import WeightSizes, plan
    from edgellm.quality import store

    env = {**os.environ, "EDGELLM_CACHE": str(tmp_path / "cache")}
    cli = lambda *a: subprocess.run([sys.executable, "-m", "edgellm.cli", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, env=env)
    out = cli("quality", base, "--types", "Q6_K,Q2_K", "-c", "128", "--chunks", "1", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert [r["type"] for r in d["rows"]] == ["Q2_K", "Q6_K", "F16 (base)"] and d["n_chunks"] == 1
    q2, q6 = d["rows"][:2]
    assert q6["kl_mean"] < q2["kl_mean"]
    kept = tmp_path / "cache" / "quality" / f"{store.model_key(GGUFFile(base))}.json"
    assert str(kept) in out.stderr and json.loads(kept.read_text())["rows"] == d["rows"]

    q4 = edgellm.quantize(base, tmp_path / "q4.gguf", "Q4_K_M").path  # another quant type of the same model
    assert store.model_key(GGUFFile(q4)) == store.model_key(GGUFFile(base))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGELLM_CACHE", env["EDGELLM_CACHE"])
        measured = store.measured_types(GGUFFile(q4))
    assert [(m.name, m.kl_mean, m.base) for m in measured] == [("Q2_K", q2["kl_mean"], "F16"),
                                                                ("Q6_K", q6["kl_mean"], "F16")]

    gf = GGUFFile(base)
    cfg = ModelConfig.from_gguf(gf)
    sizes = WeightSizes.from_tensors(gf.tensors, cfg.n_layer)
    need = plan(cfg, sizes, n_ctx=128, budgets=Budgets(cpu=1 << 40, gpu=0)).cpu.total
    q6_weights = sizes.total * q6["bits_per_weight"] / sizes.bits_per_weight
    ram = int(need - (sizes.total - q6_weights) // 2)  # F16 does not fit, Q6_K does
    got = cli("plan", base, "--ctx", "128", "--ram", ram, "--vram", "0")
    assert got.returncode == 1, got.stdout + got.stderr
    assert (f"a Q6_K file of this model ({q6['bits_per_weight']:.2f} bits/weight, measured mean KL "
            f"{q6['kl_mean']:.4f} and top-1 agreement {100 * q6['same_top']:.1f} % vs F16)") in got.stdout
    kept.unlink()  # without a report: the generic advice
    got = cli("plan", base, "--ctx", "128", "--ram", ram, "--vram", "0")
    assert got.returncode == 1 and "measured" not in got.stdout and "a Q8_0 file of this model (8.5 bits" in got.stdout
