"""Regions recorded and prewarmed: fuse(record=...) appends a line per region
miss; prewarm(manifest, model=...) compiles them in the model's process; the
readers of ops pass region lines over with one note."""

from __future__ import annotations

import copy
import gc
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoti_eager
from aoti_eager import _regions
from aoti_eager.manifest import read_entries, read_manifest, regions_note
from helpers import Block, Model, cache_entries, delta_since, row

SIZES = (4, 6, 9)  # 4: a static kernel; 6: the family's dynamic kernel; 9: served by it
REGION = f"region::{Block.__module__}.Block"


class Other(torch.nn.Module):
    """A model whose repeated block is not a Block."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(2))

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


@pytest.fixture(autouse=True)
def _models_let_go():
    """A test's models are freed when it ends (transformers' hold cycles):
    stats() in later tests has no rows of their regions."""
    yield
    gc.collect()


def _model(seed: int) -> Model:
    torch.manual_seed(seed)
    return Model().eval()


def _run(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    with torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, 16)
            torch.testing.assert_close(model(x), reference(x))


def _lines(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A manifest of a run of three blocks at batch sizes 4, 6, 9 (compile="now")."""
    where = tmp_path_factory.mktemp("recorded")
    model = _model(0)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=where / "cache", record=where / "run.jsonl")
    _run(model, reference)
    aoti_eager.unfuse(model)
    return where / "run.jsonl"


def test_a_run_records_one_line_per_region_miss(recorded):
    lines = _lines(recorded)
    # 9 is served by the dynamic kernel that 6 compiled: no miss, no line.
    assert [(line["region"], line["device"], line["signature"][0]["sizes"]) for line in lines] == [
        (REGION, "cpu", [4, 16]), (REGION, "cpu", [6, 16])]
    model = aoti_eager.fuse(_model(1))
    structure = model.blocks[0].forward.__self__.state().structure
    assert {line["structure"] for line in lines} == {structure}
    assert {line["default_dtype"] for line in lines} == {"float32"}
    manifest = read_entries(recorded)
    assert manifest.ops == [] and [r.key for r in manifest.regions] == [line["key"] for line in lines]


NEW_PROCESS = r"""
import json, sys, torch, aoti_eager
from helpers import Block, Model, row
model = aoti_eager.fuse(Model().eval(), cache_dir=sys.argv[1])
with torch.no_grad():
    model(torch.randn(9, 16))
print(json.dumps({k: row(Block)[k] for k in ("calls", "hits", "compiles", "cache_loads")}))
"""


def test_a_model_prewarmed_from_the_manifest_runs_with_no_compile(recorded, tmp_path):
    model = _model(1)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    before = row(Block)
    report = aoti_eager.prewarm(recorded, model=model, cache_dir=tmp_path)
    assert [(r.entry.op, r.outcome.status) for r in report.results] == [(REGION, "compiled")] * 2
    assert report.skipped_regions == [] and delta_since(before, Block)["compiles"] == 2
    # The static kernel, then the family's dynamic one, as the run compiled them.
    assert sorted("-" in key for _, key in cache_entries(tmp_path)) == [False, True]
    before = row(Block)
    _run(model, reference)
    assert delta_since(before, Block) == {"calls": 9, "hits": 9, "fallbacks": 0, "compiles": 0, "cache_loads": 0}
    # A new process, at a batch size the dynamic kernel serves: its first call a hit too.
    child = subprocess.run([sys.executable, "-c", NEW_PROCESS, str(tmp_path)], capture_output=True, text=True, timeout=600,
                           cwd=Path(__file__).parent)
    assert child.returncode == 0, child.stderr[-2000:]
    # (its first call runs the original forward, recording what it reads)
    assert json.loads(child.stdout.splitlines()[-1]) == {"calls": 3, "hits": 2, "compiles": 0, "cache_loads": 1}
    # Again: what the cache holds is not compiled again.
    again = aoti_eager.prewarm(recorded, model=model, cache_dir=tmp_path)
    assert [r.outcome.status for r in again.results] == ["cached"] * 2


def test_compile_never_records_each_miss_once(tmp_path):
    manifest = tmp_path / "never.jsonl"
    model = aoti_eager.fuse(_model(0), compile="never", cache_dir=tmp_path / "cache", record=manifest)
    with torch.no_grad():
        for n in (4, 4, 6):
            model(torch.randn(n, 16))
    aoti_eager.unfuse(model)
    # Another fuse (another process's recorder) does not write a line the file has.
    model = aoti_eager.fuse(model, compile="never", cache_dir=tmp_path / "cache", record=manifest)
    with torch.no_grad():
        model(torch.randn(6, 16))
    assert [line["signature"][0]["sizes"] for line in _lines(manifest)] == [[4, 16], [6, 16]]


def test_the_record_setting_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_RECORD", str(tmp_path / "env.jsonl"))
    model = aoti_eager.fuse(_model(0), compile="never", cache_dir=tmp_path / "cache")
    with torch.no_grad():
        model(torch.randn(4, 16))
    assert [line["region"] for line in _lines(tmp_path / "env.jsonl")] == [REGION]


@pytest.fixture
def mixed(recorded, tmp_path) -> Path:
    """The recorded region lines and a line of aten::abs."""
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text(recorded.read_text())
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path / "scratch", record=manifest, compile="never")
    try:
        torch.abs(torch.randn(5))
    finally:
        aoti_eager.disable()
    assert [("op" in line, "region" in line) for line in _lines(manifest)] == [(False, True)] * 2 + [(True, False)]
    return manifest


def test_op_readers_pass_region_lines_over_with_one_note(mixed, recorded, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        assert [e.op for e in read_manifest(mixed)] == ["aten::abs"]
    assert [r.getMessage() for r in caplog.records] == [f"aoti_eager: {mixed}: {regions_note(2)}"]
    caplog.clear()
    op_only = tmp_path / "ops.jsonl"
    op_only.write_text(mixed.read_text().splitlines()[-1] + "\n")
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        assert [e.op for e in read_manifest(op_only)] == ["aten::abs"]
    assert caplog.records == []
    # Without a model, the Python API says the same, once, and compiles the ops.
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        report = aoti_eager.prewarm(recorded, cache_dir=tmp_path / "cache")
    assert report.results == [] and [s.reason for s in report.skipped_regions] == ["no model given"] * 2
    assert [r.getMessage() for r in caplog.records] == [f"aoti_eager: {regions_note(2)}"]


def test_the_cli_prewarms_the_ops_and_notes_the_regions(mixed, tmp_path):
    cache = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "aoti_eager", "--cache-dir", str(cache), "prewarm", str(mixed), "--jobs", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (done.stdout + done.stderr).count(regions_note(2)) == 1
    assert "aten::abs" in done.stdout and "Traceback" not in done.stderr
    assert {op for op, _ in cache_entries(cache)} == {"aten::abs"}
    again = subprocess.run([sys.executable, "-m", "aoti_eager", "--cache-dir", str(cache), "prewarm", str(mixed), "--json"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stderr.count(regions_note(2)) == 1, again.stdout + again.stderr
    report = json.loads(again.stdout)
    assert [(r["op"], r["status"]) for r in report["results"]] == [("aten::abs", "cached")]
    assert [s["reason"] for s in report["skipped_regions"]] == ["no model given"] * 2


def test_a_mixed_manifest_prewarms_ops_in_workers_and_regions_with_the_model(mixed, tmp_path):
    model = _model(2)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path / "cache")
    report = aoti_eager.prewarm(mixed, model=model, cache_dir=tmp_path / "cache", jobs=1)
    assert sorted((r.entry.op, r.outcome.status) for r in report.results) == [
        ("aten::abs", "compiled"), (REGION, "compiled"), (REGION, "compiled")]
    assert {op for op, _ in cache_entries(tmp_path / "cache")} == {"aten::abs", REGION}
    before = row(Block)
    _run(model, reference)
    assert delta_since(before, Block)["compiles"] == 0


def test_a_line_the_model_does_not_match_is_skipped_with_its_reason(recorded, tmp_path):
    plain = _model(0)  # not fused
    report = aoti_eager.prewarm(recorded, model=plain, cache_dir=tmp_path)
    assert [s.reason for s in report.skipped_regions] == [f"the model has no fused instance of {REGION} (fuse it before prewarm)"] * 2
    other = aoti_eager.fuse(Other(), cache_dir=tmp_path)
    report = aoti_eager.prewarm(recorded, model=other, cache_dir=tmp_path)
    assert [s.reason for s in report.skipped_regions] == [f"the model has no fused instance of {REGION}"] * 2
    wide = Model()
    wide.blocks = torch.nn.ModuleList(Block(32) for _ in range(3))  # Blocks of another width
    aoti_eager.fuse(wide, modules=[Block], cache_dir=tmp_path)
    report = aoti_eager.prewarm(recorded, model=wide, cache_dir=tmp_path)
    assert report.results == [] and all("another state structure" in s.reason for s in report.skipped_regions)
    assert "SKIPPED" in aoti_eager._prewarm.summary(report)
    assert cache_entries(tmp_path) == []


def test_a_recorded_call_keyed_otherwise_here_fails_with_its_reason(recorded, tmp_path):
    line = _lines(recorded)[0]
    line["key"] = "0" * 24
    manifest = tmp_path / "edited.jsonl"
    manifest.write_text(json.dumps(line) + "\n")
    model = aoti_eager.fuse(_model(0), cache_dir=tmp_path)
    report = aoti_eager.prewarm(manifest, model=model, cache_dir=tmp_path)
    assert [(r.outcome.status, r.outcome.reason) for r in report.results] == [
        ("failed", "its call rebuilt here is keyed differently from the recorded one (the values its forward reads, "
                   "or its code, differ)")]
    assert cache_entries(tmp_path) == []


def test_a_region_line_that_is_not_one_names_its_line(recorded, tmp_path):
    line = _lines(recorded)[0]
    del line["spec"]
    manifest = tmp_path / "broken.jsonl"
    manifest.write_text(recorded.read_text() + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:3: not a manifest entry"):
        read_entries(manifest)


def _gpt2(transformers, seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_blocks_prewarmed_from_a_recorded_run(tmp_path):
    """Blocks called with keyword arguments (masks, None, flags): rebuilt from the line."""
    transformers = pytest.importorskip("transformers")
    model = aoti_eager.fuse(_gpt2(transformers, 0), cache_dir=tmp_path / "run", record=tmp_path / "gpt2.jsonl")
    with torch.no_grad():
        for length in (8, 12):
            model(torch.randint(0, 100, (2, length)), use_cache=False)
    lines = _lines(tmp_path / "gpt2.jsonl")
    assert len(lines) == 2 and any(d["name"].startswith("kwargs") for d in lines[0]["signature"])
    fresh = _gpt2(transformers, 1)
    reference = copy.deepcopy(fresh)
    block = type(fresh.transformer.h[0])
    aoti_eager.fuse(fresh, cache_dir=tmp_path / "fresh")
    report = aoti_eager.prewarm(tmp_path / "gpt2.jsonl", model=fresh, cache_dir=tmp_path / "fresh")
    assert [r.outcome.status for r in report.results] == ["compiled"] * 2, [r.outcome.reason for r in report.results]
    before = row(block)
    with torch.no_grad():
        for length in (8, 12, 16):
            ids = torch.randint(0, 100, (2, length))
            torch.testing.assert_close(fresh(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)
    assert delta_since(before, block) == {"calls": 6, "hits": 6, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


class Indexed(torch.nn.Module):
    """Looks its input up in a table of 2 rows: random indices run past it."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(2, 16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, ids):
        return self.fc(x) + self.table(ids)


class Lookups(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Indexed() for _ in range(2))

    def forward(self, x, ids):
        for block in self.blocks:
            x = block(x, ids)
        return x


def test_a_call_whose_random_integers_eager_refuses_is_prewarmed_with_zeros(tmp_path):
    x, ids = torch.randn(16, 16), torch.randint(0, 2, (16,))
    model = aoti_eager.fuse(Lookups().eval(), compile="never", cache_dir=tmp_path / "run", record=tmp_path / "ids.jsonl")
    with torch.no_grad():
        model(x, ids)
    fresh = Lookups().eval()
    reference = copy.deepcopy(fresh)
    aoti_eager.fuse(fresh, cache_dir=tmp_path / "fresh")
    report = aoti_eager.prewarm(tmp_path / "ids.jsonl", model=fresh, cache_dir=tmp_path / "fresh")
    assert [r.outcome.status for r in report.results] == ["compiled"], [r.outcome.reason for r in report.results]
    before = row(Indexed)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, ids), reference(x, ids))
    assert delta_since(before, Indexed) == {"calls": 2, "hits": 2, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


def test_a_worker_handed_a_region_line_answers_it_and_goes_on(recorded, tmp_path):
    from aoti_eager import _worker

    entries = read_entries(recorded).regions
    worker = _worker.Worker(tmp_path)
    try:
        outcomes = [worker.compile(entry) for entry in entries]
    finally:
        worker.close()
    assert outcomes == [_worker.Outcome("failed", regions_note(1))] * 2
