"""The scheduling core: requests and their queues, pages, the scheduler's frozen step plans, chunked prefill and its
pacing, stop conditions, and the loop that launches plans.
"""
