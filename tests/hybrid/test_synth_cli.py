"""`hybrid make-model` and tools/make_model.py."""
import subprocess
import sys
from pathlib import Path

import gguf
from typer.testing import CliRunner

from hybrid.cli import app
from hybrid.errors import HybridError

ROOT = Path(__file__).resolve().parents[2]
TINY_ARGS = ["--layers", "2", "--interval", "2", "--method", "codes"]


def invoke(*args):
    return CliRunner().invoke(app, ["make-model", *map(str, args)])


def test_make_model_writes_the_requested_model(tmp_path):
    out = tmp_path / "m.gguf"
    r = invoke(out, "--arch", "qwen3next", "--no-mtp", "--type", "Q8_0", "--seed", "3", *TINY_ARGS)
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output
    fields = gguf.GGUFReader(out).fields
    assert fields["general.architecture"].contents() == "qwen3next"
    assert fields["qwen3next.block_count"].contents() == 2          # no MTP block
    assert fields["general.file_type"].contents() == 7              # MOSTLY_Q8_0


def test_make_model_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    r = invoke(out, *TINY_ARGS)
    assert isinstance(r.exception, HybridError) and "--force" in str(r.exception)
    assert out.read_bytes() == b"keep me"
    r = invoke(out, "--force", *TINY_ARGS)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"GGUF"


def test_bad_options_are_user_errors(tmp_path):
    r = invoke(tmp_path / "m.gguf", "--preset", "27b", "--arch", "qwen3next")
    assert isinstance(r.exception, HybridError)
    r = invoke(tmp_path / "m.gguf", "--embd", "100")
    assert isinstance(r.exception, HybridError) and "multiples of 256" in str(r.exception)
    assert not (tmp_path / "m.gguf").exists()


def test_tools_script_prints_the_27b_plan_without_writing(tmp_path):
    out = tmp_path / "big.gguf"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), str(out), "--preset", "27b",
                        "--plan"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "blk.64.nextn.eh_proj.weight" in r.stdout and "866 tensors" in r.stdout.replace("\n", " ")
    assert not out.exists()
