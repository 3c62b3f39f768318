"""iris-extproc: the routing brain of an LLM gateway (an Envoy ext_proc server).

Packages, each importing only those below it (checked by import-linter, see pyproject.toml):

    cli                       the `iris-extproc` command
    operations                wiring and running: gateway, reload, health, fleet state, exporter, workers
    protocol                  Envoy's ext_proc: the stream loop, answers, message builders
    openai_api | routing      the OpenAI request, sessions, chains | the spec's algorithm, state, leases
    storage                   the Redis client and every key name
    config                    the routing config's schema, loading, the Envoy check
    supervision, metrics      supervised loops; every metric definition

Data path: protocol.stream (Envoy's phases) -> openai_api (request, identity, session) ->
routing.lease_table.decide -> routing.router (the spec's algorithm over routing.state) ->
protocol.messages (the route back to Envoy) -> routing.lease_table.end at the stream's end.
"""
