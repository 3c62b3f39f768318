"""The routing core: the spec's algorithm (router) over the shared routing state and its Lua
scripts (state, lua/), the lease table that owns every request lease and the routing state's
epoch (lease_table), the outage policy and Redis breaker (outage), degraded flags (degraded) and
the optional previous-provider memory (previous_provider). It knows nothing of Envoy or of the
OpenAI API: a request reaches it as a RoutingRequest."""
