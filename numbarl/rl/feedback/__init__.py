"""The validation feedback loop (E1–E9): each epoch's validation backtest steers the next epoch.

Every switch reads statistics of the *feedback* part of the validation window only; the model is
selected on the *selection* part, after an embargo (the two parts split the window
chronologically, :func:`numbarl.rl.feedback.loop.split_validation`), so choosing the best
checkpoint stays honest while validation steers training. No validation transition ever enters
the replay. What each switch writes is device memory the captured graphs already read (the
exploration rate, the replay's discount, a reward offset, a gate table): nothing is recaptured.

    loop.py            FeedbackLoop: E1 Q reality check, E2 adaptive epsilon, E3 dynamic gamma,
                       E9 tradability gate (host logic, numpy references, state for resume)
    kernels.py         the device side: E1's reward offset on the sampled batch, E9's gate on the
                       env's mask (collect) and on the greedy scores (backtests)
    regimes.py         the 9 regime buckets (trend strength x volatility terciles) E8 and E9 share
    replay_weights.py  E6 winner distillation (replay sample weights)
    curriculum.py      E8 curriculum weights per regime bucket
"""
