"""Shared gRPC helpers: proto <-> engine conversions, channel/server options, ports."""
