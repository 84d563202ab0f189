"""Knowing when to stop: the speculation policy, its cost model, the governor, decisions and counters.
"""
