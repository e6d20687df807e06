"""Replay the freeze detector (numbarl/rl/freeze.py, agent.freeze_reset's defaults) over finished runs' metrics.

Usage: python docs/results/2026-12-03-session14/freeze_replay.py RUN_FOLDER ...
(e.g. the folders of docs/results/2026-12-02-session12/runs-finished.tgz, unpacked). For each run: how often the
detector fires, the smallest per-epoch move of the watched statistics, and the smallest logged gradient norm.
"""

import json
import sys
from pathlib import Path

from numbarl.config import AgentConfig
from numbarl.rl.freeze import FreezeDetector

for folder in map(Path, sys.argv[1:]):
    last = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            last[rec.get("epoch")] = rec  # each epoch's last train record
    det = FreezeDetector.from_config(AgentConfig())
    epochs = sorted(last)
    fires = sum(bool(det.update(last[e])) for e in epochs)
    moves = [max(abs(last[b][k] - last[a][k]) for k in det.keys) for a, b in zip(epochs, epochs[1:])]
    grad = min(last[e][det.grad_key] for e in epochs)
    print(f"{folder.name}: fires {fires}, smallest epoch move {min(moves):.2e}, smallest gradient norm {grad:.3f}")
