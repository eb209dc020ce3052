"""The host's weight store (rngd_pd.model.store, rngd_pd.host.shm_refs) and partial updates
(rngd_pd.model.delta) on a small random checkpoint: mapped weights give the same tokens as a plain
load, processes share one copy (PSS), the last holder removes the store (a SIGKILLed one too, at the
next sweep), a damaged store is refused, and a delta rewrites only the touched parameters and gives
the tokens of a fresh load of the new checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from rngd_pd.errors import ModelLoadError
from rngd_pd.host.shm_refs import Root
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.delta import apply_delta
from rngd_pd.model.generate import greedy
from rngd_pd.model.store import TENSORS
from rngd_pd.model.weights import from_store, load_model, load_shared
from rngd_pd.testing.checkpoints import changed_copy, random_checkpoint

SMALL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
                    max_context=256, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
CHANGED = ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.norm.weight"]
IDS = [5, 17, 99, 3, 250, 41]
HOLDER = """
import sys, time, torch
from rngd_pd.host.shm_refs import Root
from rngd_pd.model.weights import load_shared
m = load_shared(sys.argv[1], dtype=torch.float32, root=Root(sys.argv[2]))
total = sum(float(t.float().sum()) for t in m.store.tensors.values())  # touch every page
print("ready", m.store.key, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return random_checkpoint(tmp_path_factory.mktemp("small") / "base", SMALL, dtype=torch.float32)


@pytest.fixture
def root():
    r = Root(f"/dev/shm/rngd-pd-test-weights-{uuid.uuid4().hex[:8]}")
    yield r
    r.sweep()
    assert not r.path.exists(), f"{r.path} left behind: {list(r.path.iterdir())}"


def _holder(ckpt: Path, root: Root) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt), str(root.path)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    line = p.stdout.readline() if p.stdout else ""
    assert line.startswith("ready"), line
    return p


def _store_memory(pid: int, root: Root) -> tuple[int, int]:
    """(Rss, Pss) in kB of the process's mappings of files under the store root."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            inside = str(root.path) in line
        elif inside and first == "Rss:":
            rss += int(line.split()[1])
        elif inside and first == "Pss:":
            pss += int(line.split()[1])
    return rss, pss


def test_mapped_weights_give_the_plain_loads_tokens_and_go_with_the_last_holder(ckpt, root):
    a = load_shared(str(ckpt), dtype=torch.float32, root=root)
    b = load_shared(str(ckpt), dtype=torch.float32, root=root)
    assert a.store is not None and b.store is not None and a.store.key == b.store.key
    assert a.fingerprint == load_model(str(ckpt), progress=False).fingerprint  # one fingerprint either way
    plain = load_model(str(ckpt), progress=False)
    assert greedy(a.model, IDS, 12) == greedy(plain.model, IDS, 12)
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert {ln.split()[1] for ln in maps if str(root.path) in ln} == {"r--s"}  # mapped read-only, shared
    a.close()
    assert (root.path / b.store.key).is_dir()  # b still holds it
    b.close()
    assert not root.path.exists()  # the last holder removed the store and the root


def test_two_processes_share_one_copy_and_a_killed_holder_is_swept(ckpt, root):
    procs = [_holder(ckpt, root) for _ in range(2)]
    try:
        (store,) = [p for p in root.path.iterdir() if p.is_dir()]
        size_kb = sum(f.stat().st_size for f in (store / TENSORS).iterdir()) >> 10
        for p in procs:
            rss, pss = _store_memory(p.pid, root)
            assert rss >= size_kb * 0.95, (rss, size_kb)  # each maps all of it ...
            assert pss <= size_kb * 0.55, (pss, size_kb)  # ... and pays for half: one copy between two
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        assert root.sweep() == [] and store.is_dir()  # the survivor still holds it
        assert len(list((store / ".holders").iterdir())) == 1  # the dead one's lock file is gone
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        assert store.is_dir()  # nobody released it: it stays until a sweep (serve's, at its next start)
        assert root.sweep() == [store.name]
        assert not root.path.exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_damaged_store_is_refused(ckpt, root):
    a = load_shared(str(ckpt), dtype=torch.float32, root=root)
    assert a.store is not None
    victim = a.store.path / TENSORS / "layers.1.w2"
    with open(victim, "r+b") as f:  # another process scribbling on the shared copy
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.w2 does not match its recorded hash"):
        load_shared(str(ckpt), dtype=torch.float32, root=root)
    a.close()


def test_a_delta_rewrites_only_the_touched_parameters(ckpt, root, tmp_path):
    new = changed_copy(ckpt, tmp_path / "new", CHANGED)
    a = load_shared(str(ckpt), dtype=torch.float32, root=root)
    assert a.store is not None
    s2, report = apply_delta(a.store, str(new), root=root)
    assert s2 is not None
    try:
        assert report.changed == sorted(CHANGED)
        assert report.params == ["layers.0.w2", "layers.1.wqkv", "norm"]
        assert report.new_fingerprint != a.fingerprint == report.old_fingerprint
        assert report.generation == s2.generation == 1
        for name in s2.tensors:  # untouched parameters are the same file (the same pages), not a copy
            same = os.stat(a.store.path / TENSORS / name).st_ino == os.stat(s2.path / TENSORS / name).st_ino
            assert same == (name not in report.params), name
        assert report.bytes_read == sum(4 * SMALL.hidden_size * n for n in (SMALL.intermediate_size, 32, 1))
        updated = from_store(s2, a.config, a.tokenizer, str(new))
        fresh = load_model(str(new), progress=False)
        assert greedy(updated.model, IDS, 12) == greedy(fresh.model, IDS, 12)
        assert greedy(updated.model, IDS, 12) != greedy(a.model, IDS, 12)
        none, again = apply_delta(s2, str(new), root=root)  # the same checkpoint again: nothing to do
        assert none is None and again.changed == []
    finally:
        s2.close()
        a.close()


def test_a_delta_of_another_architecture_is_refused(ckpt, root, tmp_path):
    other = random_checkpoint(tmp_path / "other", ModelConfig(**{**SMALL.__dict__, "num_layers": 3}),
                              dtype=torch.float32)
    a = load_shared(str(ckpt), dtype=torch.float32, root=root)
    assert a.store is not None
    with pytest.raises(ModelLoadError, match="another model config"):
        apply_delta(a.store, str(other), root=root)
    a.close()


def test_a_dead_builder_leaves_nothing(root):
    code = ("import sys, os, signal; from rngd_pd.host.shm_refs import Root; "
            "h = Root(sys.argv[1]).build('x'); os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, "-c", code, str(root.path)], check=False, timeout=60,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert any(p.name.startswith(".building-x-") for p in root.path.iterdir())
    hold = root.build("x")  # not blocked by the dead builder: its directory is swept first
    assert hold.path.name.startswith(".building-x-")
    hold.release()


def test_a_made_checkpoint_stops_on_ids_its_tokenizer_holds(ckpt):
    """write_checkpoint ships the embedded tokenizer, so the config's BOS/EOS are that tokenizer's
    (a Llama-3.1 shape's own 128000+ ids would be ids no text maps to)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(ckpt / "tokenizer.json")).get_vocab_size()
    cfg = json.loads((ckpt / "config.json").read_text())
    gen = json.loads((ckpt / "generation_config.json").read_text())
    ids = [cfg["bos_token_id"], *cfg["eos_token_id"], *gen["eos_token_id"]]
    assert all(0 <= i < vocab for i in ids), (ids, vocab)
