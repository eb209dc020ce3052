"""Device selection: cpu/cuda through torch, NPU SDK/card checks, the device-plugin allocation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rngd_pd.devices import ATOM, RNGD, probe_devices, select_device
from rngd_pd.devices.allocation import allocated_ordinal, checkpoint_devices, resolve_ordinal, visible_cards
from rngd_pd.errors import DeviceUnavailableError
from tests import skips

RES = RNGD.resource


def write_checkpoint(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}},
                                "Checksum": 1}))
    return path


def entry(uid: str, ids, resource: str = RES) -> dict:
    return {"PodUID": uid, "ContainerName": "c", "ResourceName": resource, "DeviceIDs": ids}


def test_cpu_always_and_unknown_kind() -> None:
    dev = select_device("cpu", -1)
    assert (dev.kind, dev.name, str(dev.torch_device)) == ("cpu", "cpu", "cpu")
    with pytest.raises(DeviceUnavailableError, match="unknown device kind 'tpu'"):
        select_device("tpu")


def test_missing_sdk_names_it_and_points_at_cpu() -> None:
    for kind, missing in (("rngd", "SDK environment /nonexistent is missing"), ("atom", "import rebel")):
        with pytest.raises(DeviceUnavailableError) as info:
            select_device(kind, -1, env={"RNGD_PD_RNGD_VENV": "/nonexistent"})
        msg = str(info.value)
        assert missing in msg and "--config-name cpu" in msg and "--model-config-name cpu" in msg
    with pytest.raises(DeviceUnavailableError, match="make rngd-env"):
        select_device("rngd", -1, env={"RNGD_PD_RNGD_VENV": "/nonexistent"})


def test_cuda_absent_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip(skips.GPU_PRESENT)
    with pytest.raises(DeviceUnavailableError, match=r"no CUDA device.*model-config-name cpu"):
        select_device("cuda", 0)


def test_probe_lists_every_kind() -> None:
    rows = {r.kind: r for r in probe_devices(env={})}
    assert list(rows) == ["cpu", "cuda", "rngd", "atom"]
    assert rows["cpu"].available
    assert not rows["rngd"].available and "furiosa" in rows["rngd"].reason.lower()


def test_visible_cards_natural_order(tmp_path: Path) -> None:
    (tmp_path / "dev" / "rngd").mkdir(parents=True)
    for name in ("npu10", "npu3", "npu0"):
        (tmp_path / "dev" / "rngd" / name).touch()
    assert visible_cards(RNGD.card_glob, tmp_path) == ["npu0", "npu3", "npu10"]
    (tmp_path / "dev" / "rbln1").touch()
    assert visible_cards(ATOM.card_glob, tmp_path) == ["rbln1"]


def test_checkpoint_maps_allocation_to_ordinal(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", [
        entry("other", {"0": ["npu0"]}),
        entry("pod-1", {"0": ["npu3"]}),
        entry("pod-1", ["rbln0"], resource=ATOM.resource),  # old list format
    ])
    env = {"POD_UID": "pod-1", "RNGD_PD_KUBELET_CHECKPOINT": str(ckpt)}
    assert checkpoint_devices("pod-1", ATOM.resource, ckpt) == ["rbln0"]
    # npu3 is ordinal 2 when npu2 is absent
    assert allocated_ordinal("rngd", RES, ["npu0", "npu1", "npu3"], env=env)[0] == 2
    with pytest.raises(DeviceUnavailableError, match="allocated only 1"):
        allocated_ordinal("rngd", RES, ["npu0", "npu1", "npu3"], instance=1, env=env)
    with pytest.raises(DeviceUnavailableError, match="'npu3', which is not among the visible cards"):
        allocated_ordinal("rngd", RES, ["npu0", "npu1"], env=env)


def test_refuses_to_guess_among_several_cards(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", [entry("someone-else", ["npu1"])])
    env = {"POD_UID": "pod-1", "RNGD_PD_KUBELET_CHECKPOINT": str(ckpt)}
    with pytest.raises(DeviceUnavailableError, match=r"2 rngd cards are visible .* refusing to guess"):
        allocated_ordinal("rngd", RES, ["npu0", "npu1"], env=env)
    with pytest.raises(DeviceUnavailableError, match="POD_UID is not set"):
        allocated_ordinal("rngd", RES, ["npu0", "npu1"], env={})
    # a single visible card needs no record
    assert allocated_ordinal("rngd", RES, ["npu5"], env={}) == (0, "the only visible card npu5")


def test_explicit_ids_are_ordinals_checked_against_cards() -> None:
    assert resolve_ordinal("atom", ATOM.resource, ["rbln0", "rbln2"], 1)[0] == 1
    with pytest.raises(DeviceUnavailableError, match="device id 2 is out of range: 2 card"):
        resolve_ordinal("atom", ATOM.resource, ["rbln0", "rbln2"], 2)
    with pytest.raises(DeviceUnavailableError, match="no rngd card is visible"):
        resolve_ordinal("rngd", RES, [], -1, env={})


def test_unreadable_checkpoint_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "ckpt"
    bad.write_text("{not json")
    with pytest.raises(DeviceUnavailableError, match="cannot read the device-plugin checkpoint"):
        checkpoint_devices("pod", RES, bad)
    assert checkpoint_devices("pod", RES, tmp_path / "absent") is None
