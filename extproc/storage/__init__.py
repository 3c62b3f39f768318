"""Redis as the gateway uses it: the client for every topology (client) and every key name
(keys). Nothing here knows the routing rules."""
