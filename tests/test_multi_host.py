"""pdserve across hosts: a Ray head and worker nodes on separate network hosts of one bridge
(tests/sandbox.py's `BridgedHosts`), the routers on the head, prefill on one host, decode on
another. A transfer crosses a real (virtual) link, and UCX's own protocol report says which
transport it took.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys

import pytest
from conftest import wait_until
from reference import MAX_TOKENS, PROMPTS, assert_matches
from sandbox import BridgedHosts, client_env, tail

from cluster.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE, ROUTER_RESOURCE

RAY_PORT = 6379
GRPC_PORT = 50051
# UCX prints, per endpoint configuration, the protocol and transport it picked for each
# operation; NixlConnector's READ is UCX's "remote memory read by ucp_get*".
UCX_REPORT = {"UCX_PROTO_INFO": "y"}
SHARED_MEMORY_TRANSPORTS = ("cma", "posix", "sysv", "xpmem", "knem", "self")


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
        env=client_env(),
        check=True,
    )
    for name, resource in workers.items():
        hosts.run(
            name,
            f"ray start --address={head}:{RAY_PORT} --node-ip-address={hosts[name].ip} {common} "
            f"--resources='{json.dumps({resource: 1})}'",
            timeout=90,
            env=client_env(**UCX_REPORT),
            check=True,
        )


def generate(target: str, prompt_file: str, max_tokens: int) -> None:
    """Runs on a host: one greedy streamed generation; prints its tokens and workers as JSON."""
    import grpc

    from router.client import build_request, stream_generate

    prompt = json.loads(open(prompt_file).read())

    async def one() -> dict:
        tokens, final = [], None
        async with grpc.aio.insecure_channel(target) as channel:
            request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True)
            async for response in stream_generate(channel, request, timeout_s=120):
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                else:
                    final = response.final
        return {"tokens": tokens, "prefill": final.prefill_worker, "decode": final.decode_worker}

    print(json.dumps(asyncio.run(one())), flush=True)


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


@pytest.mark.slow
def test_prefill_and_decode_on_separate_hosts_read_over_the_link(sandbox, model_path, reference):
    hosts = BridgedHosts(sandbox, ["head", "prefill", "decode"])
    shutil.copytree(model_path, sandbox.home / "model")
    (sandbox.home / "prompt.json").write_text(json.dumps(list(PROMPTS["long"])))
    start_cluster(hosts, {"prefill": PREFILL_RESOURCE, "decode": DECODE_RESOURCE})
    head = hosts["head"].ip
    serve = hosts.spawn(
        "head",
        f"exec pdserve serve --address {head}:{RAY_PORT} --model /root/model --listen {head}:{GRPC_PORT} "
        "--allow-unauthenticated",
        "serve.log",
        env=client_env(),
    )
    serve_log = sandbox.logs / "serve.log"
    assert wait_until(lambda: "serving pdserve.v1.Generation" in serve_log.read_text(), 240, 1), serve_log.read_text()

    call = f't.generate("{head}:{GRPC_PORT}", "/root/prompt.json", {MAX_TOKENS})'
    client = f"cd tests && {sys.executable} -c 'import test_multi_host as t; {call}'"
    result = hosts.run("head", client, timeout=150, env=client_env())
    assert result.returncode == 0, tail(result)
    generation = json.loads(result.stdout.splitlines()[-1])
    assert (generation["prefill"], generation["decode"]) == ("prefill-0", "decode-0")
    assert_matches(generation["tokens"], reference["long"])

    # The decode host's READ went over the link, by UCX's own account; the prefill host
    # (the READ's target) never read.
    reads = ucx_read_transports(hosts, "decode")
    print("decode host's UCX READ protocols:", reads)
    assert reads, "UCX reported no READ on the decode host"
    assert all(scope == "inter-node" and transport.startswith("tcp/eth0") for scope, transport in reads), reads
    assert not any(t.split("/")[0] in SHARED_MEMORY_TRANSPORTS for _, t in reads)

    hosts.run("head", "pkill -TERM -f 'pdserve serve'", check=True)
    assert serve.wait(timeout=60) == 0, tail_log(serve_log)


def tail_log(path, lines: int = 40) -> str:
    return "\n".join(path.read_text().splitlines()[-lines:])
