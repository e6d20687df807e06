"""The loss contract: a loss reads named head outputs and writes or adds its weighted gradient.

Several losses train one network in one step (the C51 cross-entropy, a CQL term on the same
logits, an auxiliary head's loss on the shared trunk), so a loss never assumes it is the only
writer of a gradient::

    class MyLoss(Loss):
        name = "my_loss"
        inputs = ("logits", "actions", ...)      # the names compute() reads
        grad_inputs = ("logits",)                 # the inputs it differentiates
        def compute(self, x: dict, stream)        # fills self.loss [1], self.per_sample [B] and
                                                  # self.grad(name) = ∂L/∂x[name] (weight 1)

    loss.apply(x, grads={"logits": d_logits}, stream=s, weight=0.5, ledger=store)

``apply`` runs ``compute`` and then moves ``weight · ∂L/∂x[name]`` into ``grads[name]`` by the
gradient rule of numbarl/rl/nets/module.py (``ledger.act_beta``): the first writer of the step
overwrites, later writers add, in program order, with no atomics. When the caller passes the
loss's own gradient buffer with weight 1 and the loss is the first writer, nothing is copied
(the single-loss train step costs exactly what it did before the contract).
"""

from __future__ import annotations

from numbarl.cuda.kernels import elementwise


class Loss:
    """Base of every loss (see the module docstring)."""

    name: str = "loss"
    inputs: tuple = ()
    grad_inputs: tuple = ()

    # every loss owns an Arena (`self.arena`) holding at least "loss" [1] and "per_sample" [B]
    @property
    def loss(self):
        """Device float32 [1]: the loss of the last compute()."""
        return self.arena["loss"]

    @property
    def per_sample(self):
        """Device float32 [B]: each sample's loss (unweighted), e.g. for replay priorities."""
        return self.arena["per_sample"]

    def compute(self, x: dict, stream) -> None:
        raise TypeError(f"{type(self).__name__} does not define compute (see numbarl.rl.losses.base)")

    def grad(self, name: str):
        """The loss's own ∂L/∂x[name] buffer (weight 1), valid after compute()."""
        raise TypeError(f"{type(self).__name__} does not define grad (see numbarl.rl.losses.base)")

    def apply(self, x: dict, grads: dict, stream, weight: float = 1.0, ledger=None) -> None:
        """compute(x), then grads[name] (+)= weight · ∂L/∂x[name] for every name in grads.

        ledger: the ParamStore whose open train step decides overwrite (first writer) or add;
        None: overwrite.
        """
        missing = [n for n in self.inputs if n not in x]
        if missing:
            raise KeyError(f"{self.name}: missing inputs {missing}; it reads {list(self.inputs)}")
        unknown = [n for n in grads if n not in self.grad_inputs]
        if unknown:
            raise KeyError(f"{self.name}: no gradient for {unknown}; it differentiates {list(self.grad_inputs)}")
        self.compute(x, stream)
        for name, dst in grads.items():
            own = self.grad(name)
            beta = ledger.act_beta(dst) if ledger is not None else 0.0
            if dst is own:
                if beta != 0.0:
                    raise ValueError(f"{self.name}: its own gradient buffer for {name!r} was written before it "
                                     "in this step; give the loss a shared buffer instead")
                if weight != 1.0:
                    elementwise.scale(own, float(weight), stream)
            elif beta == 0.0:  # a copy, not 0·dst: the buffer may hold anything (NaN) before its first write
                elementwise.copy(own, dst, stream)
                if weight != 1.0:
                    elementwise.scale(dst, float(weight), stream)
            else:
                elementwise.axpy(float(weight), own, dst, stream)
