"""Tensor parallelism: every decoder layer sharded over several devices driven by one process."""
