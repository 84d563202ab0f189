"""Tensor parallelism from the scheduler's side: starting the follower ranks and their loop.
"""
