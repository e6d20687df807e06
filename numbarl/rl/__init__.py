"""The learner (SPEC §5): replay buffer, modules (layers, heads), losses, optimizer, agents and the
PyTorch peer. The experiment harness that drives it lives in numbarl.run."""
