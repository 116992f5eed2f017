"""The import contracts in pyproject.toml ([tool.importlinter]): cpu/ and gpu/ import nothing from
hybrid/, gpu/ builds only on cpu/, no package's modules import each other in a circle, and inside
gpu/ the op set builds on the matmul family, which builds on the runtime, which imports no kernel."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    out = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "4 kept, 0 broken" in out.stdout
