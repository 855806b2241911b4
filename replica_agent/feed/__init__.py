"""The feed between replica agents and gateways: records, the three role interfaces, transports.
Everything outside this package imports from here (replica_agent.feed), never its modules."""
from .failure_log import FailureLog
from .base import Feed, FeedReader, FeedUnavailable, FeedWriter, InflightBoard, open_feed
from .fair_share import FairShareBoard, TenantShare, fair_share_board
from .stored_turns import StoredTurnBoard, stored_turn_board
from .records import INVALID_KIND, MEDIUM_GPU, FeedEvent, Hello, Inflight, LoadReport, Snapshot

__all__ = ["FailureLog", "Feed", "FeedReader", "FeedWriter", "InflightBoard", "FeedEvent", "FeedUnavailable", "Hello", "Inflight",
           "LoadReport", "Snapshot", "open_feed", "INVALID_KIND", "MEDIUM_GPU", "FairShareBoard", "TenantShare",
           "fair_share_board", "StoredTurnBoard", "stored_turn_board"]
