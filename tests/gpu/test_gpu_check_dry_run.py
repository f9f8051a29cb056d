"""tests/gpu/run.sh --dry-run: the prepared device check runs on the CPU, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_passes_and_writes_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([str(ROOT / "tests" / "gpu" / "run.sh"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    checks = doc["checks"]
    assert doc["dry_run"] is True
    assert set(checks) == {"kernels", "parity", "serve_p1d1", "staged_2to1", "decode_roofline", "cuda_graphs",
                           "layer_overlap"}
    assert all(c["status"].startswith(("ok", "skipped")) for c in checks.values()), checks
    # the Triton kernels (interpreted) equal their torch references
    errs = checks["kernels"]["max_abs_err"]
    assert {"store_kv_float32", "paged_decode_attention_float32", "pack_kv_float32", "unpack_kv_float32"} <= set(errs)
    assert max(errs.values()) <= 1e-5
    assert checks["parity"]["sequences_equal"] == checks["parity"]["of"] == 3
    # two prefill rank agents wrote their head slices into one decode agent: one write per rank per layer
    assert checks["staged_2to1"]["writes"] == checks["staged_2to1"]["expected_writes"] == 4
    assert checks["decode_roofline"]["decode_step_ms"] > 0
    assert checks["cuda_graphs"]["status"].startswith("skipped")
    # every layer's write reached the sink (checksummed there); on the CPU each is posted at once
    ov = checks["layer_overlap"]
    assert ov["posted_during_forward"] == ov["posted_at_end"] == 0 and ov["memory"] == "DRAM"


def test_gpu_check_refuses_without_cuda_unless_dry_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = subprocess.run([str(ROOT / "tests" / "gpu" / "run.sh")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--dry-run" in r.stderr


@pytest.mark.parametrize("only", [["nonexistent_check"], ["kernels", "nonexistent_check"], []])
def test_gpu_check_refuses_an_unknown_check_name(tmp_path, only):
    """An unknown --only name (or none) is exit 2 naming the valid checks, before any check runs or JSON is written."""
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([str(ROOT / "tests" / "gpu" / "run.sh"), "--dry-run", "--out", str(out), "--only", *only],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "nonexistent_check" in r.stderr if only else "--only" in r.stderr
    for name in ("kernels", "parity", "serve_p1d1", "staged_2to1", "decode_roofline", "cuda_graphs", "layer_overlap"):
        assert name in r.stderr
    assert not out.exists() and "[gpu-check]" not in r.stdout
