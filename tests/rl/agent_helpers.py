"""Shared pieces of the tests of the C51 agent's auxiliary components (IQN, IQL, spectral
normalization), on the simulator and the GPU: a replay filled with random transitions, the aux /
plain / aux train-step sequence, and the bitwise comparison of two snapshots."""

import numpy as np

# the real size of the GPU tests of the agent's auxiliary components (tests/rl/test_gpu_*.py)
GPU_SIZES = (3, 3, 4, 4)
GPU_STATE_DIM, GPU_N_ENVS = 64, 64


def gpu_agent_config(**fields):
    """The GPU tests' agent configuration: a 512 x 512 trunk, 51 atoms, batches of 4096 from a 64-step replay of
    64 envs, 3-step returns, Polyak targets, weight decay 0.01; `fields`: the component under test."""
    from numbarl.config import AgentConfig

    return AgentConfig(trunk=(512, 512), n_atoms=51, batch_size=4096, replay_capacity=64 * GPU_N_ENVS, n_step=3,
                       gamma=0.99, target_update="polyak", weight_decay=0.01, **fields)


def fill_replay(agent, rng, done_rate: float = 0.05, count: int | None = None):
    """Every slot of the agent's replay written with random transitions of its own shapes (rewards
    N(0, 0.5²), dones with probability done_rate); count: the replay's write count (None: its slots)."""
    n_slots, n_envs, sizes = agent.replay.n_slots, agent.n_envs, agent.branch_sizes
    actions = np.stack([rng.integers(0, n, (n_slots, n_envs)) for n in sizes], -1).astype(np.int32)
    mask = np.zeros((n_slots, n_envs, len(sizes), max(sizes)), np.uint8)
    for k, n in enumerate(sizes):
        mask[..., k, :n] = 1
    agent.replay.store.load({"obs": rng.normal(0, 1, (n_slots, n_envs, agent.state_dim)).astype(np.float32),
                             "action": actions, "reward": (rng.standard_normal((n_slots, n_envs)) * 0.5).astype(np.float32),
                             "done": (rng.random((n_slots, n_envs)) < done_rate).astype(np.uint8),
                             "weight": np.ones((n_slots, n_envs), np.float32), "mask": mask,
                             "count": np.array([n_slots if count is None else count], np.int64)})


def aux_steps(agent, s, fns=None):
    """aux step, plain step, aux step (eagerly, or by the given graphs {aux: graph})."""
    for aux in (True, False, True):
        if fns is None:
            agent.train_step(s, aux=aux)
        else:
            fns[aux].replay(s)
    s.synchronize()


def assert_bitwise(a, b):
    assert set(a) == set(b)
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), f"{k} differs"


def tiny_agent(state_dim: int, sizes, n_envs: int, seed: int = 1, **fields):
    """A simulator-sized C51 agent (trunk 8, 5 atoms, a replay of 10 steps per env, 2-step returns, Polyak
    targets) with `fields` (batch_size included) on top: the agent tests of the auxiliary components."""
    from numbarl.config import AgentConfig
    from numbarl.rl.agents.dqn import DQNAgent

    base = {"trunk": (8,), "n_atoms": 5, "replay_capacity": 10 * n_envs, "n_step": 2, "gamma": 0.9,
            "target_update": "polyak"}
    return DQNAgent(AgentConfig(**{**base, **fields}), state_dim, sizes, n_envs, seed=seed)


def collect_graph_and_eager_runs(cfg, n_envs, outputs, steps=4, setup=None, params=None, **agent_kw):
    """The collect step of a DQNAgent(cfg) on a DeviceEnv of n_envs (a synthetic market, sizes 0.25/0.5/1.0)
    run `steps` times eagerly and, in a second agent and env built alike, as a captured graph (after one
    eager warm-up step each). setup(agent): before the first step; outputs(agent, env) -> {name: host
    array}; returns [eager, graph] with the replay store and the env arena added (compare with
    assert_bitwise). params: the env's EnvParams (default: those sizes, every other field at its default)."""
    from numbarl.bench.train import _market
    from numbarl.cuda import graph as cuda_graph
    from numbarl.cuda.runtime import stream
    from numbarl.env.device import DeviceEnv
    from numbarl.env.params import EnvParams
    from numbarl.rl.agents.dqn import DQNAgent

    params = EnvParams(sizes=(0.25, 0.5, 1.0), size_step=0.25) if params is None else params
    host = _market(2000, 8, 1)
    runs = []
    for mode in ("eager", "graph"):
        s = stream()
        market = host.to_device(params.vol_span, params.vol_horizon_bars)
        env = DeviceEnv(market, params, n_envs, bar_range=(0, 1500), seed=3)
        agent = DQNAgent(cfg, env.state_dim, params.branch_sizes, n_envs, seed=3, **agent_kw)
        if setup is not None:
            setup(agent)
        env.reset(3, s)
        agent.collect_step(env, s)  # warm-up (compiles), then the steps eagerly or replayed
        graph = cuda_graph.capture(lambda st, a=agent, e=env: a.collect_step(e, st), stream=s, warmup=False) \
            if mode == "graph" else None
        for _ in range(steps):
            graph.replay(s) if graph is not None else agent.collect_step(env, s)
        s.synchronize()
        out = {f"replay/{k}": v for k, v in agent.replay.store.to_host().items()}
        out.update({f"env/{k}": v for k, v in env.arena.to_host().items()})
        out.update(outputs(agent, env))
        runs.append(out)
    return runs


def check_trunk_gradient_is_the_sum_of_both_heads(rng, make_aux, d_aux_shape, declare=None, ref=None, setup=None,
                                                  aux_grads=True):
    """The C51 head writes dh (first writer of the step), the auxiliary head `make_aux(H)` adds to it
    (dx_out + the gradient ledger), the trunk's backward runs once on the sum: dh, the trunk's
    gradients (and with aux_grads the auxiliary head's) equal the float64 references fed
    dh_c51 + dh_aux, and the trunk's gradient differs from the C51 head's alone.
    d_aux_shape(B): the auxiliary head's output-gradient shape; declare / ref: extra keyword
    arguments of its declare_acts / forward_ref; setup(aux, B): before the device step (e.g. IQN's τ)."""
    from numbarl.cuda.runtime import Arena, cuda, stream
    from numbarl.cuda.testing import assert_close
    from numbarl.rl.nets.base import ParamStore
    from numbarl.rl.nets.c51_head import BranchedDuelingC51Head
    from numbarl.rl.nets.mlp import Mlp

    dev = cuda().to_device
    sizes, B, D, H, Z = (3, 2), 3, 5, 6, 5
    store = ParamStore()
    trunk = Mlp("trunk", D, (H,), activation="relu")
    c51 = BranchedDuelingC51Head("head", H, sizes, Z, -2.0, 2.0)
    aux = make_aux(H)
    for m in (trunk, c51, aux):
        m.declare_params(store)
    store.allocate()
    params = {k: np.asarray(v, np.float64) for k, v in store.init(rng).items()}
    acts = Arena("acts")
    trunk.declare_acts(acts, B, "online")
    c51.declare_acts(acts, B, "online", outputs=("logits", "q"))
    aux.declare_acts(acts, B, "online", **(declare or {}))
    acts.add("dh", (B, H), np.float32)
    acts.allocate()
    obs = rng.standard_normal((B, D)).astype(np.float32)
    d_logits = rng.standard_normal((B, len(sizes), max(sizes), Z)).astype(np.float32)
    d_logits[:, 1, 2:, :] = 0.0  # padding
    d_aux = rng.standard_normal(d_aux_shape(B)).astype(np.float32)
    s = stream()
    if setup is not None:
        setup(aux, B)
    store.begin_step()
    h = trunk.forward(dev(obs), s, tag="online")
    c51.forward(h, s, tag="online")
    aux.forward(h, s, tag="online")
    dh = c51.backward(dev(d_logits), s, tag="online", dx_out=acts["dh"])
    aux.backward(dev(d_aux), s, tag="online", dx_out=dh)
    trunk.backward(dh, s, tag="online")
    store.end_step()
    h_ref, trunk_cache = trunk.forward_ref(obs, params)
    _, c51_cache = c51.forward_ref(h_ref, params)
    dh_c51, _ = c51.backward_ref(d_logits, c51_cache, params)
    _, aux_cache = aux.forward_ref(h_ref, params, **(ref or {}))
    dh_aux, g_aux = aux.backward_ref(d_aux, aux_cache, params)
    assert_close(dh.copy_to_host(), dh_c51 + dh_aux, 1e-5, 1e-4)
    _, g_trunk = trunk.backward_ref(dh_c51 + dh_aux, trunk_cache, params)
    grads = store.to_host("grads")
    for name, want in {**g_trunk, **(g_aux if aux_grads else {})}.items():
        assert_close(grads[name], want, 1e-5, 1e-4)
    _, g_c51_only = trunk.backward_ref(dh_c51, trunk_cache, params)
    assert not np.allclose(grads["trunk.fc0.w"], g_c51_only["trunk.fc0.w"])  # the auxiliary head's part is in it


def build_module(module, rng, B, tags=(("online", True),), **declare):
    """(module, store, values, acts): the module's parameters declared in a store of their own, allocated and
    initialized from rng (values: store.init's), its activations for batch B for each (tag, backward) of tags
    (declare: further keyword arguments of declare_acts)."""
    from numbarl.cuda.runtime import Arena
    from numbarl.rl.nets.base import ParamStore

    store = ParamStore()
    module.declare_params(store)
    store.allocate()
    values = store.init(rng)
    acts = Arena("acts")
    for tag, backward in tags:
        module.declare_acts(acts, B, tag, backward=backward, **declare)
    acts.allocate()
    return module, store, values, acts


def check_aux_step_trains_the_head(agent, s, prefix):
    """One aux train step: every parameter whose name starts with prefix gets a finite, nonzero gradient and a
    new value. Returns (those names, the parameters before the step, the target parameters before it, the
    parameters after it), all on the host."""
    before = agent.store.to_host("params")
    target = agent.store.to_host("target")
    agent.train_step(s, aux=True)
    s.synchronize()
    after = agent.store.to_host("params")
    grads = agent.store.to_host("grads")
    names = [n for n in agent.store.specs if n.startswith(prefix)]
    for n in names:
        assert np.all(np.isfinite(grads[n])) and np.any(grads[n] != 0), n
        assert not np.array_equal(before[n], after[n]), n
    return names, before, target, after


def aux_head_agent_after_one_step(rng, prefix, **fields):
    """A simulator-sized C51 agent with one linear auxiliary head on its trunk (`fields` switch it on; its
    parameters `prefix` + "w" / "b", its optimizer group `prefix` without the dot), aux steps every second train
    step, a replay of random transitions, and one aux step checked by `check_aux_step_trains_the_head`.
    Returns (agent, stream, the parameters before the step)."""
    from numbarl.config import AgentConfig
    from numbarl.cuda.runtime import stream
    from numbarl.rl.agents.dqn import DQNAgent

    cfg = AgentConfig(trunk=(8,), n_atoms=5, batch_size=4, replay_capacity=40, n_step=2, gamma=0.9,
                      target_update="polyak", aux_frequency=2, **fields)
    agent = DQNAgent(cfg, 5, (3, 3, 4, 4), 4, seed=1)
    assert agent.aux_every == 2 and prefix.rstrip(".") in agent.optim.groups
    fill_replay(agent, rng, done_rate=0.3, count=13)
    s = stream()
    names, before, _, _ = check_aux_step_trains_the_head(agent, s, prefix)
    assert sorted(names) == [prefix + "b", prefix + "w"]
    return agent, s, before


def check_trunk_gradient_adds_the_aux_head_then_plain_step_zeroes_it(agent, s, before, d_out, prefix):
    """After `check_aux_step_trains_the_head`: the trunk's gradients are the float64 reference backward of the C51
    head's dh plus the auxiliary linear head's, d_out · W (d_out: its λ-scaled output gradient [B, T], W its
    weight before the step, `prefix + "w"`); then a plain step zeroes every gradient of the head's parameters."""
    from numbarl.cuda.testing import assert_close

    p64 = {k: np.asarray(v, np.float64) for k, v in before.items()}
    h_on = agent.trunk.output("online").copy_to_host()
    _, cache = agent.head.forward_ref(h_on, p64)
    dh_c51, _ = agent.head.backward_ref(agent.logits_grad_host(), cache, p64)
    _, trunk_cache = agent.trunk.forward_ref(agent.replay.batch.obs.copy_to_host(), p64)
    _, g_ref = agent.trunk.backward_ref(dh_c51 + d_out @ before[prefix + "w"].T, trunk_cache, p64)
    grads = agent.store.to_host("grads")
    for name, want in g_ref.items():
        assert_close(grads[name], want, 1e-5, 1e-4)
    agent.train_step(s, aux=False)
    s.synchronize()
    grads = agent.store.to_host("grads")
    head = [n for n in grads if n.startswith(prefix)]
    assert head and not any(grads[n].any() for n in head), head


def agent_snapshot(agent, s, arrays=None):
    """The agent's state arrays, then the given device arrays {name: array} (copied on s, in order), then its
    parameter gradients as grads/<name>, all on the host."""
    out = dict(agent.state_arrays())
    for name, array in (arrays or {}).items():
        out[name] = array.copy_to_host(stream=s)
    out.update({f"grads/{k}": v for k, v in agent.store.to_host("grads").items()})
    s.synchronize()
    return out


def train_steps(agent, s, graph=None, n=3):
    """n plain train steps (eagerly, or by replaying the given graph of one)."""
    for _ in range(n):
        if graph is None:
            agent.train_step(s)
        else:
            graph.replay(s)
    s.synchronize()


def capture_aux_steps(agent, s):
    """The graphs aux_steps replays: {aux: graph of train_step(aux=aux)}."""
    from numbarl.cuda import graph as cuda_graph

    return {aux: cuda_graph.capture(lambda st, a=aux: agent.train_step(st, aux=a), stream=s, warmup=False)
            for aux in (True, False)}


def capture_train_step(agent, s):
    """The graph train_steps replays: one plain train step."""
    from numbarl.cuda import graph as cuda_graph

    return cuda_graph.capture(agent.train_step, stream=s, warmup=False)


def check_graph_replay_equals_eager(agent, rng, snapshot, steps=aux_steps, capture=capture_aux_steps):
    """The replay filled from rng, `steps` run eagerly from the start state, the start reloaded and the steps
    run again by the graphs `capture(agent, s)` gives: the two snapshots `snapshot(agent, s)` bitwise equal.
    Returns the eager snapshot, the start state and the stream, for the caller's own checks."""
    from numbarl.cuda.runtime import stream

    fill_replay(agent, rng)
    s = stream()
    start = agent.state_arrays()
    steps(agent, s)
    eager = snapshot(agent, s)
    graphs = capture(agent, s)
    agent.load_state(start)
    steps(agent, s, graphs)
    assert_bitwise(eager, snapshot(agent, s))
    return eager, start, s


def check_two_runs_bitwise_identical(rng, make_agent, snapshot, steps=aux_steps):
    """Two agents `make_agent()` on replays filled from one seed drawn from rng, `steps` run on each: their
    snapshots bitwise equal."""
    from numbarl.cuda.runtime import stream

    seed = int(rng.integers(2**31))
    snaps = []
    for _ in range(2):
        agent = make_agent()
        fill_replay(agent, np.random.default_rng(seed))
        s = stream()
        steps(agent, s)
        snaps.append(snapshot(agent, s))
    assert_bitwise(*snaps)


def check_input_gradient_fd(rng, loss_of, h, dh, n, eps=1e-6):
    """dh against central differences of loss_of(h) at n random entries of the (B, H) input h."""
    B, H = h.shape
    for _ in range(n):
        b, c = rng.integers(B), rng.integers(H)
        up, down = h.copy(), h.copy()
        up[b, c] += eps
        down[b, c] -= eps
        numeric = (loss_of(up) - loss_of(down)) / (2 * eps)
        assert abs(dh[b, c] - numeric) <= 1e-8 + 1e-5 * abs(numeric)


def check_param_gradients_fd(rng, loss_of, p, grads, n, eps=1e-6):
    """grads against central differences of loss_of(p) at n random entries of each parameter of p."""
    for name in p:
        for _ in range(n):
            idx = tuple(rng.integers(s) for s in p[name].shape)
            up, down = {k: v.copy() for k, v in p.items()}, {k: v.copy() for k, v in p.items()}
            up[name][idx] += eps
            down[name][idx] -= eps
            numeric = (loss_of(up) - loss_of(down)) / (2 * eps)
            assert abs(grads[name][idx] - numeric) <= 1e-8 + 1e-5 * abs(numeric), name


def check_scalar_head_forward_backward(rng, head, store, values, B, H):
    """A head of one output per row (B, 1) on the device against its float64 reference: its output, dh and its
    parameter gradients for a random input (B, H) and output gradient."""
    from numbarl.cuda.runtime import cuda, stream
    from numbarl.cuda.testing import assert_close

    def dev(x):
        return cuda().to_device(np.ascontiguousarray(x))

    p = {k: np.asarray(v, np.float64) for k, v in values.items()}
    h = rng.standard_normal((B, H)).astype(np.float32)
    dy = rng.standard_normal((B, 1)).astype(np.float32)
    s = stream()
    y = head.forward(dev(h), s, tag="online")
    assert y.shape == (B, 1) and head.output("online").shape == (B, 1)
    y_ref, cache = head.forward_ref(h, p)
    assert_close(y.copy_to_host(), y_ref, 1e-5, 1e-4)
    dh = head.backward(dev(dy), s, tag="online")
    dh_ref, g_ref = head.backward_ref(dy, cache, p)
    assert_close(dh.copy_to_host(), dh_ref, 1e-5, 1e-4)
    grads = store.to_host("grads")
    assert set(g_ref) == set(head.param_names)
    for name, ref in g_ref.items():
        assert_close(grads[name], ref, 1e-5, 1e-4)
