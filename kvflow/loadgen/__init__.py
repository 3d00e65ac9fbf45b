"""The load generator: clients of each front door, and the sender that drives a server
with a workload while scraping its metrics."""
