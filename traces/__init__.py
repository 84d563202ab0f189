"""NVTX range vocabulary, the trace recorder/exporter, and the analysis of where CPU work is hidden."""
