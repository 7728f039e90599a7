"""End to end: the launcher, compose.yaml's services, services killed mid-request, the benchmark scripts."""
