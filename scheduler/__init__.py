"""Process boundaries and policy: `server/` (protocol, frontend, scheduler process), `core/` (scheduler, plans,
queues, pages, the engine-core loop), `spec/` (speculation policy), `parallel/` (tensor-parallel ranks), and
start-up and the CLI at the top.
"""
