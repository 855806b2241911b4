"""End-to-end tests and tooling against real vLLM (CPU build) replicas; see README.md."""
