"""Envoy facade: REST `POST /v2/completions` transcoded onto the gRPC completion service."""
