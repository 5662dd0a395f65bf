"""A router listener (gRPC front, HTTP front, metrics) that cannot bind says where and why:
the bare OSError names no address, and gRPC's names no cause."""

from __future__ import annotations

import os


def bind_error(listener: str, host: str, port: int | str, err: OSError) -> OSError:
    """`err`, naming the listener's address and what to do about it."""
    why = os.strerror(err.errno) if err.errno else str(err)
    return OSError(err.errno, f"{listener} {host}:{port}: {why}; free that port or pick another")
