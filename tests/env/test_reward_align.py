"""bin/reward-align end to end on a small grid: it prints one row per (sigma, theta) and, per sigma, the best
theta of the reward and of net P&L."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reward_align_prints_the_grid_and_the_verdict(tmp_path):
    env = {**os.environ, "NUMBARL_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, str(ROOT / "bin" / "reward-align"), "--envs", "8", "--steps", "60",
                        "--sigmas", "0.06", "--quantiles", "0,0.5", "--set", "env.trade_reward_scale=0.01",
                        "--set", "env.micro_reward_scale=100", "--set", "env.pnl_reward_scale=0"],  # the earlier default
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 0.06 |")]
    assert len(rows) == 2 and "trade 0.01, micro 100, pnl 0," in r.stdout.splitlines()[0]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6 and float(cells[2]) >= 0.0  # trades per 1,000 steps
    assert "sigma 0.06: the reward's best theta quantile" in r.stderr
