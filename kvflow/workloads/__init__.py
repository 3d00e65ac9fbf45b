"""What a benchmark sends: request specs, arrival processes, the Azure trace, synthetic
workloads, prompt text, and the batching modes compared."""
