"""Where an op runs: on the device (the default), on the host CPU, or on the link between them.

ZeRO-Offload moves work off the accelerator: the optimizer runs on the host, gradients
go down and weights come up over PCIe. The instruments need to know which is which:
the memory tracker counts what is allocated on the host apart from device memory, and
the roofline charges host ops at the host's rate and copies at the link's, not at the
device's. The code that places work says so with `placed("host")` (or "d2h", "h2d");
the instruments read `where()`. On the meta device this is the only way to tell, and
on a CPU-only run (device and host are one memory) it keeps the two apart the same way.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

PLACES = ("device", "host", "d2h", "h2d")
_stack = ["device"]  # not thread-local: autograd may run a backward hook on its own thread


@contextlib.contextmanager
def placed(place: str) -> Iterator[None]:
    if place not in PLACES:
        raise ValueError(f"unknown place {place!r}; one of {', '.join(PLACES)}")
    _stack.append(place)
    try:
        yield
    finally:
        _stack.pop()


def where() -> str:
    return _stack[-1]


def on_host(place: str) -> bool:
    """Whether memory allocated at `place` is host memory (a copy's destination: device-to-host lands there)."""
    return place in ("host", "d2h")
