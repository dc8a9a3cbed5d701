"""Hardware profiles: what a device computes, stores and sends. Kept as data: the package's
profiles.json, read-only, and a user's own file of measured figures that overrides it by profile name
(`user_path`: $ZEROFUNC_PROFILES, else ~/.config/zerofunc/profiles.json), where the recorders write.

A profile gives per-device memory, sustained matmul rates per dtype, memory bandwidth,
the link within a node and the network between nodes (alpha-beta), which
attention kernel the device's PyTorch would run, and for ZeRO-Offload the host memory
per device, the host link's bandwidth and the host's AdamW rate. Each entry says where its figures
come from; figures not measured here are marked as published or assumed.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path

from sim.cost import Link
from sim.kernel_cost import KernelCosts
from sim.kernel_memory import MatmulWorkspaces
from sim.network import group_link
from sim.profile_fields import FIELDS, LINK_FIELDS, REQUIRED, check_fields

ATTENTION_KERNELS = ("math", "flash", "efficient", "flash_cpu")
PROFILES_ENV = "ZEROFUNC_PROFILES"  # the user's profiles file, overriding the default under ~/.config
MEASURED = "measured: "             # the key of a source that says which figures were measured, and how

# A profile's fields in profiles.json, and what each must hold
class ProfilesError(ValueError):
    """A profiles file that cannot be used, in one line that names it."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    memory_bytes: int
    reserved_bytes: int            # taken before any tensor: CUDA context, allocator slack
    flops: dict[str, float]        # peak matmul FLOP/s per dtype ("fp32", "bf16", "fp16")
    compute_efficiency: float      # the fraction of peak a real step's matmuls reach
    memory_bandwidth: float        # bytes/s
    devices_per_node: int
    intra_node: Link               # the node's fabric: bus bandwidth per device
    inter_node: Link               # one NIC (with nics_per_node), else the whole network between nodes
    attention: str
    collective_staging: dict[str, float]  # what the backend copies per collective, x payload, until it completes
    sources: dict[str, str]
    device_names: tuple[str, ...] = ()
    # ZeRO-Offload: host memory per device (on a CPU profile, the same memory as the device's),
    # the host link each way (pinned copies), and the host's fused AdamW rate per device
    host_memory_bytes: int = 0
    host_link_bandwidth: float = float("inf")
    cpu_adamw_params_per_s: float = float("inf")
    # What a step costs beyond FLOPs, bytes and the wire: per op dispatched (eager CPU: autograd's
    # bookkeeping), and the fraction of asynchronous communication that really hides behind compute
    # (a GPU's copy engines and NCCL's own SMs: all of it; a CPU rank's one core: measured)
    op_overhead_s: float = 0.0
    overlap_hidden: float = 1.0
    nics_per_node: int | None = None  # None: one network link between nodes (sim.network)
    # what each thread that runs matmuls keeps (sim.kernel_memory); a CPU keeps none
    matmul_workspace: MatmulWorkspaces = MatmulWorkspaces()
    # each op priced by its class from published constants (sim.kernel_cost); None: one roofline for all,
    # matmuls at `compute_efficiency` of peak (a CPU's figures, measured whole)
    kernels: KernelCosts | None = None

    def link(self, size: int, stride: int = 1, world: int | None = None) -> Link:
        """The link a group of `size` ranks, `stride` apart in a world of `world` (default: the
        group's own), runs its collectives at, by the nodes it spans (sim.network)."""
        return group_link(self.intra_node, self.inter_node, self.devices_per_node, self.nics_per_node,
                          size, stride, world)

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


@cache
def _shipped() -> dict:
    """The package's own profiles: read, never written."""
    return json.loads(shipped_path().read_text())


def shipped_path() -> Path:
    return Path(str(resources.files("sim").joinpath("profiles.json")))


def user_path() -> Path:
    """The user's profiles file: $ZEROFUNC_PROFILES, else $XDG_CONFIG_HOME/zerofunc/profiles.json
    (~/.config/zerofunc/profiles.json). It need not exist; where it does, its entries override the
    shipped profiles by name. An environment variable rather than an argument, so that every process
    of a run (the planner, the trainer's ranks, torchrun's) reads the same file."""
    if os.environ.get(PROFILES_ENV):
        return Path(os.environ[PROFILES_ENV]).expanduser()
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()
    return config / "zerofunc" / "profiles.json"


def use_profiles(path: str | os.PathLike | None, must_exist: bool = True) -> Path:
    """Point this process, and the processes it starts, at the profiles file `path` (None: keep the
    default), and check that file now: ProfilesError, one line naming it, if it cannot be used.
    `must_exist`: a file named explicitly must be there (a recorder may create it)."""
    if path is not None:
        path = Path(path).expanduser()
        if must_exist and not path.is_file():
            raise ProfilesError(f"--profiles {path}: {'not a file' if path.exists() else 'no such file'}")
        os.environ[PROFILES_ENV] = str(path.resolve())  # absolute: a rank started elsewhere reads the same file
    profiles()
    return user_path()


def profiles() -> dict[str, Profile]:
    """The shipped profiles, overridden by name by the user's (`user_path`), read again when that
    file changes (a recording, an edit, another file named)."""
    path = user_path()
    try:
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        stamp = None  # absent, or unreadable: _read_user says which
    return _profiles(str(path), stamp)


@lru_cache(maxsize=8)
def _profiles(user: str, stamp: tuple | None) -> dict[str, Profile]:
    raw = _overlay(_shipped(), _read_user(Path(user)))
    return {name: _profile(name, p, user) for name, p in raw.items()}


def _read_user(path: Path) -> dict:
    """The user's entries by profile name; {} where there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise ProfilesError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfilesError(f"{path}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ProfilesError(f"{path}: expected an object of hardware profiles by name, got a {type(raw).__name__}")
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise ProfilesError(f"{path}: profile {name!r} is a {type(entry).__name__}, not an object of fields")
        try:
            check_fields(FIELDS, entry)
            for side in ("intra_node", "inter_node"):
                check_fields(LINK_FIELDS, entry.get(side, {}))
        except ValueError as e:
            raise ProfilesError(f"{path}: profile {name!r}: {e}") from None
    return raw


def _overlay(shipped: dict, user: dict) -> dict:
    out = dict(shipped)
    for name, entry in user.items():
        out[name] = _updated(shipped[name], entry) if name in shipped else entry
    return out


def _updated(entry: dict, update: dict) -> dict:
    """`entry` with the fields of `update`: an object's keys update the entry's (a profile's flops per
    dtype, a link's fields), anything else replaces it. Sources are kept, but where `update` says what
    it measured, the entry's own "measured: ..." sources go (they describe figures now replaced)."""
    out = dict(entry)
    for key, value in update.items():
        if key != "sources":
            out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    mine = update.get("sources", {})
    measured = any(k.startswith(MEASURED) for k in mine)
    out["sources"] = {**mine, **{k: v for k, v in entry.get("sources", {}).items()
                                 if k not in mine and not (measured and k.startswith(MEASURED))}}
    return out


def _profile(name: str, p: dict, where: str) -> Profile:
    """A profile from its JSON entry, or ProfilesError saying which field of which file is wrong."""
    def bad(what: str) -> ProfilesError:
        return ProfilesError(f"{where}: profile {name!r}: {what}")

    missing = [k for k in REQUIRED if k not in p]
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}" + ("" if name in _shipped() else
                                                             " (a profile not shipped must give every field)"))
    try:
        check_fields(FIELDS, p)
    except ValueError as e:
        raise bad(str(e)) from None
    if p["attention"] not in ATTENTION_KERNELS:
        raise bad(f"unknown attention kernel {p['attention']!r}; choose one of {', '.join(ATTENTION_KERNELS)}")
    links = {}
    for side in ("intra_node", "inter_node"):
        try:
            links[side] = _link(p[side])
        except ValueError as e:
            raise bad(f"{side}: {e}") from None
    try:
        workspaces = _workspaces(p.get("matmul_workspace", {}))
        kernels = KernelCosts.from_json(p["kernels"]) if "kernels" in p else None
    except (ValueError, TypeError) as e:
        raise bad(str(e)) from None
    return Profile(name=name, description=p["description"],
                   memory_bytes=int(p["memory_gib"] * 2**30), reserved_bytes=int(p["reserved_gib"] * 2**30),
                   flops=p["flops"], compute_efficiency=p["compute_efficiency"],
                   memory_bandwidth=p["memory_bandwidth"], devices_per_node=p["devices_per_node"],
                   intra_node=links["intra_node"], inter_node=links["inter_node"],
                   attention=p["attention"], collective_staging=p.get("collective_staging", {}),
                   sources=p["sources"], device_names=tuple(p.get("device_names", ())),
                   host_memory_bytes=int(p["host_memory_gib"] * 2**30),
                   host_link_bandwidth=p["host_link_bandwidth"], cpu_adamw_params_per_s=p["cpu_adamw_params_per_s"],
                   op_overhead_s=p.get("op_overhead_s", 0.0), overlap_hidden=p.get("overlap_hidden", 1.0),
                   nics_per_node=p.get("nics_per_node"), matmul_workspace=workspaces, kernels=kernels)


def _workspaces(raw: dict) -> MatmulWorkspaces:
    unknown = sorted(set(raw) - {"cublas", "cublaslt"})
    if unknown:
        raise ValueError(f"matmul_workspace: unknown field(s) {', '.join(unknown)}; known: cublas, cublaslt")
    if any(v < 0 or v != int(v) for v in raw.values()):
        raise ValueError(f"matmul_workspace: bytes must be whole and not negative, got {raw}")
    return MatmulWorkspaces(**{k: int(v) for k, v in raw.items()})


def _link(raw: dict) -> Link:
    check_fields(LINK_FIELDS, raw)
    missing = [k for k in ("alpha_s", "bandwidth") if k not in raw]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    measured = {op: tuple((float(s), float(t)) for s, t in points) for op, points in raw.get("op_seconds", {}).items()}
    return Link(**{**raw, "op_seconds": measured})


def profile_for_device(device_name: str) -> Profile:
    """The profile of a device, by the name torch reports for it (e.g. "NVIDIA H200")."""
    for p in profiles().values():
        if any(key in device_name for key in p.device_names):
            return p
    raise ValueError(f"no hardware profile matches {device_name!r}; choose one of {', '.join(profiles())}")


def record_measured(name: str, figures: dict, source: str, path: Path | None = None) -> Path:
    """Write measured `figures` (profile fields: flops, memory_bandwidth, memory_gib, links, ...) for
    profile `name` into the user's profiles file `path` (default `user_path()`, the file every plan and
    every run of this user reads), where they override the shipped figures. Never into the package:
    an installed package does not rewrite itself.

    The file is replaced whole (written beside it, then renamed), so a reader never sees half of
    it, and only after the result is known to load; `source` says how the figures were measured.
    """
    path = Path(path) if path is not None else user_path()
    if path.resolve() == shipped_path().resolve():
        raise ValueError(f"{path} is the package's own profiles, which it ships read-only; "
                         f"record into a user file (--profiles FILE, or ${PROFILES_ENV})")
    user = _read_user(path)
    if name not in _shipped() and name not in user:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join({**_shipped(), **user})}")
    user[name] = _updated(user.get(name, {}), {**figures, "sources": {MEASURED + ", ".join(figures): source}})
    for n, p in _overlay(_shipped(), user).items():  # what is written must load
        _profile(n, p, str(path))
    _write_atomic(path, json.dumps(user, indent=2) + "\n")
    _profiles.cache_clear()
    return path


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp's is 0o600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def get_profile(name: str) -> Profile:
    table = profiles()
    if name not in table:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(table)}")
    return table[name]
