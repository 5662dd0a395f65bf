"""The configuration tree of each `pdserve` subcommand: the roots its flags are generated from.

Each leaf is a field of the config it sets (engine, transfer, routers, front door, planner,
client, probe, tuner), with its default written there once. The roots of `plan`, `probe`,
`tune` and `verify` live beside the code that runs them (a lower layer for `plan` and `tune`). `python -m
cli.config` prints the configuration reference (docs/configuration.md; tests/test_config.py
keeps it current).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from cli.probe import ProbeConfig
from cli.verify import VerifyConfig
from configuration.fields import knob, section
from configuration.flags import reference
from controller.deployment import DeploymentConfig
from controller.planning import PlannerSettings
from planner.cli import TUNE_FIXED, TuneConfig
from router.actor import RouterSettings
from router.security import ClientCredentials
from vllm_engine.plan_cli import PLAN_IGNORES, PlanConfig

# A sentence of the embedded model's corpus: the model continues it with the corpus's text.
DEFAULT_PROMPT = "Prefill processes the prompt and creates state; decode consumes that state one token at a time."
DEMO_FIXED = frozenset({"prefill", "decode", "switch-roles"})  # the demo is always one pair


@dataclass(frozen=True, slots=True)
class DemoConfig:
    address: str | None = knob(None, help="join this Ray cluster instead of starting a local one")
    deployment: DeploymentConfig = section(DeploymentConfig, title="pools")
    max_tokens: int = knob(48, help="tokens to generate")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    address: str | None = knob(None, help="join this Ray cluster instead of starting a local one")
    deployment: DeploymentConfig = section(DeploymentConfig, title="pools")
    routers: int = knob(1, help="router processes (Ray actors, spread over nodes; on one host they share the port)")
    router: RouterSettings = section(RouterSettings, title="routers")
    drain_timeout_s: float = knob(30.0, flag="drain-timeout", help="seconds live streams get to finish on SIGTERM")
    allow_unauthenticated: bool = knob(
        False,
        help="serve gRPC or HTTP on a non-loopback address without --tokens-file (anyone who reaches it may generate)",
    )
    planner: PlannerSettings = section(
        PlannerSettings, title="closed-loop planner (changes the split as the traffic shifts)"
    )

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError(f"routers {self.routers}: at least one router must take traffic")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        exposed = [a for a in (self.router.listen, self.router.http) if a and not _is_loopback(a)]
        if exposed and self.router.front.tokens is None and not self.allow_unauthenticated:
            raise ValueError(
                f"{', '.join(exposed)} is not loopback and no tokens are set: anyone who reaches it could generate "
                "and resize the pools. Give --tokens-file (or $PDSERVE_TOKENS), listen on 127.0.0.1, "
                "or pass --allow-unauthenticated"
            )
        # The routers tokenize for the engines' model and route by the one policy.
        router = replace(self.router, model=self.deployment.engine.model)
        object.__setattr__(self, "router", router)
        object.__setattr__(self, "deployment", replace(self.deployment, policy=router.policy))


def _is_loopback(address: str) -> bool:
    import ipaddress

    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    target: str = knob("127.0.0.1:50051", help="the server's gRPC address")
    max_tokens: int = knob(64, help="tokens to generate")
    temperature: float = knob(0.0, help="sampling temperature (0: greedy)")
    timeout_s: float | None = knob(None, flag="timeout", help="deadline in seconds")
    credentials: ClientCredentials = section(ClientCredentials, title="client credentials")


# Each command's tree, and the flag names it leaves out.
COMMANDS: dict[str, tuple[type, frozenset[str]]] = {
    "demo": (DemoConfig, DEMO_FIXED),
    "serve": (ServeConfig, frozenset()),
    "generate": (GenerateConfig, frozenset()),
    "plan": (PlanConfig, PLAN_IGNORES),
    "probe": (ProbeConfig, frozenset()),
    "tune": (TuneConfig, TUNE_FIXED),
    "verify": (VerifyConfig, frozenset()),
}

INTRO = """# Configuration reference

Generated from the configuration tree (`cli/config.py` and the config dataclasses it
holds) by `python -m cli.config > docs/configuration.md`: every flag sets the field named
beside it, and its default is written only there. Sizes take KiB/MiB/GiB suffixes; on/off
flags have a `--no-` form."""


def configuration_reference() -> str:
    return reference(COMMANDS, INTRO)


if __name__ == "__main__":
    sys.stdout.write(configuration_reference())
