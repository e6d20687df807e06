"""Mamba2-style temporal scan over the trunk features of the last K bars (SSD: Dao & Gu 2024, scalar
decay per head), with exact backpropagation through all K steps and a one-step recurrent update for
acting. The first brick of numbarl's temporal stack: a standalone module on the contract of
numbarl/rl/nets/module.py (the agent wiring, sequence replay and the acting state come later).

Shapes. A pass over B windows: x [B·K, D], row b·K + t = the features of window b at step t (oldest
first; row b·K + K − 1 is the sampled row τ), mask [B, K] float32 (1 valid, 0 masked: rows before the
episode start or not yet written). The scan's inner width H = n_heads · head_dim is D rounded up to a
multiple of n_heads (D itself when n_heads divides it), N = d_state = 16.

    z   = x · W_in                     [B·K, P], P = H + 2N + n_heads, no bias; column blocks
                                       W_x (u_t), W_B (B_t), W_C (C_t), W_Δ (Δ̃_t) of W_in [D, P]
    Δ_t = softplus(Δ̃_t + b_Δ)          per head          a_t = exp(−Δ_t · exp(A_log))   per head
    S_t = m_t (a_t S_{t−1} + Δ_t u_t ⊗ B_t),  S_{−1} = 0  state [n_heads, head_dim, N] per window
    y   = S_{K−1} · C_{K−1}             [B, H]
    h̃   = x_{K−1} + y · W_out          [B, D]            the newest row's features with its history

B_t and C_t are shared by all heads (Mamba2's single B/C group, ngroups = 1): N·2 columns instead of
n_heads·N·2, and the heads differ by their decay (Δ, A_log) and their value channels. The scan math,
its thread mapping and the BPTT derivation are in numbarl/cuda/kernels/ssm.py.

With conv = d > 0 (Mamba2's short convolution, ``d_conv`` = 4 there; agent.temporal_conv), z's u, B and C
columns go through a causal depthwise convolution over the window's rows and a SiLU before the scan
(numbarl/cuda/kernels/conv1d.py, which says why the scan needs it to form products of two bars' features):
z = conv(x · W_in), with W_conv [d + 1, H + 2N] (d taps and a bias per column). Backward: the scan's dz
goes back through the convolution (its input gradient and the fixed-order weight-gradient sums) before
∂W_in. Acting by :meth:`step` is not available with the convolution (it would carry the last d − 1 rows
of x · W_in beside S); the agent acts on windows, through the scan itself.

With residual=False the pass returns u = y · W_out alone (the ISV routing of numbarl/rl/isv.py adds
x_{K−1} with its own weights); the default keeps the residual.

Backward from dh̃ [B, D] (the gradient rule of module.py: c.beta per parameter, c.dx_beta for dx):
    ∂W_out = yᵀ dh̃ (GEMM)       g = dh̃ W_outᵀ (GEMM)       dz = scan backward (ssm.py kernels)
    ∂b_Δ, ∂A_log: fixed-order column sums (numbarl.cuda.reduce.col_sum) of per-(row, head) and
    per-(window, head) parts        ∂W_in = xᵀ dz (GEMM)       dx = dz W_inᵀ (GEMM), + dh̃ on the
    rows b·K + K − 1 (the residual). Masked rows get dx = 0 from the scan.

Acting (:meth:`MambaScan.step`, a tag declared with ``step=True``): per env a state S [H, N] carried
from bar to bar (the caller owns it; the env arena, later), updated by ``ssd_step_kernel`` with the
same device functions as the scan: z = x·W_in, S ← a·(reset ? 0 : S) + Δ u ⊗ B, h̃ = x + (S·C)·W_out.
Stepping a window's valid rows from a cleared state gives the scan's h̃ (tests/rl/test_mamba.py).
Training windows start from S = 0 at their first row, acting carries the state from the episode
start: the two agree only when the episode started within the window. Elsewhere the acting state
holds more history than the training window (the stored-state mismatch of R2D2, Kapturowski et al.
2019). The agent wiring either stores S with each replay row and starts the window from it, or
burns in (R2D2: a prefix of the window run without gradient to warm the state up), or accepts the
mismatch where the heads forget within the window (a^K ≪ 1).

Parameters (group ``temporal.mamba`` by default, so the optimizer can give it its own learning rate):
    {name}.w_in    [D, P]   U(±1/√D) (nn.Linear's default), weight decay
    {name}.dt_bias [n_h]    inverse softplus of Δ₀ ~ log-uniform [1e-3, 1e-1] (Mamba2's dt init)
    {name}.a_log   [n_h]    log U[1, 16] (Mamba2's A init)
    {name}.w_out   [H, D]   U(±1/√H), weight decay
    {name}.conv    [d + 1, H + 2N]  U(±1/√d) (nn.Conv1d's default for a depthwise kernel of d), conv = d > 0 only;
                   the taps and the bias in one tensor, without weight decay (a choice of numbarl's)
(reference: ``mamba_ssm/modules/mamba2.py``, Dao & Gu 2024, whose defaults these are).
"""

from __future__ import annotations

import math

import numpy as np

from numbarl.cuda import blas, reduce
from numbarl.cuda.kernels import conv1d, elementwise, ssm
from numbarl.rl.nets.base import bias_uniform_init, kaiming_uniform_init
from numbarl.rl.nets.module import Buf, Ctx, Module, Param

GROUP = "temporal.mamba"
DT_MIN, DT_MAX = 1e-3, 1e-1  # range of the initial step size Δ₀ (Mamba2's dt_min, dt_max)
A_INIT_RANGE = (1.0, 16.0)  # initial e^{A_log} (Mamba2's A_init_range)


def dt_bias_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """b_Δ = softplus⁻¹(Δ₀) = Δ₀ + log(1 − e^{−Δ₀}) with Δ₀ log-uniform in [DT_MIN, DT_MAX]."""
    dt = np.exp(rng.uniform(math.log(DT_MIN), math.log(DT_MAX), size=shape))
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)


def a_log_init(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    return np.log(rng.uniform(*A_INIT_RANGE, size=shape)).astype(np.float32)


class MambaScan(Module):
    """h̃ = x_{K−1} + SSD-scan(x_0..x_{K−1}) · W_out over windows of K rows (module docstring).

    scan = MambaScan("temporal.mamba", D, n_steps=8, n_heads=8)    # inner width H = D rounded up to 8·k
    scan.declare_params(store)
    scan.declare_acts(acts, B * K, "online")                   # batch = rows = B·K
    scan.declare_acts(acts, n_envs, "act", backward=False, step=True)
    h = scan.forward(x, stream, mask=mask)                      # x [B·K, D], mask [B, K] or None
    scan.backward(dh, stream)                                   # dh [B, D]; dx [B·K, D]
    h = scan.step(x_now, state, reset, stream)                  # acting: state [n_envs, H, N]
    """

    native_dx_accumulate = True  # dx is a GEMM with the ledger's beta, the residual adds onto it

    def __init__(self, name: str, width: int, n_steps: int = 8, n_heads: int = 8, group: str | None = GROUP,
                 decay: bool = True, input_grad: bool = True, compute: str = "fp32", residual: bool = True,
                 conv: int = 0):
        super().__init__(name, group)
        self.width, self.n_steps, self.n_heads = int(width), int(n_steps), int(n_heads)
        if self.n_heads < 1 or self.width < 1:
            raise ValueError(f"{name}: width {width} and n_heads {n_heads} must be positive")
        # the scan's inner width H: the input width D rounded up to a multiple of the heads (W_in [D, P] and
        # W_out [H, D] map between them), so any feature count works with any number of heads
        self.inner = -(-self.width // self.n_heads) * self.n_heads
        if not 1 <= self.n_steps <= ssm.MAX_STEPS:
            raise ValueError(f"{name}: n_steps must be in 1..{ssm.MAX_STEPS} (got {n_steps})")
        if compute not in blas.COMPUTES:
            raise ValueError(f"{name}: compute must be one of {blas.COMPUTES} (got {compute!r})")
        self.head_dim = self.inner // self.n_heads
        self.d_state = ssm.D_STATE
        self.proj_width = ssm.z_width(self.inner, self.n_heads)  # P
        self.decay, self.input_grad, self.compute = bool(decay), bool(input_grad), compute
        # residual=False: the pass returns u = y · W_out alone (the ISV routing adds x_t itself: numbarl/rl/isv.py)
        self.residual = bool(residual)
        # conv = d > 0: Mamba2's causal depthwise convolution (d taps) + SiLU on u | B | C before the scan
        self.conv = int(conv)
        if not 0 <= self.conv <= conv1d.MAX_WIDTH:
            raise ValueError(f"{name}: conv must be in 0..{conv1d.MAX_WIDTH} taps (got {conv})")
        self.conv_cols = self.inner + 2 * self.d_state  # the convolved columns of z: u | B | C
        self._masks: dict[str, object] = {}

    @property
    def out_dim(self) -> int:
        return self.width

    def state_shape(self, n_envs: int) -> tuple:
        """Shape of the acting state the caller keeps: [n_envs, H, N] float32 (H the inner width)."""
        return (int(n_envs), self.inner, self.d_state)

    # -- declarations ---------------------------------------------------------------------------
    def params(self) -> list[Param]:
        D, H, n_h = self.width, self.inner, self.n_heads
        return [Param("w_in", (D, self.proj_width), kaiming_uniform_init, decay=self.decay),
                Param("dt_bias", (n_h,), dt_bias_init),
                Param("a_log", (n_h,), a_log_init),
                Param("w_out", (H, D), kaiming_uniform_init, decay=self.decay)] \
            + ([Param("conv", (self.conv + 1, self.conv_cols), bias_uniform_init(self.conv))] if self.conv else [])

    def buffers(self, batch: int, backward: bool, step: bool = False, **opts) -> list[Buf]:
        D, H, P, n_h = self.width, self.inner, self.proj_width, self.n_heads
        if step:  # acting: one row per env
            if self.conv:
                raise ValueError(f"{self.name}: acting by step() is not available with conv = {self.conv} (it "
                                 "would carry the last conv − 1 rows of x·W_in beside the state); act on windows")
            if backward:
                raise ValueError(f"{self.name}: an acting (step=True) pass has no backward")
            return [Buf("z", (batch, P)), Buf("y_ssm", (batch, H)), Buf("y", (batch, D))]
        if batch % self.n_steps:
            raise ValueError(f"{self.name}: batch is the number of rows B·K; {batch} is not a multiple of "
                             f"n_steps {self.n_steps}")
        n_seq = batch // self.n_steps
        bufs = [Buf("z", (batch, P)), Buf("y_ssm", (n_seq, H)), Buf("y", (n_seq, D)),
                Buf("delta", (batch, n_h)), Buf("decay", (batch, n_h))]
        if self.conv:  # x·W_in before the convolution, and the convolution's pre-activation
            bufs += [Buf("z_raw", (batch, P)), Buf("conv_pre", (batch, self.conv_cols))]
        if backward:
            bufs += [Buf("dy_ssm", (n_seq, H)), Buf("d_dt_pre", (batch, n_h)), Buf("coef", (batch, n_h)),
                     Buf("dbw", (batch, n_h)), Buf("d_a_log_part", (n_seq, n_h)),
                     Buf("d_c_part", (n_seq, n_h, self.d_state)), Buf("dz", (batch, P)),
                     Buf("partials_dt", reduce.col_partials_shape(batch, n_h)),
                     Buf("partials_a", reduce.col_partials_shape(n_seq, n_h))]
            if self.conv:
                wide = (self.conv + 1) * self.conv_cols
                bufs += [Buf("dz_raw", (batch, P)), Buf("conv_part", (n_seq, wide)),
                         Buf("partials_conv", reduce.col_partials_shape(n_seq, wide))]
            if self.input_grad:
                bufs.append(Buf("dx", (batch, D)))
        return bufs

    def _is_step(self, tag: str) -> bool:
        return bool(self._opts.get(tag, {}).get("step", False))

    # -- scan pass ------------------------------------------------------------------------------
    def forward(self, x, stream, tag: str = "online", role: str = "params", mask=None):
        """h̃ [B, D] for x [B·K, D]; mask float32 [B, K] (1 valid, 0 masked) or None (all valid).
        The mask's buffer is frozen into a captured graph: pass the same one every step."""
        self._masks[tag] = mask
        return super().forward(x, stream, tag=tag, role=role)

    def forward_impl(self, c: Ctx, x):
        if self._is_step(c.tag):
            raise RuntimeError(f"{self.name}: tag {c.tag!r} is an acting pass; call step()")
        rows = c.batch
        if tuple(x.shape) != (rows, self.width):
            raise ValueError(f"{self.name}.forward({c.tag!r}): x has shape {tuple(x.shape)}, expected {(rows, self.width)}")
        z, y_ssm, y = c.buf("z"), c.buf("y_ssm"), c.buf("y")
        if self.conv:
            blas.gemm(x, c.p("w_in"), c.buf("z_raw"), compute=self.compute, stream=c.stream)
            conv1d.conv_forward(c.buf("z_raw"), c.p("conv"), self._masks.get(c.tag), self.n_steps, z,
                                c.buf("conv_pre"), c.stream)
        else:
            blas.gemm(x, c.p("w_in"), z, compute=self.compute, stream=c.stream)
        ssm.ssd_scan_forward(z, c.p("dt_bias"), c.p("a_log"), self._masks.get(c.tag), self.n_steps, self.head_dim,
                             y_ssm, c.buf("delta"), c.buf("decay"), c.stream)
        if self.residual:
            ssm.last_row(x, self.n_steps, y, c.stream)  # residual: the newest row's features
        blas.gemm(y_ssm, c.p("w_out"), y, beta=1.0 if self.residual else 0.0, compute=self.compute, stream=c.stream)
        return y

    def backward_impl(self, c: Ctx, dy, dx):
        n_seq = c.batch // self.n_steps
        if tuple(dy.shape) != (n_seq, self.width):
            raise ValueError(f"{self.name}.backward: dy has shape {tuple(dy.shape)}, expected {(n_seq, self.width)}")
        x, z, y_ssm, g = c.x(), c.buf("z"), c.buf("y_ssm"), c.buf("dy_ssm")
        # output projection
        blas.gemm(y_ssm, dy, c.g("w_out"), trans_a=True, beta=c.beta("w_out"), compute=self.compute, stream=c.stream)
        blas.gemm(dy, c.p("w_out"), g, trans_b=True, compute=self.compute, stream=c.stream)
        # the scan, back through all K steps
        dz = c.buf("dz")
        ssm.ssd_scan_backward(g, z, c.p("dt_bias"), c.p("a_log"), self._masks.get(c.tag), self.n_steps,
                              self.head_dim, c.buf("delta"), c.buf("decay"), c.buf("d_dt_pre"), c.buf("coef"),
                              c.buf("dbw"), c.buf("d_a_log_part"), c.buf("d_c_part"), dz, c.stream)
        reduce.col_sum(c.buf("d_dt_pre"), c.g("dt_bias"), c.buf("partials_dt"), c.stream,
                       accumulate=c.beta("dt_bias") == 1.0)
        reduce.col_sum(c.buf("d_a_log_part"), c.g("a_log"), c.buf("partials_a"), c.stream,
                       accumulate=c.beta("a_log") == 1.0)
        if self.conv:  # back through the convolution: dz of x·W_in, and the convolution's weights
            conv1d.conv_backward(dz, c.buf("z_raw"), c.p("conv"), c.buf("conv_pre"), self._masks.get(c.tag),
                                 self.n_steps, c.buf("dz_raw"), c.buf("conv_part"), c.stream)
            g_conv = c.g("conv")
            reduce.col_sum(c.buf("conv_part"), g_conv.reshape(g_conv.size), c.buf("partials_conv"), c.stream,
                           accumulate=c.beta("conv") == 1.0)
            dz = c.buf("dz_raw")
        # input projection
        blas.gemm(x, dz, c.g("w_in"), trans_a=True, beta=c.beta("w_in"), compute=self.compute, stream=c.stream)
        if dx is None:
            return None
        blas.gemm(dz, c.p("w_in"), dx, trans_b=True, beta=c.dx_beta, compute=self.compute, stream=c.stream)
        if self.residual:
            ssm.add_to_last_row(dy, self.n_steps, dx, c.stream)
        return dx

    # -- acting ---------------------------------------------------------------------------------
    def step(self, x, state, reset, stream, tag: str = "act", role: str = "params"):
        """One bar for every env: h̃ [n_envs, D] for x [n_envs, D]; state [n_envs, H, N] updated in
        place; reset float32 [n_envs] (nonzero: the env's episode starts at this bar). Capturable."""
        if not self._is_step(tag):
            raise RuntimeError(f"{self.name}: tag {tag!r} was not declared with step=True")
        c = Ctx(self, tag, role, stream)
        if tuple(x.shape) != (c.batch, self.width):
            raise ValueError(f"{self.name}.step({tag!r}): x has shape {tuple(x.shape)}, expected {(c.batch, self.width)}")
        z, y_ssm, y = c.buf("z"), c.buf("y_ssm"), c.buf("y")
        blas.gemm(x, c.p("w_in"), z, compute=self.compute, stream=stream)
        ssm.ssd_step(z, c.p("dt_bias"), c.p("a_log"), reset, self.head_dim, state, y_ssm, stream)
        if self.residual:
            elementwise.copy(x, y, stream)
        blas.gemm(y_ssm, c.p("w_out"), y, beta=1.0 if self.residual else 0.0, compute=self.compute, stream=stream)
        return y

    # -- float64 reference (host dict of params by name) ----------------------------------------
    def _p(self, params):
        n = self.param_names
        return {k: np.asarray(params[v], np.float64) for k, v in n.items()}

    def forward_ref(self, x, params, mask=None):
        """(h̃ [B, D], cache) in float64 for x [B·K, D] (module docstring)."""
        p = self._p(params)
        x = np.asarray(x, np.float64)
        z = z_raw = x @ p["w_in"]
        if self.conv:
            z, _ = conv1d.causal_conv_ref(z_raw, p["conv"], mask, self.n_steps, self.conv_cols)
        y_ssm, scan = ssm.ssd_scan_ref(z, p["dt_bias"], p["a_log"], mask, self.n_steps, self.n_heads)
        out = y_ssm @ p["w_out"]
        if self.residual:
            out = out + x[self.n_steps - 1::self.n_steps]
        return out, (x, y_ssm, scan, z_raw, mask)

    def backward_ref(self, dy, cache, params):
        """(dx [B·K, D], {store name: gradient}) in float64."""
        p, n = self._p(params), self.param_names
        x, y_ssm, scan, z_raw, mask = cache
        dy = np.asarray(dy, np.float64)
        g = dy @ p["w_out"].T
        dz, d_dt_bias, d_a_log = ssm.ssd_scan_backward_ref(g, scan)
        grads = {}
        if self.conv:
            dz, grads[n["conv"]] = conv1d.causal_conv_backward_ref(dz, z_raw, p["conv"], mask, self.n_steps,
                                                                  self.conv_cols)
        dx = dz @ p["w_in"].T
        if self.residual:
            dx[self.n_steps - 1::self.n_steps] += dy
        return dx, {n["w_in"]: x.T @ dz, n["dt_bias"]: d_dt_bias, n["a_log"]: d_a_log, n["w_out"]: y_ssm.T @ dy,
                    **grads}

    def step_ref(self, x, state, reset, params):
        """(h̃ [n_envs, H], new state [n_envs, H, N]) in float64: one acting step."""
        if self.conv:
            raise ValueError(f"{self.name}: acting by step() is not available with conv = {self.conv}")
        p = self._p(params)
        x = np.asarray(x, np.float64)
        y_ssm, new_state = ssm.ssd_step_ref(x @ p["w_in"], state, reset, p["dt_bias"], p["a_log"], self.n_heads)
        return (x if self.residual else 0.0) + y_ssm @ p["w_out"], new_state
