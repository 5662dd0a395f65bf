"""`pdserve` command line: demo, serve, generate, plan, probe, tune, verify."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

if TYPE_CHECKING:
    from cli.config import DemoConfig, ServeConfig
    from router.security import ClientCredentials
    from router.tier import RouterTier

T = TypeVar("T")


def main(argv: list[str] | None = None) -> int:
    from cli.config import COMMANDS, DEFAULT_PROMPT
    from configuration.flags import add_flags, build

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode serving")
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "demo": "local cluster (1 prefill + 1 decode), one generation streamed through gRPC",
        "serve": "start or join a Ray cluster, bring up the pools under a controller, serve gRPC from N routers",
        "generate": "stream a generation from a running server",
        "plan": "size engines from a model's config.json (weights, KV, state, blocks)",
        "probe": "measure prefill and decode throughput apart on this hardware",
        "tune": "recommend (and apply) the prefill:decode split",
        "verify": "check every prefill/decode pair of a live cluster against colocated serving",
    }
    # The sizing and measurement tools build their parsers from the same trees themselves, so
    # `python -m planner.cli` and the others take the same flags: here they get the rest.
    tools = {"plan", "probe", "tune", "verify"}
    for command, (tree, skip) in COMMANDS.items():
        command_parser = sub.add_parser(command, help=helps[command], add_help=command not in tools)
        if command == "demo":
            command_parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
        if command == "generate":
            command_parser.add_argument("prompt")
        if command not in tools:
            add_flags(command_parser, tree, skip)

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
    if args.command == "verify":
        from cli.verify import main as verify_main

        return verify_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    command, prompt = args.command, getattr(args, "prompt", None)
    del args.command
    if prompt is not None:
        del args.prompt
    try:
        config = build(COMMANDS[command][0], args)
        if command == "demo":
            return asyncio.run(_demo(config, prompt))
        if command == "serve":
            return asyncio.run(_serve(config))
    except (ValueError, RuntimeError, OSError) as err:  # a configuration that cannot run: say why, no traceback
        print(f"pdserve {command}: {err}", file=sys.stderr)
        return 2
    return asyncio.run(
        _generate(
            config.target,
            prompt,
            config.timeout_s,
            config.credentials,
            max_tokens=config.max_tokens,
            temperature=config.temperature,
        )
    )


def _join_or_start(ray_cluster: Any, address: str | None) -> None:
    if address:
        ray_cluster.join(address)
    else:
        ray_cluster.start_local()


async def _demo(config: "DemoConfig", prompt: str) -> int:
    from cluster import ray_cluster
    from controller.local_stack import LocalStack
    from router.security import ClientCredentials

    _join_or_start(ray_cluster, config.address)
    async with LocalStack(config.deployment, verbose=True) as stack:
        local = ClientCredentials()  # the demo's own loopback server: no TLS, no tokens
        # Warm-up: the first request pays the one-time NIXL handshake between the pair.
        await _generate(stack.address, "warm up", None, local, quiet=True, max_tokens=2)
        print(f"\n{prompt}", end="", flush=True)
        return await _generate(stack.address, prompt, None, local, max_tokens=config.max_tokens, ignore_eos=True)


async def _serve(config: "ServeConfig") -> int:
    """A detached controller owns the pools; `--routers` router actors serve in front of it."""
    import dataclasses

    from cluster import ray_cluster
    from controller.actor import CONTROLLER_NAME, controller_for
    from controller.deployment import check_sizing
    from router.tier import RouterTier

    config = _with_local_prefill_limit(config)
    deployment, router = config.deployment, config.router
    front = router.front
    check_sizing(deployment)
    _join_or_start(ray_cluster, config.address)
    planner = config.planner.setup(
        deployment.role_engine("prefill"),
        deployment.role_engine("decode"),
        deployment.num_prefill + deployment.num_decode,
    )
    controller, created = controller_for(deployment, CONTROLLER_NAME, front.prometheus_sd_file, planner)
    if created:
        print(f"model {deployment.engine.model}: starting {deployment.summary()}...", file=sys.stderr)
    else:
        print(f"a controller already runs on this cluster ({CONTROLLER_NAME}): serving its pools", file=sys.stderr)
    tier = None
    try:
        await _remote(controller.start.remote() if created else controller.view.remote())
        for name, summary in (await controller.capacities.remote()).items():
            print(f"  {name}: {summary}", file=sys.stderr)
        for link in await controller.links.remote():
            print(f"  link {link.summary()}", file=sys.stderr)
            if slow := link.warning(deployment.transfer.link_floor_gbit_s):
                print(f"warning: {slow}", file=sys.stderr)
        # The controller keeps the Prometheus target file.
        settings = dataclasses.replace(router, front=dataclasses.replace(front, prometheus_sd_file=None))
        tier = RouterTier(controller, settings)
        routers = await _remote(tier.start(config.routers))
    except BaseException:
        await _stop(controller, tier, 0)
        raise
    first = routers[0]
    shared = f" ({len(routers)} routers)" if len(routers) > 1 else ""
    if front.tokens is None and config.allow_unauthenticated:
        print(
            "warning: --allow-unauthenticated: anyone who reaches the front door may generate and resize",
            file=sys.stderr,
        )
    if deployment.num_prefill and (slow := deployment.transfer.fabric_warning(deployment.engine.device)):
        print(f"warning: {slow}", file=sys.stderr)
    print(f"serving pdserve.v1.Generation on {first.grpc}{shared}", file=sys.stderr)
    if first.http:
        print(f"serving the OpenAI API on http{'s' if front.tls else ''}://{first.http}/v1{shared}", file=sys.stderr)
    for addresses in routers:
        if addresses.metrics:
            print(f"router metrics on http://{addresses.metrics}/metrics", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    printing = loop.create_task(_print_planner_log(controller, config.planner.interval_s)) if planner else None
    await stop.wait()
    if printing is not None:
        printing.cancel()
    print(f"draining: no new requests, live streams get {config.drain_timeout_s:.0f}s to finish", file=sys.stderr)
    finished = await _stop(controller, tier, config.drain_timeout_s)
    print(f"{'drained' if finished else 'drain timed out'}: engines stopped", file=sys.stderr)
    return 0


def _with_local_prefill_limit(config: "ServeConfig") -> "ServeConfig":
    """Conditional disaggregation's threshold as given, else the break-even of the planner
    model's measured prefill and transfer costs, else off; said on stderr."""
    import dataclasses
    from pathlib import Path

    from planner.model import PerformanceModel

    policy = config.router.policy
    if policy.local_prefill_uncached is not None or not config.deployment.num_prefill:
        return config
    limit, source = 0, "off: no --planner-model to derive it from; or set --local-prefill-uncached"
    if config.planner.model:
        limit = PerformanceModel.load(Path(config.planner.model)).local_prefill_limit()
        source = f"the break-even of {config.planner.model}'s prefill and transfer costs"
    print(f"prefill on the decode engine when it lacks at most {limit} prompt tokens ({source})", file=sys.stderr)
    policy = dataclasses.replace(policy, local_prefill_uncached=limit)
    return dataclasses.replace(config, router=dataclasses.replace(config.router, policy=policy))


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
        (
            "prompt / completion tokens",
            f"{final.usage.prompt_tokens} / {final.usage.completion_tokens} ({final.finish_reason})",
        ),
        ("queue (routing + prefill feed)", f"{t.queue_s * 1e3:.1f} ms"),
        ("prefill", f"{t.prefill_s * 1e3:.1f} ms on {final.prefill_worker}"),
        ("time to first token (router)", f"{t.ttft_s * 1e3:.1f} ms"),
        ("handoff (NIXL pull + decode step)", f"{t.transfer_s * 1e3:.1f} ms on {final.decode_worker}"),
        (
            "decode",
            f"{t.decode_tokens_per_s:.1f} tok/s, inter-token p50 {t.inter_token.p50_s * 1e3:.1f} ms, "
            f"p99 {t.inter_token.p99_s * 1e3:.1f} ms",
        ),
        (
            "bytes moved",
            f"{moved:,} = attention KV {t.attention_kv_bytes:,} + DeltaNet state {t.deltanet_state_bytes:,}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
