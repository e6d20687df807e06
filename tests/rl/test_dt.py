"""Decision Transformer (agent.kind = "dt"): the attention kernels on a hand-computed case and odd shapes,
the token kernel, the loss kernel against its float64 reference (finite differences, a hand case), the
network + loss against the PyTorch peer, the return scan, the behavior kernel, the agent's update
(deterministic) and its evaluation state, the config checks, and a tiny end-to-end simulator run.
Tiny shapes throughout: every simulated thread costs ~0.1 ms. (The module contract test covers the
attention and the transformer block too: numbarl/rl/nets/registry.py.)"""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from numbarl.config import AgentConfig
from numbarl.cuda import blas
from numbarl.cuda.runtime import Arena, cuda, simulator, stream
from numbarl.rl.losses.dt import DtLoss, dt_loss_ref
from numbarl.rl.nets.attention import CausalAttentionCore, attention_forward_ref
from numbarl.rl.nets.base import ParamStore
from numbarl.rl.nets.dt import (
    DecisionTransformerNet,
    branch_offsets,
    launch_tokens,
    tokens_ref,
)

_cuda = cuda()
SIZES = (3, 2, 4)


@pytest.fixture(autouse=True)
def host_gemm():
    """Under the simulator the numpy GEMM (a simulated GEMM costs ~1 s a call); on a GPU these tests
    run on the default cuBLASLt path (the 'host' backend reads device memory directly: simulator only)."""
    if simulator():
        blas.set_backend("host")
    yield
    blas.set_backend(None)


def _dev(x):
    return _cuda.to_device(np.ascontiguousarray(x))


def _core(E, H, T, n_seq, qkv):
    core = CausalAttentionCore("core", E, H, T)
    acts = Arena("acts")
    core.declare_acts(acts, n_seq * T, "online")
    acts.allocate()
    y = core.forward(_dev(qkv.astype(np.float32)), stream())
    return core, y.copy_to_host(), core._arena("online")["core.online.probs"].copy_to_host()


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
def test_attention_hand_computed():
    """One head of width 1, two tokens: o_0 = v_0; s_1 = (q_1 k_0, q_1 k_1) = (0, ln 3), so
    P_1 = (1/4, 3/4) and o_1 = 4/4 + 3·8/4 = 7."""
    qkv = np.array([[5.0, 0.0, 4.0], [1.0, math.log(3.0), 8.0]])
    _, y, probs = _core(1, 1, 2, 1, qkv)
    np.testing.assert_allclose(y[:, 0], [4.0, 7.0], rtol=1e-6)
    np.testing.assert_allclose(probs[0, 0], [[1.0, 0.0], [0.25, 0.75]], rtol=1e-6)


def test_attention_kernel_on_odd_shapes_is_causal(rng):
    E, H, T, n_seq = 6, 3, 7, 3
    qkv = rng.normal(0, 1.5, (n_seq * T, 3 * E))
    _, y, probs = _core(E, H, T, n_seq, qkv)
    y_ref, p_ref = attention_forward_ref(qkv, T, H)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs, p_ref, rtol=1e-5, atol=1e-7)
    assert np.all(np.triu(probs, 1) == 0)  # no query sees a later key
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    # a later token changes nothing before it
    qkv2 = qkv.copy()
    qkv2[T - 1] += 10.0
    _, y2, _ = _core(E, H, T, n_seq, qkv2)
    np.testing.assert_array_equal(y2[:T - 1], y[:T - 1])


# ---------------------------------------------------------------------------------------------
# tokens and loss
# ---------------------------------------------------------------------------------------------
def _batch(rng, B, L, S=4, sizes=SIZES):
    rtg = rng.normal(0, 1, (B, L)).astype(np.float32)
    states = rng.normal(0, 1, (B, L, S)).astype(np.float32)
    actions = np.stack([rng.integers(0, n, (B, L)) for n in sizes], -1).astype(np.int32)
    return rtg, states, actions


def test_token_kernel_matches_reference(rng):
    B, L, S = 2, 3, 4
    rtg, states, actions = _batch(rng, B, L, S)
    actions[1, 2, :] = -1  # the step being decided: no action token
    F = 4 + S + sum(SIZES) + L
    tokens = _cuda.device_array((B * 3 * L, F), np.float32)
    launch_tokens(_dev(rtg), _dev(states), _dev(actions), _dev(branch_offsets(SIZES)), tokens, stream())
    got = tokens.copy_to_host()
    np.testing.assert_array_equal(got, tokens_ref(rtg, states, actions, SIZES))
    row = got[(1 * 3 + 0) * 3 + 2]  # window 1, step 0, action token: kind one-hot, 3 action one-hots, position 0
    assert row[2] == 1 and row[4 + S:4 + S + sum(SIZES)].sum() == 3 and row[4 + S + sum(SIZES)] == 1
    assert got[(1 * 3 + 2) * 3 + 2, 4 + S:4 + S + sum(SIZES)].sum() == 0


def test_loss_kernel_matches_reference_and_a_hand_case(rng):
    B, L = 2, 3
    logits = rng.normal(0, 2, (B * 3 * L, sum(SIZES))).astype(np.float32)
    _, _, actions = _batch(rng, B, L)
    loss = DtLoss(B, L, SIZES)
    s = stream()
    loss.compute({"logits": _dev(logits), "actions": _dev(actions)}, s)
    host = loss.arena.to_host()
    ref, per, correct, d_logits = dt_loss_ref(logits, actions, SIZES)
    assert float(host["loss"][0]) == pytest.approx(ref, rel=1e-6)
    np.testing.assert_allclose(host["per_sample"], per, rtol=1e-6)
    np.testing.assert_allclose(host["correct"], correct, rtol=1e-6)
    np.testing.assert_allclose(host["d_logits"], d_logits, rtol=1e-5, atol=1e-8)
    assert np.all(host["d_logits"].reshape(B, L, 3, -1)[:, :, [0, 2]] == 0)  # only state tokens predict
    # hand case: one window of one step, one branch of two actions, logits (0, ln 3) at the state token,
    # action 0: CE = ln 4, d = (1/4 − 1, 3/4), the argmax (action 1) is wrong
    hand = np.zeros((3, 2), np.float32)
    hand[1] = [0.0, math.log(3.0)]
    one = DtLoss(1, 1, (2,))
    one.compute({"logits": _dev(hand), "actions": _dev(np.zeros((1, 1, 1), np.int32))}, s)
    h = one.arena.to_host()
    assert h["loss"][0] == pytest.approx(math.log(4.0), rel=1e-6) and h["correct"][0] == 0.0
    np.testing.assert_allclose(h["d_logits"][1], [-0.75, 0.75], rtol=1e-6)


def test_loss_reference_by_finite_differences(rng):
    B, L = 2, 2
    logits = rng.normal(0, 1, (B * 3 * L, sum(SIZES)))
    _, _, actions = _batch(rng, B, L)
    _, _, _, d = dt_loss_ref(logits, actions, SIZES)
    h = 1e-6
    for idx in [(1, 0), (4, 5), (7, 8), (10, 3), (3, 1)]:
        up, down = logits.copy(), logits.copy()
        up[idx] += h
        down[idx] -= h
        fd = (dt_loss_ref(up, actions, SIZES)[0] - dt_loss_ref(down, actions, SIZES)[0]) / (2 * h)
        assert fd == pytest.approx(d[idx], abs=1e-8, rel=1e-5)


def test_network_and_loss_match_pytorch_peer(rng):
    """The device network + loss (forward, backward into the store) against the PyTorch peer on the same
    weights and batch: loss and every gradient within 1e-5 relative (fp32)."""
    pytest.importorskip("torch")
    from numbarl.rl.torch_peer_dt import dt_loss_and_grads

    B, L, S = 2, 3, 4
    net = DecisionTransformerNet("dt", S, SIZES, L, dim=8, n_heads=2, n_layers=2, activation="silu")
    store = ParamStore()
    net.declare_params(store)
    store.allocate()
    store.init(rng)
    acts = Arena("acts")
    net.declare_acts(acts, B * 3 * L, "train")
    acts.add("tokens", (B * 3 * L, net.in_dim), np.float32)
    acts.allocate()
    rtg, states, actions = _batch(rng, B, L, S)
    s = stream()
    launch_tokens(_dev(rtg), _dev(states), _dev(actions), _dev(branch_offsets(SIZES)), acts["tokens"], s)
    loss = DtLoss(B, L, SIZES)
    loss.compute({"logits": net.forward(acts["tokens"], s, tag="train"), "actions": _dev(actions)}, s)
    net.backward(loss.grad("logits"), s, tag="train")
    params = {k: v.astype(np.float64) for k, v in store.to_host("params").items()}
    peer = dt_loss_and_grads(net, params, acts["tokens"].copy_to_host(), actions, dtype="float32")
    assert float(loss.loss.copy_to_host()[0]) == pytest.approx(peer["loss"], rel=1e-5)
    grads = store.to_host("grads")
    assert set(grads) == set(peer["grads"])
    for name, want in peer["grads"].items():
        assert np.max(np.abs(grads[name] - want)) <= 1e-5 * np.max(np.abs(want)), name


# ---------------------------------------------------------------------------------------------
# the agent's kernels
# ---------------------------------------------------------------------------------------------
def test_returns_scan_and_window_starts(rng):
    from numbarl.rl.agents.dt import returns_kernel, returns_ref, window_starts

    T, N = 5, 3
    reward = rng.normal(0, 1, (T, N)).astype(np.float32)
    done = np.zeros((T, N), np.uint8)
    done[1, 0] = done[4, 1] = 1
    out = _cuda.device_array((T, N), np.float32)
    returns_kernel[1, N, stream()](_dev(reward), _dev(done), np.float64(0.5), out)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, returns_ref(reward, done, 0.5), rtol=1e-6, atol=1e-7)
    r = reward[:, 0].astype(np.float64)  # env 0 by hand: the episode ends at step 1
    assert got[1, 0] == pytest.approx(r[1]) and got[0, 0] == pytest.approx(r[0] + 0.5 * r[1])
    assert got[2, 0] == pytest.approx(r[2] + 0.5 * r[3] + 0.25 * r[4])
    # tail = ceil(log 0.05 / log γ): γ = 0.5 → 5; γ = 0.9 → 29; γ = 1: only the first start
    assert window_starts(64, 8, 0.5) == 64 - 8 - 5 + 1 and window_starts(64, 8, 0.9) == 64 - 8 - 29 + 1
    assert window_starts(64, 8, 1.0) == 1 and window_starts(8, 8, 0.0) == 1
    with pytest.raises(ValueError, match="dt_rollout"):
        window_starts(4, 8, 0.9)


def _agent(T=4, N=3, L=2, B=3, K=2, seed=5, state_dim=4, sizes=(3, 2, 2, 2), eval_batch=1, **kw):
    from numbarl.rl.agents.dt import DTAgent

    kw = {"dt_portfolio": True, **kw}  # tokens of every obs column: the kernel tests feed small random obs
    cfg = AgentConfig(kind="dt", dt_rollout=T, dt_context=L, dt_batch=B, dt_updates=K, dt_embed=8, dt_heads=2,
                      dt_gamma=0.5, lr=1e-3, max_grad_norm=1.0, **kw)
    return DTAgent(cfg, state_dim, sizes, N, seed, eval_batch=eval_batch)


def test_behavior_kernel_follows_the_oracle_within_the_mask(rng):
    from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT
    from numbarl.rl.agents.dt import behavior_kernel

    sizes = (3, 2, 2, 2)
    N, S = 5, 4
    agent = _agent(N=N, sizes=sizes)
    mask = np.zeros((N, 4, 3), np.uint8)
    for k, n in enumerate(sizes):
        mask[:, k, :n] = 1
    mask[1, 0, DIR_LONG] = 0  # env 1: long locked out → flat
    signal = np.array([0.5, 0.5, -1.0, 0.0, 2.0], np.float32)
    cursor = np.array([0, 1, 2, 3, 4], np.int32)
    obs = rng.normal(0, 1, (N, S)).astype(np.float32)
    actions = _cuda.device_array((N, 4), np.int32)
    pref = _cuda.device_array(N, np.float32)
    d = agent.data
    s = stream()
    behavior_kernel[1, N, s](_dev(mask), _dev(cursor), _dev(signal), np.float32(0.0), agent.work["sizes"],
                             _dev(np.array([7], np.uint64)), _dev(np.array([3], np.int64)), agent.scalars["pos"],
                             _dev(obs), actions, pref, d["obs"], d["actions"])
    a = actions.copy_to_host()
    np.testing.assert_array_equal(a[:, 0], [DIR_LONG, DIR_FLAT, DIR_SHORT, DIR_FLAT, DIR_LONG])
    assert np.all(a[:, 1] == 1) and np.all(a[:, 2:] == 0)  # the largest size, target and stop 0
    np.testing.assert_array_equal(d["actions"].copy_to_host()[0], a)
    np.testing.assert_array_equal(d["obs"].copy_to_host()[0], obs)
    # noise 1: env i explores with probability i / (N − 1); every draw is an allowed action
    mask[:, 0, DIR_SHORT] = 0
    behavior_kernel[1, N, s](_dev(mask), _dev(cursor), _dev(signal), np.float32(1.0), agent.work["sizes"],
                             _dev(np.array([7], np.uint64)), _dev(np.array([3], np.int64)), agent.scalars["pos"],
                             _dev(obs), actions, pref, d["obs"], d["actions"])
    a = actions.copy_to_host()
    for k, n in enumerate(sizes):
        assert np.all(mask[np.arange(N), k, a[:, k]] == 1)
    assert a[N - 1, 0] != DIR_SHORT and a[0, 0] == DIR_LONG  # env 0: never explores


def test_hindsight_signal_stays_inside_the_range():
    from numbarl.rl.agents.dt import hindsight_signal

    mid = np.array([1.0, 2.0, 4.0, 7.0, 11.0, 100.0])
    got = hindsight_signal(mid, 1, 5, 2)
    np.testing.assert_array_equal(got, [0.0, 5.0, 7.0, 4.0, 0.0, 0.0])  # bars 3, 4 look at bar 4 = hi − 1, no further


def test_behavior_signal_hindsight_by_default_or_the_given_oracle():
    """step_functions uploads the hindsight signal of the env's own range; set_behavior_signal (e.g. the
    synthetic cache's planted oracle) replaces it in place, before or after, with a clear error on a
    length mismatch."""
    from types import SimpleNamespace

    from numbarl.rl.agents.dt import hindsight_signal

    mid = np.array([1.0, 2.0, 4.0, 7.0, 11.0, 100.0])
    env = SimpleNamespace(market=SimpleNamespace(n_bars=6, data=SimpleNamespace(mid=mid)), lo=0, hi=5)
    agent = _agent()
    agent._ensure_signal(env)
    np.testing.assert_array_equal(agent.signal.copy_to_host(), hindsight_signal(mid, 0, 5, agent.cfg.dt_oracle_horizon))
    address = agent.signal
    oracle = np.array([0.1, -0.2, 0.0, 0.3, -0.4, 0.5], np.float32)
    agent.set_behavior_signal(oracle)  # after the upload: in place (a captured collect graph keeps reading it)
    assert agent.signal is address
    np.testing.assert_array_equal(agent.signal.copy_to_host(), oracle)
    with pytest.raises(ValueError, match="6"):
        agent.set_behavior_signal(oracle[:4])
    other = _agent()
    other.set_behavior_signal(oracle)  # before: used by the first upload
    other._ensure_signal(env)
    np.testing.assert_array_equal(other.signal.copy_to_host(), oracle)


def market_data(rng, n_bars=60, n_features=3, tick=0.25):
    """A random-walk market on a tick grid (tests/env/conftest.py's synthetic_market, smaller)."""
    from numbarl.env.market import MarketData

    mid = 100.0 + np.cumsum(rng.integers(-3, 4, n_bars) * (tick / 2))
    spread = tick * rng.integers(1, 3, n_bars)
    prev = np.concatenate([[mid[0]], mid[:-1]])
    return MarketData(features=rng.standard_normal((n_bars, n_features)).astype(np.float32), mid=mid,
                      bid=mid - spread / 2, ask=mid + spread / 2, high=np.maximum(prev, mid) + tick,
                      low=np.minimum(prev, mid) - tick, session_id=(np.arange(n_bars) // 30).astype(np.int32),
                      timestamps=np.arange(n_bars, dtype=np.int64) * 1_000_000_000, tick_size=tick, bars_per_day=30.0)


def test_collect_writes_the_behavior_trajectories(rng):
    """The collect step on a real device env: the dataset holds each step's obs, the oracle's action
    (noise 0: the hindsight direction, or flat where the lock forbids it) and the env's reward and done;
    the update is scheduled after every T-th step."""
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import (
        DIR_FLAT,
        DIR_LONG,
        DIR_SHORT,
        PORTFOLIO_DIM,
        EnvParams,
    )
    from numbarl.rl.agents.dt import hindsight_signal

    params = EnvParams()
    env = DeviceEnv(market_data(rng), params, 3, bar_range=(0, 50), seed=4)
    s = stream()
    env.reset(4, s)
    agent = _agent(T=3, N=3, state_dim=env.state_dim, sizes=params.branch_sizes, dt_behavior_noise=0.0,
                   dt_portfolio=False)
    n_market = env.state_dim - PORTFOLIO_DIM
    assert agent.data["obs"].shape == (3, 3, n_market)  # the market features only (the default)
    steps = agent.step_functions(env)
    signal = hindsight_signal(env.market.data.mid, 0, 50, agent.cfg.dt_oracle_horizon)
    for t in range(3):
        cursor = env.arena["cursor"].copy_to_host().astype(np.int64)
        steps["collect"](s)
        d = agent.data.to_host()
        mask = env.arena["mask"].copy_to_host()
        np.testing.assert_array_equal(d["obs"][t], env.arena["obs"].copy_to_host()[:, :n_market])
        want = np.where(signal[cursor] > 0, DIR_LONG, np.where(signal[cursor] < 0, DIR_SHORT, DIR_FLAT))
        want = np.where(mask[np.arange(3), 0, want] != 0, want, DIR_FLAT)
        np.testing.assert_array_equal(d["actions"][t, :, 0], want)
        assert np.all(d["actions"][t, :, 1] == params.branch_sizes[1] - 1)
        np.testing.assert_array_equal(d["reward"][t], env.arena["reward"].copy_to_host())
        np.testing.assert_array_equal(d["done"][t], env.arena["done"].copy_to_host())
        assert agent.after_collect(t + 1, 0, 1) == (("update",) if t == 2 else ())
    assert agent.scalars["pos"].copy_to_host()[0] == 0  # the dataset is full: the next step rewrites step 0


def _fill(agent, rng):
    T, N = agent.T, agent.n_envs
    actions = np.stack([rng.integers(0, n, (T, N)) for n in agent.branch_sizes], -1).astype(np.int32)
    agent.data.load({"obs": rng.normal(0, 1, (T, N, agent.token_dim)).astype(np.float32), "actions": actions,
                     "reward": rng.normal(0, 1, (T, N)).astype(np.float32),
                     "done": (rng.random((T, N)) < 0.2).astype(np.uint8)})


def test_update_is_deterministic_and_its_step_matches_the_references(rng):
    """update_step twice from one state gives the same bits; its last gradient step equals the float64
    network and loss references on the batch the step drew (the gradients before the AdamW update)."""
    agent = _agent()
    _fill(agent, rng)
    start = agent.state_arrays()
    s = stream()
    snaps = []
    for _ in range(2):
        agent.load_state(start)
        agent.update_step(s)
        s.synchronize()
        snaps.append({**{k: v for k, v in agent.state_arrays().items() if k != "agent/stats"},
                      **{f"grads/{k}": v for k, v in agent.store.to_host("grads").items()}})
    for k in snaps[0]:
        assert snaps[0][k].tobytes() == snaps[1][k].tobytes(), k
    assert snaps[0]["agent/updates"][0] == 1 and snaps[0]["agent/train_step"][0] == 2
    assert not np.array_equal(snaps[0]["params/dt.head.w"], start["params/dt.head.w"])
    # normalized returns: mean 0, std 1 over the dataset
    rtg = agent.data["rtg"].copy_to_host().astype(np.float64)
    assert abs(rtg.mean()) < 1e-5 and rtg.std() == pytest.approx(1.0, rel=1e-4)
    # the last step's gradients against the composed float64 references (params before its update)
    agent.load_state(start)
    agent.K = 1
    agent.update_step(s)  # one step: its gradients are those of the start parameters
    w = agent.work.to_host()
    params = {k.split("/", 1)[1]: v.astype(np.float64) for k, v in start.items() if k.startswith("params/")}
    logits, cache = agent.net.forward_ref(w["tokens"], params)
    loss, _, correct, d_logits = dt_loss_ref(logits, w["mb_actions"], agent.branch_sizes)
    _, want = agent.net.backward_ref(d_logits, cache, params)
    grads = agent.store.to_host("grads")
    assert set(want) == set(grads)
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
    stats = agent.read_stats(s)
    assert stats["loss"] == pytest.approx(loss, rel=1e-5) and stats["dt_action_acc"] == pytest.approx(correct.mean())
    assert stats["dt_return_std"] > 0 and stats["nonfinite_step"] == -1 and stats["epsilon"] == 0.0
    # every sampled window is L consecutive steps of one env of the dataset
    for win in w["mb_rtg"].astype(np.float64):
        assert any(np.array_equal(win, rtg[t0:t0 + agent.L, e]) for e in range(agent.n_envs)
                   for t0 in range(agent.n_starts))


def test_scores_carry_the_last_L_steps_and_reset(rng):
    """Each scores() call pushes one observation (shifting out the oldest after L), runs the network on
    the window and returns the newest state token's logits; its argmax is that step's action token."""
    agent = _agent(L=2, eval_batch=2)
    P, S, L = 2, agent.state_dim, 2
    params = {k: v.astype(np.float64) for k, v in agent.store.to_host("params").items()}
    out = _cuda.device_array((P, agent.n_branches, agent.max_actions), np.float32)
    s = stream()
    agent.reset_eval(s)
    hist_obs, hist_act = [], []
    for bar in range(3):
        obs = rng.normal(0, 1, (P, S)).astype(np.float32)
        agent.scores(_dev(obs), out, s)
        got = out.copy_to_host()
        hist_obs.append(obs)
        window = np.stack(hist_obs[-L:], 1)  # [P, n, S]
        n = window.shape[1]
        states = np.zeros((P, L, S), np.float32)
        states[:, :n] = window
        acts = np.full((P, L, agent.n_branches), -1, np.int32)
        for j, a in enumerate(hist_act[-(n - 1):] if n > 1 else []):
            acts[:, j] = a
        tokens = tokens_ref(np.full((P, L), agent.cfg.dt_target, np.float32), states, acts, agent.branch_sizes)
        logits, _ = agent.net.forward_ref(tokens, params)
        rows = logits.reshape(P, L, 3, -1)[:, n - 1, 1]
        for k, (o, size) in enumerate(zip(branch_offsets(agent.branch_sizes), agent.branch_sizes)):
            want = rows[:, o:o + size].copy()
            if k == 0:  # direction: a side's argmax puts the other side below flat
                for p in range(P):
                    best = int(want[p].argmax())
                    if best != 1:
                        want[p, 2 - best] = min(want[p, 2 - best], want[p, 1] - 1.0)
            np.testing.assert_allclose(got[:, k, :size], want, rtol=1e-4, atol=1e-5)
            assert np.all(got[:, k, size:] < -1e38)
        hist_act.append(np.stack([got[:, k, :n_k].argmax(-1) for k, n_k in enumerate(agent.branch_sizes)], -1))
    assert agent.eval_state["count"].copy_to_host().tolist() == [3, 3]
    agent.reset_eval(s)
    assert agent.eval_state["count"].copy_to_host().tolist() == [0, 0]
    with pytest.raises(ValueError, match="eval_batch"):
        agent.scores(_dev(np.zeros((1, S), np.float32)), out, s)


def test_acting_reads_no_portfolio_and_a_masked_side_closes(rng):
    """The bug this guards (H200, default preset: the DT entered once and held, 2-14 trades over ~3,000
    bars): the behavior's portfolio features (position, ...) are the trace of its decisions on a signal
    the state does not show, so a DT reading them learns "long now, long next" and, acting, holds its
    own position. By default the state token holds the market features only: the scores do not move
    when only the portfolio part of the obs does. And where the DT's side is masked (the direction lock
    against the position), the backtest's greedy choice over the mask closes (flat), never holds."""
    from numbarl.env.params import DIR_FLAT, DIR_LONG, DIR_SHORT, PORTFOLIO_DIM
    from numbarl.env.rows import greedy_action

    F, sizes, P = 3, (3, 2, 2, 2), 2
    agent = _agent(L=2, eval_batch=P, state_dim=F + PORTFOLIO_DIM, sizes=sizes, dt_portfolio=False)
    assert agent.token_dim == F and agent.net.state_dim == F
    out = _cuda.device_array((P, agent.n_branches, agent.max_actions), np.float32)
    s = stream()
    market = rng.normal(0, 1, (3, P, F)).astype(np.float32)
    got = []
    for portfolio in (rng.normal(0, 1, (3, P, PORTFOLIO_DIM)), -rng.normal(0, 1, (3, P, PORTFOLIO_DIM))):
        agent.reset_eval(s)
        for bar in range(3):  # a window longer than L: the history shifts
            agent.scores(_dev(np.concatenate([market[bar], portfolio[bar].astype(np.float32)], 1)), out, s)
        got.append(out.copy_to_host())
    np.testing.assert_array_equal(got[0], got[1])
    # the head's direction bias decides: short first, long second, flat last
    params = agent.store.to_host("params")
    params["dt.head.w"][:] = 0.0
    params["dt.head.b"][:] = 0.0
    params["dt.head.b"][[DIR_SHORT, DIR_FLAT, DIR_LONG]] = [2.0, -1.0, 1.0]
    agent.load_params({f"params/{k}": v for k, v in params.items()})
    agent.reset_eval(s)
    agent.scores(_dev(np.zeros((P, F + PORTFOLIO_DIM), np.float32)), out, s)
    q = out.copy_to_host()
    mask = np.zeros((P, 4, 3), np.uint8)
    for k, n in enumerate(sizes):
        mask[:, k, :n] = 1
    mask[1, 0, DIR_SHORT] = 0  # policy 1 is long under the lock: short is not an action
    assert greedy_action(q, mask, 0, 0) == DIR_SHORT  # allowed: the DT's side
    assert greedy_action(q, mask, 1, 0) == DIR_FLAT  # masked: close (the raw logits would hold the long)
    assert agent.eval_state["hist_act"].copy_to_host()[:, 0, 0].tolist() == [DIR_SHORT, DIR_SHORT]
    with pytest.raises(ValueError, match="portfolio"):
        _agent(state_dim=PORTFOLIO_DIM, dt_portfolio=False)


# ---------------------------------------------------------------------------------------------
# config and an end-to-end run
# ---------------------------------------------------------------------------------------------
def test_config_checks_dt_keys():
    from dataclasses import replace

    from numbarl.config import PRESETS, ConfigError

    cfg = PRESETS["tiny"]
    replace(cfg, agent=replace(cfg.agent, kind="dt")).validate()
    with pytest.raises(ConfigError, match="dt_heads"):
        replace(cfg.agent, kind="dt", dt_embed=10, dt_heads=4).validate()
    with pytest.raises(ConfigError, match="dt_context"):
        replace(cfg.agent, kind="dt", dt_rollout=4, dt_context=8).validate()
    with pytest.raises(ConfigError, match="dt_gamma"):
        replace(cfg.agent, kind="dt", dt_gamma=1.5).validate()
    with pytest.raises(ConfigError, match="agent.iqn"):
        replace(cfg.agent, kind="dt", iqn=True).validate()
    with pytest.raises(ConfigError, match="feedback"):
        replace(cfg, agent=replace(cfg.agent, kind="dt"), train=replace(cfg.train, e9_tradability_gate=True)).validate()


def test_tiny_training_run_finishes(tmp_path, monkeypatch):
    from numbarl.cli import train_cmd

    monkeypatch.setenv("NUMBARL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    r = CliRunner().invoke(train_cmd, ["--preset", "tiny", "--quiet", "--epochs", "1", "--set", "agent.kind=dt",
                                       "--set", "agent.dt_rollout=3", "--set", "agent.dt_context=2",
                                       "--set", "agent.dt_updates=2", "--set", "agent.dt_batch=2",
                                       "--set", "agent.dt_embed=8", "--set", "data.synth_bars_per_day=16",
                                       "--out", str(out)], catch_exceptions=True)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert (out / "summary.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [rec for rec in records if rec["kind"] == "train" and rec.get("train_step", 0) > 0]
    assert train and train[-1]["dt_updates"] == 2 and train[-1]["train_step"] == 4
    assert train[-1]["dt_action_acc"] > 0 and train[-1]["nonfinite_step"] == -1 and np.isfinite(train[-1]["loss"])
    assert any(rec["kind"] == "val" for rec in records)
