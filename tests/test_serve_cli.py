"""`pdserve serve` as a user runs it: its own local cluster, a controller, two routers on
one port (gRPC and HTTP), colocated serving (the baseline P/D is compared with) through each
front, then SIGTERM: drained, engines and controller stopped, every process of its cluster
gone."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from conftest import run, stream_tokens
from listeners import not_rays
from reference import MAX_TOKENS, PROMPTS, assert_matches

pytestmark = pytest.mark.slow  # a long module: run early (tests/conftest.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC binds IPv4 addresses as ::ffff:a.b.c.d
    return (mapped or address).is_loopback


def test_serve_with_two_routers_generates_and_drains_on_sigterm(tmp_path, model_path, reference):
    import grpc

    from router.client import build_request

    grpc_port, http_port = _free_port(), _free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "cli.main", "serve", "--model", model_path, "--prefill", "0", "--decode", "1"]
    command += ["--routers", "2", "--listen", f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{http_port}"]
    command += ["--metrics-port", "0", "--drain-timeout", "5"]
    with open(log, "w") as out:
        serve = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "serving the OpenAI API" not in log.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert f"serving pdserve.v1.Generation on 127.0.0.1:{grpc_port} (2 routers)" in log.read_text()
        cluster = [p for p in psutil.Process(serve.pid).children(recursive=True)]
        routers = [p for p in cluster if "RouterActor" in " ".join(p.cmdline())]
        assert len(routers) == 2

        # Told to listen on loopback, nothing of pdserve's listens wider; only Ray's own servers do.
        wide = []
        for process in [psutil.Process(serve.pid), *cluster]:
            with contextlib.suppress(psutil.Error):
                for sock in process.net_connections(kind="inet"):
                    listening = sock.status == psutil.CONN_LISTEN or (sock.type == socket.SOCK_DGRAM and not sock.raddr)
                    if listening and not _is_loopback(sock.laddr.ip):
                        wide.append((process.pid, sock.laddr.port, " ".join(process.cmdline())))
        print(f"{len(wide)} listeners on every interface, all Ray's: {sorted(port for _, port, _ in wide)}")
        assert not_rays(wide) == []

        async def through_grpc():
            request = build_request(list(PROMPTS["long"]), "cli", max_tokens=MAX_TOKENS, ignore_eos=True)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                return await stream_tokens(channel, request)

        # Colocated serving (--prefill 0): the decode engine prefills, nothing is transferred.
        tokens, _, final = run(through_grpc())
        assert_matches(tokens, reference["long"])
        assert final.finish_reason == "length" and final.prefill_worker == ""
        assert final.timings.attention_kv_bytes == final.timings.deltanet_state_bytes == 0
        assert final.timings.ttft_s > 0
        body = json.dumps({"model": model_path, "prompt": "Prefill and decode", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] == 4

        os.kill(serve.pid, signal.SIGTERM)
        assert serve.wait(90) == 0, log.read_text()[-3000:]
        assert "drained: engines stopped" in log.read_text()
        time.sleep(2)
        assert [p.pid for p in cluster if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def test_serve_refuses_role_switching_with_per_pool_engine_settings_before_any_cluster(capsys, model_path):
    from cli.main import main

    assert main(["serve", "--model", model_path, "--switch-roles", "--decode-max-num-seqs", "64"]) == 2
    assert "both pools run one engine configuration" in capsys.readouterr().err
    assert main(["serve", "--model", model_path, "--switch-roles", "--prefill", "0"]) == 2
    assert "--prefill >= 1" in capsys.readouterr().err
