"""Command line: `serve` runs the HTTP server, `cluster` runs it as replicas on Ray Serve, `generate` tries the
engine, `distill` trains a draft head."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from server.config import Settings
from server.speculation.registry import BUILTIN


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML settings file (default: config/default.yaml)")
    p.add_argument("--target", default=None, help="target model: directory, hub id or .gguf (default: SmolLM2)")
    p.add_argument("--draft", default=None,
                   help='draft model (directory, hub id or .gguf with the target\'s tokenizer), or "target" for the '
                        "target's weights in --draft-dtype")
    p.add_argument("--target-dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--weights", default=None, choices=["auto", "as-file", "int8", "fp32", "bf16"],
                   help="how the target's weights are served (default auto: a GGUF's quantized tensors on CPU)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"],
                   help="precision of the target's cached keys and values (default auto: float16 for quantized "
                        "weights, else the model's dtype)")
    p.add_argument("--compile", default=None, choices=["auto", "on", "off"],
                   help="static-shape passes, CUDA graphs on a GPU (auto: on a GPU only; default off)")
    p.add_argument("--draft-head", default=None, help='EAGLE-style head directory, "auto" (shipped) or "none"')
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                   help="the draft's dtype (default auto: the target as served for `target`, a GGUF's quantized "
                        "blocks on CPU; another dtype: its weights dense in it)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 or auto")
    p.add_argument("--speculation", default=None, choices=BUILTIN.methods)
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="draft tokens per step (K) of a fixed method")
    p.add_argument("--auto-max-speculative-tokens", type=int, default=None,
                   help="the most draft tokens `auto` may choose per step (default 16)")


def _settings(args: argparse.Namespace, *names: str) -> Settings:
    overrides = {name: getattr(args, name) for name in names}
    return Settings.load(args.config, **overrides)


def _read_key_file(parser: argparse.ArgumentParser, path: str) -> str:
    """The API key in `path` (surrounding whitespace stripped); a usage error if unreadable or empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        parser.error(f"--api-key-file {path}: {exc.strerror}")
    if not key:
        parser.error(f"--api-key-file {path}: the file is empty")
    return key


_MODEL_FIELDS = (
    "target", "draft", "draft_head", "target_dtype", "draft_dtype", "device", "speculation", "num_speculative_tokens",
    "auto_max_speculative_tokens", "weights", "kv_cache_dtype", "compile",
)


_EDGE = {  # the HTTP edge's limits (server/api/connections.py): flag -> help
    "max_header_bytes": "a larger request line and headers get 431",
    "max_header_count": "more header fields get 431",
    "header_timeout_s": "seconds a request's line and headers may take to arrive (then 408)",
    "body_timeout_s": "seconds a request's body may take to arrive after its headers (then 408)",
    "max_connections": "open connections at most; a new one past it gets 503",
    "probe_connections": "connections past max_connections that health probes (GET /health) may still use",
}
_CLUSTER_FIELDS = (
    "replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "replica_num_cpus", "request_router",
)


def _add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """The flags of `serve`, which `cluster` takes too."""
    _add_model_flags(serve)
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    key = serve.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file", default=None, help="require `Authorization: Bearer KEY`, KEY read from this file"
    )
    key.add_argument(
        "--api-key", default=None, help="the same with KEY on the command line (visible in `ps`: prefer "
        "--api-key-file or SPECULA_API_KEY)"
    )
    serve.add_argument(
        "--protect-metrics", action="store_true", default=None, help="/metrics, /docs, /openapi.json need the key too"
    )
    serve.add_argument("--max-request-body-bytes", type=int, default=None, help="larger request bodies get 413")
    for name, text in _EDGE.items():
        field = Settings.model_fields[name]
        serve.add_argument(f"--{name.replace('_', '-')}", type=field.annotation, default=None,
                           help=f"{text}; default {field.default:g}")
    serve.add_argument("--max-batch-size", type=int, default=None)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--record-traffic", default=None, metavar="DIR",
        help="write finished requests' prompts and outputs as JSONL into DIR (for distill --traffic); off by default",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specula", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_serve_flags(serve)
    cluster = sub.add_parser("cluster", help="serve the same API from N engine replicas on Ray Serve (docs/deploy.md)")
    _add_serve_flags(cluster)
    cluster.add_argument("--replicas", type=int, default=None, help="engine replicas (default 2)")
    cluster.add_argument("--min-replicas", type=int, default=None, help="autoscaling's lower bound")
    cluster.add_argument("--max-replicas", type=int, default=None,
                         help="autoscaling's upper bound (above --min-replicas: Ray Serve autoscales)")
    cluster.add_argument("--target-ongoing-requests", type=float, default=None,
                         help="ongoing requests per replica the autoscaler aims at (default 4)")
    cluster.add_argument("--replica-num-cpus", type=float, default=None, help="CPUs Ray reserves per replica")
    cluster.add_argument("--request-router", default=None, choices=["cache_aware", "power_of_two"],
                         help="cache_aware (default): longest prompt prefix, then load; power_of_two: Ray's default")

    gen = sub.add_parser("generate", help="generate once from a prompt and print acceptance stats")
    _add_model_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")

    distill = sub.add_parser("distill", help="train an EAGLE-style draft head for a target (docs/distill.md)")
    from server.draft_head.cli import add_arguments

    add_arguments(distill)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "cluster"):
        from server.model.memory import limit_heap_arenas, limit_kernel_caches

        limit_heap_arenas()  # before the server's threads allocate (docs/api.md#memory)
        limit_kernel_caches()  # before the first forward (docs/api.md#memory)

        if args.api_key_file is not None:
            args.api_key = _read_key_file(parser, args.api_key_file)
        fields = (*_MODEL_FIELDS, "host", "port", "api_key", "protect_metrics", "max_request_body_bytes", *_EDGE,
                  "max_batch_size", "served_model_name", "record_traffic")
        if args.command == "cluster":
            from server.cluster.application import run_cluster

            return run_cluster(_settings(args, *fields, *_CLUSTER_FIELDS))
        from server.api.serve import serve as run_server

        return run_server(_settings(args, *fields))  # 1 when the engine worker died (a supervisor restarts it)
    if args.command == "distill":
        from server.draft_head.distill import distill_cli

        return distill_cli(args)
    from server.generate import generate_cli

    return generate_cli(_settings(args, *_MODEL_FIELDS), args)


if __name__ == "__main__":
    sys.exit(main())
