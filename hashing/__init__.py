"""Pure hashing: token ids -> block keys. No I/O, no asyncio, no sockets.

- `hashing.keys`: warmroute's own chained block keys (a contract; layout in hashing/keys.py), computed identically
  by the gateway (from a request's tokens) and by the replica agent (from engine events).
- `hashing.history_keys`: the gateway's own keys for a chat's blocks past its first media item
  (which the engine keys by the item's hash): where its conversation's next turn should go.
- `hashing.vllm_hash`: vLLM's engine-exact prefix-cache hashes (sha256, sha256_cbor), used by the
  simulator to emit the same hashes a real engine would and by checks.
"""
from hashing.keys import BlockKey, EngineHash, KeyChain, block_extras, chain_keys, root_key

__all__ = ["BlockKey", "EngineHash", "KeyChain", "block_extras", "chain_keys", "root_key"]
