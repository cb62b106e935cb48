"""An OpenAI-compatible HTTP server over one bundle: `python -m runtime serve BUNDLE`.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true sends
server-sent events as OpenAI clients expect), GET /health, GET /metrics (Prometheus text).
Responses carry `usage` and, as an extra field, `speculative` (the engine's stats for that
generation). Errors are OpenAI-style objects: {"error": {"message", "type", "param", "code"}}.

Up to --parallel generations run at a time; up to --max-queue more wait, clients taking turns
for a free slot (one client's own requests in arrival order, at most --max-per-client of them),
and the rest get 429 at once (503 when a request waited past --queue-timeout). A client that disconnects, while
waiting or mid-stream, cancels its generation and frees the engine.

Built on starlette + uvicorn (h11); imports no torch/transformers. One module per concern:
`config` (ServerConfig, Host/Origin rules, client networks), `security` (keys, wrong-key
throttle, the Host/Origin guard and access log, connection counts), `body` (reading and
decoding a body off the event loop, its limits from the bundle), `schema` (fields and their checks), `metrics`,
`streaming` (disconnect watching, server-sent events), `protocol` (the uvicorn h11 subclass),
`app` (the routes), `run` (binding and serving).
"""

from runtime.server.app import Server
from runtime.server.body import BodyLimits
from runtime.server.config import ServerConfig, client_network, is_loopback
from runtime.server.errors import ApiError
from runtime.server.metrics import Metrics
from runtime.server.protocol import guarded_protocol
from runtime.server.run import bind, check_bind, make_uvicorn, serve
from runtime.server.security import check_api_keys, read_api_key_file

__all__ = ["ApiError", "BodyLimits", "Metrics", "Server", "ServerConfig", "bind", "check_api_keys", "check_bind",
           "client_network", "guarded_protocol", "is_loopback", "make_uvicorn", "read_api_key_file", "serve"]
