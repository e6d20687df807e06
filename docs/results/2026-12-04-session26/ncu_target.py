"""For Nsight Compute: the C51 loss's launches once to compile, then once more (the profiled launch) at B = 16,384,
4 branches, 51 atoms, on a batch like a train step's (rewards N(0, 2²), γ = 0.95, 5% done).
  ncu --kernel-name regex:c51_target_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight ... python3 ncu_target.py
"""
import numpy as np
from numba import cuda

from numbarl.rl.losses import c51

B, SIZES, Z = 16384, (3, 3, 4, 4), 51
NB, NA = len(SIZES), max(SIZES)
rng = np.random.default_rng(0)
f32 = np.float32
x = rng.standard_normal((B, NB, NA, Z))
args = [cuda.to_device(a) for a in (
    (rng.standard_normal((B, NB, NA, Z)) * 2).astype(f32),                       # online logits
    np.stack([rng.integers(0, n, B) for n in SIZES], 1).astype(np.int32),       # actions
    rng.standard_normal((B, NB, NA)).astype(f32),                               # next Q
    (np.exp(x) / np.exp(x).sum(-1, keepdims=True)).astype(f32),                 # target probabilities
    (rng.standard_normal(B) * 2).astype(f32),                                   # rewards
    (rng.random(B) < 0.05).astype(f32),                                         # dones
    np.full(B, 0.95, f32))]                                                     # discounts
loss = c51.C51Loss(B, SIZES, Z, -10.0, 10.0)
s = cuda.stream()
for _ in range(2):
    loss(*args, s, taken_grad=True)
s.synchronize()
print("loss", float(loss.loss.copy_to_host()[0]))
