"""Losses with fused backward passes."""
