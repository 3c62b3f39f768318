"""A plain in-memory reference model of the routing state (`state`) and of the spec's routing
algorithm over it (`routing`), for the differential tests. Not shipped. The choices made where
the spec is silent are listed in README.md next to this file."""
