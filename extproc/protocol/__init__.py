"""Envoy's ext_proc protocol: the stream loop (stream), the router's own answers (answers), the
ProcessingResponse builders (messages) and the live routing config a stream decides with (live).
Only this package knows Envoy's phases and messages."""
