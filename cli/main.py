"""`pdserve` command line: demo, serve, generate."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

if TYPE_CHECKING:
    from controller.deployment import DeploymentConfig
    from router.security import ClientCredentials
    from router.server import FrontDoorConfig
    from controller.planning import PlannerSetup
    from router.tier import RouterTier

T = TypeVar("T")

# A sentence of the embedded model's corpus: the model continues it with the corpus's text.
DEFAULT_PROMPT = "Prefill processes the prompt and creates state; decode consumes that state one token at a time."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode serving")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="local cluster (1 prefill + 1 decode), one generation streamed through gRPC")
    _add_cluster_args(demo)
    demo.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=48)

    serve = sub.add_parser(
        "serve", help="start or join a Ray cluster, bring up the pools under a controller, serve gRPC from N routers"
    )
    _add_cluster_args(serve)
    serve.add_argument("--prefill", type=int, default=1, help="prefill actors (0: colocated serving)")
    serve.add_argument("--decode", type=int, default=1, help="decode actors")
    serve.add_argument(
        "--switch-roles", action="store_true",
        help="every engine runs both NIXL roles: a resize or the planner moves engines between the pools "
        "(drain, relabel) instead of restarting them; both pools then share one engine configuration",
    )
    serve.add_argument(
        "--routers", type=int, default=1, help="router processes (Ray actors, spread over nodes; on one host they share the port)"
    )
    serve.add_argument("--listen", default="127.0.0.1:50051", help="gRPC address to listen on")
    serve.add_argument("--metrics-port", type=int, default=9400, help="router Prometheus port; router i: port + i (0: off)")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoints bind")
    serve.add_argument(
        "--prometheus-sd-file", help="keep a Prometheus file_sd target file of the workers' and routers' metrics endpoints here"
    )
    plan = serve.add_argument_group("closed-loop planner (changes the split as the traffic shifts)")
    plan.add_argument("--planner", action="store_true", help="re-plan the prefill:decode split every --interval")
    plan.add_argument("--planner-model", help="performance model fitted on this hardware (`pdserve tune --save-model`)")
    plan.add_argument(
        "--gpu-budget", type=int, help="GPUs (CPU: engine core sets) the split may use (default: the engines started)"
    )
    plan.add_argument("--interval", type=float, default=60.0, help="seconds between two decisions")
    plan.add_argument("--cooldown", type=float, default=180.0, help="least seconds between two split changes")
    plan.add_argument("--ttft-slo", type=float, default=2.0, help="seconds, for 90%% of requests")
    plan.add_argument("--itl-slo", type=float, default=0.1, help="a request's mean inter-token seconds, for 90%%")
    serve.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API here")
    serve.add_argument("--served-model-name", help="model id for the HTTP API (default: --model)")
    door = serve.add_argument_group("front door")
    door.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (with --tls-key)")
    door.add_argument("--tls-key", help="PEM private key of --tls-cert")
    door.add_argument("--tls-client-ca", help="PEM roots: require client certificates signed by them (mutual TLS)")
    door.add_argument(
        "--tokens-file", help="ROLE:TOKEN lines (roles generate, admin); default: $PDSERVE_TOKENS, else no auth"
    )
    door.add_argument("--max-in-flight", type=int, help="requests admitted at once (default: decode batch capacity)")
    door.add_argument("--max-queue", type=int, help="requests waiting for a slot (default: as many as in flight)")
    door.add_argument("--max-engines-per-pool", type=int, default=64, help="Admin.ScalePools refuses more")
    door.add_argument("--drain-timeout", type=float, default=30.0, help="seconds live streams get to finish on SIGTERM")

    gen = sub.add_parser("generate", help="stream a generation from a running server")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_client_credential_args(gen)

    # Measurement and sizing tools keep their own argument parsers.
    sub.add_parser("plan", help="size engines from a model's config.json (weights, KV, state, blocks)", add_help=False)
    sub.add_parser("probe", help="measure prefill and decode throughput apart on this hardware", add_help=False)
    sub.add_parser("tune", help="recommend (and apply) the prefill:decode split", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command == "plan":
        from vllm_engine.plan_cli import main as plan_main

        return plan_main(rest)
    if args.command == "probe":
        from cli.probe import main as probe_main

        return probe_main(rest)
    if args.command == "tune":
        from planner.cli import main as tune_main

        return tune_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "demo":
            return asyncio.run(_demo(args))
        if args.command == "serve":
            return asyncio.run(_serve(args))
        credentials = client_credentials(args)
    except (ValueError, RuntimeError, OSError) as err:  # a configuration that cannot run: say why, no traceback
        print(f"pdserve {args.command}: {err}", file=sys.stderr)
        return 2
    return asyncio.run(
        _generate(
            args.target, args.prompt, args.timeout, credentials, max_tokens=args.max_tokens, temperature=args.temperature
        )
    )


def add_client_credential_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", help="PEM roots to verify the server with (turns TLS on)")
    parser.add_argument("--tls-cert", help="client certificate, for servers that require mutual TLS")
    parser.add_argument("--tls-key", help="private key of --tls-cert")
    parser.add_argument("--token-file", help="file holding the bearer token (default: $PDSERVE_TOKEN)")


def client_credentials(args: argparse.Namespace) -> "ClientCredentials":
    from router.security import ClientCredentials

    return ClientCredentials.from_env(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)


def front_door_config(args: argparse.Namespace) -> "FrontDoorConfig":
    from router.security import ServerTLS, TokenTable
    from router.server import FrontDoorConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    return FrontDoorConfig(
        tls=ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
        tokens=TokenTable.load(args.tokens_file),
        max_in_flight=args.max_in_flight,
        max_queue=args.max_queue,
        max_pool_size=args.max_engines_per_pool,
        prometheus_sd_file=args.prometheus_sd_file,
    )


# Engine sizing flags: `--X` sets both pools, `--prefill-X` / `--decode-X` one pool.
_SIZING_FLAGS = {
    "max_num_seqs": (int, "batch limit per engine (decode: concurrent streams)"),
    "max_num_batched_tokens": (int, "tokens per engine step (prefill: the prompt token budget)"),
    "kv_cache_bytes": ("bytes", "KV cache per rank, e.g. 4GiB (CPU default 256MiB; GPU default from --gpu-memory-utilization)"),
    "gpu_memory_utilization": (float, "fraction of each GPU vLLM may use (default 0.9)"),
}


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    from vllm_engine.plan_cli import parse_bytes

    parser.add_argument("--model", default="embedded", help="HF model directory (default: embedded tiny Qwen3.5 hybrid)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where engines and KV buffers live")
    parser.add_argument("--lease", type=int, default=30, help="seconds prefill holds blocks for decode to read")
    engine = parser.add_argument_group("engines (see `pdserve plan` for what a setting holds)")
    engine.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel GPUs (CPU: core sets) per prefill engine")
    engine.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel GPUs (CPU: core sets) per decode engine")
    engine.add_argument("--max-model-len", type=int, default=8192, help="longest prompt + output an engine accepts")
    engine.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
        help="no compiled model: GPU default off (torch.compile + CUDA graphs), CPU default on "
        "(--no-enforce-eager compiles on CPU too: ~15 s more start-up per engine, faster steps)",
    )
    engine.add_argument(
        "--engine-path", choices=["auto", "inprocess", "async"], default="auto",
        help="auto: vLLM's AsyncLLM (engine-core process) on GPU, in-process LLMEngine on CPU",
    )
    for name, (kind, text) in _SIZING_FLAGS.items():
        flag, convert = name.replace("_", "-"), parse_bytes if kind == "bytes" else kind
        engine.add_argument(f"--{flag}", type=convert, default=None, help=text)
        for role in ("prefill", "decode"):
            engine.add_argument(f"--{role}-{flag}", type=convert, default=None, help=argparse.SUPPRESS)


def deployment_config_from_args(args: argparse.Namespace, num_prefill: int, num_decode: int) -> "DeploymentConfig":
    from dataclasses import replace

    from kv_transfer.connector_config import TransferConfig
    from controller.deployment import DeploymentConfig
    from vllm_engine.config import EngineConfig, EngineSizing

    def sizing(role: str) -> EngineSizing:
        values = {name: getattr(args, f"{role}_{name}") for name in _SIZING_FLAGS}
        return EngineSizing(tensor_parallel_size=getattr(args, f"{role}_tp"), **values)

    shared = {name: getattr(args, name) for name in _SIZING_FLAGS if getattr(args, name) is not None}
    engine = replace(
        EngineConfig(model=args.model, device=args.device, max_model_len=args.max_model_len, engine_path=args.engine_path),
        enforce_eager=args.enforce_eager,
        **shared,
    )
    return DeploymentConfig(
        # Unresolved: "embedded" is built on each node, so nodes need no shared filesystem.
        engine=engine,
        transfer=TransferConfig(kv_buffer_device=args.device, lease_s=args.lease),
        num_prefill=num_prefill,
        num_decode=num_decode,
        prefill_sizing=sizing("prefill"),
        decode_sizing=sizing("decode"),
        switch_roles=getattr(args, "switch_roles", False),  # `serve` only
    )


@dataclass(slots=True)
class _Stack:
    deployment: object
    server: object
    tokenizer: object

    async def close(self) -> None:
        await self.server.stop()  # type: ignore[attr-defined]
        self.deployment.shutdown()  # type: ignore[attr-defined]


async def _bring_up(
    args: argparse.Namespace, num_prefill: int, num_decode: int, listen: str, front: "FrontDoorConfig | None" = None
) -> _Stack:
    from transformers import AutoTokenizer

    from cluster import ray_cluster
    from controller.deployment import Deployment
    from router.server import RouterServer
    from vllm_engine.config import resolve_model

    config = deployment_config_from_args(args, num_prefill, num_decode)  # refuses bad TP pairings
    front_kwargs = {"front": front} if front else {}
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.address:
        ray_cluster.join(args.address)
    else:
        ray_cluster.start_local()
    deployment = Deployment(config)
    tps = f"TP {config.role_engine('prefill').tensor_parallel_size} / {config.role_engine('decode').tensor_parallel_size}"
    print(f"model {model}: starting {num_prefill} prefill + {num_decode} decode engines ({tps})...", file=sys.stderr)
    try:
        orchestrator = await deployment.start()
        for name, capacity in deployment.capacities.items():
            print(f"  {name}: {capacity.summary()}", file=sys.stderr)
        server = RouterServer(orchestrator, deployment.health, tokenizer.encode, model, listen, scale=deployment.resize, **front_kwargs)
        await server.start()
    except BaseException:
        deployment.shutdown()
        raise
    print(f"serving pdserve.v1.Generation on {server.address}", file=sys.stderr)
    return _Stack(deployment, server, tokenizer)


async def _demo(args: argparse.Namespace) -> int:
    stack = await _bring_up(args, 1, 1, "127.0.0.1:0")
    try:
        target = stack.server.address  # type: ignore[attr-defined]
        # Warm-up: the first request pays the one-time NIXL handshake between the pair.
        from router.security import ClientCredentials

        local = ClientCredentials()  # the demo's own loopback server: no TLS, no tokens
        await _generate(target, "warm up", None, local, quiet=True, max_tokens=2)
        print(f"\n{args.prompt}", end="", flush=True)
        return await _generate(target, args.prompt, None, local, max_tokens=args.max_tokens, ignore_eos=True)
    finally:
        await stack.close()


async def _serve(args: argparse.Namespace) -> int:
    """A detached controller owns the pools; `--routers` router actors serve in front of it."""
    import dataclasses

    from controller.actor import CONTROLLER_NAME, controller_for
    from controller.deployment import check_sizing
    from cluster import ray_cluster
    from router.actor import RouterSettings
    from router.tier import RouterTier

    front = front_door_config(args)  # before any engine starts: a bad TLS or token file fails fast
    config = deployment_config_from_args(args, args.prefill, args.decode)  # refuses bad TP pairings
    check_sizing(config)
    if args.routers < 1:
        raise ValueError(f"--routers {args.routers}: at least one router must take traffic")
    if args.address:
        ray_cluster.join(args.address)
    else:
        ray_cluster.start_local()
    planner = planner_setup(args, config) if args.planner else None
    controller, created = controller_for(config, CONTROLLER_NAME, args.prometheus_sd_file, planner)
    tps = f"TP {config.role_engine('prefill').tensor_parallel_size} / {config.role_engine('decode').tensor_parallel_size}"
    if created:
        print(f"model {args.model}: starting {args.prefill} prefill + {args.decode} decode engines ({tps})...", file=sys.stderr)
    else:
        print(f"a controller already runs on this cluster ({CONTROLLER_NAME}): serving its pools", file=sys.stderr)
    tier = None
    try:
        await _remote(controller.start.remote() if created else controller.view.remote())
        for name, summary in (await controller.capacities.remote()).items():
            print(f"  {name}: {summary}", file=sys.stderr)
        settings = RouterSettings(
            model=args.model,
            listen=args.listen,
            front=dataclasses.replace(front, prometheus_sd_file=None),  # the controller keeps that file
            http=args.http,
            served_model_name=args.served_model_name,
            metrics_host=args.metrics_host if args.metrics_port else None,
            metrics_port=args.metrics_port,
        )
        tier = RouterTier(controller, settings)
        routers = await _remote(tier.start(args.routers))
    except BaseException:
        await _stop(controller, tier, 0)
        raise
    first = routers[0]
    shared = f" ({len(routers)} routers)" if len(routers) > 1 else ""
    if front.tokens is None and not args.listen.startswith(("127.", "localhost", "[::1]")):
        print(f"warning: {args.listen} is not loopback and no tokens are set: anyone who reaches it can "
              "generate and resize the pools (--tokens-file)", file=sys.stderr)
    print(f"serving pdserve.v1.Generation on {first.grpc}{shared}", file=sys.stderr)
    if first.http:
        print(f"serving the OpenAI API on http{'s' if front.tls else ''}://{first.http}/v1{shared}", file=sys.stderr)
    for router in routers:
        if router.metrics:
            print(f"router metrics on http://{router.metrics}/metrics", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    printing = loop.create_task(_print_planner_log(controller, args.interval)) if planner else None
    await stop.wait()
    if printing is not None:
        printing.cancel()
    print(f"draining: no new requests, live streams get {args.drain_timeout:.0f}s to finish", file=sys.stderr)
    finished = await _stop(controller, tier, args.drain_timeout)
    print(f"{'drained' if finished else 'drain timed out'}: engines stopped", file=sys.stderr)
    return 0


def planner_setup(args: argparse.Namespace, config: "DeploymentConfig") -> "PlannerSetup":
    from pathlib import Path

    from controller.planning import PlannerSetup
    from messages.timings import SLO
    from planner.closed_loop import PlannerConfig
    from planner.model import PerformanceModel

    if not args.planner_model:
        raise ValueError(
            "--planner needs --planner-model: fit one on this hardware with `pdserve probe --out probe.json` "
            "and `pdserve tune --probe probe.json --save-model model.json`"
        )
    prefill, decode = (config.role_engine(role) for role in ("prefill", "decode"))
    per_engine = max(prefill.tensor_parallel_size, decode.tensor_parallel_size)
    instances = args.gpu_budget // per_engine if args.gpu_budget else args.prefill + args.decode
    planner = PlannerConfig(
        instances=instances,
        slo=SLO(args.ttft_slo, args.itl_slo),
        interval_s=args.interval,
        cooldown_s=args.cooldown,
        batch_limit=decode.max_num_seqs,
        token_budget=prefill.max_num_batched_tokens,
    )
    return PlannerSetup(planner, PerformanceModel.load(Path(args.planner_model)))


async def _print_planner_log(controller: Any, interval_s: float) -> None:
    """Every planner decision, with its figures, as the controller makes it."""
    printed = 0
    while True:
        await asyncio.sleep(max(1.0, interval_s / 2))
        try:
            lines = await controller.planner_log.remote(printed)
        except Exception:  # the controller is busy or restarting: next time
            continue
        for line in lines:
            print(line, file=sys.stderr)
        printed += len(lines)


async def _remote(awaitable: Awaitable[T]) -> T:
    """A remote call's result; a refusal raised in an actor comes out as itself (ValueError,
    RuntimeError), without Ray's traceback around it."""
    import ray

    try:
        return await awaitable
    except ray.exceptions.RayTaskError as err:
        raise err.cause from None


async def _stop(controller: Any, tier: "RouterTier | None", drain_timeout_s: float) -> bool:
    """Drain the routers, then stop the engines and the controller."""
    import ray

    finished = await tier.drain(drain_timeout_s) if tier is not None else True
    try:
        await controller.shutdown.remote()
    finally:
        ray.kill(controller, no_restart=True)
    return finished


async def _generate(
    target: str,
    prompt: str,
    timeout: float | None,
    credentials: "ClientCredentials",
    quiet: bool = False,
    **sampling: object,
) -> int:
    import grpc

    from router.client import build_request, stream_generate

    async with credentials.channel(target) as channel:
        request = build_request(prompt, f"cli-{uuid.uuid4().hex[:8]}", **sampling)
        try:
            async for response in stream_generate(channel, request, timeout, credentials.metadata()):
                if response.HasField("chunk"):
                    if not quiet:
                        print(response.chunk.text, end="", flush=True)
                elif not quiet:
                    print("\n")
                    _print_final(response.final)
        except grpc.aio.AioRpcError as err:
            print(f"\nerror: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    return 0


def _print_final(final) -> None:  # noqa: ANN001
    t = final.timings
    moved = t.attention_kv_bytes + t.deltanet_state_bytes
    rows = [
        ("prompt / completion tokens", f"{final.usage.prompt_tokens} / {final.usage.completion_tokens} ({final.finish_reason})"),
        ("queue (routing + Ray hop)", f"{t.queue_s * 1e3:.1f} ms"),
        ("prefill", f"{t.prefill_s * 1e3:.1f} ms on {final.prefill_worker}"),
        ("time to first token (router)", f"{t.ttft_s * 1e3:.1f} ms"),
        ("handoff (NIXL pull + decode step)", f"{t.transfer_s * 1e3:.1f} ms on {final.decode_worker}"),
        (
            "decode",
            f"{t.decode_tokens_per_s:.1f} tok/s, inter-token p50 {t.inter_token.p50_s * 1e3:.1f} ms, "
            f"p99 {t.inter_token.p99_s * 1e3:.1f} ms",
        ),
        ("bytes moved", f"{moved:,} = attention KV {t.attention_kv_bytes:,} + DeltaNet state {t.deltanet_state_bytes:,}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
