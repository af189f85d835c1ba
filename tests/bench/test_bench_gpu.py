"""``bench/gpu.py --tiny``: the device script's code paths on the CPU (Triton interpreter), on a machine
that has only what the GPU machine has (platformdirs, sqlite-utils, textual and gguf made unimportable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("platformdirs", "sqlite_utils", "textual", "gguf")
# runs a script as ``python SCRIPT`` does (its folder first on sys.path, the working directory after it,
# as ``-c`` puts it) with BLOCKED unimportable: ``sys.modules[name] = None`` makes ``import name`` raise
# ImportError
_RUNNER = ("import os, runpy, sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in BLOCKED)
           + "sys.argv = sys.argv[1:]\nsys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
           + "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _run(args: list[str], tmp_path: Path, timeout: int = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVCHAT_HOME": str(tmp_path / "home"),
           "KVCHAT_MODELS": str(tmp_path / "models"), "OPENBLAS_NUM_THREADS": "1"}
    env.pop("KVCHAT_ATTENTION", None)
    return subprocess.run([sys.executable, "-c", _RUNNER, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd or tmp_path)


@pytest.mark.timeout(900)
def test_gpu_script_tiny_runs_every_section_without_the_app_only_packages(tmp_path):
    """Run from the checkout root, where ``bench/`` and the root both sit on ``sys.path``: section (d)
    imports transformers' model code, which imports Hugging Face's ``kernels``; neither
    ``bench/gpu_kernels.py`` nor the root's ``kernels/`` folder may pose as it."""
    out = tmp_path / "gpu.json"
    proc = _run([str(ROOT / "bench" / "gpu.py"), "--tiny", "--json", str(out)], tmp_path, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    assert list(sections) == ["a_checks", "b_copy", "c_attention", "c_sweep", "d_engine", "e_restore",
                              "f_resume_large", "g_fit_24gb", "h_warm_start"]
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["result"] for k, s in sections.items()}
    checks = sections["a_checks"]["result"]
    assert len(checks) == 6 and all(c["ok"] for c in checks)  # fp8 + fp16 pools x write/decode/extend
    assert sections["b_copy"]["result"]["gbps"] > 0
    assert {(r["what"], r["batch"]) for r in sections["c_attention"]["result"]} == {("decode", 1), ("decode", 2), ("write", 1)}
    pools = sections["d_engine"]["result"]["tiny"]["pools"]
    assert set(pools) == {"fp8", "fp16"}
    for pool in pools.values():
        assert pool["load"]["weight_bytes"] > 0 and pool["load"]["load_s"] > 0
        assert [r["context"] for r in pool["runs"]] == [64, 160]
        assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_tok_s_eager"] > 0
                   and r["decode_graphs"].startswith("eager: no graphs on cpu") for r in pool["runs"])
        # a decode step on the GPU path (the fused Triton kernels): at most 14 launches per decoder layer
        assert all(0 < r["launches_per_layer"] <= 14 and r["launches_outside_layers"] > 0
                   and "_rope_write_kernel" in r["layer_launch_ops"] for r in pool["runs"])
    sweep = sections["c_sweep"]["result"]
    plain = {"n128w4s3x1", "n128w4s3x2", "n64w4s3x1", "n64w4s3x2"}  # every pool; fp8 also in fp16 math ("h")
    assert {r["tiles"] for r in sweep if r["kv_dtype"] != "fp8"} == plain
    assert {r["tiles"] for r in sweep if r["kv_dtype"] == "fp8"} == plain | {"n128w4s3x2h", "n64w4s3x2h"}
    assert all(r["what"] == "sweep" and r["ms"] > 0 for r in sweep)
    for pool in pools.values():  # the large shape's extras run on the tiny one here
        assert [b["batch"] for b in pool["batch"]] == [1, 2] and all(b["decode_tok_s_total"] > 0 for b in pool["batch"])
    # without sqlite-utils the sections on the store say why instead of crashing
    for name in ("e_restore", "f_resume_large", "g_fit_24gb", "h_warm_start"):
        result = sections[name]["result"]
        assert result["status"] == "not run" and "sqlite_utils" in result["reason"], (name, result)


def test_kernel_bench_engine_step_runs_without_platformdirs(tmp_path):
    """bench/gpu_kernels.py's step (d) imports the engine, which must not need platformdirs (settings at import)."""
    script = tmp_path / "step_d.py"
    script.write_text(
        "import importlib.util, sys, torch\n"
        f"spec = importlib.util.spec_from_file_location('kvchat_bench_kernels', {str(ROOT / 'bench' / 'gpu_kernels.py')!r})\n"
        "bench = importlib.util.module_from_spec(spec); sys.modules[spec.name] = bench; spec.loader.exec_module(bench)\n"
        "tps, steps = bench.engine_decode_tokens_per_s(torch.device('cpu'), tiny=True, kv_dtype='fp8')\n"
        "assert tps > 0 and steps == 3\n"
        "assert 'platformdirs' not in sys.modules or sys.modules['platformdirs'] is None\n"
        "print('ok')\n")
    proc = _run([str(script)], tmp_path, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_gpu_script_exits_nonzero_after_writing_a_failed_section(tmp_path):
    """A section that raises is recorded in the JSON, the next sections still run, and the exit status says so."""
    script = tmp_path / "failing_d.py"
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('kvchat_gpu_bench', {str(ROOT / 'bench' / 'gpu.py')!r})\n"
        "gpu = importlib.util.module_from_spec(spec); sys.modules[spec.name] = gpu; spec.loader.exec_module(gpu)\n"
        "def broken(*args): raise RuntimeError('injected failure')\n"
        "gpu.section_engine = broken\n"
        f"sys.exit(gpu.main(['--tiny', '--only', 'b', '--only', 'd', '--json', {str(tmp_path / 'out.json')!r}]))\n")
    proc = _run([str(script)], tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    sections = json.loads((tmp_path / "out.json").read_text())["sections"]
    assert sections["b_copy"]["status"] == "ok"
    assert sections["d_engine"]["status"] == "error" and "injected failure" in sections["d_engine"]["result"]["error"]
    assert "failed sections: d_engine" in proc.stderr
