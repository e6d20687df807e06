"""The PPO throughput benchmark (numbarl/bench/ppo.py) runs end to end at tiny shapes under the simulator
(its numbers are not timings there), so it cannot rot before its GPU run: the agent's graphs replayed as
the trainer does, the check against the PyTorch peer (must agree), the PyTorch rows, the table and the JSON."""

import json

import numpy as np
import pytest

TINY = ["--preset", "tiny", "--n-envs", "2", "--rollout", "2", "--epochs", "1", "--minibatches", "2",
        "--trunk", "4", "--features", "3", "--bars", "300", "--compute", "fp32", "--iters", "1", "--reps", "1"]


def test_bench_ppo_runs_at_tiny_shapes(tmp_path, capsys):
    pytest.importorskip("torch")
    from numbarl.bench import ppo as bench

    out = tmp_path / "ppo.json"
    assert bench.main(TINY + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["n_envs"] == 2 and r["rollout"] == 2 and r["minibatch"] == 2 and r["trunk"] == [4]
    chk = r["check"]
    assert chk["available"] and chk["agrees"], chk
    assert chk["loss_relerr"] <= 1e-5 and chk["grad_relerr_max"] <= 1e-4
    nb = r["numbarl"]["fp32"]
    for key in ("iteration_ms", "collect_step_ms", "update_ms", "minibatch_step_ms", "env_step_ms"):
        assert np.isfinite(nb[key]) and nb[key] > 0, key
    # warm-up + 1 timed iteration, 1 update replay and the check's step: updates and optimizer steps counted
    assert nb["stats_after"]["ppo_updates"] >= 3 and nb["stats_after"]["nonfinite_step"] == -1
    t = r["torch"]["fp32"]
    assert t["act_eager_ms"] > 0 and t["update_eager_ms"] > 0 and "eager" in t
    assert "AGREES" in text and "NO env" in text and "SIMULATOR" in text


def test_torch_ppo_update_trains_on_the_rollout():
    """The PyTorch side's update (GAE into its fixed buffers, K x M minibatch steps) changes the weights
    and normalizes the advantages over the rollout, like numbarl's."""
    torch = pytest.importorskip("torch")
    from numbarl.bench.ppo import TorchPPO
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.ppo import PPOAgent

    sizes = (3, 2)
    agent = PPOAgent(AgentConfig(kind="ppo", trunk=(5,), ppo_rollout=3, ppo_epochs=2, ppo_minibatches=2), 4, sizes, 2, 1)
    rng = np.random.default_rng(0)
    T, N = 3, 2
    mask = np.ones((T, N, 2, 3), np.uint8)
    mask[:, :, 1, 2] = 0
    rollout = {"obs": rng.normal(size=(T, N, 4)).astype(np.float32), "actions": np.zeros((T, N, 2), np.int32),
               "logp": np.full((T, N), -np.log(6.0), np.float32), "value": rng.normal(size=(T, N)).astype(np.float32),
               "reward": rng.normal(size=(T, N)).astype(np.float32), "done": np.zeros((T, N), np.uint8), "mask": mask}
    params = agent.store.to_host("params")
    tp = TorchPPO(agent, params, rollout, "cpu")
    before = tp.net.pi.weight.detach().clone()
    tp.update_eager()
    assert not torch.equal(before, tp.net.pi.weight)
    assert float(tp.adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(tp.adv.std(unbiased=False)) == pytest.approx(1.0, rel=1e-4)
    tp.act(1)
    a = tp.data["actions"][1].numpy()
    assert np.all(a[:, 1] < 2)  # a masked action is never sampled
