"""A small training loop, for tests/test_training.py: run as a process of its
own (``python training_loop.py CACHE RESULT.json STEPS``), or imported.

Two copies of a small model train on the same batches with AdamW(foreach=True)
and ``clip_grad_norm_``: one with aoti_eager enabled for every op a step
reaches, one eagerly. The result file holds, per step, both losses and what
the enabled ops did (misses, compiles, cache loads); stdout and stderr carry
only the runtime's own log records, formatted with ``LOG_PREFIX``.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from typing import Callable

import torch

import aoti_eager

LOG_PREFIX = "aoti_eager-record:"


def model_and_steps() -> tuple[Callable[[], float], Callable[[], float], Callable[[], float]]:
    """A training step of each of two copies of one model (the first for
    aoti_eager, the second eager), and one of a third copy for ops_reached."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def trainer(model: torch.nn.Module) -> Callable[[], float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)

        def step() -> float:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        return step

    return trainer(model), trainer(copy.deepcopy(model)), trainer(copy.deepcopy(model))


def counts() -> dict[str, int]:
    rows = aoti_eager.stats().values()
    return {key: sum(row[key] for row in rows) for key in ("misses", "compiles", "cache_loads")}


def train(steps: int, cache_dir: str) -> dict:
    """Trains both copies for ``steps`` steps; what each step did."""
    step, eager_step, probe = model_and_steps()
    ops = aoti_eager.ops_reached(probe)
    aoti_eager.enable(ops, devices=["cpu"], cache_dir=cache_dir)
    rows, before = [], counts()
    for _ in range(steps):
        loss = step()
        now = counts()
        rows.append({"loss": loss, "eager_loss": eager_step(), **{k: now[k] - before[k] for k in now}})
        before = now
    stats = aoti_eager.stats()
    aoti_eager.disable()
    return {"ops": [str(op) for op in ops], "steps": rows, "stats": stats}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=f"{LOG_PREFIX} %(message)s")
    cache, result, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(result, "w") as f:
        json.dump(train(steps, cache), f)
