"""`hybrid info`: JSON keys and values, the human summary, and clean errors (no traceback)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hybrid.cli import app, main

from ..conftest import BUNDLED_MODEL
from .ggufs import patch, write_tiny_model

runner = CliRunner()


def info_json(*args: str) -> dict:
    result = runner.invoke(app, ["info", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)   # exactly one JSON object, nothing else


def test_json_of_the_default_model():
    s = info_json()
    assert s["path"] == str(BUNDLED_MODEL.resolve())
    assert (s["architecture"], s["n_layer"], s["n_nextn"], s["n_embd"], s["n_vocab"]) == ("qwen35", 8, 1, 512, 8192)
    assert s["layer_kinds"] == ["gdn", "gdn", "gdn", "attn", "gdn", "gdn", "gdn", "attn"]
    assert s["tensor_types"] == {"Q4_K": 61, "F32": 52, "Q6_K": 11}
    assert list(s["bytes_by_role"]) == ["embeddings", "lm_head", "trunk", "ffn", "mtp"]
    assert sum(s["bytes_by_role"].values()) == sum(s["bytes_by_type"].values()) == s["tensor_bytes"]
    assert s["tensor_bytes"] < s["file_bytes"] == 20_584_608
    assert s["config"]["n_ff"] == 1024 and s["config"]["ssm_n_v_heads"] == 8 and s["tied_output"] is False
    assert s["layers"] == "8 trunk: 6 GDN + 2 attention; MTP block at blk.8"


def test_json_of_a_tied_moe_model(tmp_path):
    path = tmp_path / "moe.gguf"
    write_tiny_model(path, "qwen3next", tied_output=True)
    s = info_json(str(path))
    assert (s["architecture"], s["n_layer"], s["tied_output"], s["mtp_block"]) == ("qwen3next", 4, True, "blk.4")
    assert s["bytes_by_role"]["lm_head"] == 0 and s["config"]["n_expert"] == 4
    assert s["tensor_types"]["Q8_0"] > 0 and s["file_bytes"] == path.stat().st_size


def test_human_summary():
    result = runner.invoke(app, ["info", str(BUNDLED_MODEL)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("qwen35", "8 trunk: 6 GDN + 2 attention; MTP block at blk.8", "Q4_K", "Q6_K",
                 "embeddings", "lm_head", "trunk", "ffn", "mtp", "separate output.weight", "width 1024"):
        assert text in out, text


def test_human_summary_moe(tmp_path):
    path = tmp_path / "moe.gguf"
    write_tiny_model(path, "qwen35moe", tied_output=True)
    out = runner.invoke(app, ["info", str(path)]).stdout
    assert "qwen35moe" in out and "2 of 4 experts" in out and "tied to token_embd" in out


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["hybrid", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code, unwrap(capsys.readouterr().err)


def unwrap(text: str) -> str:
    """rich wraps long error lines at the terminal width; compare text, not line breaks."""
    return " ".join(text.split())


def test_missing_file_exits_1_with_message(monkeypatch, capsys, tmp_path):
    code, err = run_main(monkeypatch, capsys, "info", str(tmp_path / "nope.gguf"))
    assert code == 1 and "model file not found" in err and "Traceback" not in err


def test_broken_file_exits_1_with_message_in_a_real_process(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_model(path)
    patch(path, 0, b"GGML")
    proc = subprocess.run([sys.executable, "-c", "from hybrid.cli import main; main()", "info", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "is not a GGUF file" in unwrap(proc.stderr) and "Traceback" not in proc.stderr + proc.stdout
