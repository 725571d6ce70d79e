"""The router as a process (``python -m pdgrpc.router``): its flags, start-up and shutdown.

Nothing here imports torch (tests/router checks it): the router starts in well under a
second and holds no tensor."""

from __future__ import annotations

import argparse
import logging

from pdgrpc.argtypes import port, positive_seconds, seconds, whole_number
from pdgrpc.discovery.cli import add_discovery_arguments, check_discovery_args, membership_watcher
from pdgrpc.engine.config import DEFAULT_MAX_PROMPT_TOKENS
from pdgrpc.errors import PdgrpcError
from pdgrpc.metrics import RouterMetrics, add_metrics_arguments, start_metrics_from_args
from pdgrpc.router.kv_events import KvEventFollower
from pdgrpc.router.policy import DEFAULT_MARGIN, POLICIES
from pdgrpc.router.service import (
    DEFAULT_REQUESTS_PER_CLIENT, FIRST_TOKEN_FROM, MAX_RETRIES, GenerateServicer, RouterConfig, parse_decode, parse_prefill,
    service_names,
)
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.drain import add_drain_arguments
from pdgrpc.rpc.open_calls import limit_arg
from pdgrpc.rpc.security import add_security_arguments, current
from pdgrpc.rpc.server import run, serve_until_signal, start_server
from pdgrpc.rpc.tracing import add_tracing_arguments
from pdgrpc.serving.launch import Role
from pdgrpc.serving.logs import add_logging_arguments
from pdgrpc.state.local_prefill import DEFAULT_LOCAL_PREFILL_QUEUE, DEFAULT_LOCAL_PREFILL_TOKENS
from pdgrpc.state.prefix_index import PrefixIndex
from pdgrpc.v1 import generate_pb2_grpc

DESCRIPTION = """\
The router: clients call pdgrpc.v1.GenerateService here. For each request it draws a
random bootstrap room, sends the prompt to a prefill instance (PrefillService) and a
decode instance (DecodeService) at the same time, and streams the decode's tokens back
with their text. A failure on either side cancels the other and reaches the client as a
gRPC error naming the side that failed; a client that cancels gets both sides to release
the request. Also serves grpc.health.v1 and server reflection; logs one line per
request event (room=<room> ...)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdgrpc.router", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 = every IPv4 interface (default: %(default)s)")
    p.add_argument("--port", type=port, default=8000, help="TCP port for GenerateService; 0 picks a free one, printed in the log line (default: %(default)s)")
    p.add_argument(
        "--prefill", action="append", default=[], metavar="HOST:PORT[,bootstrap=HOST:PORT][,local=PATH]",
        help="a prefill instance's PrefillService address; repeat for several (--policy picks among them). "
        "Its BootstrapService is assumed on the same address (bootstrap embedded in the prefill); "
        "add ',bootstrap=HOST:PORT' when the instance uses a separate `python -m pdgrpc.bootstrap`. "
        "Decode resolves the prefill's dp rank and workers there. ',local=PATH': the instance's --local-socket on "
        "this host, where Prefill is then called instead of over gRPC",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="HOST:PORT[,local=PATH]",
        help="a decode instance's DecodeService address; repeat for several (--policy cache_aware picks among them "
        "by their prefix caches, the other policies round robin). ',local=PATH': the instance's --local-socket on "
        "this host, where Decode is then called instead of over gRPC",
    )
    p.add_argument(
        "--request-timeout", type=positive_seconds, default=300.0, metavar="SECONDS",
        help="deadline of the Prefill and Decode calls of one request (a client's own, shorter deadline wins) (default: %(default)s)",
    )
    p.add_argument(
        "--max-requests-per-client", type=limit_arg, default=DEFAULT_REQUESTS_PER_CLIENT, metavar="N",
        help="Generate calls one client (its mTLS certificate's name, else its host) holds open at once; one more is "
        "refused RESOURCE_EXHAUSTED. Each prefill and decode counts this router as one client (their "
        "--max-prefills-per-client and --max-decodes-per-client, 512): keep the router's own calls in flight below "
        "those (default: %(default)s)",
    )
    p.add_argument(
        "--model", metavar="PATH", default="",
        help="the checkpoint directory the prefills and decodes serve (their --model): text prompts and chat "
        "messages are tokenized here with its tokenizer.json and chat template. Default: the reference engine's "
        "byte tokenizer",
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS, metavar="TOKENS",
        help="longest prompt forwarded; set it to the engines' --max-prompt-tokens: a longer prompt is refused "
        "with INVALID_ARGUMENT before any prefill or decode sees it (default: %(default)s)",
    )
    p.add_argument(
        "--retries", type=whole_number(0, maximum=MAX_RETRIES), default=1, metavar="N",
        help="times a request is sent again, with a fresh room, to another prefill or decode when its call to one "
        "fails UNAVAILABLE (gone, unreachable, a worker died) before the first token reached the client; never "
        f"after a token (0: never; at most {MAX_RETRIES}; default: %(default)s)",
    )
    p.add_argument(
        "--eject-s", type=float, default=5.0, metavar="SECONDS",
        help="how long a prefill or decode whose call failed UNAVAILABLE is passed over when requests (and retries) "
        "pick their instances; when every instance of a role is passed over, requests go to them anyway, and a "
        "success ends it early (0: never; default: %(default)s)",
    )
    p.add_argument(
        "--policy", choices=POLICIES, default="cache_aware",
        help="which prefill a request goes to: 'round_robin' (in turn), 'least_load' (fewest Prefill calls this "
        "router has in flight there), 'cache_aware' (the prefill whose prefix cache holds the longest prefix of "
        "the prompt, learned from each prefill's KV events (SubscribeKvEvents), unless "
        "its load exceeds the least loaded prefill's by more than --cache-aware-margin; else least_load). "
        "Under cache_aware the decode is picked the same way, from each decode's KV events and its open Decode "
        "streams; under the others, round robin (default: %(default)s)",
    )
    p.add_argument(
        "--cache-aware-margin", type=int, default=DEFAULT_MARGIN, metavar="CALLS",
        help="under --policy cache_aware: how many more calls in flight (Prefill calls; Decode streams for decodes) "
        "than the least loaded instance the one holding the longest prefix may have and still get the request "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--local-prefill-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_TOKENS, metavar="TOKENS",
        help="local prefill: when the chosen decode's prefix cache holds a prefix of a prompt (by its KV events) and "
        "lacks at most this many tokens of it, the router sends only Decode, flagged local_prefill, and the decode "
        "computes the rest itself between its decode steps, with no Prefill call and no transfer; a prompt the decode "
        "holds nothing of goes to a prefill. Only decodes that advertise local prefill on their KV event stream (a "
        "decode with its prefix cache on) and only under --policy cache_aware (0: never for this reason; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--local-prefill-queue", type=int, default=DEFAULT_LOCAL_PREFILL_QUEUE, metavar="CALLS",
        help="local prefill when every prefill has more than this many Prefill calls from this router in flight and "
        "the chosen decode has fewer prompts of its own to compute than the least busy prefill has calls, whatever "
        "the prompt's length: under a burst the prompts then split between the prefills' queues and the decode's, "
        "and the decode's batch stays full. Only "
        "decodes that advertise local prefill; no effect on a lone request (0: never for this reason; default: "
        "%(default)s)",
    )
    p.add_argument(
        "--migration-limit", type=int, default=1, metavar="N",
        help="times a request's running stream may move to another prefill and decode when its decode fails after "
        "the first token (UNAVAILABLE, a peer failure, a reset stream): it goes on with prompt + generated tokens and "
        "the same seed, so the output is exactly what the first pair would have made (0: never; default: %(default)s)",
    )
    p.add_argument(
        "--migration-max-seq-len", type=int, default=0, metavar="TOKENS",
        help="longest prompt + generated tokens a stream migrates with, since the new prefill computes them all "
        "(0: --max-prompt-tokens; default: %(default)s)",
    )
    p.add_argument(
        "--first-token", choices=FIRST_TOKEN_FROM, default="prefill",
        help="where the client's first token comes from. prefill: the prefill sends it ahead as soon as it samples it "
        "(PrefillStream), while its KV still travels to the decode, and the KV figures (bytes_transferred, "
        "transfer_seconds, data_plane_seconds, cached_tokens) come on the next message; decode: the decode's first "
        "message, once it committed the KV, carries the token and the figures. The tokens are the same either way "
        "(default: %(default)s)",
    )
    p.add_argument("--grace", type=seconds, default=5.0, metavar="SECONDS", help="on SIGTERM/SIGINT, how long in-flight requests may finish before the server closes (default: %(default)s)")
    add_metrics_arguments(p)
    add_logging_arguments(p)
    add_tracing_arguments(p)
    add_discovery_arguments(p, "router")
    add_security_arguments(p, public=True)
    add_drain_arguments(p)
    return p


async def _main(args: argparse.Namespace, config: RouterConfig) -> None:
    metrics = RouterMetrics()
    watcher = None
    if args.discovery:
        watcher = membership_watcher(args)
        watcher.start()
    index = PrefixIndex() if config.policy == "cache_aware" else None
    view = None if watcher is None else watcher.view
    feeds: list[KvEventFollower] = []
    events_pool = ChannelPool(server_names=None if view is None else view.server_name)
    if index is not None:  # one index: the prefills' and the decodes' caches
        feeds = [
            KvEventFollower(
                index,
                (lambda: [p.address for p in config.prefills]) if view is None else (lambda: [p.address for p in view.instances("prefill")]),
                events_pool, metrics, "prefill",
            ),
            KvEventFollower(
                index,
                (lambda: config.decodes) if view is None else (lambda: [d.address for d in view.instances("decode")]),
                events_pool, metrics, "decode",
            ),
        ]
        servicer = GenerateServicer(config, metrics=metrics, view=view, index=index, decode_capabilities=feeds[1].capabilities)
        for feed in feeds:
            feed.start()
    else:
        servicer = GenerateServicer(config, metrics=metrics, view=view)
    (name,) = service_names()
    server = await start_server(
        [(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, s))],
        host=args.host, port=args.port, what="pdgrpc router", security=current().public(),
    )
    mismatches = (lambda: 0) if view is None else (lambda: view.identity_mismatches)
    metrics.bind(lambda: {"active_requests": servicer.active, "identity_mismatches": mismatches()})
    try:
        stop_metrics = start_metrics_from_args(args, metrics.registry, "router")
    except BaseException:
        await server.stop(0)
        await servicer.close()
        for feed in feeds:
            await feed.close()
        await events_pool.close()
        raise
    log = logging.getLogger("pdgrpc.router")
    if watcher is not None:
        log.info("routing to the live instances under %s in etcd %s", watcher.view.prefix, args.discovery)
    else:
        log.info(
            "routing to prefill %s; decode %s",
            ", ".join(p.address if p.bootstrap == p.address else f"{p.address} (bootstrap {p.bootstrap})" for p in config.prefills),
            ", ".join(config.decodes),
        )
    try:
        server.on_drain(metrics.on_draining)
        await serve_until_signal(server, grace=args.grace, drain_timeout=args.drain_timeout)
    finally:
        # Only now: in-flight requests used these channels until the grace period ended.
        await servicer.close()
        for feed in feeds:
            await feed.close()
        await events_pool.close()
        if watcher is not None:
            await watcher.close()
        metrics.unbind()
        stop_metrics()
    log.info("stopped")


def _config(args: argparse.Namespace) -> RouterConfig:
    decodes = [parse_decode(s) for s in args.decode]
    return RouterConfig(
        prefills=tuple(parse_prefill(s) for s in args.prefill),
        decodes=tuple(address for address, _ in decodes),
        decode_sockets=tuple((address, local) for address, local in decodes if local),
        request_timeout=args.request_timeout,
        discovery=bool(args.discovery),
        model=args.model,
        max_prompt_tokens=args.max_prompt_tokens,
        retries=args.retries,
        eject_s=args.eject_s,
        policy=args.policy,
        cache_aware_margin=args.cache_aware_margin,
        migration_limit=args.migration_limit,
        migration_max_seq_len=args.migration_max_seq_len,
        local_prefill_tokens=args.local_prefill_tokens,
        local_prefill_queue=args.local_prefill_queue,
        first_token=args.first_token,
        max_requests_per_client=args.max_requests_per_client,
    )


def check(args: argparse.Namespace) -> None:
    if args.discovery and (args.prefill or args.decode):
        raise ValueError("--discovery takes the backends from etcd: leave out --prefill and --decode")
    check_discovery_args(args)
    _config(args)
    if args.model:  # a missing or bad tokenizer fails at start-up, naming the file
        from pdgrpc.engine.hf.tokenizer import load_tokenizer

        load_tokenizer(args.model)


def serve(args: argparse.Namespace) -> int:
    try:
        run(_main(args, _config(args)))
    except PdgrpcError as exc:  # a configuration refused at start (a non-loopback --host without TLS or a token)
        logging.getLogger("pdgrpc.router").error("%s", exc)
        return 2
    return 0


ROLE = Role(build_parser=build_parser, serve=serve, log_name=lambda args: "router", check=check)
