"""The feed between replica agents and gateways: records, interface, transports."""
from .base import Feed, FeedUnavailable, open_feed
from .records import FeedEvent, Hello, Inflight, LoadReport, Snapshot

__all__ = ["Feed", "FeedEvent", "FeedUnavailable", "Hello", "Inflight", "LoadReport", "Snapshot", "open_feed"]
