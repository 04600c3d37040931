"""A kernel compiled by one process is loaded, not compiled, by the next."""

from __future__ import annotations

import json
import subprocess
import sys


SCRIPT = r"""
import json, sys, torch, aoti_eager
x = torch.linspace(-4, 4, 40)
expected = torch.sigmoid(x)
aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=sys.argv[1])
results = [torch.sigmoid(x) for _ in range(3)]
stats = aoti_eager.stats()["aten::sigmoid"]
aoti_eager.disable()
for r in results:
    torch.testing.assert_close(r, expected)
print(json.dumps(stats))
"""


def run_process(cache_dir) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_makes_no_compile(tmp_path):
    first = run_process(tmp_path)
    assert (first["compiles"], first["cache_loads"], first["hits"]) == (1, 0, 2), first
    second = run_process(tmp_path)
    assert (second["compiles"], second["cache_loads"], second["hits"]) == (0, 1, 2), second
    assert second["fallbacks"] == 0
