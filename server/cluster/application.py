"""`python -m server cluster`: the Ray Serve application (an ingress and N engine replicas) and its process.

```
client -> Ray Serve HTTP proxy (host:port) -> Ingress (ingress.py) --handle--> EngineReplica x N (replica.py)
                                                 the request router (router.py) picks the replica
```

`build_application(settings)` is the application: `EngineReplica` with `replicas` replicas (or Ray Serve's
autoscaler between `min_replicas` and `max_replicas`, aiming at `target_ongoing_requests` per replica), each
reserving `replica_num_cpus` CPUs (and a GPU on cuda), at most `max_batch_size + max_waiting` requests ongoing
each (what one server admits), routed by `request_router`; the ingress queues at most `max_waiting` more requests
(then 429). deploy/ray/serve.yaml names it for `serve run` / `serve deploy` / KubeRay (`app_builder`).

`run_cluster(settings)` joins the Ray cluster `RAY_ADDRESS` names (else starts one on this machine), starts Serve's
proxy on `host:port`, deploys the application (it returns once every replica has loaded its model), and serves
until SIGTERM/SIGINT, then shuts Serve down (replicas drain within `shutdown_grace_s`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from server.config import Settings

log = logging.getLogger(__name__)

APP_NAME = "specula"


def replica_options(settings: Settings) -> dict[str, Any]:
    """The engine replicas' Ray Serve deployment options (see the module doc)."""
    from ray.serve.config import RequestRouterConfig

    from server.cluster.router import CacheAwareRouter

    gpu = settings.device.startswith("cuda")
    options: dict[str, Any] = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": settings.replica_num_cpus, "num_gpus": 1 if gpu else 0},
        "max_ongoing_requests": settings.max_batch_size + settings.max_waiting,
        "max_queued_requests": max(settings.max_waiting, 1),
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 60.0,
        "graceful_shutdown_timeout_s": settings.shutdown_grace_s + 5,
    }
    if settings.request_router == "cache_aware":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=CacheAwareRouter,
            request_router_kwargs={"imbalance": settings.router_imbalance},
            request_routing_stats_period_s=60.0,
        )
    low, high = settings.min_replicas, settings.max_replicas
    if (low is not None or high is not None) and (low or settings.replicas) < (high or settings.replicas):
        options["autoscaling_config"] = {
            "min_replicas": settings.replicas if low is None else low,
            "max_replicas": settings.replicas if high is None else high,
            "initial_replicas": settings.replicas,
            "target_ongoing_requests": settings.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = settings.replicas
    return options


def build_application(settings: Settings) -> Any:
    """The Ray Serve application (`ray.serve.Application`) serving the API from the engine replicas."""
    from ray import serve

    from server.cluster.ingress import Ingress
    from server.cluster.replica import EngineReplica

    engines = serve.deployment(EngineReplica).options(**replica_options(settings)).bind(settings)
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=settings.max_connections,
    )
    return ingress.bind(settings, engines)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run server.cluster.application:app_builder config=FILE key=value ...`: the application from the
    settings file `config` (default config/default.yaml) with the other arguments as overrides."""
    args = dict(args)
    return build_application(Settings.load(args.pop("config", None), **args))


def run_cluster(settings: Settings) -> int:
    """Serve the cluster until SIGTERM/SIGINT (see the module doc); 0 after a clean shutdown."""
    import ray
    from ray import serve

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address or None, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": _replica_env()})
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("cluster ready: %d replica(s) on http://%s:%d (router %s)", settings.replicas, settings.host,
                 settings.port, settings.request_router)
        stop.wait()
        log.info("shutting down the cluster")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _replica_env() -> dict[str, str]:
    """Environment the replicas' processes inherit from this one: the server's own settings and caches."""
    keep = ("SPECULA_", "OMP_", "HF_", "TRANSFORMERS_")
    return {k: v for k, v in os.environ.items() if k.startswith(keep)}
