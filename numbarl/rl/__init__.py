"""Learning: replay buffer, networks and heads, losses, optimizers, agents, trainer (SPEC §5)."""
