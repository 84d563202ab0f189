"""The load generator: a ZMQ client that behaves like an upstream router, and throughput/latency sweeps."""
