"""The validation window's split for the feedback loop (no CUDA import: the trainer's module level
and the config checks use it before the backend is chosen)."""

from __future__ import annotations


def feedback_on(t) -> bool:
    """Whether any feedback switch of TrainConfig `t` is on (then validation is split)."""
    return bool(t.e1_q_reality > 0 or t.e2_adaptive_epsilon or t.e3_dynamic_gamma or t.e4_trade_autopsy
                or t.e6_winner_boost > 0
                or t.e7_margin_weight > 0 or t.e8_curriculum_kappa > 0 or t.e9_tradability_gate)


def split_validation(window: tuple[int, int], share: float, embargo: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(feedback, selection): the first `share` of the validation bars, then `embargo` bars
    dropped, then the rest. Both parts must hold at least 2 bars."""
    lo, hi = int(window[0]), int(window[1])
    mid = lo + int(round(share * (hi - lo)))
    fb, sel = (lo, mid), (mid + int(embargo), hi)
    if fb[1] - fb[0] < 2 or sel[1] - sel[0] < 2:
        raise ValueError(f"validation window {window} is too short to split into a feedback part ({share:.0%}) and a "
                         f"selection part after {embargo} embargo bars: got {fb} and {sel}; lower train.embargo_bars, "
                         "change train.feedback_split or validate on more sessions")
    return fb, sel
