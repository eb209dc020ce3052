"""Which card the device plugin allocated to this pod (`device_ids: -1`).

A privileged pod sees every card, so the card is read from the kubelet device-plugin checkpoint
(`/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint`, mounted read-only, found by `POD_UID`).
Without that record and with several cards visible it stops instead of guessing. The result is the
card's position among the visible cards (npu3 is ordinal 2 when npu2 is absent), which is what the
vendor runtimes expect; an explicit device id is that ordinal too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from rngd_pd.config.env import POD_UID, RNGD_PD_KUBELET_CHECKPOINT
from rngd_pd.devices.base import unavailable


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def visible_cards(pattern: str, dev_root: str | Path = "/") -> list[str]:
    """Card names (`npu0`, `rbln1`) matching a glob under dev_root, in natural order."""
    root = Path(dev_root)
    return sorted((p.name for p in root.glob(pattern.lstrip("/"))), key=_natural)


def checkpoint_devices(pod_uid: str, resource: str, path: Path) -> list[str] | None:
    """Device ids the kubelet allocated to `pod_uid` for `resource`; None when there is no record."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise unavailable(f"cannot read the device-plugin checkpoint {path}: {exc}",
                          "mount it read-only into the pod or give device_ids explicitly") from exc
    found: list[str] = []
    for entry in (data.get("Data") or {}).get("PodDeviceEntries") or []:
        if entry.get("PodUID") != pod_uid or entry.get("ResourceName") != resource:
            continue
        ids = entry.get("DeviceIDs") or []
        if isinstance(ids, Mapping):  # kubelet >= 1.20: {numa node: [ids]}
            ids = [i for group in ids.values() for i in group]
        found.extend(i for i in ids if i not in found)
    return found or None


def _ordinal(device_id: str, cards: Sequence[str], kind: str) -> int:
    for ordinal, card in enumerate(cards):
        if device_id == card or device_id.endswith(f"/{card}") or device_id.endswith(f":{card}"):
            return ordinal
    raise unavailable(f"the device plugin allocated {kind} card {device_id!r}, which is not among the "
                      f"visible cards ({', '.join(cards) or 'none'})",
                      "check the pod's device mounts")


def allocated_ordinal(kind: str, resource: str, cards: Sequence[str], instance: int = 0,
                      env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Ordinal of the card this pod (instance) was allocated, and how it was found."""
    if not cards:
        raise unavailable(f"no {kind} card is visible", f"check the driver and the pod's {resource} request")
    pod_uid = POD_UID.get(env) or ""
    path = RNGD_PD_KUBELET_CHECKPOINT.get(env)
    ids = checkpoint_devices(pod_uid, resource, path) if pod_uid else None
    if ids:
        if instance >= len(ids):
            raise unavailable(f"instance {instance} needs a {kind} card but the device plugin allocated "
                              f"only {len(ids)} ({', '.join(ids)})",
                              f"request more {resource} or fewer instances")
        return _ordinal(ids[instance], cards, kind), f"allocated {ids[instance]} (device-plugin checkpoint)"
    if len(cards) == 1:
        return 0, f"the only visible card {cards[0]}"
    why = f"no device-plugin record for POD_UID={pod_uid!r} in {path}" if pod_uid else "POD_UID is not set"
    raise unavailable(
        f"{len(cards)} {kind} cards are visible ({', '.join(cards)}) and {why}; refusing to guess",
        "mount the kubelet checkpoint and set POD_UID, or set device_ids to the card's ordinal",
    )


def resolve_ordinal(kind: str, resource: str, cards: Sequence[str], device_id: int, instance: int = 0,
                    env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """-1 -> the allocated card; N -> ordinal N, checked against the visible cards."""
    if device_id == -1:
        return allocated_ordinal(kind, resource, cards, instance, env)
    if not 0 <= device_id < len(cards):
        raise unavailable(f"{kind} device id {device_id} is out of range: {len(cards)} card(s) visible "
                          f"({', '.join(cards) or 'none'})", "use -1 or an ordinal among the visible cards")
    return device_id, f"device id {device_id} = {cards[device_id]}"
