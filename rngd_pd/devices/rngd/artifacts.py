"""Compiled RNGD graphs on disk, and the one compiler setting that makes them: the tactic search.

Stdlib only: the serving environment reads it (parameters, `rngd-pd compile`) and so does the
`.venv-rngd` worker that writes and loads the binaries.

**The search.** furiosa's `CompilerConfig()` searches every tactic shape; the prefill layer at the
configured chunk of 512 tokens did not finish that search within an hour on a 2-core host, and
bounded to 16 unique shapes (`max_num_unique_shapes=16`) it compiles in about 8 minutes
(docs/devices-rngd.md). Serving, `--compile-only`, `rngd-pd compile` and CI therefore all compile
with the bound by default; `--param rngd_search=full` (or a number) changes it everywhere at once,
and the artifacts remember which search made them.

**An artifact** is what `furiosa.torch._C.ir.Runnable.serialize()` returns for one compiled graph
(the EDF binary with its DRAM shapes; `Runnable.deserialize` reads it back on a host without a card,
checked here), saved as `<graph>.<key>.runnable` beside `<graph>.<key>.json` (what made it, its size
and sha256). The key digests everything that decides the binary without loading any weights (the
graphs take every weight as an input): the graph's name and shape, compute and KV dtypes, the search,
the furiosa compiler's version, the model's architecture (`ModelConfig`) and the source of the code
that builds the graph. One directory can hold the graphs of several models and searches.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rngd_pd.errors import ConfigError

DEFAULT_SEARCH = 16  # CompilerConfig.max_num_unique_shapes; None is furiosa's full search
FULL = "full"


def parse_search(value: str | int | None) -> int | None:
    """`rngd_search` as the compiler takes it: "full" -> None (furiosa's full tactic search), "16"
    -> 16 unique shapes; empty -> the default bound. A bad value is a ConfigError naming both forms."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULT_SEARCH
    text = str(value).strip().lower()
    if text == FULL:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"rngd_search {value!r}: use `full` (furiosa's whole tactic search) or a number "
                          f"of unique shapes >= 1 (default {DEFAULT_SEARCH})")
    return n


def search_label(search: int | None) -> str:
    """The inverse of parse_search: "full" or the bound as text."""
    return FULL if search is None else str(search)


@dataclass(frozen=True)
class CompileOptions:
    """How a card host gets its graphs: the tactic search, and the artifact directory it loads
    from (and saves what it had to compile into); empty: compile every graph at load."""

    search: int | None = DEFAULT_SEARCH
    artifacts: str = ""

    def args(self) -> list[str]:
        """The `rngd.graphs` command-line arguments that carry these options."""
        where = ["--artifacts", self.artifacts] if self.artifacts else []
        return ["--search", search_label(self.search), *where]


@dataclass(frozen=True)
class ArtifactKey:
    """What decides one compiled graph's binary (module docstring); `digest` names its files."""

    graph: str
    shape: str
    dtype: str
    kv_dtype: str
    search: str
    compiler: str
    model: str  # sha256 of ModelConfig.to_json()
    code: str  # sha256 of the source that builds the graph (rngd.graphs.graph_code_digest)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def stem(self) -> str:
        return f"{self.graph}.{self.digest}"


def digest_text(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


class ArtifactStore:
    """A directory of compiled graphs. `find` answers without reading the binary; `read` checks
    its sha256; `save` writes the binary, then its description, each atomically (a compile killed
    halfway leaves no artifact that `find` would take)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _paths(self, key: ArtifactKey) -> tuple[Path, Path]:
        return self.root / f"{key.stem}.runnable", self.root / f"{key.stem}.json"

    def find(self, key: ArtifactKey) -> dict[str, Any] | None:
        """The artifact's description when this directory holds `key`'s binary, else None."""
        binary, meta = self._paths(key)
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if info.get("key") != asdict(key) or not binary.is_file():
            return None
        if binary.stat().st_size != info.get("bytes"):
            return None
        return info

    def read(self, key: ArtifactKey) -> tuple[bytes, dict[str, Any]]:
        info = self.find(key)
        if info is None:
            raise FileNotFoundError(f"no artifact {key.stem} in {self.root}")
        data = self._paths(key)[0].read_bytes()
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise ConfigError(f"artifact {self._paths(key)[0]} does not match its sha256 (a partial copy?)")
        return data, info

    def save(self, key: ArtifactKey, data: bytes, info: dict[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        binary, meta = self._paths(key)
        _atomic_write(binary, data)
        record = {**info, "key": asdict(key), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(meta, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
        return binary

    def listing(self) -> list[dict[str, Any]]:
        """Every artifact description in the directory (for `rngd-pd compile`'s summary)."""
        out = []
        for meta in sorted(self.root.glob("*.json")):
            try:
                out.append(json.loads(meta.read_text()))
            except (OSError, ValueError):
                continue
        return out


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the serving user from reading it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
