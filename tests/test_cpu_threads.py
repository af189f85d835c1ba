"""``on_own_thread``: a model is loaded on a thread that ends (PyTorch's OpenMP pool of the loading thread goes with it)."""

from __future__ import annotations

import threading

import pytest

from kvchat.cpu_threads import on_own_thread


def test_runs_on_another_thread_that_ends_and_returns_the_result():
    seen = []

    def work(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert on_own_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_its_exception_is_raised_on_the_caller():
    def fail():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_own_thread(fail)


def test_openmp_spins_are_short_unless_the_user_chose():
    from kvchat.cpu_threads import short_openmp_spins

    for given, expected in (({}, ("1000", None)), ({"OMP_WAIT_POLICY": "PASSIVE"}, (None, "PASSIVE")),
                            ({"GOMP_SPINCOUNT": "10000"}, ("10000", None))):
        env = dict(given)
        short_openmp_spins(env)
        assert (env.get("GOMP_SPINCOUNT"), env.get("OMP_WAIT_POLICY")) == expected, given


@pytest.mark.parametrize("user, shown", [(None, "GOMP_SPINCOUNT = '1000'"), ("PASSIVE", "GOMP_SPINCOUNT = '0'")])
def test_the_kvchat_command_gives_torchs_openmp_runtime_a_short_spin(tmp_path, user, shown):
    """libgomp (torch's OpenMP runtime) prints what it runs with (OMP_DISPLAY_ENV) as torch loads it: 1,000
    rounds before sleeping unless the user chose (its default, nothing set, spins 300,000; passive spins 0)."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_DISPLAY_ENV": "VERBOSE", "KVCHAT_HOME": str(tmp_path / "home")} | ({"OMP_WAIT_POLICY": user} if user else {})
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "plan", "--model", str(tmp_path), "--json"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert shown in proc.stdout + proc.stderr
