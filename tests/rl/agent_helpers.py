"""Shared pieces of the tests of the C51 agent's auxiliary components (IQN, IQL, spectral
normalization), on the simulator and the GPU: a replay filled with random transitions, the aux /
plain / aux train-step sequence, and the bitwise comparison of two snapshots."""

import numpy as np


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
