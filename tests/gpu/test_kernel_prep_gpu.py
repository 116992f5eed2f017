"""A cold start on the GPU: the warm-up finds the CUDA kernels a drafting run needs, compiles
them in worker processes (counted), and the run then compiles nothing mid-way; a warm cache
compiles and prints nothing; a library run that never called warmup() compiles only before its
first token. Real GPU only: the simulator compiles no kernels."""
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, sys
from numba.cuda.dispatcher import CUDADispatcher
import hybrid
from hybrid.draft_policy import MAX_AUTO_DEPTH
seen = []
m = hybrid.load(device="cuda")
if sys.argv[1] == "warmup":
    m.warmup(8, progress=lambda d, t: seen.append((d, t)), draft_depth=MAX_AUTO_DEPTH)     # auto may try every depth up to it
compiled = []           # kernel names, and "token" after each generated token
inner = CUDADispatcher.compile
def compile(self, sig):
    known = len(self.overloads)
    out = inner(self, sig)
    if len(self.overloads) > known:
        compiled.append(self.py_func.__name__)
    return out
CUDADispatcher.compile = compile
texts = {}
for draft in ((0, 2, "auto") if sys.argv[1] == "warmup" else ("auto",)):
    texts[str(draft)] = []
    for e in m.generate("def fibonacci(n):", max_tokens=24, temperature=0, draft=draft):
        if hasattr(e, "text"):
            texts[str(draft)].append(e.text)
            compiled.append("token")
first = compiled.index("token") if "token" in compiled else len(compiled)
print(json.dumps({"progress": seen, "before": [c for c in compiled[:first] if c != "token"],
                  "mid_run": [c for c in compiled[first:] if c != "token"], "texts": texts}))
"""


def _run(cache_dir, how="warmup") -> dict:
    import json
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, how], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cold_gpu_warmup_counts_kernels_and_nothing_compiles_mid_run(on_real_gpu, tmp_path):
    if not on_real_gpu:
        pytest.skip("CUDA kernels compile only on a real GPU")
    cold = _run(tmp_path)
    done, total = cold["progress"][-1]
    assert done == total > 0 and cold["progress"][0][0] == 0
    assert cold["before"] == [] and cold["mid_run"] == [], (cold["before"], cold["mid_run"])
    texts = cold["texts"]
    assert texts["0"] == texts["2"] == texts["auto"]          # drafting stays lossless
    warm = _run(tmp_path)
    assert warm["progress"] == [] and warm["before"] == [] and warm["mid_run"] == []
    assert warm["texts"] == texts
    # no warmup() call: generate(draft="auto") builds (here: loads) what drafting may meet before
    # its prompt, so no step stalls on a call size first met mid-run
    library = _run(tmp_path, how="library")
    assert library["mid_run"] == [], library["mid_run"]
    assert library["texts"]["auto"] == texts["auto"]

