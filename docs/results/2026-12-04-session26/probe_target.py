"""Probe: where c51_target_kernel's time goes at B = 16,384, 4 branches, 51 atoms (H200). Variants of the kernel,
each timed over 50 launches (CUDA events, median of 5): the real one; its projection alone; its log-sum-exp and
cross-entropy alone (m read from the target row); the projection with the support in shared memory; the real one at
32, 64 and 256 threads per block; the argmax alone; the rows' loads and one store alone (no arithmetic). Writes
JSON to argv[1]."""
import json
import math
import sys

import numpy as np
from numba import cuda, float32

from numbarl.rl.losses import c51
from numbarl.rl.losses.c51 import (_NEG_INF, _U0, _U1, _ZERO, bootstrap_gamma_dev, c51_target_kernel, hat_weight,
                                   project_row_dev, target_atom)

B, SIZES, Z = 16384, (3, 3, 4, 4), 51
NB, NA = len(SIZES), max(SIZES)
rng = np.random.default_rng(0)
f32 = np.float32
logits = (rng.standard_normal((B, NB, NA, Z)) * 2).astype(f32)
x = rng.standard_normal((B, NB, NA, Z))
probs = (np.exp(x) / np.exp(x).sum(-1, keepdims=True)).astype(f32)
next_q = rng.standard_normal((B, NB, NA)).astype(f32)
actions = np.stack([rng.integers(0, n, B) for n in SIZES], 1).astype(np.int32)
rewards = (rng.standard_normal(B) * 2).astype(f32)
dones = (rng.random(B) < 0.05).astype(f32)
discounts = np.full(B, 0.95, f32)
loss = c51.C51Loss(B, SIZES, Z, -10.0, 10.0)
d = {k: cuda.to_device(v) for k, v in dict(logits=logits, probs=probs, next_q=next_q, actions=actions,
                                             rewards=rewards, dones=dones, discounts=discounts).items()}
a = loss.arena
args = (d["logits"], d["actions"], d["next_q"], d["probs"], d["rewards"], d["dones"], d["discounts"], loss.support,
        a["branch_sizes"], a["no_mask"], np.int32(0), a["support_scalars"], loss.target_dist, a["lse"], loss.ce,
        np.int32(0), loss.entropy, np.int32(0), loss._support_mode, a["best_action"])


@cuda.jit(device=True)
def best_dev(next_q, b, k, n):
    best = _U0
    bq = next_q[b, k, 0]
    a = _U1
    while a < n:
        q = next_q[b, k, a]
        if q > bq:
            bq = q
            best = a
        a += _U1
    return best


@cuda.jit
def proj_only(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support, branch_sizes,
              next_mask, use_mask, ss, target_dist, lse, ce, ue, ent, ad, sm, ba):
    b = np.uint64(cuda.blockIdx.x) * np.uint64(cuda.blockDim.x) + np.uint64(cuda.threadIdx.x)
    k = np.uint64(cuda.blockIdx.y)
    if b >= np.uint64(online_logits.shape[0]):
        return
    best = best_dev(next_q, b, k, np.uint64(branch_sizes[k]))
    gamma = bootstrap_gamma_dev(discounts, dones, b)
    project_row_dev(rewards[b], gamma, target_probs[b, k, best], support, ss[0], ss[1], ss[2], target_dist[b, k])


@cuda.jit
def ce_only(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support, branch_sizes,
            next_mask, use_mask, ss, target_dist, lse, ce, ue, ent, ad, sm, ba):
    b = np.uint64(cuda.blockIdx.x) * np.uint64(cuda.blockDim.x) + np.uint64(cuda.threadIdx.x)
    k = np.uint64(cuda.blockIdx.y)
    if b >= np.uint64(online_logits.shape[0]):
        return
    best = best_dev(next_q, b, k, np.uint64(branch_sizes[k]))
    m_row = target_probs[b, k, best]
    row = online_logits[b, k, np.uint64(actions[b, k])]
    n = np.uint64(row.shape[0])
    mx = _NEG_INF
    i = _U0
    while i < n:
        mx = max(mx, row[i])
        i += _U1
    tot = _ZERO
    i = _U0
    while i < n:
        tot += math.exp(row[i] - mx)
        i += _U1
    ln = mx + math.log(tot)
    acc = _ZERO
    i = _U0
    while i < n:
        acc -= m_row[i] * (row[i] - ln)
        i += _U1
    lse[b, k] = ln
    ce[b, k] = acc


@cuda.jit
def proj_shared_support(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support,
                        branch_sizes, next_mask, use_mask, ss, target_dist, lse, ce, ue, ent, ad, sm, ba):
    sh = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    if t < support.shape[0]:
        sh[t] = support[t]
    cuda.syncthreads()
    b = np.uint64(cuda.blockIdx.x) * np.uint64(cuda.blockDim.x) + np.uint64(t)
    k = np.uint64(cuda.blockIdx.y)
    if b >= np.uint64(online_logits.shape[0]):
        return
    best = best_dev(next_q, b, k, np.uint64(branch_sizes[k]))
    gamma = bootstrap_gamma_dev(discounts, dones, b)
    probs_row = target_probs[b, k, best]
    out_row = target_dist[b, k]
    reward, v_min, v_max, inv = rewards[b], ss[0], ss[1], ss[2]
    n = np.uint64(support.shape[0])
    lo = _U0
    i = _U0
    while i < n:
        z_i = sh[i]
        while lo < n:
            tz = target_atom(reward, gamma, sh[lo], v_min, v_max)
            if tz < z_i and hat_weight(tz, z_i, inv) == _ZERO:
                lo += _U1
            else:
                break
        m = _ZERO
        j = lo
        while j < n:
            tz = target_atom(reward, gamma, sh[j], v_min, v_max)
            w = hat_weight(tz, z_i, inv)
            if w == _ZERO and tz > z_i:
                break
            m += w * probs_row[j]
            j += _U1
        out_row[i] = m
        i += _U1


@cuda.jit
def argmax_only(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support, branch_sizes,
                next_mask, use_mask, ss, target_dist, lse, ce, ue, ent, ad, sm, ba):
    b = np.uint64(cuda.blockIdx.x) * np.uint64(cuda.blockDim.x) + np.uint64(cuda.threadIdx.x)
    k = np.uint64(cuda.blockIdx.y)
    if b >= np.uint64(online_logits.shape[0]):
        return
    lse[b, k] = float32(best_dev(next_q, b, k, np.uint64(branch_sizes[k]))) + rewards[b]


@cuda.jit
def rows_only(online_logits, actions, next_q, target_probs, rewards, dones, discounts, support, branch_sizes,
              next_mask, use_mask, ss, target_dist, lse, ce, ue, ent, ad, sm, ba):
    """Each thread reads its two rows (taken logits, a* probabilities) and writes one: the memory pattern alone."""
    b = np.uint64(cuda.blockIdx.x) * np.uint64(cuda.blockDim.x) + np.uint64(cuda.threadIdx.x)
    k = np.uint64(cuda.blockIdx.y)
    if b >= np.uint64(online_logits.shape[0]):
        return
    best = best_dev(next_q, b, k, np.uint64(branch_sizes[k]))
    row = online_logits[b, k, np.uint64(actions[b, k])]
    p = target_probs[b, k, best]
    out = target_dist[b, k]
    i = _U0
    while i < np.uint64(row.shape[0]):
        out[i] = row[i] + p[i]
        i += _U1


def timed(kernel, block):
    grid = (-(-B // block), NB)
    for _ in range(3):
        kernel[grid, block](*args)
    cuda.synchronize()
    ms = []
    for _ in range(5):
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        for _ in range(50):
            kernel[grid, block](*args)
        e1.record()
        e1.synchronize()
        ms.append(cuda.event_elapsed_time(e0, e1) * 1000 / 50)
    return float(np.median(ms))


out = {"real_128": timed(c51_target_kernel, 128)}
ref_m = loss.target_dist.copy_to_host()
out["real_64"] = timed(c51_target_kernel, 64)
out["real_32"] = timed(c51_target_kernel, 32)
out["real_256"] = timed(c51_target_kernel, 256)
out["proj_only_128"] = timed(proj_only, 128)
out["proj_shared_support_128"] = timed(proj_shared_support, 128)
out["proj_shared_support_same_bits"] = bool(np.array_equal(loss.target_dist.copy_to_host(), ref_m))
out["ce_only_128"] = timed(ce_only, 128)
out["argmax_only_128"] = timed(argmax_only, 128)
out["rows_only_128"] = timed(rows_only, 128)
print(json.dumps(out, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
