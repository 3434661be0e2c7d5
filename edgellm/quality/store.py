"""Quality reports kept for `plan`: what `edgellm quality` measured, found again by model.

A report is stored as JSON (QualityReport.to_dict, the `--json` output) at
`<cache dir>/quality/<model key>.json`. The key names the model whatever its quant type: its
architecture, `general.name` and every tensor's name and shape, hashed. So the base file the report was
measured on and every quantization of it (an F16 file and the Q4_K_M made from it) share one report,
and `edgellm plan` on any of them can advise a measured smaller type. A later run for the same model
replaces the report.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

REPORT_VERSION = 1


def model_key(gf) -> str:
    """16 hex digits naming the model behind an open GGUFFile, the same for all its quant types."""
    h = hashlib.sha256()
    h.update(f"{gf.metadata.get('general.architecture', '')}\0{gf.metadata.get('general.name', '')}\0".encode("utf-8", "surrogateescape"))
    for name in sorted(gf.tensors):
        h.update(f"{name}:{','.join(map(str, gf.tensors[name].ne))}\0".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def report_path(key: str) -> Path:
    from edgellm.fetch import cache_dir

    return cache_dir() / "quality" / f"{key}.json"


def save(rep, key: str) -> Path:
    """Write QualityReport `rep` for the model `key`; returns the path (written whole, then renamed)."""
    path = report_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps({"version": REPORT_VERSION, "model_key": key, **rep.to_dict()}, indent=1) + "\n")
    tmp.replace(path)
    return path


def measured_types(gf) -> tuple:
    """The stored report's quant types for this model as planner.MeasuredType, () when there is none
    (or it cannot be read: a report is advice, never a reason to fail)."""
    from edgellm.planner import MeasuredType

    path = report_path(model_key(gf))
    try:
        d = json.loads(path.read_text())
        if d.get("version") != REPORT_VERSION:
            return ()
        base = str(d["base_type"])
        return tuple(MeasuredType(str(r["type"]), float(r["bits_per_weight"]), float(r["kl_mean"]),
                                  float(r["same_top"]), base, str(path))
                     for r in d["rows"] if not str(r["type"]).endswith("(base)"))
    except (OSError, ValueError, KeyError, TypeError):
        return ()
