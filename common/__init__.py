"""The floor every service stands on: server lifecycle, status mapping, TLS, telemetry, metrics,
settings, engine flags and paths.

It imports only ``engine`` and ``protos`` below it, never a service or ``tandem`` (the CLI and
launcher above); the layer rules are in the README's Layout section and enforced by
``tests/unit/test_layers.py``.
"""
