"""Process boundaries and policy: protocol, frontend, scheduler loop, requests, pages, batching, CLI."""
