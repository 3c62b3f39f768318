"""irislab: demo and test tooling for iris-extproc, apart from the production package.

The simulated providers (`simulator`), a whole gateway on this machine (`local_gateway`: Redis,
Envoy, ext_proc servers, simulated providers), the demo conversation (`demo`), process helpers
(`processes`), the rendering of `envoy.yaml` onto free ports (`envoy_config`) and the `iris-lab`
command (`cli`: `up` and the demo). Used by the tests and the benchmarks; `extproc` never imports
it.
"""
