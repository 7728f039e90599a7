"""End to end: the launcher, compose.yaml's services, the Kubernetes manifests, services killed mid-request,
the benchmark scripts."""
