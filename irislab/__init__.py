"""irislab: demo and test tooling for iris-extproc, apart from the production package.

The simulated providers (`simulator`), a whole gateway on this machine (`local_gateway`: Redis,
Envoy, ext_proc servers, simulated providers), the demo conversation (`demo`), process helpers
(`processes`) and the rendering of `envoy.yaml` onto free ports (`envoy_config`). Used by
`iris-extproc up`, the tests and the benchmarks; nothing in `extproc` imports it but the `up`
command.
"""
