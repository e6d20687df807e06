"""The agent contract and the registry keyed by ``agent.kind``.

An agent owns everything it learns with and is the ONE place its steps are written: the trainer,
the benchmarks and the GPU tests take the step functions from it (SPEC §2.0)::

    agent = make_agent(cfg.agent, state_dim, branch_sizes, n_envs, seed, eval_batch=1, epsilon=...,
                       feature_names=cache.feature_names)
    steps = agent.step_functions(env)       # {"collect": fn(stream), "train": fn(stream), "diagnostics": ...}
    graphs = {name: capture(fn) for name, fn in steps.items()}        # each captured once
    for each collect step t:
        graphs["collect"].replay()
        for name in agent.after_collect(t, learning_starts, train_every):   # e.g. ("train",)
            graphs[name].replay()
    every log interval: graphs["diagnostics"].replay() (if the agent has one), then agent.read_stats()
    agent.reset_eval(stream); agent.scores(obs, out, stream)   # greedy scores in a backtest
    agent.state_arrays() / load_state(arrays) / load_params(arrays)          # checkpoints

``train_phases()`` lists the named phases of the train step in program order (the train step is
exactly their concatenation), so a benchmark times each phase from the same code the run uses.
Statistics go to mapped memory through a named :class:`numbarl.cuda.registry.StatsLayout` and are
read at log intervals by :meth:`Agent.read_stats`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

AGENTS: dict[str, type] = {}


def register(kind: str):
    """Class decorator: the agent built for ``agent.kind = kind``."""

    def deco(cls):
        if kind in AGENTS and AGENTS[kind] is not cls:
            raise ValueError(f"agent kind {kind!r} is registered twice ({AGENTS[kind].__name__}, {cls.__name__})")
        AGENTS[kind] = cls
        cls.kind = kind
        return cls

    return deco


def agent_class(kind: str) -> type:
    _load_builtin()
    cls = AGENTS.get(kind)
    if cls is None:
        raise ValueError(f"agent.kind = {kind!r} is not a registered agent; registered: {', '.join(sorted(AGENTS))}")
    return cls


def make_agent(cfg, state_dim: int, branch_sizes, n_envs: int, seed: int, **kwargs):
    """The agent of ``cfg.kind`` (an AgentConfig), built for an env of this shape. ``feature_names=`` (the
    cache's market feature names) resolves the options that name obs columns (numbarl/rl/obs_columns.py);
    without it they resolve against the default feature list."""
    return agent_class(cfg.kind)(cfg, state_dim, branch_sizes, n_envs, seed, **kwargs)


def known_kinds() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(AGENTS))


def _load_builtin() -> None:
    from numbarl.rl.agents import (
        dqn,  # noqa: F401  (registers "c51")
        dt,  # noqa: F401  (registers "dt")
        ppo,  # noqa: F401  (registers "ppo")
    )


class Agent:
    """Base of every agent (see the module docstring). Subclasses define the step functions."""

    kind: str = ""

    def step_functions(self, env) -> dict[str, Callable]:
        """{graph name: step function(stream)}: what the trainer captures, once each. "collect" and
        the names after_collect returns run every step; "diagnostics", when present, only at log
        intervals, right before read_stats (statistics only the log reads stay off the train step)."""
        raise TypeError(f"{type(self).__name__} does not define step_functions")

    def train_phases(self) -> list[tuple[str, Callable]]:
        """[(phase name, fn(stream))] of the train step, in program order."""
        return []

    def after_collect(self, collect_steps: int, learning_starts: int, train_every: int) -> tuple[str, ...]:
        """The graphs to replay after collect step number `collect_steps` (1-based), in order."""
        return ()

    @property
    def prefill_steps(self) -> int:
        """Collect steps needed before the first training graph may run."""
        return 0

    def train_starts_after(self, learning_starts: int) -> int:
        """The collect steps before the first train step (the replay's prefill): train.learning_starts or
        the agent's own prefill_steps, the larger."""
        return max(int(learning_starts), int(self.prefill_steps))

    def arm_entry_gates(self, armed: bool, stream) -> None:
        """Turn the agent's entry gates on or off (the trainer: off over the replay's prefill); an agent without
        gates has nothing to switch (numbarl/rl/agents/dqn.py has them)."""

    def scores(self, obs, out, stream) -> None:
        """Greedy per-branch action scores [P, n_branches, max_actions] for a backtest's policies."""
        raise TypeError(f"{type(self).__name__} does not define scores")

    def reset_eval(self, stream) -> None:
        """Clear state carried from bar to bar in a backtest (recurrent / sequence agents)."""

    def state_arrays(self) -> dict:
        return {}

    def load_state(self, arrays: dict) -> None:
        pass

    # the checkpoint arrays a policy needs (load_params reads them): the trainer's test backtest and
    # numbarl-backtest load only these from a checkpoint
    policy_prefixes: tuple = ("params/",)

    def load_params(self, arrays: dict) -> None:
        pass

    def read_stats(self, stream) -> dict:
        return {}

    def nonfinite_tensors(self) -> list[str]:
        return []


class ArenaStateAgent(Agent):
    """An agent whose state is a parameter store (`store`: params, target, Adam moments...), the
    optimizer's state arena (`optim.state`), a resume-only data arena (`data_arena`: a rollout, a
    trajectory dataset; saved under "replay/" like the C51 replay, so the run folder writes it only
    where resume needs it), `scalars` and mapped `stats` with a `stats_layout`: checkpoints, stats
    and the finiteness check written once for such agents (PPO, the Decision Transformer).
    Subclasses set `data_arena`, `data_label` (its name in nonfinite reports) and `finite_data`
    (the data arrays checked for NaN/inf)."""

    data_label: str = "data"
    finite_data: tuple[str, ...] = ()

    @property
    def data_arena(self):
        raise TypeError(f"{type(self).__name__} does not define data_arena")

    def state_arrays(self) -> dict:
        out = {}
        for role, arena in self.store.arenas.items():
            if role == "grads":
                continue
            for name, value in arena.to_host().items():
                out[f"{role}/{name}"] = value
        for name, value in self.optim.state.to_host().items():
            out[f"optim/{name}"] = value
        for name, value in self.data_arena.to_host().items():  # resume-only, like the c51 replay
            out[f"replay/{name}"] = value
        for name, value in self.scalars.to_host().items():
            out[f"agent/{name}"] = value
        out["agent/stats"] = self.stats.host.copy()
        return out

    def load_state(self, arrays: dict) -> None:
        def under(prefix):
            return {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(prefix + "/")}

        for role, arena in self.store.arenas.items():
            if role != "grads":
                arena.load(under(role))
        self.optim.state.load(under("optim"))
        self.data_arena.load(under("replay"))
        self.scalars.load({k: v for k, v in under("agent").items() if k != "stats"})
        if "agent/stats" in arrays:
            saved = np.asarray(arrays["agent/stats"], np.float32)
            n = min(saved.size, self.stats.host.size)
            self.stats.host[:n] = saved[:n]

    def load_params(self, arrays: dict) -> None:
        self.store.load({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("params/")})

    def read_stats(self, stream) -> dict:
        self.stats.record(stream)
        values = self.stats_layout.read(self.stats.read())
        values.pop("optim_step")  # the same number as train_step
        return values

    def nonfinite_tensors(self) -> list[str]:
        bad = []
        for role, arena in self.store.arenas.items():
            for name, value in arena.to_host().items():
                if not np.all(np.isfinite(value)):
                    bad.append(f"{role}:{name}")
        for name in self.finite_data:
            if not np.all(np.isfinite(self.data_arena[name].copy_to_host())):
                bad.append(f"{self.data_label}:{name}")
        return bad
