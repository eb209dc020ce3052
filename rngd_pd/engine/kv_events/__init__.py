"""KV events in vLLM's wire format: block identity (`hashing`), the messages (`messages`), the ZMQ
publisher with its replay socket (`publisher`) and a subscriber (`subscriber`). The prefix cache
(rngd_pd.engine.prefix) names its blocks with `hashing` and reports every change to a publisher, so a
router that tokenizes a prompt itself (llm-d's precise prefix-cache scorer, Dynamo's KV router) finds
the same keys. Details and the choices made: docs/kv-events.md.
"""
