"""The built wheel maps kernels/, models/ and tui/ into the edgellm package and nothing else lands
in site-packages; the installed wheel imports without the source tree."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("edgellm-*.whl")
    return whl


def test_wheel_file_list(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"edgellm", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for must in ("edgellm/kernels/cpu/legacy.py", "edgellm/kernels/cuda/quant_k.cu", "edgellm/kernels/cuda/common.cuh",
                 "edgellm/models/llama.py", "edgellm/models/gemma3.py", "edgellm/tui/app.py", "edgellm/tui/app.tcss",
                 "edgellm/commands/run.py"):
        assert must in names, must
    assert not any(n.startswith(("tests/", "scripts/", "kernels/", "models/", "tui/")) for n in names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "edgellm = edgellm.cli:main" in entry


def test_installed_wheel_imports(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    code = ("import edgellm, edgellm.kernels.cpu, edgellm.kernels.cuda, edgellm.models.gemma3, edgellm.tui, "
            "edgellm.commands.plan; print(edgellm.__file__); print(edgellm.models.gemma3.__file__)")
    # -I: no cwd, no PYTHONPATH; the wheel's copy goes first, ahead of any editable install
    r = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); " + code],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(line.startswith(str(target)) for line in r.stdout.split())
