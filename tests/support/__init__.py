"""Helpers shared by the tests: configs, a whole gateway, load, Prometheus."""
