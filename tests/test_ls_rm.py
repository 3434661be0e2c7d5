"""`edgellm ls` and `edgellm rm NAME` on a cache dir of their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def edgellm(*args, cache):
    env = dict(os.environ, EDGELLM_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.real
def test_ls_and_rm(tmp_path, smollm2_path, gemma3_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / gemma3_path.name).symlink_to(gemma3_path)
    (models / smollm2_path.name).symlink_to(smollm2_path)
    (models / "mine.gguf").write_bytes(b"not a gguf file at all")
    (models / "notes.txt").write_text("not a model")

    r = edgellm("ls", "--json", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["name"], x["file"], x["type"]) for x in rows] == [
        ("smollm2-135m", smollm2_path.name, "Q4_1"), ("gemma3-270m", gemma3_path.name, "Q4_K_M"),
        ("mine", "mine.gguf", "unreadable")]
    assert rows[0]["size"] == smollm2_path.stat().st_size and rows[1]["size"] == gemma3_path.stat().st_size
    assert rows[2]["size"] == 22 and rows[0]["path"] == str(models / smollm2_path.name)

    table = edgellm("ls", cache=tmp_path).stdout.splitlines()
    assert table[0].split() == ["NAME", "FILE", "SIZE", "TYPE", "PATH"]
    assert table[1].split()[:2] == ["smollm2-135m", smollm2_path.name] and table[1].endswith(str(models / smollm2_path.name))

    r = edgellm("rm", "gemma3-270m", cache=tmp_path)
    assert r.returncode == 0 and "removed gemma3-270m" in r.stdout
    assert not (models / gemma3_path.name).exists() and gemma3_path.exists()  # the link, not our fixture
    r = edgellm("rm", "mine.gguf", cache=tmp_path)
    assert r.returncode == 0 and not (models / "mine.gguf").exists()
    r = edgellm("rm", "gemma3-270m", cache=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no cached model 'gemma3-270m' (cached: smollm2-135m)" in r.stderr
    assert [x["name"] for x in json.loads(edgellm("ls", "--json", cache=tmp_path).stdout)] == ["smollm2-135m"]


def test_ls_empty_cache(tmp_path):
    r = edgellm("ls", cache=tmp_path)
    assert r.returncode == 0 and "no models in" in r.stdout and "edgellm pull" in r.stdout
