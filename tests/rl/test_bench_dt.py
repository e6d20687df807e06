"""The Decision Transformer benchmark (numbarl/bench/dt.py) runs end to end at tiny shapes under the simulator
(its numbers are not timings there), so it cannot rot before its GPU run: the agent built and its graphs
replayed as the trainer does, the check against the PyTorch peer (must agree), the acting rows, the
validation backtest, the PyTorch rows, the table and the JSON."""

import json

import numpy as np
import pytest

TINY = ["--preset", "tiny", "--n-envs", "2", "--context", "2", "--embed", "4", "--heads", "2", "--layers", "1",
        "--batch", "2", "--rollout", "3", "--updates", "1", "--features", "3", "--bars", "300", "--val-bars", "4",
        "--compute", "fp32", "--iters", "1", "--reps", "1"]


def test_bench_dt_runs_at_tiny_shapes(tmp_path, capsys):
    pytest.importorskip("torch")
    from numbarl.bench import dt as bench

    out = tmp_path / "dt.json"
    assert bench.main(TINY + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["n_envs"], r["context"], r["embed"], r["batch"], r["rollout"], r["updates"]) == (2, 2, 4, 2, 3, 1)
    assert r["tokens_per_step"] == 2 * 3 * 2 and r["samples_per_step"] == 2 * 2 and r["token_dim"] == 3
    chk = r["check"]
    assert chk["available"] and chk["agrees"], chk
    assert chk["loss_relerr"] <= 1e-5 and chk["grad_relerr_max"] <= 1e-4 and chk["torch_dt_grad_relerr_max"] <= 1e-9
    nb = r["numbarl"]["fp32"]
    for key in ("train_step_ms", "update_ms", "collect_step_ms", "iteration_ms", "act_ms", "act_p1_ms",
                "train_samples_per_s", "train_tokens_per_s", "act_env_steps_per_s", "env_steps_per_s_incl_update"):
        assert np.isfinite(nb[key]) and nb[key] > 0, key
    v = nb["validation"]
    assert v["bars"] == 4 and np.isfinite(v["s_cached"]) and v["s_cached"] > 0 and v["ms_per_bar_cached"] > 0
    # the first update and the timed replays trained; nothing went non-finite
    assert nb["stats_after"]["dt_updates"] >= 2 and nb["stats_after"]["nonfinite_step"] == -1
    assert np.isfinite(nb["stats_after"]["loss"])
    t = r["torch"]["fp32"]
    assert t["train_step_eager_ms"] > 0 and t["act_eager_ms"] > 0 and "graphed_error" in t  # no CUDA here
    assert "AGREES" in text and "SIMULATOR" in text and "validation backtest" in text


def test_torch_dt_matches_the_peer_and_trains():
    """The timed PyTorch DT (SDPA attention, F.cross_entropy) is the peer's computation: same loss and
    gradients in float64 on one batch; its train step changes the weights; its acting forward returns
    the newest state token's logits of each window."""
    torch = pytest.importorskip("torch")
    from numbarl.bench.dt import TorchDT, torch_dt_logits
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dt import DTAgent
    from numbarl.rl.nets.dt import tokens_ref
    from numbarl.rl.torch_peer_dt import dt_loss_and_grads

    sizes, S, B, L = (3, 2), 4, 3, 2
    cfg = AgentConfig(kind="dt", dt_rollout=3, dt_context=L, dt_batch=B, dt_embed=8, dt_heads=2, dt_layers=2,
                      dt_portfolio=True, activation="silu")
    agent = DTAgent(cfg, S, sizes, 2, 0)
    rng = np.random.default_rng(1)
    actions = np.stack([rng.integers(0, n, size=(B, L)) for n in sizes], axis=-1).astype(np.int32)
    tokens = tokens_ref(rng.normal(size=(B, L)), rng.normal(size=(B, L, S)), actions, sizes)
    params = agent.store.to_host("params")
    peer = dt_loss_and_grads(agent.net, params, tokens, actions)
    t = TorchDT(agent, params, tokens, actions, "cpu", dtype=torch.float64)
    loss = t.loss()
    loss.backward()
    assert float(loss.detach()) == pytest.approx(peer["loss"], rel=1e-12)
    for name, p in t.P.items():
        np.testing.assert_allclose(p.grad.numpy(), peer["grads"][name], rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(torch_dt_logits(t.P, t.tokens, agent.net).detach().numpy(), peer["logits"], rtol=1e-9,
                               atol=1e-12)
    newest = t.act(t.tokens).numpy()  # [B, W]: row b·3L + 3(L − 1) + 1 of the logits
    np.testing.assert_allclose(newest, peer["logits"].reshape(B, 3 * L, -1)[:, 3 * (L - 1) + 1], rtol=1e-9, atol=1e-12)
    before = t.P["dt.head.w"].detach().clone()
    t.train_step()
    assert not torch.equal(before, t.P["dt.head.w"])
