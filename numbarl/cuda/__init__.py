"""Device runtime and generic kernels. Knows nothing about trading (SPEC §2)."""
