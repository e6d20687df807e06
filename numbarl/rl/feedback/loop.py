"""FeedbackLoop: after each epoch's validation, E1, E2, E3 and E9 set what the next epoch trains with.

The loop reads only the *feedback* part of the validation window (:func:`split_validation`); the
model is selected on the other part. Rules (numbarl's reading of the origin notes' E1–E9, with
their defaults; every quantity below is a number the epoch's feedback backtest produced):

E1 Q reality check (``train.e1_q_reality`` = eta, 0 = off). For each feedback trade, Q^ = the
   greedy pass's Q of the trade's direction at its entry bar (the backtest's per-bar record) and
   G = the reward the trade realized, discounted from its entry, in reward units:

       G = sum_{j=e}^{x-1} gamma^(j-e) * conv * (micro_scale * pos * (mid_{j+1} / mid_j - 1)
                                                 - hold_rate * |pos|)
           + gamma^(x-1-e) * conv * trade_scale * pnl / tick_value

   and with env.pnl_reward_scale = s > 0 also s * pos * (mid_{j+1} - mid_j) * multiplier / tick_value per
   bar and the rest of its net P&L, s * (pnl - those moves) / tick_value (costs, and a stop or target
   fill's distance from the mid), at its last bar (the env pays them at the fills; the placement is
   this estimate's)

   (the env's micro, holding and trade terms on the trade's path, numbarl/env/core.py; conv the
   plan-conviction factor of its size). b = median(Q^ - G) is the epoch's Q bias; the reward
   offset integrates it, offset <- offset + eta * b, and the train step subtracts it from the
   sampled returns (numbarl/rl/feedback/kernels.py), so the values shift by -offset. Integrating
   (not setting offset = eta * b) keeps a bias that has been corrected corrected.
E2 adaptive epsilon (``train.e2_adaptive_epsilon``): from the end of the first epoch the
   exploration rate is eps <- clip(eps * 0.8 if S >= best - delta * |best| else eps * 1.25,
   0.01, 0.3) with S the feedback Sharpe, best the best S so far and delta = 0.1; with fewer than
   ``e9_min_trades`` feedback trades eps >= 0.1 (raise the floor: the agent stopped trading).
   Written as a constant device schedule (no recapture).
E3 dynamic gamma (``train.e3_dynamic_gamma``): gamma = clip(1 - 1 / (2 * avg_hold), 0.95, 0.999)
   with avg_hold the feedback trades' mean holding time in bars; the replay's device gamma (every
   n-step return and bootstrap discount reads it).
E9 tradability gate (``train.e9_tradability_gate``): per regime bucket b (regimes.py) the feedback
   trades entered in b give a count n_b and a P&L sum s_b, decayed by half each epoch and added
   to (n_b <- n_b / 2 + new, s_b <- s_b / 2 + new): old evidence fades, so a gated bucket (which
   gets no new trades) is retried once its count falls below the minimum. tau_b = s_b / (n_b + 20)
   (the mean shrunk towards 0 with a prior of 20 trades); entries are gated where tau_b < 0 and
   n_b >= ``e9_min_trades``, in training (the env's mask) and in every backtest (the scores).

E4 trade autopsy (``train.e4_trade_autopsy``): each losing feedback trade is blamed on one
   branch, by the first rule that holds (vol = the env's volatility unit at the entry bar, MFE the
   trade's maximum favourable excursion over its bars, H its holding time in bars):
     stop       it was stopped out and within H bars after the exit the price went 1 vol in the
                trade's favour from the entry (the stop was too tight; the env's target levels are
                not in the trade list, so 1 vol stands for "the target");
     target     its MFE reached 1 vol, yet it closed at a loss (it gave the move back);
     size       it was at the largest size and lost more than the median losing trade;
     direction  otherwise (it went against the entry and never 1 vol its way).
   err_k = branch k's share of the losers, lr_k = agent.lr * clip(err_k / mean(err), 0.5, 2) for
   branch k's columns of the advantage GEMM (their own optimizer groups, head.adv.<branch>).

E6 winner distillation (``train.e6_winner_boost`` = kappa) and E8 curriculum
(``train.e8_curriculum_kappa``) weight the sampled batch (replay_weights.py, curriculum.py: the
rows of the top decile of the epoch's training trades x (1 + kappa); the regime buckets where the
feedback trades lost most often x clip(1 + kappa (f_b - f), 0.5, 2)); the loop owns them and
updates them each epoch. E7 hindsight labels (``train.e7_margin_weight`` = lambda_E): the entry
rows of losing training trades are labelled flat and a large-margin loss on the direction branch
pulls towards the label, its weight halved each epoch (hindsight.py, numbarl/rl/losses/margin.py).
E5 (ensemble agreement) needs the ensemble and is not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numbarl.cuda.runtime import Arena
from numbarl.env.params import DIR_LONG, DIR_SHORT
from numbarl.rl.feedback import kernels
from numbarl.rl.feedback.regimes import N_BUCKETS, RegimeBuckets
from numbarl.rl.feedback.split import feedback_on, split_validation  # noqa: F401 (re-exported)

E2_DECAY, E2_GROW, E2_DELTA, E2_MIN, E2_MAX, E2_FLOOR = 0.8, 1.25, 0.1, 0.01, 0.3, 0.1
E3_C, E3_MIN, E3_MAX = 2.0, 0.95, 0.999
E9_PRIOR, E9_DECAY = 20.0, 0.5


# ---------------------------------------------------------------------------------------------
# the rules (host, float64): each a pure function, tested against hand-computed cases
# ---------------------------------------------------------------------------------------------
def trade_returns(trades, mid: np.ndarray, k, gamma: float) -> np.ndarray:
    """G of each trade (E1, module docstring) from its entry/exit bars, side, size and net P&L."""
    out = np.zeros(len(trades), np.float64)
    if not len(trades):
        return out
    entry = trades["entry_bar"].to_numpy(np.int64)
    exit_ = trades["exit_bar"].to_numpy(np.int64)
    pos = (trades["side"].to_numpy(np.float64) * trades["size"].to_numpy(np.float64))
    pnl = trades["pnl"].to_numpy(np.float64)
    mid = np.asarray(mid, np.float64)
    for i in range(len(trades)):
        e, x, p = entry[i], exit_[i], pos[i]
        size = abs(p)
        conv = 1.0 + float(k.conviction_weight) * (size / float(k.max_size) - 1.0) if size > 0 else 1.0
        g, disc = 0.0, 1.0
        pnl_scale = float(k.pnl_scale)
        marked = 0.0  # the mark-to-market term's moves so far (pnl_scale > 0)
        for j in range(e, x):
            r = 0.0
            if mid[j] > 0:
                r += float(k.micro_scale) * p * (mid[j + 1] / mid[j] - 1.0)
            r -= float(k.hold_rate) * size
            if pnl_scale:  # the bar's mid-to-mid P&L; the rest of the net P&L (costs, exit fill vs mid) at its exit
                move = p * (mid[j + 1] - mid[j]) * float(k.multiplier)
                marked += move
                r += pnl_scale * move / float(k.tick_value)
            if j == x - 1:
                r += float(k.trade_scale) * pnl[i] / float(k.tick_value)
                if pnl_scale:
                    r += pnl_scale * (pnl[i] - marked) / float(k.tick_value)
            g += disc * conv * r
            disc *= gamma
        out[i] = g
    return out


def entry_q(trades, q_record: np.ndarray, start: int) -> np.ndarray:
    """Q^ of each trade: the direction branch's Q of its side at its entry bar (policy 0)."""
    if not len(trades):
        return np.zeros(0, np.float64)
    row = trades["entry_bar"].to_numpy(np.int64) - int(start)
    side = np.where(trades["side"].to_numpy(np.int64) > 0, DIR_LONG, DIR_SHORT)
    ok = (row >= 0) & (row < q_record.shape[1])
    q = np.full(len(trades), np.nan)
    q[ok] = q_record[0, row[ok], side[ok]]
    return q


def q_bias(q_hat: np.ndarray, g: np.ndarray) -> float | None:
    """E1's b = median(Q^ - G) over the trades with a finite Q^ (None without one)."""
    d = np.asarray(q_hat, np.float64) - np.asarray(g, np.float64)
    d = d[np.isfinite(d)]
    return float(np.median(d)) if d.size else None


def autopsy(trades, mid, high, low, vol, max_size: float) -> np.ndarray:
    """E4: losing trades blamed per branch (direction, size, target, stop), float64 counts [4]."""
    from numbarl.env.params import BR_DIRECTION, BR_SIZE, BR_STOP, BR_TARGET

    out = np.zeros(4, np.float64)
    if not len(trades):
        return out
    lose = trades[trades["pnl"].to_numpy(np.float64) < 0]
    if not len(lose):
        return out
    median_loss = float(np.median(lose["pnl"].to_numpy(np.float64)))
    n_bars = len(mid)
    for row in lose.itertuples(index=False):
        e, x, side = int(row.entry_bar), int(row.exit_bar), float(row.side)
        unit = float(vol[e])
        entry_px = float(mid[e])
        span = slice(e + 1, x + 1)
        if side > 0:
            mfe = float(np.max(high[span]) - entry_px) if x > e else 0.0
        else:
            mfe = float(entry_px - np.min(low[span])) if x > e else 0.0
        hold = max(x - e, 1)
        after = slice(x + 1, min(x + 1 + hold, n_bars))
        later = 0.0
        if after.start < after.stop:
            later = float(np.max(high[after]) - entry_px) if side > 0 else float(entry_px - np.min(low[after]))
        if str(row.exit_reason) == "stop" and later >= unit:
            out[BR_STOP] += 1
        elif mfe >= unit:
            out[BR_TARGET] += 1
        elif float(row.size) >= max_size and float(row.pnl) < median_loss:
            out[BR_SIZE] += 1
        else:
            out[BR_DIRECTION] += 1
    return out


def branch_lr_scales(blame: np.ndarray) -> np.ndarray:
    """E4: clip(err_k / mean(err), 0.5, 2) per branch (1 everywhere without a losing trade)."""
    blame = np.asarray(blame, np.float64)
    if blame.sum() <= 0:
        return np.ones_like(blame)
    err = blame / blame.sum()
    return np.clip(err / err.mean(), 0.5, 2.0)


def next_epsilon(eps: float, sharpe, best, n_trades: int, min_trades: int) -> float:
    """E2 (module docstring). sharpe/best None when undefined (then: treated as not improving)."""
    good = sharpe is not None and best is not None and sharpe >= best - E2_DELTA * abs(best)
    eps = eps * (E2_DECAY if good else E2_GROW)
    eps = min(max(eps, E2_MIN), E2_MAX)
    if n_trades < min_trades:
        eps = max(eps, E2_FLOOR)
    return float(eps)


def gamma_from_hold(avg_hold) -> float | None:
    """E3 (module docstring); None when the average holding time is undefined."""
    if avg_hold is None or not math.isfinite(avg_hold) or avg_hold <= 0:
        return None
    return float(min(max(1.0 - 1.0 / (E3_C * avg_hold), E3_MIN), E3_MAX))


def tradability(counts: np.ndarray, sums: np.ndarray, min_trades: int) -> tuple[np.ndarray, np.ndarray]:
    """E9: (tau [9], gate uint8 [9]) from the decayed per-bucket counts and P&L sums."""
    counts = np.asarray(counts, np.float64)
    tau = np.asarray(sums, np.float64) / (counts + E9_PRIOR)
    gate = ((tau < 0) & (counts >= min_trades)).astype(np.uint8)
    return tau, gate


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
@dataclass
class FeedbackState:
    """What the loop carries from epoch to epoch (saved in every checkpoint's state)."""

    offset: float = 0.0
    epsilon: float | None = None
    gamma: float | None = None
    best_sharpe: float | None = None
    counts: list | None = None
    sums: list | None = None
    e2_updates: int = 0
    lr_scales: list | None = None
    e4_updates: int = 0
    e7_epochs: int = 0


class FeedbackLoop:
    """The E switches of one fold's training. Built by the trainer, attached to the agent before
    its graphs are captured (`agent.attach_feedback(loop)`), fed each epoch's feedback backtest."""

    def __init__(self, tcfg, agent, params, market_host, train_window, feature_names, tick_size: float):
        self.t = tcfg
        self.agent = agent
        self.params = params
        self.mid = np.asarray(market_host.mid, np.float64)
        self.k = params.step_consts(tick_size)
        self.e1 = float(tcfg.e1_q_reality)
        self.e2, self.e3, self.e9 = bool(tcfg.e2_adaptive_epsilon), bool(tcfg.e3_dynamic_gamma), bool(tcfg.e9_tradability_gate)
        self.e4 = bool(tcfg.e4_trade_autopsy)
        if self.e4:
            self.high, self.low = np.asarray(market_host.high, np.float64), np.asarray(market_host.low, np.float64)
            self.vol = np.asarray(market_host.volatility(params.vol_span, params.vol_horizon_bars), np.float64)
            self.max_size = float(max(params.sizes))
            self.adv_groups = [g for g in agent.optim.groups if agent.optim.parents[g] == "head.adv"]
            self.base_lr = float(agent.cfg.lr)
        self.features = market_host.features
        self.state = FeedbackState(gamma=float(agent.replay.gamma),
                                   counts=[0.0] * N_BUCKETS, sums=[0.0] * N_BUCKETS)
        self.regimes = None
        n_feat = market_host.features.shape[1]
        self.position_col = n_feat  # the first portfolio feature: signed position / max size
        if self.e9 or tcfg.e8_curriculum_kappa > 0:
            wanted = tuple(w.strip() for w in tcfg.regime_features.split(",") if w.strip())
            self.regimes = RegimeBuckets.fit(market_host.features, train_window, feature_names, wanted)
        # E6 and E8 weight the sampled batch (numbarl/rl/feedback/replay_weights.py, curriculum.py)
        self.winners = self.curriculum = None
        if tcfg.e6_winner_boost > 0:
            from numbarl.rl.feedback.replay_weights import WinnerDistillation

            self.winners = WinnerDistillation(agent.n_envs, boost=tcfg.e6_winner_boost, top_frac=tcfg.e6_top_frac).allocate()
        if tcfg.e8_curriculum_kappa > 0:
            from numbarl.rl.feedback.curriculum import Curriculum

            self.curriculum = Curriculum(self.regimes, kappa=tcfg.e8_curriculum_kappa).allocate()
        # E7: hindsight labels on losing training trades' entries and the margin loss they feed
        self.hindsight = self.margin = None
        if tcfg.e7_margin_weight > 0:
            from numbarl.rl.feedback.hindsight import HindsightLabels
            from numbarl.rl.losses.margin import MarginLoss

            B = int(agent.cfg.batch_size)
            self.hindsight = HindsightLabels(agent.replay.n_slots, agent.n_envs, B).allocate()
            self.margin = MarginLoss(B, agent.branch_sizes, agent.cfg.n_atoms, branch=0, margin=tcfg.e7_margin)
            self.margin.set_weight(tcfg.e7_margin_weight)
        self.dev = Arena("feedback")
        self.dev.add("offset", (1,), np.float32)
        self.dev.add("gate", (N_BUCKETS,), np.uint8)
        self.dev.add("edges", (4,), np.float32)
        self.dev.add("blocked", (max(int(agent.n_envs), 1),), np.uint8)
        self.dev.allocate()
        self.dev.load({"offset": np.zeros(1, np.float32), "gate": np.zeros(N_BUCKETS, np.uint8),
                       "edges": self.regimes.edges_array() if self.regimes else np.zeros(4, np.float32),
                       "blocked": np.zeros(max(int(agent.n_envs), 1), np.uint8)})

    @property
    def record_q(self) -> bool:
        return self.e1 > 0

    # -- device hooks the agent calls inside its step functions (capturable) ----------------------
    def on_sample(self, batch, stream) -> None:
        """E1: lower the sampled returns of every window (the main one and each extra horizon's, each by its
        own discount) by the offset; E7: the batch's labels (train step, after SAMPLE)."""
        if self.hindsight is not None:
            self.hindsight.gather(batch, stream)
        if self.e1 > 0:
            kernels.offset_every_window(batch, self.dev["offset"], stream)

    @property
    def weighted(self) -> bool:
        """Whether the sampled batch carries loss weights (E6, E8): the agent switches the replay's
        normalized weights on when it attaches the loop."""
        return self.winners is not None or self.curriculum is not None

    @property
    def sample_factor(self):
        """E8's per-bucket weight table for Replay.sample (None without E8)."""
        return self.curriculum

    @property
    def has_aux_loss(self) -> bool:
        """Whether the loop adds an auxiliary loss to the train step (E7's margin loss)."""
        return self.margin is not None

    def on_written(self, env_out, env, replay, stream) -> None:
        """E6/E7, after the collect step's replay write: mark winners' rows, label losers' entries."""
        if self.winners is not None:
            self.winners.mark(env_out, env.state, replay, stream)
        if self.hindsight is not None:
            self.hindsight.mark(env_out, env.state, replay, stream)

    def apply_losses(self, inputs: dict, d_logits, support, stream, ledger) -> None:
        """E7's margin loss on the sampled rows' labels, added into the head's logits gradient."""
        if self.margin is not None:
            self.margin.apply({"logits": inputs["logits"], "lse": inputs["lse"], "support": support,
                               "labels": self.hindsight.arena["batch_label"]}, {"logits": d_logits}, stream,
                              ledger=ledger)

    def on_mask(self, obs, mask, stream) -> None:
        """E9 on the env's mask before the behaviour policy chooses (collect step)."""
        if self.regimes is not None:
            n = obs.shape[0]
            r = self.regimes
            kernels.gate_mask_kernel[(n + 255) // 256, 256, stream](
                obs, mask, self.position_col, self.dev["edges"], self.dev["gate"], r.col_a, r.col_b, self.dev["blocked"])

    def on_scores(self, obs, q, stream) -> None:
        """E9 on the greedy scores of a backtest."""
        if self.regimes is not None:
            n = obs.shape[0]
            r = self.regimes
            kernels.gate_scores_kernel[(n + 255) // 256, 256, stream](
                obs, q, self.position_col, self.dev["edges"], self.dev["gate"], r.col_a, r.col_b)

    # -- the epoch hook ---------------------------------------------------------------------------
    def on_epoch(self, result, metrics: dict, epsilon_now: float) -> dict:
        """Feed the epoch's feedback backtest (BacktestResult, its metrics dict) and the exploration
        rate of the last collect step; write the device knobs for the next epoch; return the record
        logged as kind "feedback"."""
        st, rec = self.state, {}
        trades = result.trades
        trades = trades[trades["policy"] == 0] if len(trades) else trades
        n_trades = int(len(trades))
        rec["feedback_trades"] = n_trades
        rec["feedback_sharpe"] = metrics.get("sharpe")
        if self.e1 > 0:
            q_hat = entry_q(trades, result.q_record, result.window[0])
            g = trade_returns(trades, self.mid, self.k, st.gamma)
            b = q_bias(q_hat, g)
            if b is not None:
                st.offset += self.e1 * b
            rec["e1.q_bias"] = b
            rec["e1.offset"] = st.offset
        if self.e2:
            sharpe = metrics.get("sharpe")
            best = st.best_sharpe if sharpe is None else (sharpe if st.best_sharpe is None else max(st.best_sharpe, sharpe))
            eps = float(epsilon_now) if st.epsilon is None else st.epsilon  # the schedule's, after epoch 1
            st.epsilon = next_epsilon(eps, sharpe, best, n_trades, self.t.e9_min_trades)
            st.best_sharpe = best
            st.e2_updates += 1
            rec["e2.epsilon"] = st.epsilon
        if self.e3:
            g3 = gamma_from_hold(metrics.get("avg_hold"))
            if g3 is not None:
                st.gamma = g3
            rec["e3.gamma"] = st.gamma
        if self.e4:
            blame = autopsy(trades, self.mid, self.high, self.low, self.vol, self.max_size)
            st.lr_scales = [float(x) for x in branch_lr_scales(blame)]
            st.e4_updates += 1
            rec.update({f"e4.blame_{g.rsplit('.', 1)[1]}": float(b) for g, b in zip(self.adv_groups, blame)})
            rec.update({f"e4.lr_scale_{g.rsplit('.', 1)[1]}": x for g, x in zip(self.adv_groups, st.lr_scales)})
        if self.winners is not None:  # E6: the threshold of the next epoch, from this epoch's training trades
            rec["e6.threshold"] = self.winners.epoch_threshold()
            rec.update({f"e6.{k}": v for k, v in self.winners.counters().items()})
        if self.curriculum is not None:  # E8: the feedback part's failure rate per regime bucket
            rec.update({f"e8.{k}": v for k, v in self.curriculum.update(trades, self.features).items()})
        if self.margin is not None:  # E7: the margin term decays by half per epoch (DQfD)
            st.e7_epochs += 1
            lam = self.t.e7_margin_weight * 0.5 ** st.e7_epochs
            self.margin.set_weight(lam)
            rec["e7.weight"] = lam
            rec["e7.labelled"] = self.hindsight.labelled()
        if self.e9:
            new_n = np.zeros(N_BUCKETS)
            new_s = np.zeros(N_BUCKETS)
            if n_trades:
                rows = self.regimes.of(self.features[trades["entry_bar"].to_numpy(np.int64)])
                np.add.at(new_n, rows, 1.0)
                np.add.at(new_s, rows, trades["pnl"].to_numpy(np.float64))
            st.counts = list(E9_DECAY * np.asarray(st.counts) + new_n)
            st.sums = list(E9_DECAY * np.asarray(st.sums) + new_s)
            tau, gate = tradability(np.asarray(st.counts), np.asarray(st.sums), self.t.e9_min_trades)
            rec.update({f"e9.tau_{b}": float(x) for b, x in enumerate(tau)})
            rec["e9.gated_buckets"] = int(gate.sum())
        self.apply()
        return rec

    def apply(self) -> None:
        """Write the state's knobs to the device (and the agent's epsilon / the replay's gamma)."""
        st = self.state
        self.dev.load({"offset": np.array([st.offset], np.float32)})
        if self.e2 and st.epsilon is not None:
            self.agent.set_epsilon_schedule(st.epsilon, st.epsilon, 1)
        if self.e3:
            self.agent.replay.set_gamma(st.gamma)
        if self.e4 and st.lr_scales is not None:
            for g, x in zip(self.adv_groups, st.lr_scales):
                self.agent.optim.set_lr(self.base_lr * x, group=g)
        if self.margin is not None:
            self.margin.set_weight(self.t.e7_margin_weight * 0.5 ** st.e7_epochs)
        if self.e9:
            _, gate = tradability(np.asarray(st.counts), np.asarray(st.sums), self.t.e9_min_trades)
            self.dev.load({"gate": gate})

    def gate_in_force(self) -> list:
        """The E9 gate table the policy acts with now (part of the policy: saved with each
        checkpoint, restored when that checkpoint is scored)."""
        return [int(x) for x in self.dev["gate"].copy_to_host()]

    def set_gate(self, gate) -> None:
        if gate is not None:
            self.dev.load({"gate": np.asarray(gate, np.uint8)})

    def train_stats(self) -> dict:
        """Values merged into the train records (liveness keys of the switches that are on)."""
        out = {}
        if self.e1 > 0:
            out["feedback.e1_offset"] = self.state.offset
        if self.e2:  # the rate in force comes from the schedule until the first update
            out["feedback.e2_updates"] = self.state.e2_updates
        if self.e3:
            out["feedback.e3_gamma"] = self.state.gamma
        if self.e4:
            out["feedback.e4_updates"] = self.state.e4_updates
        if self.winners is not None:  # trades the mark kernel saw close in training, rows it boosted
            counters = self.winners.counters()
            out["feedback.e6_trades_logged"] = counters["winner_trades_logged"]
            out["feedback.e6_rows_marked"] = counters["winner_rows_marked"]
        if self.curriculum is not None:  # feedback trades behind the last table, its largest weight
            out["feedback.e8_trades"] = int(self.curriculum.counts[0].sum())
            out["feedback.e8_weight_max"] = self.curriculum.summary()["curriculum_weight_max"]
        if self.hindsight is not None:
            out["feedback.e7_labelled"] = self.hindsight.labelled()
        if self.e9:
            blocked = self.dev["blocked"].copy_to_host()
            out["feedback.e9_blocked_frac"] = float(np.mean(blocked))  # entries gated at the last collect step
            out["feedback.e9_evidence"] = float(np.sum(self.state.counts))  # decayed feedback trades behind the gate
        return out

    # -- resume -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return dict(vars(self.state))

    def state_arrays(self) -> dict:
        """Device state of E6/E8 for a checkpoint (prefix-free names: winners/..., curriculum/...)."""
        out = {}
        for name, part in (("winners", self.winners), ("curriculum", self.curriculum), ("hindsight", self.hindsight)):
            if part is not None:
                out.update({f"{name}/{k}": v for k, v in part.state_arrays().items()})
        return out

    def load_arrays(self, arrays: dict) -> None:
        for name, part in (("winners", self.winners), ("curriculum", self.curriculum), ("hindsight", self.hindsight)):
            if part is not None:
                part.load_state({k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(name + "/")})

    def load_state_dict(self, d: dict | None) -> None:
        if d:
            self.state = FeedbackState(**d)
            self.apply()
