"""Agents: orchestrate networks, losses and optimizers into captured step graphs."""
