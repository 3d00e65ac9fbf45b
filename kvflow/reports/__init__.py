"""Reports of serving runs: latency and fairness metrics, the run report, sweeps, and the
markdown and plot writers."""
