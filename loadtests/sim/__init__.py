"""The vLLM replica simulator: speaks vLLM's interfaces (OpenAI routes, /metrics, KV events) so
the gateway and the agent cannot tell it from an engine except by speed.

- `blockpool`, `scheduler`: the pure engine core (paged KV pool with prefix caching, continuous
  batching, time model), drivable in virtual time.
- `kv_events`: vLLM's ZMQ KV-event wire format and PUB/ROUTER-replay transport.
- `tokenize`: the engine's tokenization (chat template, special-token defaults).
- `server`: the aiohttp replica (`start_sim_server`, `warmroute sim`); `config` its settings and
  flags, `openai_requests` vLLM's request rules and prompt tokenization, `metrics` its `/metrics`
  and step-timing figures.
"""
from loadtests.sim.blockpool import BlockPool, ModelShape
from loadtests.sim.scheduler import EngineConfig, SimEngine, SimRequest, StepOutcome, TimeModel

__all__ = ["BlockPool", "ModelShape", "EngineConfig", "SimEngine", "SimRequest", "StepOutcome", "TimeModel"]
