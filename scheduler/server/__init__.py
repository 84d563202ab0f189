"""The serving process boundary: wire protocol, the asyncio ZeroMQ frontend, request validation, the scheduler
process and its supervisor, metrics.
"""
