"""The replica agent (sidecar): what one vLLM replica holds, published on the feed.

decode.py (pure: msgpack -> typed events, both wire formats) -> translate.py (pure: engine hashes ->
warmroute keys, reference counts) -> feed/ (records, interface, memory:// and redis:// transports).
transport.py holds the sans-I/O sequencer (ordering, gaps, replay, resync) and the thin ZMQ edge;
scraper.py the engine's load; agent.py wires them (asyncio) and serves /healthz and /metrics.
"""
