"""Operations: running the server. The runner that wires everything (gateway), the live reload of
the routing config (reload), active and passive health checks and load gauges (health), the
fleet's routing state and its Prometheus exporter (fleet_state, exporter), worker processes
(workers) and grpc's log (grpc_logs)."""
