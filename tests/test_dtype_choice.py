"""Compute dtype `auto`: bf16 only where the CPU (or GPU) computes bf16 natively, fp32 elsewhere, and why.

The CPUs are cpuinfo texts, so every kind is covered without the hardware; nothing starts tritonserver.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types

import pytest

from rngd_pd.config import params
from rngd_pd.config.dtypes import COMPUTE_CHOICES
from rngd_pd.config.env import RNGD_PD_DTYPE
from rngd_pd.devices import cpu_features, kernels
from rngd_pd.devices.cpu_features import CpuFeatures, choose_compute_dtype, parse_cpuinfo
from rngd_pd.errors import ConfigError

X86_COMMON = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
              "sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni pclmulqdq "
              "ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor "
              "lahf_lm abm 3dnowprefetch bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb "
              "sha_ni xsaveopt xsavec xgetbv1 xsaves")
AVX512 = "avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vnni"


def x86_cpuinfo(model: str, extra: str = "", cpus: int = 2) -> str:
    block = (f"processor\t: {{n}}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\n"
             f"flags\t\t: {X86_COMMON} {extra}\nbugs\t\t: spectre_v1\n\n")
    return "".join(block.format(n=n) for n in range(cpus))


def arm_cpuinfo(features: str) -> str:
    return (f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
            "CPU architecture: 8\nCPU part\t: 0xd40\n\n")


ZEN4 = x86_cpuinfo("AMD EPYC 9654 96-Core Processor", f"{AVX512} avx512_bf16 avx512_vbmi2")
SAPPHIRE_RAPIDS = x86_cpuinfo("Intel(R) Xeon(R) Platinum 8480+", f"{AVX512} amx_bf16 amx_tile amx_int8")
HASWELL = x86_cpuinfo("Intel(R) Xeon(R) CPU E5-2680 v3 @ 2.50GHz")
# what rngd_pd.devices.kernels measures (seconds): AVX2 emulates bf16, AVX512-BF16 runs it natively
AVX2_TIMES = kernels.PhaseTimes({"bf16": 0.080, "fp32": 0.010}, {"bf16": 0.008, "fp32": 0.002})
BF16_TIMES = kernels.PhaseTimes({"bf16": 0.010, "fp32": 0.030}, {"bf16": 0.001, "fp32": 0.002})
SKYLAKE_X = x86_cpuinfo("Intel(R) Xeon(R) Gold 6130 CPU @ 2.10GHz", AVX512)
GRAVITON3 = arm_cpuinfo("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
                        "jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc "
                        "flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng")
GRAVITON2 = arm_cpuinfo("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
                        "lrcpc dcpop asimddp ssbs")


def test_avx512_bf16_cpu_gets_bf16() -> None:
    choice = choose_compute_dtype("auto", ZEN4)
    assert (choice.dtype, choice.requested) == ("bf16", "auto")
    assert choice.reason == "auto: this CPU has AVX512-BF16 (native bf16)"


def test_amx_cpu_gets_bf16() -> None:
    choice = choose_compute_dtype(None, SAPPHIRE_RAPIDS)
    assert choice.dtype == "bf16" and "AMX-BF16" in choice.reason


def test_avx2_only_cpu_gets_fp32_and_says_why() -> None:
    choice = choose_compute_dtype("auto", HASWELL)
    assert choice.dtype == "fp32"
    assert choice.reason == "auto: no native bf16 on this CPU (AVX2 only); bf16 would be ~8x slower"
    skylake = choose_compute_dtype("auto", SKYLAKE_X)  # AVX-512 alone does not compute bf16 natively
    assert skylake.dtype == "fp32" and "AVX-512 without BF16" in skylake.reason


def test_aarch64_with_and_without_bf16() -> None:
    g3 = choose_compute_dtype("auto", GRAVITON3)
    assert g3.dtype == "bf16" and "Arm BF16" in g3.reason
    g2 = choose_compute_dtype("auto", GRAVITON2)
    assert g2.dtype == "fp32" and "no native bf16" in g2.reason and "Arm" in g2.reason


def test_cpuinfo_parsing_reads_the_first_cpu() -> None:
    f = parse_cpuinfo(ZEN4)
    assert (f.arch, f.model, f.native_bf16) == ("x86_64", "AMD EPYC 9654 96-Core Processor", "AVX512-BF16")
    assert "avx2" in f.flags and "bugs" not in f.flags
    assert parse_cpuinfo(GRAVITON3).arch == "aarch64"


def test_features_as_a_flag_set_or_object() -> None:
    assert choose_compute_dtype("auto", {"avx2", "avx512_bf16"}).dtype == "bf16"
    assert choose_compute_dtype("auto", frozenset({"avx", "avx2"})).dtype == "fp32"
    assert choose_compute_dtype("auto", CpuFeatures("aarch64", frozenset({"sve", "bf16"}))).dtype == "bf16"


def test_unknown_features_fall_back_to_fp32() -> None:
    """macOS and other systems: nothing is read, and auto is the safe fp32."""
    mac = CpuFeatures("aarch64", frozenset(), "", "not read on darwin")
    choice = choose_compute_dtype("auto", mac)
    assert choice.dtype == "fp32" and "not read on darwin" in choice.reason


def test_non_linux_host_reads_nothing(monkeypatch) -> None:
    monkeypatch.setattr(cpu_features.sys, "platform", "darwin")
    cpu_features.read_cpu_features.cache_clear()
    try:
        f = cpu_features.read_cpu_features()
        assert not f.flags and "darwin" in f.source
        assert choose_compute_dtype("auto").dtype == "fp32"
    finally:
        cpu_features.read_cpu_features.cache_clear()


def test_forced_values_win() -> None:
    for cpu in (ZEN4, HASWELL, GRAVITON2):
        for forced in ("bf16", "fp32", " FP32 "):
            choice = choose_compute_dtype(forced, cpu)
            assert choice.dtype == forced.strip().lower() and choice.reason.startswith("forced by --dtype")
    assert not choose_compute_dtype("bf16", ZEN4).warning
    slow = choose_compute_dtype("bf16", HASWELL, source="$RNGD_PD_DTYPE")
    assert slow.warning
    assert slow.reason == "forced by $RNGD_PD_DTYPE (this CPU has no native bf16, AVX2 only: slow)"


def test_unknown_value_is_a_config_error_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"compute dtype 'fp16' is not one of auto, bf16, fp32"):
        choose_compute_dtype("fp16", ZEN4)
    env = {RNGD_PD_DTYPE.name: "fp16"}
    needle = r"'dtype' from \$RNGD_PD_DTYPE is 'fp16'; choose one of auto, bf16, fp32"
    with pytest.raises(ConfigError, match=needle):
        params.parse_params(params.ServingParams, {"name": "prefill"}, env=env)


def test_parameter_parser_accepts_auto_and_defaults_to_it() -> None:
    dtype_field = next(f for f in dataclasses.fields(params.ServingParams) if f.name == "dtype")
    assert dtype_field.metadata["choices"] == COMPUTE_CHOICES  # what choose_compute_dtype accepts
    assert params.parse_params(params.ServingParams, {"name": "prefill"}, env={}).dtype == "auto"
    for value in ("auto", "bf16", "fp32"):
        config = {"name": "prefill", "parameters": {"dtype": {"string_value": value}}}
        assert params.parse_params(params.ServingParams, config, env={}).dtype == value
    assert params.parse_params(params.ServingParams, {}, env={RNGD_PD_DTYPE.name: "auto"}).dtype == "auto"


def test_serve_dtype_flag_accepts_auto_and_forces_the_others() -> None:
    from rngd_pd.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    for value in ("auto", "bf16", "fp32"):
        args = p.parse_args(["--dtype", value])
        assert serve.model_env(args)[RNGD_PD_DTYPE.name] == value
    assert RNGD_PD_DTYPE.name not in serve.model_env(p.parse_args([]))  # no flag: the models' default (auto)
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "fp16"])


def test_cuda_asks_torch(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_compute_dtype("auto", HASWELL, device="cuda").dtype == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    choice = choose_compute_dtype("auto", ZEN4, device="cuda")
    assert choice.dtype == "fp32" and "Fake GPU has no bf16" in choice.reason
    assert choose_compute_dtype("bf16", device="cuda").dtype == "bf16"


def test_rngd_is_bf16_whatever_the_host_cpu() -> None:
    """The card computes, not the host: an AVX2-only host (whose own auto is fp32) still gets the
    bf16 graphs that `rngd-pd compile` and CI build; a forced dtype is taken as given, unwarned."""
    for cpu in (HASWELL, ZEN4, frozenset()):
        choice = choose_compute_dtype("auto", cpu, device="rngd")
        assert choice.dtype == "bf16" and "whatever the host CPU" in choice.reason
    forced = choose_compute_dtype("bf16", HASWELL, device="rngd")
    assert forced.dtype == "bf16" and not forced.warning and forced.reason == "forced by --dtype"
    assert choose_compute_dtype("fp32", ZEN4, device="rngd").dtype == "fp32"


def test_atom_resolves_on_the_host_cpu() -> None:
    choice = choose_compute_dtype("auto", HASWELL, device="atom")
    assert choice.dtype == "fp32" and "host CPU" in choice.reason


def test_load_for_resolves_auto_and_logs_why(monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(kernels, "measured", lambda config, cpu: (
        BF16_TIMES if cpu.native_bf16 else AVX2_TIMES, False))
    from rngd_pd.devices import runtime
    from rngd_pd.stubs import loading
    from rngd_pd.stubs.serving import PrefillParams

    load_for = loading.load_for
    loaded: list = []
    monkeypatch.setattr(loading, "load_weights", lambda params, args, dtype: loaded.append(dtype))
    monkeypatch.setattr(loading, "runtime_for", lambda device, model, rngd=None: types.SimpleNamespace(
        memory=lambda: runtime.MemoryInfo(1 << 30, 1 << 29), share_cores=lambda phase: f"lent ({phase})"))
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: parse_cpuinfo(HASWELL))
    monkeypatch.delenv(RNGD_PD_DTYPE.name, raising=False)
    load_for(PrefillParams(), {"model_instance_name": "prefill_0_0"}, "prefill")
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: parse_cpuinfo(ZEN4))
    load_for(PrefillParams(), {"model_instance_name": "prefill_0_0"}, "prefill")
    # the source of the dtype is what parse_params recorded (the stub does not read the environment again)
    forced = params.parse_params(PrefillParams, {"share_cores": "true"}, env={RNGD_PD_DTYPE.name: "fp32"})
    load_for(forced, {"model_instance_name": "prefill_0_0"})
    assert loaded == [torch.float32, torch.bfloat16, torch.float32]
    out = capsys.readouterr().out
    assert ("prefill_0_0: compute dtype fp32 (auto (prefill, measured now on this CPU: AVX2 only): fp32 "
            "10.0 ms vs bf16 80.0 ms per 256-token prefill") in out
    assert "prefill_0_0: compute dtype bf16 (auto (prefill, measured now on this CPU: AVX512-BF16)" in out
    assert "compute dtype fp32 (forced by $RNGD_PD_DTYPE (rngd-pd serve --dtype))" in out
    assert "prefill_0_0: cores: lent (both)" in out  # with share_cores on, its decision is logged too


def test_devices_command_shows_the_choice(monkeypatch, capsys) -> None:
    from rngd_pd.commands import devices

    monkeypatch.setattr(kernels, "measured", lambda config, cpu: (AVX2_TIMES, True))
    monkeypatch.setattr(devices, "read_cpu_features", lambda: parse_cpuinfo(HASWELL))
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: parse_cpuinfo(HASWELL))
    monkeypatch.delenv(RNGD_PD_DTYPE.name, raising=False)
    args = argparse.Namespace(repository=None, role="all", json=False)
    assert devices.run(args) == 0
    out = capsys.readouterr().out
    assert "compute dtype by CPU flags: fp32 (auto: no native bf16 on this CPU (AVX2 only)" in out
    assert "  decode     fp32  auto (decode, cached measurement on this CPU: AVX2 only): fp32" in out
    assert devices.run(argparse.Namespace(repository=None, role="all", json=True)) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (last["compute_dtype"], last["compute_dtype_requested"]) == ("fp32", "auto")
    assert last["cpu_native_bf16"] is None and "Xeon" in last["cpu"] and "config_name" in last
    assert last["compute_dtype_by_model"]["prefill"]["dtype"] == "fp32"
    monkeypatch.setenv(RNGD_PD_DTYPE.name, "bf16")
    choice, _ = devices.compute_dtype_choice()
    assert choice.dtype == "bf16" and choice.warning


def test_kernel_times_are_measured_once_per_host_and_model_then_read(tmp_path, smollm) -> None:
    """A real measurement on this host (a 2-layer probe in bf16 and fp32), cached by CPU, torch,
    threads and model shape; the second call reads the file."""
    env = {"RNGD_PD_CACHE": str(tmp_path)}
    cpu = cpu_features.read_cpu_features()
    times, cached = kernels.measured(smollm.config, cpu, env)
    assert not cached and set(times.prefill_s) == set(times.decode_s) == {"bf16", "fp32"}
    assert all(t > 0 for t in [*times.prefill_s.values(), *times.decode_s.values()])
    again, cached = kernels.measured(smollm.config, cpu, env)
    assert cached and again == times
    table = json.loads((tmp_path / kernels.CACHE_FILE).read_text())
    assert len(table) == 1 and "threads" in next(iter(table))
    for phase in kernels.PHASES:
        assert times.best(phase) in ("bf16", "fp32") and "ms vs" in times.describe(phase)
    if cpu.native_bf16 is None and cpu.flags:  # an AVX2 host: bf16 is emulated, fp32 must win
        assert times.best("prefill") == times.best("decode") == "fp32"
    with pytest.raises(ConfigError):
        kernels.check_phase("training")
