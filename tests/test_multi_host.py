"""pdserve across hosts, and the faults of real networks.

A Ray head (the routers) and worker nodes (one prefill host, two decode hosts) on separate
hosts of one bridge (tests/sandbox.py's `BridgedHosts`). A transfer crosses a real (virtual)
link, and UCX's own protocol report says which transport it took. Then, under bounded load,
one fault at a time: packet loss and a bandwidth cap on the prefill <-> decode links, those
links down for 5 s as the requests arrive (every handoff's READ meets it), the prefill host
lost as they arrive, and, once every request streams, the controller killed, a decode host
cut off from the router, a decode host lost. For each: every request completes or ends
with a retriable status before its deadline, no engine keeps blocks afterwards, and the time
until a new request succeeds. The table is printed (docs/operations.md holds a run's figures).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import pytest
from conftest import wait_until
from listeners import not_rays
from reference import MAX_TOKENS, PROMPTS, assert_matches, prompt_of
from sandbox import BridgedHosts, client_env

from cluster.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE, ROUTER_RESOURCE, WORKER_NICENESS_ENV

RAY_PORT = 6379
GRPC_PORT = 50051
DECODE_HOSTS = ("decode-a", "decode-b")
# UCX prints, per endpoint configuration, the protocol and transport it picked for each
# operation; NixlConnector's READ is UCX's "remote memory read by ucp_get*".
UCX_REPORT = {"UCX_PROTO_INFO": "y"}
SHARED_MEMORY_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem", "self")

# The load each fault meets: arbitrary prompts (no prefix hits) of two or more attention
# blocks and the DeltaNet state to move, all in flight at once.
LOAD_REQUESTS = 4
LOAD_PROMPT_TOKENS = 300
LOAD_MAX_TOKENS = 128  # streams long enough that a fault made once they stream lands mid-stream
# Serve's own bounds for a stalled pull or stream; a request not done by the client's
# deadline counts as hung.
TRANSFER_TIMEOUT_S = 8
STALL_TIMEOUT_S = 8
LINK_DOWN_S = 5
CLIENT_DEADLINE_S = 60
RETRIABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
REPLY = "@@ "  # the driver's answer lines (Ray and grpc may print too)


# As deploy/'s `ray start` commands: engines at nice 0, or a busy control plane (Ray's GCS and
# agents after a host is lost) starves them on a small box.
RAY_NODE_ENV = dict([WORKER_NICENESS_ENV])


def start_cluster(hosts: BridgedHosts, workers: dict[str, str]) -> None:
    """A Ray head on host "head" (router slots only) and one worker node per `workers` entry
    (host -> the pool resource it offers, one engine slot)."""
    head = hosts["head"].ip
    common = "--num-cpus=1 --object-store-memory=100000000 --disable-usage-stats"
    hosts.run(
        "head",
        f"ray start --head --node-ip-address={head} --port={RAY_PORT} {common} --include-dashboard=false "
        f"--resources='{json.dumps({ROUTER_RESOURCE: 2})}'",
        timeout=90,
        env=client_env(**RAY_NODE_ENV),
        check=True,
    )
    joining = {
        name: hosts.spawn(
            name,
            f"ray start --address={head}:{RAY_PORT} --node-ip-address={hosts[name].ip} {common} "
            f"--resources='{json.dumps({resource: 1})}'",
            f"ray-start-{name}.log",
            env=client_env(**RAY_NODE_ENV, **UCX_REPORT),
        )
        for name, resource in workers.items()
    }
    for name, start in joining.items():  # at once: each mostly waits for its own raylet
        assert start.wait(timeout=90) == 0, (hosts.box.logs / f"ray-start-{name}.log").read_text()[-3000:]


# ---- the driver: runs on the head, answers one JSON command per stdin line ------------------


async def _generate(target: str, prompt: list[int], max_tokens: int, streamed: list[int] | None = None) -> dict:
    """One generation; `streamed`, if given, is a one-element list kept at the tokens received
    so far (-1 once the call has ended)."""
    import grpc

    from router.client import build_request, stream_generate

    start, tokens, final = time.monotonic(), [], None
    streamed = streamed if streamed is not None else [0]
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True)
            async for response in stream_generate(channel, request, timeout_s=CLIENT_DEADLINE_S):
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                    streamed[0] = len(tokens)
                else:
                    final = response.final
        status = "OK" if len(tokens) == max_tokens and final is not None else f"SHORT({len(tokens)})"
        detail = ""
    except grpc.aio.AioRpcError as error:
        status, detail = error.code().name, error.details()
    finally:
        streamed[0] = -1
    return {
        "status": status,
        "detail": detail,
        "s": round(time.monotonic() - start, 2),
        "tokens": tokens,
        "prefill": final.prefill_worker if final else "",
        "decode": final.decode_worker if final else "",
    }


def _engine_loads() -> dict:
    """Each engine's lifecycle and load, as the controller and the engine itself report them."""
    import ray

    from controller.actor import CONTROLLER_NAME

    try:
        view = ray.get(ray.get_actor(CONTROLLER_NAME).view.remote(), timeout=10)
    except Exception as error:  # restarting: it answers once it has adopted its engines
        return {"controller": {"busy": type(error).__name__}}
    loads = {}
    for member in view.prefill + view.decode:
        entry = {"lifecycle": member.lifecycle.value}
        try:
            load = ray.get(member.actor.load.remote(), timeout=5)
            busy = load.running + load.waiting + load.held_for_transfer
            pid = ray.get(member.actor.pid.remote(), timeout=5)
            entry.update(busy=busy, blocks_in_use=load.total_blocks - load.free_blocks, pid=pid)
        except Exception as error:  # a lost host's engine: gone is not holding anything
            entry["unreachable"] = type(error).__name__
        loads[member.name] = entry
    return loads


def drive(target: str, ray_address: str) -> None:
    """Commands: {"do": "start", "offset": N} starts LOAD_REQUESTS generations in the
    background; {"do": "streaming"} answers once each has streamed a token or ended, with
    how many are streaming; {"do": "results"} waits for them; {"do": "generate", "prompt_file": F,
    "max_tokens": N} runs one; {"do": "controller_host"} is the controller's node address;
    {"do": "kill_controller"} kills the controller actor (Ray restarts it); {"do": "loads"}
    reports the engines."""
    import ray

    ray.init(address=ray_address, namespace="pdserve", log_to_driver=False)
    background: dict[str, object] = {}

    def start(offset: int) -> None:
        prompts = [list(prompt_of(7, offset + i, LOAD_PROMPT_TOKENS)) for i in range(LOAD_REQUESTS)]
        background["streamed"] = streamed = [[0] for _ in prompts]

        async def all_of() -> list[dict]:
            return await asyncio.gather(*(_generate(target, p, LOAD_MAX_TOKENS, n) for p, n in zip(prompts, streamed)))

        thread = threading.Thread(target=lambda: background.update(results=asyncio.run(all_of())))
        thread.start()
        background["thread"] = thread

    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "start":
            start(command["offset"])
            answer: object = {}
        elif command["do"] == "streaming":
            counts = background["streamed"]
            deadline = time.monotonic() + CLIENT_DEADLINE_S
            while any(n == [0] for n in counts) and time.monotonic() < deadline:
                time.sleep(0.01)
            answer = {"streaming": sum(n[0] > 0 for n in counts)}
        elif command["do"] == "results":
            background.pop("thread").join()
            answer = background.pop("results")
        elif command["do"] == "controller_host":
            from controller.actor import CONTROLLER_NAME

            controller = ray.get_actor(CONTROLLER_NAME)
            answer = ray.get(controller.__ray_call__.remote(lambda _: ray.util.get_node_ip_address()))
        elif command["do"] == "kill_controller":
            from controller.actor import CONTROLLER_NAME

            ray.kill(ray.get_actor(CONTROLLER_NAME), no_restart=False)
            answer = {}
        elif command["do"] == "generate":
            prompt = json.loads(open(command["prompt_file"]).read())
            answer = asyncio.run(_generate(target, prompt, command["max_tokens"]))
        else:
            answer = _engine_loads()
        print(REPLY + json.dumps(answer), flush=True)


class Driver:
    def __init__(self, hosts: BridgedHosts, target: str, ray_address: str) -> None:
        call = f't.drive("{target}", "{ray_address}")'
        self._proc = hosts.popen(
            "head", f"cd tests && exec {sys.executable} -c 'import test_multi_host as t; {call}'", client_env()
        )

    def ask(self, **command: object) -> object:
        self._proc.stdin.write(json.dumps(command) + "\n")
        for line in self._proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        raise AssertionError(f"the driver exited ({self._proc.wait()})")

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


# ---- what the hosts report ---------------------------------------------------------------


def ucx_read_transports(hosts: BridgedHosts, name: str) -> list[tuple[str, str]]:
    """(scope, transport) of every READ protocol UCX reported in the host's Ray worker logs:
    scope "inter-node" or "intra-node", transport e.g. "tcp/eth0" or "cma/memory"."""
    found = []
    # session_latest links to /tmp/ray/..., the host's path.
    for log in (hosts.tmp(name) / "ray").glob("session_2*/logs/worker-*"):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "remote memory read by ucp_get" not in line:
                continue
            scope = re.search(r"(inter|intra)-node", lines[i - 1])
            for row in lines[i + 4 : i + 12]:  # the table's rows: | range | description | transport |
                cells = [c.strip() for c in row.split("|")[1:-1]]
                if len(cells) != 3:
                    break
                found.append((scope[0] if scope else "?", cells[2].split()[0]))
    return found


def wide_listeners(hosts: BridgedHosts, name: str) -> list[tuple[int, int, str]]:
    """(pid, port, command line) of the host's TCP and UDP listeners bound to neither its
    own address nor loopback, as `ss` and /proc list them."""
    allowed = (f"{hosts[name].ip}:", "127.", "[::1]:", "[::ffff:127.", f"[::ffff:{hosts[name].ip}]:")
    wide = []
    for line in hosts.run(name, "ss -Htulnp", check=True).stdout.splitlines():
        address = line.split()[4]
        if address.startswith(allowed):
            continue
        found = re.search(r"pid=(\d+)", line)  # no process: a socket of the kernel's
        pid = int(found[1]) if found else 0
        command = hosts.run(name, f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout.strip() if pid else line
        wide.append((pid, int(address.rsplit(":", 1)[1]), command))
    return wide


# ---- the faults ---------------------------------------------------------------------------


@dataclass
class FaultRun:
    fault: str
    outcomes: dict[str, int]  # status -> requests
    slowest_s: float
    recovered_s: float  # from the fault's end until a new request succeeded
    idle_s: float  # from then until no engine held a request or a block

    def row(self) -> str:
        outcomes = ", ".join(f"{n} {status}" for status, n in sorted(self.outcomes.items()))
        return f"| {self.fault} | {outcomes} | {self.slowest_s:.1f} | {self.recovered_s:.1f} | {self.idle_s:.1f} |"


@pytest.mark.slow
def test_hosts_over_a_bridge_serve_and_survive_network_faults(sandbox, model_path, reference):
    hosts = BridgedHosts(sandbox, ["head", "prefill", *DECODE_HOSTS])
    shutil.copytree(model_path, sandbox.home / "model")
    (sandbox.home / "prompt.json").write_text(json.dumps(list(PROMPTS["long"])))
    (sandbox.home / "probe.json").write_text(json.dumps(list(PROMPTS["short"])))  # recovered yet?
    start_cluster(hosts, {"prefill": PREFILL_RESOURCE, **dict.fromkeys(DECODE_HOSTS, DECODE_RESOURCE)})
    head = hosts["head"].ip
    target, ray_address = f"{head}:{GRPC_PORT}", f"{head}:{RAY_PORT}"
    serve = hosts.spawn(
        "head",
        f"exec pdserve serve --address {ray_address} --model /root/model --listen {target} --allow-unauthenticated "
        f"--decode {len(DECODE_HOSTS)} --transfer-timeout-s {TRANSFER_TIMEOUT_S} --stall-timeout-s {STALL_TIMEOUT_S}",
        "serve.log",
        env=client_env(),
    )
    serve_log = sandbox.logs / "serve.log"
    serving = "serving pdserve.v1.Generation"
    started = wait_until(lambda: serving in serve_log.read_text() or serve.poll() is not None, 240, 1)
    assert started and serve.poll() is None, f"{serve_log.read_text()}\n{hosts.report()}"
    # serve measured each prefill/decode pair's link with a READ across hosts at start-up.
    links = re.findall(r"link (prefill-0 -> decode-\d): .* ([\d.,]+) Gbit/s", serve_log.read_text())
    print("start-up links:", links)
    assert sorted(pair for pair, _ in links) == ["prefill-0 -> decode-0", "prefill-0 -> decode-1"]
    assert all(float(rate.replace(",", "")) > 0 for _, rate in links)
    assert "runs at nice" not in serve_log.read_text()  # the raylets start workers at nice 0
    driver = Driver(hosts, target, ray_address)

    # The controller runs beside serve, on the head: losing an engine host cannot take it.
    assert driver.ask(do="controller_host") == head
    # One generation crosses hosts and equals colocated serving.
    generation = driver.ask(do="generate", prompt_file="/root/prompt.json", max_tokens=MAX_TOKENS)
    assert generation["status"] == "OK", generation
    assert_matches(generation["tokens"], reference["long"])
    decode_host = {"decode-0": "decode-a", "decode-1": "decode-b"}[generation["decode"]]

    # Its READ went over the link, by UCX's own account.
    reads = ucx_read_transports(hosts, decode_host)
    print(f"{decode_host}'s UCX READ protocols:", reads)
    assert reads, f"UCX reported no READ on {decode_host}"
    assert all(scope == "inter-node" and transport.startswith("tcp/eth0") for scope, transport in reads), reads
    assert not any(t.split("/")[0] in SHARED_MEMORY_TRANSPORTS for _, t in reads)

    # pdserve's listeners (routers, metrics, token feeds, NIXL side channels, UCX) are on each
    # host's cluster address or loopback; only Ray's own servers listen on every interface.
    for name in hosts.hosts:
        wide = wide_listeners(hosts, name)
        print(f"{name}: {len(wide)} listeners on every interface, all Ray's:", sorted(port for _, port, _ in wide))
        assert not_rays(wide) == [], name

    runs: list[FaultRun] = []
    offset = 0

    def under_load(fault: str, before=None, during=None, after=None) -> FaultRun:
        nonlocal offset
        offset += LOAD_REQUESTS
        if before:
            before()
        driver.ask(do="start", offset=offset * 10)
        if during:
            during()
        outcomes = driver.ask(do="results")
        hosts.heal()
        if after:
            after()
        healed = time.monotonic()
        while (probe := driver.ask(do="generate", prompt_file="/root/probe.json", max_tokens=4))["status"] != "OK":
            assert time.monotonic() - healed < 60, f"{fault}: no request succeeded 60 s after: {probe}"
        recovered = time.monotonic()
        assert wait_until(
            lambda: all(not e.get("busy") and not e.get("blocks_in_use") for e in driver.ask(do="loads").values()),
            40,
            1,
        ), driver.ask(do="loads")
        counts: dict[str, int] = {}
        for outcome in outcomes:
            counts[outcome["status"]] = counts.get(outcome["status"], 0) + 1
        run = FaultRun(fault, counts, max(o["s"] for o in outcomes), recovered - healed, time.monotonic() - recovered)
        print(run.row(), [o["detail"] for o in outcomes if o["status"] != "OK"])
        runs.append(run)
        return run

    def between_prefill_and_decode(percent: int):
        return lambda: [hosts.drop("prefill", d, percent) for d in DECODE_HOSTS]

    def once_streaming(fault) -> Callable[[], None]:
        """Make `fault` once every request streams (each has its prompt prefilled and moved):
        a fixed delay lands after the requests are done on a fast box."""

        def when() -> None:
            assert driver.ask(do="streaming")["streaming"] == LOAD_REQUESTS, "a request ended before the fault"
            fault()

        return when

    under_load("none")
    engines = {name: e["pid"] for name, e in driver.ask(do="loads").items()}
    under_load("controller killed", during=once_streaming(lambda: driver.ask(do="kill_controller")))
    # Ray restarted the controller, which adopted the engines it had: none was started anew.
    assert {name: e["pid"] for name, e in driver.ask(do="loads").items()} == engines
    assert driver.ask(do="controller_host") == head
    under_load("1% loss, prefill <-> decode", before=between_prefill_and_decode(1))
    under_load("5% loss, prefill <-> decode", before=between_prefill_and_decode(5))
    under_load("decode links capped at 1 Gbit/s", before=lambda: [hosts.cap(d, "1gbit") for d in DECODE_HOSTS])
    # Down as the requests arrive, so every handoff's READ meets the dead link (TCP holds the
    # connection made at start-up); up again after LINK_DOWN_S, inside the transfer timeout.
    down = under_load(
        f"prefill <-> decode down {LINK_DOWN_S} s as requests arrive",
        before=between_prefill_and_decode(100),
        during=lambda: (time.sleep(LINK_DOWN_S), hosts.heal()),
    )
    assert down.slowest_s >= LINK_DOWN_S - 1, "no request waited for the link"
    cut = once_streaming(lambda: hosts.drop("head", "decode-a", 100))
    under_load("decode-a cut off from the router (still reaches prefill)", during=cut)
    # Before the requests come: every prefill leg's start is lost, so each one stalls, marks
    # the prefill engine dead for the router and is prefilled on decode instead.
    cut_prefill = under_load(
        "prefill cut off from the router (still reaches decode)", before=lambda: hosts.drop("head", "prefill", 100)
    )
    assert cut_prefill.slowest_s >= STALL_TIMEOUT_S - 1, "no request waited for its prefill leg to stall"
    under_load("decode-a lost", during=once_streaming(lambda: hosts.lose("decode-a")))
    # At once: the prompts are then being routed to prefill or prefilled there.
    under_load("prefill host lost", during=lambda: hosts.lose("prefill"))

    print("| fault | outcomes | slowest (s) | recovered (s) | idle (s) |")
    print("\n".join(run.row() for run in runs))
    for run in runs:
        lost = {status: n for status, n in run.outcomes.items() if status not in ("OK", *RETRIABLE)}
        assert not lost, f"{run.fault}: requests lost or hung: {lost}"
    driver.close()
    hosts.run("head", "pkill -TERM -f 'pdserve serve'", check=True)
