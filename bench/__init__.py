"""Benchmarks of the gateway: `python -m bench.overhead`, `bench.cost`, `bench.replay`,
`bench.profile`. See docs/benchmarks.md for what each measures and the figures of this machine."""
