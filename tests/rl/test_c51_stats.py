"""The c51 agent's Q statistics (C6: std, per-branch means, q_divergence, mean |q_gap|) and the
adaptive atom-entropy controller (C5: utilisation, its EMA, β) against float64 numpy."""

import numpy as np
import pytest

from numbarl.cuda.runtime import cuda, stream
from numbarl.rl.agents import dqn
from numbarl.rl.agents.dqn import STATS_BLOCK, atom_entropy_control_kernel, atom_entropy_control_ref, q_stats_kernel

_cuda = cuda()


def _q(rng, batch, sizes):
    q = rng.standard_normal((batch, len(sizes), max(sizes))).astype(np.float32)
    actions = np.zeros((batch, len(sizes)), np.int32)
    for k, n in enumerate(sizes):
        q[:, k, n:] = -np.inf  # padding, never taken
        actions[:, k] = rng.integers(0, n, batch)
    return q, actions


@pytest.mark.parametrize("sizes", [(3, 2, 4, 4), (3, 2)])
def test_q_stats_match_numpy(rng, sizes):
    batch, n_envs, first = 2 * STATS_BLOCK + 5, 37, 3  # rows beyond one pass of the block
    q, actions = _q(rng, batch, sizes)
    q_target = (q + rng.normal(0, 0.3, q.shape)).astype(np.float32)
    pref = rng.normal(0, 1, n_envs).astype(np.float32)
    stats = _cuda.to_device(np.zeros(16, np.float32))
    q_stats_kernel[1, STATS_BLOCK, stream()](_cuda.to_device(q), _cuda.to_device(q_target), _cuda.to_device(actions),
                                             _cuda.to_device(pref), _cuda.to_device(np.array([4], np.int64)), stats,
                                             np.int64(first))
    got = stats.copy_to_host()
    std, div, gap, means = dqn.q_stats_ref(q, q_target, actions, pref)
    np.testing.assert_allclose(got[first + dqn.QS_STD], std, rtol=1e-5)
    np.testing.assert_allclose(got[first + dqn.QS_DIVERGENCE], div, rtol=1e-5)
    np.testing.assert_allclose(got[first + dqn.QS_GAP_ABS], gap, rtol=1e-5)
    np.testing.assert_allclose(got[first + dqn.QS_BRANCH_MEAN:first + dqn.QS_BRANCH_MEAN + len(sizes)], means,
                               rtol=1e-5, atol=1e-6)
    assert np.all(got[first + dqn.QS_BRANCH_MEAN + len(sizes):] == 0) and np.all(got[:first] == 0)


def test_q_stats_before_training_write_only_the_gap(rng):
    q, actions = _q(rng, 6, (3, 2))
    pref = np.float32([1.0, -3.0])
    stats = _cuda.to_device(np.zeros(8, np.float32))
    q_stats_kernel[1, STATS_BLOCK, stream()](_cuda.to_device(q), _cuda.to_device(q), _cuda.to_device(actions),
                                             _cuda.to_device(pref), _cuda.to_device(np.array([0], np.int64)), stats,
                                             np.int64(0))
    got = stats.copy_to_host()
    assert got[dqn.QS_GAP_ABS] == 2.0 and np.count_nonzero(got) == 1


def test_atom_entropy_controller_matches_numpy_over_steps(rng):
    """u = share of atoms whose batch-mean probability exceeds 0.1/Z; the first step sets u_ema = u,
    later steps 0.99·u_ema + 0.01·u; β = β_max · clip((0.5 − u_ema)/0.5, 0, 1)."""
    batch, nb, z, beta_max = 7, 3, 11, 0.02
    u_ema_dev = _cuda.to_device(np.array([-1.0], np.float32))
    beta_dev = _cuda.to_device(np.zeros(1, np.float32))
    stats = _cuda.to_device(np.zeros(6, np.float32))
    u_ema = -1.0
    for step in range(4):
        logits = rng.standard_normal((batch, nb, z)) * (1.0 + 3.0 * step)  # sharper each step: fewer atoms
        logits[..., : 2 + step] = -30.0  # some atoms carry (almost) nothing
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
        sums = p.reshape(-1, z).astype(np.float64).sum(0).astype(np.float32)
        atom_entropy_control_kernel[1, 1, stream()](_cuda.to_device(sums), np.float64(1.0 / (batch * nb)), u_ema_dev,
                                                    np.float64(beta_max), beta_dev, stats, np.int64(1), np.int64(2),
                                                    np.int64(3), np.int64(0))
        u, u_ema, beta = atom_entropy_control_ref(p, u_ema, beta_max)
        got = stats.copy_to_host()
        assert got[1] == np.float32(u) and got[2] == np.float32(u_ema), (step, got, u, u_ema)
        np.testing.assert_allclose(beta_dev.copy_to_host()[0], beta, rtol=1e-6)
        np.testing.assert_allclose(got[3], beta, rtol=1e-6)
    # a collapsed distribution: u = 1/Z, the EMA from 1/Z gives β near β_max
    u, e, b = atom_entropy_control_ref(np.eye(z, dtype=np.float32)[None, None, 3], -1.0, beta_max)
    assert u == 1 / z and b == pytest.approx(beta_max * (0.5 - e) / 0.5)
    assert atom_entropy_control_ref(np.full((1, 1, z), 1 / z), 0.9, beta_max)[2] == 0.0  # u_ema ≥ 0.5: off


def test_controller_on_the_projected_targets_uses_the_diagnostics_measure(rng):
    """agent.atom_entropy_source = 'target': u = exp(H(p̄)) / Z of the batch-mean distribution (the
    atom_utilization diagnostic); kernel == float64 reference, and a distribution on 3 of 11 atoms
    (u ≈ 0.27 < 0.5) switches the term on."""
    batch, nb, z, beta_max = 6, 2, 11, 0.02
    p = np.zeros((batch, nb, z), np.float32)
    p[..., 4:7] = rng.dirichlet(np.ones(3), size=(batch, nb)).astype(np.float32)
    sums = p.reshape(-1, z).astype(np.float64).sum(0).astype(np.float32)
    u_ema_dev = _cuda.to_device(np.array([-1.0], np.float32))
    beta_dev = _cuda.to_device(np.zeros(1, np.float32))
    stats = _cuda.to_device(np.zeros(4, np.float32))
    atom_entropy_control_kernel[1, 1, stream()](_cuda.to_device(sums), np.float64(1.0 / (batch * nb)), u_ema_dev,
                                                np.float64(beta_max), beta_dev, stats, np.int64(1), np.int64(2),
                                                np.int64(3), np.int64(1))
    u, u_ema, beta = atom_entropy_control_ref(p, -1.0, beta_max, perplexity=True)
    p_bar = p.reshape(-1, z).astype(np.float64).mean(0)
    q = p_bar[p_bar > 0]
    assert u == pytest.approx(np.exp(-np.sum(q * np.log(q))) / z) and u < 3.0 / z + 1e-9
    np.testing.assert_allclose(stats.copy_to_host()[1], u, rtol=1e-6)
    assert beta > 0 and beta_dev.copy_to_host()[0] == pytest.approx(beta, rel=1e-6)
    # the threshold measure of the same batch counts 3 atoms: the two measures differ
    assert atom_entropy_control_ref(p, -1.0, beta_max)[0] == pytest.approx(3.0 / z)


def test_tiny_run_controls_on_the_logged_atom_utilization(tmp_path, monkeypatch):
    """With agent.atom_entropy_source=target the controller's u is the diagnostics' atom_utilization
    of the same (last) train batch, in every train record."""
    import json

    from click.testing import CliRunner

    from numbarl.cli import train_cmd

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, ["--preset", "tiny", "--quiet", "--epochs", "1", "--set", "data.synth_bars_per_day=30",
                                       "--set", "train.collect_steps_per_epoch=6", "--set", "train.log_interval=2",
                                       "--set", "train.learning_starts=3", "--set", "agent.atom_entropy_max=0.01",
                                       "--set", "agent.atom_entropy_source=target", "--out", str(out)],
                           catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [rec for rec in recs if rec["kind"] == "train" and rec.get("train_step", 0) > 0]
    assert train
    for rec in train:
        assert rec["atom_utilization_ctrl"] == pytest.approx(rec["atom_utilization"], rel=1e-5)
