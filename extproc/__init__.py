"""iris-extproc: the routing brain of an LLM gateway (an Envoy ext_proc server).

Data path: gRPC stream (server) -> OpenAI request parsing (openai_request) -> identity and session
key (sessions; Responses chains in chains) -> routing algorithm
(routing, the spec's functions) -> routing state (state, the Lua scripts in lua/) -> mutations
back to Envoy -> lease release at stream end (lease_table).
"""
