"""edgellm bench's weight-bandwidth pieces: bytes read per forward pass, the cached stream test
(edgellm.machine), -d."""
import json
from pathlib import Path

import pytest

from edgellm import machine
from edgellm.commands import bench
from edgellm.gguf_file import GGUFFile
from edgellm.synthetic import write_synthetic_gguf

SHAPE = {"n_layer": 2, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "n_vocab": 512}


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_counts_every_matrix_and_the_head_once(tmp_path, tied):
    path = write_synthetic_gguf(tmp_path / "m.gguf", tied_output=tied, sparse=True, **SHAPE)
    gf = GGUFFile(path)
    tensors = gf.tensors
    embd = tensors["token_embd.weight"].nbytes
    everything = sum(t.nbytes for t in tensors.values())
    # untied: the embeddings are looked up (one row), the separate head is read; tied: the
    # embedding matrix is the head
    assert bench.weight_bytes(gf) == (everything if tied else everything - embd)
    assert ("output.weight" in tensors) is not tied


def test_machine_bandwidth_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_CACHE", str(tmp_path))
    calls = []

    def fake(threads):
        calls.append(threads)
        return 12.5e9

    monkeypatch.setattr(machine, "stream_bandwidth", fake)
    assert machine.machine_bandwidth(2) == 12.5e9
    assert machine.machine_bandwidth(2) == 12.5e9
    assert calls == [2]
    assert list(json.loads((tmp_path / "bandwidth.json").read_text()).values()) == [12.5e9]


def test_stream_array_outgrows_the_largest_cache():
    """The stream test reads twice the largest cache (an array the cache holds measures the cache),
    256 MiB at least, a quarter of the available memory at most."""
    GiB, MiB = 1 << 30, 1 << 20
    assert machine.stream_bytes(cache=480 * MiB, available=20 * GiB) == 960 * MiB
    assert machine.stream_bytes(cache=32 * MiB, available=20 * GiB) == 256 * MiB
    assert machine.stream_bytes(cache=480 * MiB, available=2 * GiB) == 512 * MiB
    assert machine.stream_bytes(cache=0, available=100 * MiB) == 64 * MiB
    # this machine's, from sysfs: the L3 (or L2) it reports, or 0 without sysfs
    llc = machine.last_level_cache_bytes()
    sizes = [int(p.read_text().strip().rstrip("K")) << 10
             for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")
             if p.read_text().strip().endswith("K")]
    assert llc == max(sizes, default=0) or not sizes
    assert machine.stream_bytes(available=64 * GiB) >= 2 * llc


def test_stream_bandwidth_reads_at_a_plausible_rate():
    bw = machine.stream_bandwidth(1, n_bytes=16 << 20, reps=2)
    assert 1e8 < bw < 1e12


def test_negative_depth_is_a_clear_error(capsys):
    from edgellm.cli import main

    assert main(["bench", "smollm2-135m", "-d", "-1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "-d" in err[0]


@pytest.mark.real
def test_bench_reports_rates_the_timings_give(smollm2_path, capsys):
    """`edgellm bench --json` on the real file: a pp and a tg test at a depth, each with its weight
    rate from its own t/s and the memory read rate measured beside it."""
    from edgellm.cli import main

    assert main(["bench", str(smollm2_path), "-p", "16", "-n", "8", "-r", "2", "-d", "8", "-t", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["depth"] == 8 and info["threads"] == 1
    pp, tg = info["results"]
    assert (pp["test"], tg["test"]) == ("pp16 @ d8", "tg8 @ d8")
    per_pass = info["weight_bytes_per_pass"]
    for r in (pp, tg):
        assert len(r["runs"]) == 2 and r["tokens_per_s"] == pytest.approx(sum(r["runs"]) / 2)
        assert 1e8 < r["memory_gb_per_s"] * 1e9 < 1e12
    assert tg["weight_gb_per_s"] * 1e9 == pytest.approx(tg["tokens_per_s"] * per_pass)
    assert pp["weight_gb_per_s"] * 1e9 == pytest.approx(pp["tokens_per_s"] / 16 * per_pass)  # one pass for 16
    assert info["machine"]["memory_gb_per_s"] == pytest.approx((pp["memory_gb_per_s"] + tg["memory_gb_per_s"]) / 2)


@pytest.mark.real
def test_bench_runs_speculative_decoding_beside_plain(smollm2_path, capsys):
    """`bench --spec-type ngram-simple` (or -md): the same greedy answer plain and speculative, each
    one's decode rate and the drafted / kept tokens of the speculative runs."""
    from edgellm.cli import main

    assert main(["bench", str(smollm2_path), "--spec-type", "ngram-simple", "-n", "48", "-r", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["spec"]
    assert [r["mode"] for r in rows] == ["plain", "ngram-simple"]
    assert all(r["tokens"] == 48 and r["tg"] > 0 for r in rows)
    assert rows[0]["draft_n"] == 0 and 0 <= rows[1]["draft_n_accepted"] <= rows[1]["draft_n"]
    assert main(["bench", str(smollm2_path), "--spec-type", "draft-simple"]) != 0  # no draft model given
    assert "needs a draft model" in capsys.readouterr().err
