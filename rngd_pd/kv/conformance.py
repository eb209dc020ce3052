"""The transport contract suite: `python -m rngd_pd.kv.conformance NAME` (or `rngd-pd conformance NAME`).

Runs every case against a registered transport, with the pushing side in a separate process
(multiprocessing spawn, as prefill and decode are), prints one PASS/FAIL/SKIP line per case and exits
non-zero when any case fails. Setup and storage hooks come from the transport class's
`conformance_case()` (see rngd_pd.kv.protocol.ConformanceCase); a case whose hook is missing is
skipped, never passed.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from rngd_pd.errors import TransportError, TransportIntegrityError, TransportTimeoutError
from rngd_pd.kv.protocol import ConformanceCase, flush
from rngd_pd.kv.registry import load_transport, transport_class

SIZES = (1, 7, 4096, 65537, 1 << 20, (16 << 20) + 3, 64 << 20)
PULL_TIMEOUT = 60.0


class Skip(Exception):
    """A case that cannot run for this transport (a hook is missing)."""


@dataclass
class Result:
    case: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str = ""

    def line(self) -> str:
        return f"{self.status:4} {self.case:28} {self.seconds:7.2f}s  {self.detail}".rstrip()


def payload(seed: int, size: int) -> bytes:
    """Deterministic random bytes both processes can produce."""
    return np.random.default_rng(seed).bytes(size)


# ---------------------------------------------------------------- child processes (pushing side)
def _pusher(name: str, options: dict, env: dict, jobs: list, threads: int, done, report) -> None:
    """Push (key, index, seed, size, delay) jobs, report, then stay up until `done` (nixl-ucx needs it)."""
    os.environ.update(env)
    try:
        t = load_transport(name, **options)

        def work(part: list) -> None:
            for key, index, seed, size, delay in part:
                time.sleep(delay)
                t.push(key, index, payload(seed, size))
            for key in dict.fromkeys(job[0] for job in part):
                flush(t, key)

        parts = [jobs[i::threads] for i in range(threads)]
        pool = [threading.Thread(target=work, args=(p,)) for p in parts]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        report.put("ok")
        done.wait(PULL_TIMEOUT * 2)
        t.close()
    except BaseException as e:
        report.put(f"push failed: {e!r}")


def _dier(name: str, options: dict, env: dict, key: str) -> None:
    """Push blob 0, then die without cleaning up (a prefill process that crashed)."""
    os.environ.update(env)
    load_transport(name, **options).push(key, 0, payload(0, 4096))
    os._exit(17)


class Suite:
    """The cases, run against one transport name inside its ConformanceCase."""

    def __init__(self, name: str, case: ConformanceCase, sizes: tuple[int, ...] = SIZES) -> None:
        self.name, self.case, self.sizes = name, case, sizes
        self.ctx = mp.get_context("spawn")
        self.tag = f"conf{os.getpid()}-{int(time.time() * 1000) % 10**8}"

    def transport(self, **extra: object):
        return load_transport(self.name, **{**self.case.options, **extra})

    @contextlib.contextmanager
    def pushing(self, jobs: list, threads: int = 1) -> Iterator[None]:
        done, report = self.ctx.Event(), self.ctx.Queue()
        p = self.ctx.Process(target=_pusher, args=(self.name, self.case.options, self.case.env, jobs,
                                                   threads, done, report), daemon=True)
        p.start()
        try:
            yield
            msg = report.get(timeout=PULL_TIMEOUT)
            assert msg == "ok", msg
        finally:
            done.set()
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()

    def check_pull(self, t, key: str, index: int, seed: int, size: int) -> None:
        out = np.zeros(size + 16, np.uint8)  # larger than the blob: the tail must stay untouched
        n = t.pull(key, index, out, PULL_TIMEOUT)
        assert n == size, f"pull returned {n}, expected {size}"
        assert out[:size].tobytes() == payload(seed, size), f"bytes differ for {key}[{index}]"
        assert not out[size:].any(), "pull wrote past the blob"

    # ------------------------------------------------------------------------------ the cases
    def roundtrips(self) -> Iterator[Result]:
        """One pushing child for every size; a result per size, pulled in order."""
        key = f"{self.tag}-rt"
        jobs = [(key, i, i, s, 0.0) for i, s in enumerate(self.sizes)]
        with contextlib.closing(self.transport()) as t, self.pushing(jobs):
            try:
                for i, size in enumerate(self.sizes):
                    yield _timed(f"roundtrip {_fmt(size)}", lambda i=i, size=size: self.check_pull(
                        t, key, i, i, size))
            finally:
                t.release(key)

    def pull_before_push(self) -> None:
        key = f"{self.tag}-early"
        with contextlib.closing(self.transport()) as t, self.pushing([(key, 0, 5, 300_000, 1.0)]):
            t0 = time.monotonic()
            self.check_pull(t, key, 0, 5, 300_000)
            assert time.monotonic() - t0 > 0.5, "the pull did not wait for the push"
            t.release(key)

    def in_flight_8(self) -> None:
        keys = [f"{self.tag}-if{r}" for r in range(8)]
        jobs = [(k, i, 100 * r + i, 256 << 10, 0.0) for r, k in enumerate(keys) for i in range(4)]
        errors: list[str] = []
        with contextlib.closing(self.transport()) as t, self.pushing(jobs, threads=8):
            def pull_request(r: int) -> None:
                try:
                    for i in range(4):
                        self.check_pull(t, keys[r], i, 100 * r + i, 256 << 10)
                    t.release(keys[r])
                except BaseException as e:
                    errors.append(repr(e))

            threads = [threading.Thread(target=pull_request, args=(r,)) for r in range(8)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        assert not errors, errors[0]

    def release_frees(self) -> None:
        if self.case.stored_blobs is None:
            raise Skip("transport gives no stored_blobs hook")
        key = f"{self.tag}-rel"
        with contextlib.closing(self.transport()) as t:
            before = self.case.stored_bytes() if self.case.stored_bytes else 0
            for i in range(4):
                t.push(key, i, payload(i, 1 << 20))
            flush(t, key)
            assert self.case.stored_blobs(key) == 4, f"stored {self.case.stored_blobs(key)} of 4 blobs"
            if self.case.stored_bytes:
                assert self.case.stored_bytes() >= before + (4 << 20), "pushed bytes are not accounted"
            t.release(key)
            t.release(key)  # idempotent
            assert self.case.stored_blobs(key) == 0, "blobs remain after release"
            if self.case.stored_bytes:
                assert self.case.stored_bytes() <= before, "memory still held after release"
            _expect(TransportTimeoutError, lambda: t.pull(key, 0, bytearray(1 << 20), 0.2))

    def ttl_expires(self) -> None:
        if self.case.ttl_options is None or self.case.stored_blobs is None:
            raise Skip("transport gives no short-TTL options")
        key = f"{self.tag}-ttl"
        with contextlib.closing(self.transport(**self.case.ttl_options)) as t:
            t.push(key, 0, payload(1, 65536))
            flush(t, key)
            assert self.case.stored_blobs(key) == 1
            deadline = time.monotonic() + 10 * self.case.ttl_s + 5
            while self.case.stored_blobs(key) and time.monotonic() < deadline:
                time.sleep(self.case.ttl_s / 2)
                t.push(f"{key}-tick", 0, b"x")  # lets transports that sweep on push do so
                t.release(f"{key}-tick")
            assert self.case.stored_blobs(key) == 0, "blob outlived its TTL"

    def corrupt_detected(self) -> None:
        if self.case.corrupt is None:
            raise Skip("transport gives no corrupt hook")
        key = f"{self.tag}-bad"
        with contextlib.closing(self.transport()) as t:
            try:
                self.case.corrupt(t, key, 0, payload(3, 1 << 20))
                _expect(TransportIntegrityError, lambda: t.pull(key, 0, bytearray(1 << 20), 5.0))
            except TransportIntegrityError:
                pass  # refused on the way in: detected too
            finally:
                t.release(key)

    def missing_times_out(self) -> None:
        with contextlib.closing(self.transport()) as t:
            t0 = time.monotonic()
            _expect(TransportTimeoutError, lambda: t.pull(f"{self.tag}-none", 0, bytearray(64), 0.5))
            took = time.monotonic() - t0
            assert 0.45 <= took <= 2.0, f"timeout of 0.5 s took {took:.2f} s"

    def too_small_output(self) -> None:
        key = f"{self.tag}-small"
        with contextlib.closing(self.transport()) as t:
            t.push(key, 0, payload(4, 4096))
            _expect(TransportIntegrityError, lambda: t.pull(key, 0, bytearray(100), 5.0))
            t.release(key)

    def dead_peer(self) -> None:
        key = f"{self.tag}-dead"
        p = self.ctx.Process(target=_dier, args=(self.name, self.case.options, self.case.env, key))
        p.start()
        p.join(PULL_TIMEOUT)
        assert p.exitcode == 17, f"pushing child exited with {p.exitcode}"
        with contextlib.closing(self.transport()) as t:
            t0 = time.monotonic()
            _expect(TransportError, lambda: t.pull(key, 1, bytearray(4096), 1.0))
            assert time.monotonic() - t0 < 5.0, "a dead peer took too long to report"
            t.release(key)

    def cases(self) -> list[tuple[str, Callable[[], None]]]:
        return [("pull before push", self.pull_before_push),
                ("8 requests in flight", self.in_flight_8), ("release frees", self.release_frees),
                ("ttl expires", self.ttl_expires), ("corrupt blob detected", self.corrupt_detected),
                ("missing blob times out", self.missing_times_out),
                ("output too small", self.too_small_output), ("dead peer", self.dead_peer)]


def _expect(kind: type[BaseException], fn: Callable[[], object]) -> None:
    try:
        fn()
    except kind:
        return
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def _fmt(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


@contextlib.contextmanager
def _case_for(name: str) -> Iterator[ConformanceCase]:
    cls = transport_class(name)
    hook = getattr(cls, "conformance_case", None)
    if hook is None:
        yield ConformanceCase()
    else:
        with hook() as case:
            yield case


def _timed(label: str, fn: Callable[[], None]) -> Result:
    t0 = time.monotonic()
    try:
        fn()
        return Result(label, "PASS", time.monotonic() - t0)
    except Skip as e:
        return Result(label, "SKIP", time.monotonic() - t0, str(e))
    except BaseException as e:
        detail = f"{type(e).__name__}: {e}" if str(e) else traceback.format_exc(limit=3)
        return Result(label, "FAIL", time.monotonic() - t0, detail)


def run_suite(name: str, sizes: tuple[int, ...] = SIZES, out: Callable[[str], None] = print) -> list[Result]:
    """Run every case against `name`; print a line per case; return the results."""
    results: list[Result] = []
    with _case_for(name) as case:
        suite = Suite(name, case, sizes)
        try:
            for res in suite.roundtrips():
                results.append(res)
                out(res.line())
        except BaseException as e:  # the pushing child itself failed
            results.append(Result("roundtrip pusher", "FAIL", 0.0, f"{type(e).__name__}: {e}"))
            out(results[-1].line())
        for label, fn in suite.cases():
            results.append(_timed(label, fn))
            out(results[-1].line())
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rngd_pd.kv.conformance", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="transport name (entry point in airm.kv_transports)")
    p.add_argument("--max-size", type=int, default=SIZES[-1], help="largest round-trip size in bytes")


def run(args: argparse.Namespace) -> int:
    results = run_suite(args.name, tuple(s for s in SIZES if s <= args.max_size))
    failed = [r for r in results if r.status == "FAIL"]
    print(f"{args.name}: {len(results) - len(failed)} of {len(results)} cases did not fail, "
          f"{len(failed)} failed, {sum(r.status == 'SKIP' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
